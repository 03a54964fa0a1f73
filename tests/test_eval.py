"""Tokenizer, Wilson intervals, and Meta-World end to end (the policy runtime itself: test_inference.py)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.tokenizer import load_tokenizer, train_bpe
from vlaforge.data.video import decode_frames
from vlaforge.evaluation.closed_loop import wilson_interval

from conftest import run_cli


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


@pytest.mark.slow
@pytest.mark.gl
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
@pytest.mark.gl
def test_reach_expert_can_bring_the_fingertips_to_the_goal():
    """Reach's success test measures the fingertips' midpoint (`tcp_center`), 4.5 cm below the hand body that
    Meta-World's expert steers to the goal; with `steer_tcp` the expert settles the fingertips on the goal."""
    from vlaforge.data.metaworld import MetaWorldEnv, expert_action, make_expert

    env = MetaWorldEnv("reach-v3", ["corner"], 32)
    for seed in (3, 4):
        final = {}
        for steer in (False, True):
            expert, obs = make_expert("reach-v3"), env.reset(seed)
            for _ in range(120):  # past success, until the expert's proportional steps settle
                obs, _ = env.step(expert_action(expert, env.expert_input(obs, steer)))
            final[steer] = np.linalg.norm(env.env.tcp_center - obs[36:39])
        assert final[False] > 0.04 and final[True] < 0.01  # metres from the goal
    env.close()


@pytest.mark.slow
@pytest.mark.gl
def test_side_view_shows_goal_depth_and_height_as_column_and_row():
    """The free "side" view: across reach goals, the goal marker's image column follows the goal's depth (y) and its
    row the goal's height (z), each far more than the other axes."""
    from vlaforge.data.metaworld import MetaWorldEnv

    env = MetaWorldEnv("reach-v3", ["side"], 64, hide_distractors=True)
    goals, centres = [], []
    for seed in range(12):
        goals.append(env.reset(seed)[36:39])
        rows, cols = np.nonzero(env.goal_mask()["side"])
        assert len(rows) >= 4  # the goal is in the picture
        centres.append((rows.mean(), cols.mean()))
    design, centres = np.c_[np.array(goals), np.ones(len(goals))], np.array(centres)
    row, col = (np.linalg.lstsq(design, c, rcond=None)[0] for c in centres.T)  # pixels per m of x, y, z; offset
    assert np.abs(design @ np.stack([row, col], 1) - centres).max() < 1.5  # a linear map, to the pixel
    assert row[2] < 0 and abs(row[2]) > 3 * max(abs(row[0]), abs(row[1]))  # higher goals: higher rows
    assert abs(col[1]) > 4 * max(abs(col[0]), abs(col[2]))  # depth: along the columns
    env.close()


@pytest.mark.slow
@pytest.mark.gl
def test_hidden_distractors_change_the_picture_not_the_physics():
    """reach's puck drawn transparent: the same observations step by step, pictures that differ only where the
    puck was, and no trace of the puck's colour left there."""
    from vlaforge.data.metaworld import MetaWorldEnv

    shown, hidden = (MetaWorldEnv("reach-v3", ["corner", "topview"], 64, hide_distractors=h) for h in (False, True))
    for env in (shown, hidden):
        env.reset(5)
    action = np.array([0.3, -0.2, 0.1, 0.0], np.float32)
    for _ in range(3):
        assert np.array_equal(shown.step(action)[0], hidden.step(action)[0])
    a, b = shown.views()["corner"].astype(int), hidden.views()["corner"].astype(int)
    changed = np.abs(a - b).max(-1) > 30
    assert 0 < changed.sum() < 0.02 * changed.size  # a small region: the 4 cm puck at 64 px
    assert (b[changed] - a[changed]).mean() > 20  # the dark puck gave way to the lighter table behind it
    for env in (shown, hidden):
        env.close()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Two 2-episode reach datasets from the same seed, as make demo generates: the puck hidden and shown."""
    tmp = tmp_path_factory.mktemp("metaworld")
    gen = ["data", "generate", "--tasks=reach-v3", "--episodes=2", "--image-size=32", "--cameras=corner,behindGripper",
           "--workers=1", "--no-progress", "--seed=3", "--steer-tcp"]  # as make demo generates
    for name, scene in (("a", "--hide-distractors"), ("b", "--no-hide-distractors")):
        proc = run_cli(*gen, f"--out={tmp / name}", scene, timeout=300, fresh=name == "a")  # the entry point once
        assert proc.returncode == 0, proc.stderr
    return tmp


@pytest.fixture(scope="module")
def trained(generated):
    """The demo recipe trained 2 steps on the hidden-puck dataset, evaluating in the simulator at step 2."""
    run = generated / "run"
    proc = run_cli("train", "recipes/tiny_metaworld.toml", f"--data.path={generated / 'a'}", "--model.image_size=32",
                   "--train.steps=2", "--train.batch_size=4", f"--train.output_dir={run}", "--data.num_workers=0",
                   "--train.progress=false", "--train.tensorboard=false", "--eval.every=2", "--eval.train_episodes=1",
                   "--eval.max_steps=3", "--eval.workers=1", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.fixture(scope="module")
def evaluated(trained, generated):
    """`vlaforge eval` of the trained run: its process and report."""
    proc = run_cli("eval", str(trained), "--episodes=2", "--max-steps=6", "--workers=1", "--no-progress",
                   f"--out={generated / 'eval'}", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((generated / "eval" / "report.json").read_text())


@pytest.mark.slow
def test_generation_is_reproducible_leak_free_and_described(generated):
    """Meta-World for real: the same seed gives the same demonstrations, the policy's inputs hold no goal, and
    `data info` says how the dataset was recorded."""
    a, b = (pq.read_table(next((generated / n / "data").rglob("*.parquet"))) for n in ("a", "b"))
    assert a.equals(b)  # same seed, same demonstrations (hiding the puck changes the pictures, not the physics)
    d = LeRobotDataset(generated / "a")
    assert len(d.episodes) == 2 and d.columns["observation.state"].shape[1] == 4  # hand xyz + gripper only
    goal = d.columns["observation.environment_state"]  # the goal, a training target only: fixed per episode, in
    for e in d.episodes:  # reach's goal box (x -0.1..0.1, y 0.8..0.9, z 0.05..0.3 m)
        rows = goal[e.start:e.start + e.length]
        assert np.all(rows == rows[0]) and np.all(rows[0] >= [-0.1, 0.8, 0.05]) and np.all(rows[0] <= [0.1, 0.9, 0.3])
    phases = set(d.columns["annotation.phase"])
    assert phases <= {"move the hand to the goal", "hold the hand at the goal"} and phases
    assert d.info["vlaforge"]["tasks"] == ["reach-v3"] and d.info["vlaforge"]["hide_distractors"] is True
    # `data info` says how it was recorded (make demo refuses a dataset whose reach expert did not steer the fingertips)
    info = json.loads(run_cli("data", "info", str(generated / "a"), "--json").stdout)
    assert info["expert_steers_tcp"] == ["reach-v3"] and info["hide_distractors"] is True
    # the recorded frames are the env's: re-decoding the first frame gives an image of the scene, not zeros
    first = decode_frames(d.episodes[0].videos["observation.images.corner"][0], 0.0, 1, d.fps)
    assert first.std() > 10


@pytest.mark.slow
def test_training_reads_it_and_evaluates_in_the_loop(trained):
    logged = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/success/reach-v3" in m and 0 <= m["eval/success"] <= 1 for m in logged)
    ckpt = trained / "checkpoints" / "step_00000002"
    assert (ckpt / "policy.json").is_file() and (ckpt / "tokenizer.json").is_file()


@pytest.mark.slow
def test_eval_reports_success_and_a_video(generated, evaluated):
    proc, report = evaluated
    r = report["tasks"]["reach-v3"]
    assert report["distractors"] == "hidden"  # evaluated in the scene the dataset was rendered in
    assert r["episodes"] == 2 and 0 <= r["success_rate"] <= 1 and len(r["ci95"]) == 2
    assert r["mean_length"] <= 6
    video = generated / "eval" / "videos" / "reach-v3.mp4"
    frames = decode_frames(video, 0.0, int(r["mean_length"]) if r["successes"] == 0 else 1, 20)
    assert frames.shape[1:] == (32, 64, 3)  # two views side by side
    assert "reach-v3" in proc.stdout and "95% CI" in proc.stdout
    assert report["inference"]["options"]["cache"] == "exact" and report["inference"]["predictions"] > 0


@pytest.mark.slow
def test_eval_takes_the_runtime_options(trained, generated):
    """The runtime's options reach the report: token cache, asynchronous chunks with a simulated delay; a merge the
    head cannot do is one line."""
    proc = run_cli("eval", str(trained), "--episodes=1", "--max-steps=12", "--workers=1", "--no-progress", "--no-video",
                   "--cache=token", "--async", "--latency-ms=20", "--execute=2", f"--out={generated / 'eval2'}",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    inf = json.loads((generated / "eval2" / "report.json").read_text())["inference"]
    assert inf["options"] | {"cache": "token", "asynchronous": True, "latency_ms": 20.0} == inf["options"]
    assert inf["p50_ms"] > 0 and 0 <= inf["idle_fraction"] < 1 and inf["cache"]["frames"] > 0
    proc = run_cli("eval", str(trained), "--merge=rtc", "--episodes=1", timeout=300, fresh=True)  # the entry point
    assert proc.returncode == 2 and "needs a flow-matching action head" in proc.stderr


@pytest.mark.slow
def test_eval_through_a_server_gives_the_in_process_outcomes(trained, evaluated, tmp_path):
    """`vlaforge serve RUN` in a subprocess; `vlaforge eval --server` gives the in-process outcomes on the same
    seeds; SIGTERM stops the server with exit code 0."""
    from conftest import served

    in_process = evaluated[1]
    with served(trained, "--device=cpu") as uri:
        proc = run_cli("eval", str(trained), "--episodes=2", "--max-steps=6", "--workers=1", "--no-progress",
                       "--no-video", f"--server={uri}", f"--out={tmp_path / 'remote'}", timeout=300)
        assert proc.returncode == 0, proc.stderr
        remote = json.loads((tmp_path / "remote" / "report.json").read_text())
        for task, r in in_process["tasks"].items():
            assert {k: remote["tasks"][task][k] for k in ("successes", "mean_length")} == \
                {k: r[k] for k in ("successes", "mean_length")}
        assert remote["inference"]["options"]["server"] == uri
