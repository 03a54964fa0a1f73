"""`vlaforge serve DIR --protocol lerobot` for LeRobot's own policy folders (SmolVLA, pi0, pi0.5: a `LeRobotRuntime`),
to LeRobot 0.4.4's own robot client naming the folder's policy_type: its chunks have the folder's shape (chunk 5 x
6 actions) and equal `PolicyRuntime.load(DIR).predict` on the same observation, the noise fixed by seeding torch's
generator in the serving process (the runtime draws (chunk, max_action_dim) from it per prediction when none is
given); its control loop then drives a simulated 6-joint robot with them. Through the CLI (SmolVLA; the server's
noise is its own there): the folder's shape, finite, within the action statistics' plausible range. A policy_type
the folder is not is refused at the handshake in one line. The folders are LeRobot 0.6.1's (tests/lerobot061.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lerobot061 as ref061
import numpy as np
import pytest
import torch

from vlaforge.inference.runtime import Observation, PolicyRuntime
from vlaforge.serving import protocol
from vlaforge.serving.lerobot_grpc import policy_type

from conftest import served
from real_lerobot import SCRIPTS, lerobot_env
from test_serving import Live

pytestmark = pytest.mark.xdist_group("lerobot061")

TASK = "pick up the red cube"
CAMERAS = ["top", "wrist"]  # the folders' input_features
CHUNK, ACTION_DIM, STATE_DIM = ref061.CHUNK, ref061.ACTION_DIM, ref061.STATE_DIM
SEED = 1234
TOL = 1e-5


@pytest.fixture
def session_root(tmp_path_factory) -> Path:
    return ref061.session_root(tmp_path_factory)


def _folder(kind: str, root: Path) -> tuple[Path, dict]:
    out = ref061.policy_folder(kind, root)
    return out / "policy", ({"sizes": str(out / "sizes.json")} if kind != "smolvla" else {})


def _frames(n: int, seed: int) -> dict[str, np.ndarray]:
    """n observations of the simulated robot: 6 joints, two 48 x 64 cameras (the folders take 24 x 32: resized)."""
    g = np.random.default_rng(seed)
    return {"state": g.normal(size=(n, STATE_DIM)).astype(np.float32),
            **{c: g.integers(0, 256, (n, 48, 64, 3), dtype=np.uint8) for c in CAMERAS}}


def _observation(frames: dict, i: int) -> Observation:
    return Observation({c: frames[c][i] for c in CAMERAS}, frames["state"][i], TASK)


def _job(address: str, kind: str, frames: Path, **extra) -> dict:
    return {"address": address, "policy_type": kind, "path": f"lerobot/{kind}", "frames": str(frames),
            "cameras": CAMERAS, "action_dim": ACTION_DIM, "chunk": CHUNK, "task": TASK, **extra}


def _run_client(jobs: list[dict], tmp_path: Path) -> list[dict]:
    """LeRobot 0.4.4's own robot client for each job (tests/lerobot_env/robot_client_run.py): one result each."""
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(SCRIPTS / "robot_client_run.py"), str(tmp_path / "jobs.json")],
                          env=lerobot_env(), capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # (its logger writes logs/ into the working folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _live(runtime) -> tuple[Live, str, list[str]]:
    logs: list[str] = []
    live = Live(runtime, protocol="lerobot")
    live.server.log = logs.append
    host, port, _ = live.server.address
    return live, f"{host}:{port}", logs


def _served_like_the_runtime(result: dict, reference: PolicyRuntime, frames: dict) -> None:
    """The job's chunks, one per frame in order, equal the reference's predictions in that order (torch seeded as
    the server was before the client ran: the same noise draws)."""
    assert result["started"] and not result["errors"], result["errors"]
    torch.manual_seed(SEED)
    for i, chunk in enumerate(result["chunks"]):
        assert chunk["timesteps"] == [100 * i + k for k in range(CHUNK)]
        got = np.asarray(chunk["actions"])
        assert got.shape == (CHUNK, ACTION_DIM)
        np.testing.assert_allclose(got, reference.predict(_observation(frames, i), f"ref{i}").actions, atol=TOL)
    assert len(result["chunks"]) == len(frames["state"])


def _refused(result: dict, asked: str, folder: str) -> None:
    """The real client's start() failed, and it logged the server's one line."""
    assert result["started"] is False and result["chunks"] == []
    says = (f"policy_type '{asked}': this server serves a LeRobot '{folder}' policy folder; ask for "
            f"policy_type={folder}")
    assert any(says in line and "INVALID_ARGUMENT" in line for line in result["errors"]), result["errors"]


@pytest.mark.slow
def test_the_real_client_gets_a_smolvla_folders_actions(tmp_path, session_root):
    folder, _ = _folder("smolvla", session_root)
    frames = _frames(3, seed=0)
    np.savez(tmp_path / "frames.npz", **frames)
    reference = PolicyRuntime.load(folder, device="cpu")
    live, address, logs = _live(PolicyRuntime.load(folder, device="cpu"))
    try:
        with served(folder, "--protocol", "lerobot", "--fps", "30") as uri:
            jobs = [_job(address, "smolvla", tmp_path / "frames.npz", loop_s=2.0),
                    _job(uri.removeprefix("grpc://"), "smolvla", tmp_path / "frames.npz"),
                    _job(address, "pi0", tmp_path / "frames.npz")]
            torch.manual_seed(SEED)  # the in-process server's noise: its only predictions are the first job's
            here, cli, wrong = _run_client(jobs, tmp_path)
    finally:
        live.close()
    _served_like_the_runtime(here, reference, frames)
    # its own threads then drove the robot with the folder's 6 actions (noise drawn on: not compared)
    executed = np.asarray(here["executed"])
    assert executed.shape[1:] == (ACTION_DIM,) and len(executed) >= 10 and np.isfinite(executed).all(), here
    assert set(here["shown"]) == {0, 1, 2}
    # `vlaforge serve DIR --protocol lerobot`: its own noise, so the shape, finite, and within the statistics
    assert cli["started"] and not cli["errors"] and len(cli["chunks"]) == 3, cli
    stats = ref061.action_stats(folder.parent)
    mean, std = stats["mean"].numpy(), stats["std"].numpy()
    for chunk in cli["chunks"]:
        got = np.asarray(chunk["actions"])
        assert got.shape == (CHUNK, ACTION_DIM) and np.isfinite(got).all()
        assert np.abs((got - mean) / std).max() < 6.0  # 30 draws of the runtime's own stay under 3.5
    _refused(wrong, "pi0", "smolvla")
    refusals = [line for line in logs if line.startswith("lerobot: refused")]
    assert len(refusals) == 1 and "policy_type 'pi0'" in refusals[0] and "\n" not in refusals[0], logs
    assert any("asks for 'smolvla'" in line and "5 actions a chunk of the policy's 5" in line for line in logs)


@pytest.mark.slow
def test_the_real_client_gets_pi0_and_pi05_folders_actions(tmp_path, session_root):
    """In-process (their sizes.json is a `PolicyRuntime.load` option the CLI does not take); pi0 asked of a pi0.5
    folder is refused (the two share their key layout: the type is what tells them apart)."""
    folders = {kind: _folder(kind, session_root) for kind in ("pi0", "pi05")}
    frames = _frames(2, seed=1)
    np.savez(tmp_path / "frames.npz", **frames)
    references = {k: PolicyRuntime.load(f, device="cpu", lerobot=o) for k, (f, o) in folders.items()}
    lives = {k: _live(PolicyRuntime.load(f, device="cpu", lerobot=o)) for k, (f, o) in folders.items()}
    try:
        jobs = [_job(lives["pi0"][1], "pi0", tmp_path / "frames.npz"),
                _job(lives["pi05"][1], "pi05", tmp_path / "frames.npz"),
                _job(lives["pi05"][1], "pi0", tmp_path / "frames.npz")]
        torch.manual_seed(SEED)
        pi0, pi05, wrong = _run_client(jobs, tmp_path)
    finally:
        for live, _, _ in lives.values():
            live.close()
    _served_like_the_runtime(pi0, references["pi0"], frames)
    # pi0.5's draws follow pi0's in the seeded generator: replay pi0's first
    assert pi05["started"] and not pi05["errors"], pi05["errors"]
    torch.manual_seed(SEED)
    for i in range(2):
        references["pi0"].predict(_observation(frames, i), f"again{i}")
    for i, chunk in enumerate(pi05["chunks"]):
        np.testing.assert_allclose(np.asarray(chunk["actions"]),
                                   references["pi05"].predict(_observation(frames, i), f"ref{i}").actions, atol=TOL)
        assert np.asarray(chunk["actions"]).shape == (CHUNK, ACTION_DIM)
    _refused(wrong, "pi0", "pi05")


def test_policy_type_is_checked_for_a_lerobot_folder_only():
    policy_type("act", None)  # a vlaforge run: LeRobot has no type for it; logged, not checked
    policy_type("vlaforge", None)
    policy_type("smolvla", "smolvla")
    for asked in ("pi0", "vlaforge", None, ["smolvla"]):
        with pytest.raises(protocol.RequestError, match=r"^policy_type .*: this server serves a LeRobot 'smolvla' "
                                                        r"policy folder; ask for policy_type=smolvla$"):
            policy_type(asked, "smolvla")
