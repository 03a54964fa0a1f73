"""Tokenizer, Wilson intervals, the policy runtime against the training dataset, and Meta-World end to end."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from vlaforge.data.episodes import DemoDataset
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.video import decode_frames
from vlaforge.data.tokenizer import load_tokenizer, train_bpe
from vlaforge.data.transforms import ObservationSpec, normalization_from_stats
from vlaforge.evaluation.closed_loop import Policy, wilson_interval

from conftest import run_cli
from fake_lerobot import CAMS, SIZE, write_dataset


def test_bpe_tokenizer_round_trip(tmp_path):
    texts = ["press the button from the top", "open the door", "move above the button"]
    tok = train_bpe(texts, 400)
    assert 259 < tok.vocab_size <= 400 and tok.pad_id == 0
    ids, mask = tok.encode(texts + ["open the drawer"], 12)
    assert ids.shape == (4, 12) and ids.dtype == torch.long
    for row, m, text in zip(ids, mask, texts):
        n = int(m.sum())
        assert row[n - 1] == tok.eos_id and torch.all(row[n:] == 0)
        assert tok.tok.decode(row[:n - 1].tolist()) == text
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path, None)
    assert torch.equal(again.encode(texts, 12)[0], ids[:3])


def test_task_counts():
    from vlaforge.data.metaworld import parse_task_counts
    from vlaforge.errors import VlaforgeError

    assert parse_task_counts("reach-v3:40, door-open-v3", 7) == {"reach-v3": 40, "door-open-v3": 7}
    with pytest.raises(VlaforgeError, match="did you mean 'door-open-v3'"):
        parse_task_counts("door-opn-v3", 1)
    with pytest.raises(VlaforgeError, match="positive integer"):
        parse_task_counts("reach-v3:0", 1)


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0),
                                       (38, 50, 0.6259, 0.8570)])
def test_wilson_interval(k, n, lo, hi):
    a, b = wilson_interval(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


class _Recorder(torch.nn.Module):
    """Stands in for the VLA: returns a fixed normalized chunk and records what it was shown."""

    def __init__(self, chunk):
        super().__init__()
        self.seen, self.chunk = [], chunk

    def predict_actions(self, obs):
        self.seen.append(obs)
        return torch.arange(self.chunk * 4, dtype=torch.float32).reshape(self.chunk, 4)


def test_policy_sees_what_training_saw(tmp_path):
    """Closed-loop inputs (frame history, resizing, normalization, tokens) equal the dataset's samples."""
    root = tmp_path / "ds"
    eps = write_dataset(root)
    d = LeRobotDataset(root)
    spec = ObservationSpec(cameras=[f"observation.images.{c}" for c in CAMS], frames=3, frame_stride=2,
                           image_size=24, render_size=SIZE, instruction_tokens=6, text_tokens=0, chunk=4,
                           **normalization_from_stats(d.stats))
    tok = train_bpe(d.tasks, 300)
    ds = DemoDataset(d, spec, tok, seed=0, shift=0, color=0.0, cache_mb=64, text_column=None)
    model = _Recorder(spec.chunk)
    policy = Policy(model, spec, tok, execute=3)
    e = d.episodes[1]
    frames = {c: d.decode(f"observation.images.{c}", e) for c in CAMS}
    policy.reset(e.task)
    executed = []
    for t in range(e.length):
        views = {c: frames[c][t] for c in CAMS}
        executed.append(policy.act(views, d.columns["observation.state"][e.start + t]))
        ref = ds[e.start + t]
        obs = policy.observation(d.columns["observation.state"][e.start + t])
        torch.testing.assert_close(obs.images, ref.images)
        torch.testing.assert_close(obs.state, ref.state)
        assert torch.equal(obs.instruction_ids, ref.instruction_ids)
    # receding horizon: a new prediction every 3 steps, executing its first 3 actions (denormalized)
    assert len(model.seen) == -(-e.length // 3)
    chunk = spec.denormalize_action(model.predict_actions(None)).numpy()
    np.testing.assert_allclose(np.stack(executed[:6]), np.concatenate([chunk[:3], chunk[:3]]), rtol=1e-6)
    assert eps[1]["state"].shape[0] == e.length


def test_policy_renders_only_when_it_predicts(tmp_path):
    root = tmp_path / "ds"
    write_dataset(root)
    d = LeRobotDataset(root)
    spec = ObservationSpec(cameras=[f"observation.images.{c}" for c in CAMS], frames=1, frame_stride=1,
                           image_size=SIZE, render_size=SIZE, instruction_tokens=6, text_tokens=0, chunk=4,
                           **normalization_from_stats(d.stats))
    policy = Policy(_Recorder(4), spec, train_bpe(d.tasks, 300), execute=3)
    policy.reset(d.tasks[0])
    frame = {c: np.zeros((SIZE, SIZE, 3), np.uint8) for c in CAMS}
    wants = []
    for _ in range(7):
        wants.append(policy.wants_views())
        policy.act(frame if wants[-1] else None, d.columns["observation.state"][0])
    assert wants == [True, False, False, True, False, False, True]


@pytest.mark.slow
def test_first_frame_shows_this_episodes_goal():
    """reset() must refresh what the renderer reads: the first frame may not show the previous goal."""
    from vlaforge.data.metaworld import MetaWorldEnv

    env = MetaWorldEnv("reach-v3", ["topview"], 64)
    for seed in (1, 2):
        env.reset(seed)
        first = env.views()["topview"].astype(int)
        env.step(np.zeros(4, np.float32))  # a still hand: only a stale goal would change the picture
        second = env.views()["topview"].astype(int)
        assert (np.abs(first - second).max(-1) > 60).sum() <= 3  # a stale goal: 7-8 pixels here
    env.close()


@pytest.mark.slow
def test_generate_train_eval_end_to_end(tmp_path):
    """Meta-World for real: generation is reproducible and leak-free, training reads it, eval reports."""
    gen = ["data", "generate", "--tasks=reach-v3", "--episodes=2", "--image-size=32", "--cameras=corner,topview",
           "--workers=1", "--no-progress", "--seed=3"]
    for name in ("a", "b"):
        proc = run_cli(*gen, f"--out={tmp_path / name}", timeout=300)
        assert proc.returncode == 0, proc.stderr
    a, b = (pq.read_table(next((tmp_path / n / "data").rglob("*.parquet"))) for n in ("a", "b"))
    assert a.equals(b)  # same seed, same demonstrations
    d = LeRobotDataset(tmp_path / "a")
    assert len(d.episodes) == 2 and d.columns["observation.state"].shape[1] == 4  # hand xyz + gripper only
    phases = set(d.columns["annotation.phase"])
    assert phases <= {"move the hand to the goal", "hold the hand at the goal"} and phases
    assert d.info["vlaforge"]["tasks"] == ["reach-v3"]
    # the recorded frames are the env's: re-decoding the first frame gives an image of the scene, not zeros
    first = decode_frames(d.episodes[0].videos["observation.images.corner"][0], 0.0, 1, d.fps)
    assert first.std() > 10

    run = tmp_path / "run"
    proc = run_cli("train", "recipes/tiny_metaworld.toml", f"--data.path={tmp_path / 'a'}", "--model.image_size=32",
                   "--train.steps=2", "--train.batch_size=4", f"--train.output_dir={run}", "--data.num_workers=0",
                   "--train.progress=false", "--train.tensorboard=false", "--eval.every=2", "--eval.train_episodes=1",
                   "--eval.max_steps=3", "--eval.workers=1", timeout=300)
    assert proc.returncode == 0, proc.stderr
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/success/reach-v3" in m and 0 <= m["eval/success"] <= 1 for m in logged)
    ckpt = run / "checkpoints" / "step_00000002"
    assert (ckpt / "policy.json").is_file() and (ckpt / "tokenizer.json").is_file()
    proc = run_cli("eval", str(run), "--episodes=2", "--max-steps=6", "--workers=1", "--no-progress",
                   f"--out={tmp_path / 'eval'}", timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    r = report["tasks"]["reach-v3"]
    assert r["episodes"] == 2 and 0 <= r["success_rate"] <= 1 and len(r["ci95"]) == 2
    assert r["mean_length"] <= 6
    video = tmp_path / "eval" / "videos" / "reach-v3.mp4"
    frames = decode_frames(video, 0.0, int(r["mean_length"]) if r["successes"] == 0 else 1, 20)
    assert frames.shape[1:] == (32, 64, 3)  # two views side by side
    assert "reach-v3" in proc.stdout and "95% CI" in proc.stdout
