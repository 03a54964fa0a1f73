"""The real LeRobot package, for tests against it: `make venv` installs LeRobot 0.4.4 into .venv/lerobot044
(tests/lerobot_env/requirements.txt); its scripts run on this interpreter with that folder first on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv" / "lerobot044"
SCRIPTS = Path(__file__).resolve().parent / "lerobot_env"


def lerobot_site() -> Path:
    """The folder LeRobot is installed in; skips the test where `make venv` did not install it (never on CI)."""
    if not (SITE / ".installed").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{SITE} is missing: `make venv` installs the real LeRobot for these tests")
        pytest.skip(f"the real LeRobot is not installed in {SITE} (run `make venv`)")
    return SITE


def lerobot_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(lerobot_site()), str(SCRIPTS)]),
            "PYTHONWARNINGS": "ignore"}


def popen_lerobot(script: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / script), *args], env=lerobot_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def run_lerobot(script: str, *args: str, timeout: float = 240) -> dict:
    """Runs tests/lerobot_env/SCRIPT ARGS under the real LeRobot; its JSON output (asserts it exits 0)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], env=lerobot_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
