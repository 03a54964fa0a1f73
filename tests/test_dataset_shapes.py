"""Model shapes from the dataset: cameras / state_dim / action_dim left "auto" come from `meta/info.json`, are saved
in the run's config and policy.json, and the trained policy predicts chunks of the dataset's action size;
`vlaforge data info` shows what a dataset holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vlaforge.config import load_config
from vlaforge.config.shapes import resolve_shapes
from vlaforge.data.lerobot_writer import DatasetWriter
from vlaforge.errors import VlaforgeError

from conftest import TINY_RECIPE, run_cli
from fake_lerobot import _images, write_dataset

STATE, ACTION = 6, 7


def write_one_camera(root: Path) -> Path:
    """Two episodes from one 'wrist' camera, state 6, action 7 (the project's writer)."""
    rng = np.random.default_rng(0)
    with DatasetWriter(root, fps=10, cameras=["wrist"], image_size=32, state_names=[f"s{i}" for i in range(STATE)],
                       action_names=[f"a{i}" for i in range(ACTION)], text_features=["annotation.phase"]) as w:
        for ep, n in enumerate((9, 6)):
            w.add_episode("pick the cube", {"wrist": _images(ep, n, 0)},
                          rng.normal(size=(n, STATE)).astype(np.float32),
                          rng.uniform(-1, 1, (n, ACTION)).astype(np.float32),
                          {"annotation.phase": ["reach"] * n})
        w.finish()
    return root


def _lerobot(root: Path, *overrides: str):
    return load_config(TINY_RECIPE, ["--data.source=lerobot", f"--data.path={root}", *overrides])


def test_auto_shapes_come_from_the_dataset(tmp_path):
    root = write_one_camera(tmp_path / "one")
    cfg = _lerobot(root)
    assert (cfg.model.cameras, cfg.model.state_dim, cfg.model.action_dim) == ("auto", "auto", "auto")
    resolved, chosen = resolve_shapes(cfg)
    assert chosen == {"cameras": ["wrist"], "state_dim": STATE, "action_dim": ACTION}
    assert (resolved.model.cameras, resolved.model.state_dim, resolved.model.action_dim) == (["wrist"], 6, 7)
    # set in the recipe: kept as set (and checked against the dataset when the data is built)
    kept, chosen = resolve_shapes(_lerobot(root, "--model.state_dim=5"))
    assert kept.model.state_dim == 5 and "state_dim" not in chosen
    # bounded: the first N cameras in the dataset's order
    two = tmp_path / "two"
    write_dataset(two)
    assert resolve_shapes(_lerobot(two))[0].model.cameras == ["front", "top"]
    assert resolve_shapes(_lerobot(two, "--model.max_cameras=1"))[0].model.cameras == ["front"]
    # synthetic data has no dataset to ask: the old defaults
    synthetic = load_config(TINY_RECIPE)
    assert (synthetic.model.cameras, synthetic.model.state_dim, synthetic.model.action_dim) == (["corner"], 4, 4)


def test_a_missing_dataset_leaves_auto_only_where_allowed(tmp_path):
    cfg = _lerobot(tmp_path / "none")
    assert resolve_shapes(cfg, required=False)[0].model.cameras == "auto"
    with pytest.raises(VlaforgeError, match="dataset folder .* does not exist"):
        resolve_shapes(cfg)
    with pytest.raises(VlaforgeError, match="model.cameras = 'auto'"):
        _ = cfg.model.frames_per_sample


@pytest.mark.slow
def test_a_one_camera_dataset_trains_without_model_overrides(tmp_path):
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    root = write_one_camera(tmp_path / "one")
    run = tmp_path / "run"
    proc = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={root}", "--train.steps=2",
                   "--train.batch_size=4", "--train.progress=false", f"--train.output_dir={run}", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model.cameras = ['wrist'], model.state_dim = 6, model.action_dim = 7" in proc.stdout
    ckpt = run / "checkpoints" / "step_00000002"
    saved = load_config(ckpt / "config.toml")
    assert (saved.model.cameras, saved.model.state_dim, saved.model.action_dim) == (["wrist"], 6, 7)
    assert json.loads((ckpt / "policy.json").read_text())["cameras"] == ["observation.images.wrist"]
    runtime = PolicyRuntime.load(ckpt)
    chunk = runtime.predict(Observation({"wrist": _images(0, 1, 0)[0]}, np.zeros(STATE, np.float32),
                                        "pick the cube")).actions
    assert chunk.shape == (saved.model.action_chunk, ACTION) and np.isfinite(chunk).all()
    # a recipe that sets a shape the dataset does not have keeps today's one-line error
    proc = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={root}", "--model.action_dim=4",
                   "--train.steps=1", f"--train.output_dir={tmp_path / 'bad'}", timeout=180)
    assert proc.returncode == 2 and "set model.action_dim = 7" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_data_info_shows_a_dataset_and_refuses_a_damaged_one(tmp_path):
    root = tmp_path / "ds"
    write_dataset(root)
    proc = run_cli("data", "info", str(root), fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert "3 episodes, 24 frames, 2 tasks" in proc.stdout and "observation.images.front" in proc.stdout
    assert "open the door" in proc.stdout and "10 fps" in proc.stdout
    summary = json.loads(run_cli("data", "info", str(root), "--json").stdout)
    assert summary["model_shapes"] == {"cameras": ["front", "top"], "state_dim": 4, "action_dim": 4}
    assert [t["episodes"] for t in summary["tasks"]] == [2, 1] and summary["frames"] == 24
    assert summary["hide_distractors"] is False and summary["expert_steers_tcp"] == []  # info.json does not say
    broken = next((root / "data").rglob("*.parquet"))
    broken.write_bytes(b"PAR1 not parquet")
    proc = run_cli("data", "info", str(root))
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and str(broken) in lines[0] and "Traceback" not in proc.stderr
