"""Imported first by every script that runs under the real LeRobot (tests/real_lerobot.py): offline, and torchao
hidden - diffusers 0.35 (imported by LeRobot 0.4.4's policy registry) fails on the project's torchao 0.18 while
importing its optional torchao quantizer; LeRobot itself never uses torchao."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.modules["torchao"] = None  # importlib.util.find_spec("torchao") -> None: diffusers skips its quantizer
