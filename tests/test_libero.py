"""LIBERO (docs/libero.md): the assets check, the benchmark's fixed initial states, the LIBERO-Object expert,
`vlaforge eval --benchmark`, and data in the LeRobot / openpi LIBERO layout (a fixture the real LeRobot 0.4.4 wrote,
and `data generate --suite libero_object`'s recordings) through `recipes/libero.toml`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vlaforge.data import libero
from vlaforge.errors import VlaforgeError

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "lerobot" / "v044_libero"
RECIPE = ROOT / "recipes" / "libero.toml"


def _vlaforge(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """A fresh `python -m vlaforge` with `env` added: a forked run would inherit this process's LIBERO, configured
    once (`libero.libero` is cached) with the installed assets."""
    return subprocess.run([sys.executable, "-m", "vlaforge", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def _libero_file_state(task_index: int, episode: int) -> np.ndarray:
    """An initial state read the way LIBERO's own benchmark API reads it (its torch.load of the task's file)."""
    libero.libero()
    from libero.libero import benchmark

    suite = benchmark.get_benchmark_dict()["libero_object"]()
    return np.asarray(suite.get_task_init_states(task_index)[episode], np.float64)


def test_assets_check_names_the_missing_or_altered_file(tmp_path):
    root = tmp_path / "assets"
    (root / "meshes").mkdir(parents=True)
    (root / "meshes" / "a.obj").write_bytes(b"vertices")
    (root / "b.xml").write_bytes(b"<mujoco/>")
    manifest = tmp_path / "manifest"
    manifest.write_text("# test\n" + "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.stat().st_size}  "
                                             f"{p.relative_to(root)}\n" for p in [root / "meshes/a.obj",
                                                                                  root / "b.xml"]))
    stamp = tmp_path / "ok"
    libero.check_assets(root, manifest, stamp)
    assert stamp.is_file()
    (root / "meshes" / "a.obj").write_bytes(b"verticez")  # same size, other bytes: the hash finds it
    with pytest.raises(VlaforgeError, match=r"meshes/a\.obj differs from the upstream file"):
        libero.check_assets(root, manifest, stamp)
    (root / "b.xml").unlink()
    with pytest.raises(VlaforgeError, match=r"b\.xml is missing"):
        libero.check_assets(root, manifest, stamp)


def test_installed_assets_match_the_manifest(tmp_path):
    lines = [x for x in libero.ASSET_MANIFEST.read_text().splitlines() if x and not x.startswith("#")]
    assert len(lines) > 500
    libero.check_assets(libero._assets_root(), stamp=tmp_path / "ok")  # all hashes, no stamp yet


def test_initial_state_is_the_benchmark_file_and_the_expert_solves_it():
    """The state an evaluation episode starts from is the benchmark's file's (read by LIBERO's own API); the scripted
    expert solves it (cream cheese: the flat box beside a can), physics only."""
    task = libero.suite_tasks("libero_object")[1]
    env = libero.LiberoEnv(task.id, [], render=False)
    try:
        env.eval_reset(task.index, 2, seed=7)
        want = _libero_file_state(task.index, 2)
        assert env.start_digest == hashlib.sha256(want.tobytes()).hexdigest()
        expert, success = libero.ObjectExpert(env), False
        for _ in range(env.max_steps):
            _, success = env.step(expert.act())
            if success:
                break
        assert success, f"the expert ended in phase {expert.phase}"
        assert env.env.check_success()  # LIBERO's own goal predicate
    finally:
        env.close()


def test_protocol_full_and_reduced():
    from vlaforge.evaluation.closed_loop import libero_protocol

    tasks, episodes, steps, record = libero_protocol("libero_object", None, None, None)
    assert (len(tasks), episodes, steps, record["protocol"]) == (10, 50, 280, "full")
    assert record["settle_steps"] == 10
    tasks, episodes, steps, record = libero_protocol("libero_10", "2", 5, None)
    assert (len(tasks), episodes, steps, record["protocol"]) == (2, 5, 520, "reduced")
    tasks, *_ = libero_protocol("libero_object", "3,pick_up_the_milk_and_place_it_in_the_basket", None, None)
    assert tasks[1] == "libero_object/pick_up_the_milk_and_place_it_in_the_basket"
    for bad, match in [(("libero_object", "11", None, None), "has 10 tasks"),
                       (("libero_object", "milk", None, None), "not a task of libero_object"),
                       (("libero_object", None, 51, None), "50 fixed initial states"),
                       (("libero_90", None, None, None), "unknown LIBERO suite")]:
        with pytest.raises(VlaforgeError, match=match):
            libero_protocol(*bad)


def test_a_policy_of_other_cameras_or_shapes_is_refused():
    libero.check_policy(["image", "wrist_image"], 8, 7)
    with pytest.raises(VlaforgeError, match="takes camera 'corner'; LIBERO renders image, wrist_image"):
        libero.check_policy(["corner"], 8, 7)
    with pytest.raises(VlaforgeError, match="4-D state and predicts 4-D actions"):
        libero.check_policy(["image"], 4, 4)


def test_missing_asset_is_one_line(tmp_path):
    """An asset folder with one file missing: `vlaforge data generate --suite` names the file and exits 2."""
    real = libero._assets_root()
    lines = [x.split("  ", 2)[2] for x in libero.ASSET_MANIFEST.read_text().splitlines()
             if x and not x.startswith("#")]
    gone = next(x for x in lines if x.endswith(".obj"))
    copy = tmp_path / "assets"
    for rel in lines:
        if rel != gone:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            (copy / rel).symlink_to(real / rel)
    done = _vlaforge("data", "generate", "--suite", "libero_object", "--out", str(tmp_path / "data"),
                     env={"VLAFORGE_LIBERO_ASSETS": str(copy), "VLAFORGE_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and gone in err[0] and "missing" in err[0], err
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_public_layout_trains_and_evaluates_on_the_benchmark(tmp_path):
    """The LeRobot-written fixture in the LIBERO datasets' layout (image-dtype cameras, {"motors": ...} names)
    trains with recipes/libero.toml and no data override but its path; the policy runs one short LIBERO-Object
    episode under `eval --benchmark`, and the report has the task, success, interval and the initial state used."""
    run = tmp_path / "run"
    done = run_cli("train", str(RECIPE), f"--data.path={FIXTURE}", "--train.steps=2", "--train.batch_size=4",
                   "--model.image_size=32", f"--train.output_dir={run}", "--data.num_workers=0")
    assert done.returncode == 0, done.stderr[-3000:]
    # the public layout has no per-frame text or environment state: the recipe's auto terms turn off, one line each
    assert "loss.weights.env_state = 1 -> 0" in done.stdout and "loss.weights.language = 0.1 -> 0" in done.stdout
    out = tmp_path / "eval"
    done = run_cli("eval", str(run), "--benchmark", "libero_object", "--tasks", "1", "--episodes", "1",
                   "--max-steps", "12", "--workers", "1", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    task = libero.suite_tasks("libero_object")[0]
    assert list(report["tasks"]) == [task.id]
    row = report["tasks"][task.id]
    assert row["episodes"] == 1 and row["successes"] in (0, 1) and len(row["ci95"]) == 2
    assert (report["benchmark"], report["protocol"], report["max_steps"]) == ("libero_object", "reduced", 12)
    assert report["instructions"][task.id] == task.instruction
    (episode,) = report["episodes"]
    assert episode["initial_state_sha256"] == hashlib.sha256(_libero_file_state(0, 0).tobytes()).hexdigest()
    assert episode["length"] == 12 or episode["success"]
    assert (out / "videos" / f"{task.id}.mp4").is_file()


@pytest.mark.slow
def test_generated_episode_has_the_public_layout_and_trains(tmp_path):
    """`data generate --suite libero_object --tasks NAME`'s recording (one expert episode of one task, by LIBERO's
    task name, the suite's step limit by default) reads back with the public layout's cameras, state and action, plus
    the expert's phase and the object's position; the recipe trains on it."""
    from vlaforge.data.lerobot_v3 import LeRobotDataset

    task = libero.suite_tasks("libero_object")[0]
    out = tmp_path / "gen"
    done = run_cli("data", "generate", "--suite", "libero_object", "--tasks", task.name, "--episodes", "1",
                   "--image-size", "32", "--workers", "1", "--no-progress", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["episodes"] == {task.id: 1} and summary["expert_failures"] == {task.id: 0}
    ours, public = LeRobotDataset(out), LeRobotDataset(FIXTURE)
    assert ours.cameras == public.cameras == ["observation.images.image", "observation.images.wrist_image"]
    for key in ("observation.state", "action"):
        assert ours.columns[key].shape[1] == public.columns[key].shape[1]
    assert ours.tasks == [task.instruction]
    frames = ours.decode("observation.images.image", ours.episodes[0])
    assert frames.shape == (ours.episodes[0].length, 32, 32, 3)
    assert "annotation.phase" in ours.columns and ours.columns["observation.environment_state"].shape[1] == 3
    # the recorded state is the LIBERO datasets' 8-D state: eef position, axis-angle, two finger positions
    first = ours.columns["observation.state"][0]
    assert abs(np.linalg.norm(first[3:6]) - np.pi) < 0.2 and first[6] > 0 > first[7]
    info = json.loads((out / "meta" / "info.json").read_text())
    assert (info["fps"], info["robot_type"], info["vlaforge"]["tasks"]) == (20, "panda", [task.id])
    run = tmp_path / "run"
    done = run_cli("train", str(RECIPE), f"--data.path={out}", "--train.steps=2", "--train.batch_size=4",
                   "--model.image_size=32", f"--train.output_dir={run}", "--data.num_workers=0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-> 0" not in done.stdout  # the env_state and language terms stay on: the generated data has both
