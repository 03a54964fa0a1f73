"""The auxiliary env_state term: the dataset's observation.environment_state (the goal position) as a training target
of a probe in the action head, never a policy input."""

import json

import numpy as np
import pytest
import torch

from vlaforge.config import load_config
from vlaforge.config.shapes import resolve_shapes
from vlaforge.data.batch import Batch
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.loader import build_data
from vlaforge.errors import ConfigError, VlaforgeError
from vlaforge.models.build import build_vla
from vlaforge.training.trainer import train

from conftest import TINY_RECIPE, run_cli
from fake_lerobot import LENGTHS, write_dataset

AUX = ["--model.env_state_dim=3", "--loss.weights.env_state=1.0"]


def _cfg(root, tmp_path, *overrides):
    return resolve_shapes(load_config(TINY_RECIPE, [
        "--data.source=lerobot", f"--data.path={root}", "--model.image_size=32", "--model.patch_size=8",
        "--train.progress=false", "--train.tensorboard=false", "--train.log_every=1", "--train.batch_size=8",
        "--data.augment_shift=0", f"--train.output_dir={tmp_path / 'run'}", *overrides]))[0]


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "ds"
    return root, write_dataset(root)


def test_env_state_round_trips_and_is_standardized_within_each_task(dataset, tmp_path):
    root, eps = dataset
    d = LeRobotDataset(root)
    col = d.columns["observation.environment_state"]
    np.testing.assert_array_equal(col, np.concatenate([e["env_state"] for e in eps]))
    assert d.info["features"]["observation.environment_state"]["names"] == ["goal_x", "goal_y", "goal_z"]
    stats = json.loads((root / "meta" / "stats.json").read_text())["observation.environment_state"]
    np.testing.assert_allclose(stats["mean"], col.mean(0), rtol=1e-5)

    cfg = _cfg(root, tmp_path, *AUX)
    data = build_data(cfg, build_vla(cfg.model, cfg.loss))
    targets = torch.stack([data.dataset[i].env_state for i in range(len(data.dataset))])
    door = np.r_[0:LENGTHS[0], LENGTHS[0] + LENGTHS[1]:sum(LENGTHS)]  # episodes 0 and 2: door-open-v3
    raw = torch.as_tensor(col[door])
    torch.testing.assert_close(targets[door], (raw - raw.mean(0)) / raw.std(0, correction=0))
    # the one button episode has a constant goal: standardized to zeros, not blown up by a zero std
    assert targets[LENGTHS[0]:LENGTHS[0] + LENGTHS[1]].abs().max() < 1e-4
    # without the term, samples carry no env_state and the model has no probe
    plain = _cfg(root, tmp_path)
    assert build_data(plain, build_vla(plain.model, plain.loss)).dataset[0].env_state is None
    assert build_vla(plain.model, plain.loss).action_head.env_probe is None


def test_the_probe_trains_the_vision_tower_and_stays_out_of_inference(dataset, tmp_path):
    root, _ = dataset
    cfg = _cfg(root, tmp_path, *AUX, "--loss.weights.contrastive=0", "--loss.weights.language=0")
    model = build_vla(cfg.model, cfg.loss)
    ds = build_data(cfg, model).dataset
    batch = Batch.collate([ds[i] for i in range(8)]).validate()
    terms = model(batch)
    assert terms["env_state"] > 0
    terms["env_state"].backward()
    grads = {c: sum(p.grad.abs().sum().item() for p in getattr(model, c).parameters() if p.grad is not None)
             for c in ("vision", "llm", "action_head")}
    assert all(g > 0 for g in grads.values()), grads  # the term reaches back through the LLM into the vision tower

    model.eval()
    obs = Batch(batch.images, batch.state, batch.instruction_ids, batch.instruction_mask)
    before = model.predict_actions(obs)
    with torch.no_grad():
        model.action_head.env_probe.weight.add_(1.0)
    torch.testing.assert_close(model.predict_actions(obs), before, rtol=0, atol=0)  # inference never reads it


def test_training_with_the_term_lowers_it_and_resumes_bit_exactly(dataset, tmp_path):
    root, _ = dataset
    steps = ["--train.lr_schedule=constant", "--train.warmup_steps=0"]
    full = _cfg(root, tmp_path, *AUX, *steps, "--train.steps=40", "--train.checkpoint_every=20",
                "--components.action_head.lr=3e-3")
    train(full)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    curve = [m["loss/env_state"] for m in logged if "loss/env_state" in m]
    assert len(curve) == 40 and np.mean(curve[-5:]) < 0.5 * np.mean(curve[:5])

    resumed = _cfg(root, tmp_path, *AUX, *steps, "--train.steps=40", "--components.action_head.lr=3e-3",
                   f"--train.resume={tmp_path / 'run' / 'checkpoints' / 'step_00000020'}",
                   f"--train.output_dir={tmp_path / 'resumed'}")
    train(resumed)
    again = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss/env_state"] for m in again if m.get("step", 0) > 20] == curve[20:]


def test_bad_env_state_settings_are_one_line_errors(dataset, tmp_path):
    root, _ = dataset
    with pytest.raises(ConfigError, match="set model.env_state_dim"):
        _cfg(root, tmp_path, "--loss.weights.env_state=1.0")
    with pytest.raises(ConfigError, match="needs data.source = 'lerobot'"):
        load_config(TINY_RECIPE, AUX)
    wrong = _cfg(root, tmp_path, "--model.env_state_dim=2", "--loss.weights.env_state=1.0")
    with pytest.raises(VlaforgeError, match="set model.env_state_dim = 3"):
        build_data(wrong, build_vla(wrong.model, wrong.loss))
    nan = tmp_path / "nan"
    write_dataset(nan, edit=lambda eps: eps[1]["env_state"].__setitem__((2, 0), np.nan))
    broken = _cfg(nan, tmp_path, *AUX)
    with pytest.raises(VlaforgeError, match=r"'observation.environment_state' holds NaN or inf in 1 rows \(first: "
                                            r"episode 1, frame 2\)"):
        build_data(broken, build_vla(broken.model, broken.loss))
    old = tmp_path / "old"
    write_dataset(old, env_state=False)  # a dataset recorded without the column
    proc = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={old}", *AUX,
                   "--train.steps=1", f"--train.output_dir={tmp_path / 'never'}")
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "observation.environment_state" in line and "regenerate" in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "never" / "checkpoints").exists()
