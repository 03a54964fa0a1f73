"""Shared fixtures: tiny configs, a fixed synthetic batch, and a CLI runner in a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlaforge.config import load_config
from vlaforge.config.loading import deep_merge

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_synthetic.toml"


def tiny_config(tmp_path: Path | None = None, **sections):
    """The tiny recipe with small data, fp32 everywhere, no progress bar, plus section overrides."""
    base = {
        "components": {c: {"precision": "fp32"} for c in ("vision", "projector", "llm", "action_head")},
        "data": {"num_samples": 64},
        "train": {"progress": False, "tensorboard": False, "log_every": 1, "batch_size": 4,
                  "output_dir": str(tmp_path / "run") if tmp_path else "runs/test"},
    }
    return load_config(TINY_RECIPE, deep_merge(base, sections))


def make_batch(cfg, model, size: int = 4, start: int = 0):
    from vlaforge.data.batch import Batch
    from vlaforge.data.loader import build_data

    ds = build_data(cfg, model).dataset
    return Batch.collate([ds[i] for i in range(start, start + size)])


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "vlaforge", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


@contextlib.contextmanager
def served(path, *args: str):
    """`vlaforge serve PATH ARGS` in a subprocess on a free port: yields its ws:// URI; SIGTERM afterwards must stop
    it cleanly (exit code 0, "stopped")."""
    server = subprocess.Popen([sys.executable, "-m", "vlaforge", "serve", str(path), "--port=0", *args], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        found = None
        for line in server.stderr:
            found = re.search(r"on (ws://[\d.]+:\d+)", line)
            if found:
                break
        assert found, "the server did not start"
        yield found.group(1)
    finally:
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=60)
    assert rc == 0 and "stopped" in server.stderr.read()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
