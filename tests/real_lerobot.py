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


def require_site(site: Path, what: str, make: str) -> Path:
    """`site`, a test-only LeRobot folder (`what`, installed by `make`); skips the test where it is missing, and fails
    it on CI (which must have built it)."""
    if not (site / ".installed").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{site} is missing: `{make}` installs {what} for these tests")
        pytest.skip(f"{what} is not installed in {site} (run `{make}`)")
    return site


def lerobot_site() -> Path:
    """The folder LeRobot 0.4.4 is installed in (`make lerobot-env`, which `make test` runs)."""
    return require_site(SITE, "the real LeRobot 0.4.4", "make lerobot-env")


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
