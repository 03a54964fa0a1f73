"""LeRobotDataset v3 writer/reader, v2.1 reading, the training dataset over it, and damaged-file errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from vlaforge.data.episodes import DemoDataset
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.lerobot_writer import DatasetWriter
from vlaforge.data.tokenizer import train_bpe
from vlaforge.data.transforms import ObservationSpec, normalization_from_stats
from vlaforge.errors import VlaforgeError

from conftest import run_cli
from fake_lerobot import CAMS, SIZE, TASKS, VideoWriter, _episode, write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds") / "demo"
    eps = write_dataset(root)
    return root, eps


def test_v3_round_trip(dataset):
    root, eps = dataset
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] == 3 and info["total_frames"] == 24
    d = LeRobotDataset(root)
    assert d.tasks == ["open the door", "press the button"]
    assert [(e.index, e.length, e.start, e.task) for e in d.episodes] == [
        (0, 7, 0, TASKS[0]), (1, 12, 7, TASKS[1]), (2, 5, 19, TASKS[2])]
    assert d.columns["task_index"].tolist() == [0] * 7 + [1] * 12 + [0] * 5
    for i, e in enumerate(d.episodes):
        rows = slice(e.start, e.start + e.length)
        np.testing.assert_array_equal(d.columns["observation.state"][rows], eps[i]["state"])
        np.testing.assert_array_equal(d.columns["action"][rows], eps[i]["action"])
        assert d.columns["frame_index"][rows].tolist() == list(range(e.length))
        assert list(d.columns["annotation.phase"][rows]) == eps[i]["text"]["annotation.phase"]
        for cam in CAMS:
            frames = d.decode(f"observation.images.{cam}", e)  # many episodes per mp4: decoded by timestamp
            assert frames.shape == (e.length, SIZE, SIZE, 3)
            err = np.abs(frames.astype(int) - eps[i]["images"][cam].astype(int))
            assert err.mean() < 3.0, (i, cam, err.mean())  # lossy codec, but the right frames
    # One video file per camera holds all three episodes.
    assert len(list((root / "videos").rglob("*.mp4"))) == 2
    # Global stats equal stats over all frames.
    all_actions = np.concatenate([e["action"] for e in eps])
    np.testing.assert_allclose(d.stats["action"]["mean"], all_actions.mean(0), atol=1e-5)
    np.testing.assert_allclose(d.stats["action"]["std"], all_actions.std(0), atol=1e-5)
    assert d.stats["action"]["count"] == [24]
    ep_meta = pq.read_table(next((root / "meta" / "episodes").rglob("*.parquet"))).to_pylist()
    assert ep_meta[1]["dataset_from_index"] == 7 and ep_meta[1]["dataset_to_index"] == 19
    assert ep_meta[1]["videos/observation.images.top/from_timestamp"] == pytest.approx(0.7)


def test_files_roll_over_and_stay_readable(tmp_path):
    eps = write_dataset(tmp_path / "rolled", data_file_mb=1e-6, video_file_mb=1e-6)
    d = LeRobotDataset(tmp_path / "rolled")
    assert len(list((tmp_path / "rolled" / "data").rglob("*.parquet"))) == 3
    assert len(list((tmp_path / "rolled" / "videos" / "observation.images.top").rglob("*.mp4"))) == 3
    e = d.episodes[2]
    np.testing.assert_array_equal(d.columns["action"][e.start:e.start + e.length], eps[2]["action"])
    assert d.decode("observation.images.front", e).shape[0] == 5


def write_v21(root, eps):
    """A LeRobot v2.1 dataset: per-episode parquet and mp4, episodes.jsonl, tasks.jsonl."""
    (root / "meta").mkdir(parents=True)
    feats = {f"observation.images.{c}": {"dtype": "video", "shape": [SIZE, SIZE, 3]} for c in CAMS}
    feats |= {"observation.state": {"dtype": "float32", "shape": [4]}, "action": {"dtype": "float32", "shape": [4]}}
    info = {"codebase_version": "v2.1", "fps": 10, "chunks_size": 1000, "features": feats,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    (root / "meta" / "tasks.jsonl").write_text("\n".join(json.dumps({"task_index": i, "task": t})
                                                         for i, t in enumerate(["open the door", "press the button"])))
    lines, start = [], 0
    for i, e in enumerate(eps):
        n = len(e["state"])
        lines.append(json.dumps({"episode_index": i, "tasks": [TASKS[i]], "length": n}))
        path = root / f"data/chunk-000/episode_{i:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({  # older writers: plain list<float>, index restarting per file
            "observation.state": pa.array(e["state"].tolist(), pa.list_(pa.float32())),
            "action": pa.array(e["action"].tolist(), pa.list_(pa.float32())),
            "timestamp": pa.array(np.arange(n) / 10, pa.float32()), "frame_index": np.arange(n),
            "episode_index": np.full(n, i), "index": start + np.arange(n),
            "task_index": np.full(n, TASKS.index(TASKS[i]) if i != 1 else 1)}), path)
        for c in CAMS:
            v = VideoWriter(root / f"videos/chunk-000/observation.images.{c}/episode_{i:06d}.mp4", 10, (SIZE, SIZE))
            v.add(e["images"][c])
            v.close()
        start += n
    (root / "meta" / "episodes.jsonl").write_text("\n".join(lines))
    stats = {"observation.state": {"mean": [0.0] * 4, "std": [1.0] * 4},
             "action": {"mean": [0.0] * 4, "std": [1.0] * 4}}
    (root / "meta" / "stats.json").write_text(json.dumps(stats))


def test_v21_reading(tmp_path, dataset):
    _, eps = dataset
    write_v21(tmp_path / "v21", eps)
    d = LeRobotDataset(tmp_path / "v21")
    assert d.version == "v2.1" and d.tasks == ["open the door", "press the button"]
    assert [(e.length, e.start) for e in d.episodes] == [(7, 0), (12, 7), (5, 19)]
    np.testing.assert_array_equal(d.columns["action"][7:19], eps[1]["action"])
    frames = d.decode("observation.images.top", d.episodes[1])
    assert np.abs(frames.astype(int) - eps[1]["images"]["top"].astype(int)).mean() < 3.0


def _spec(d: LeRobotDataset, chunk=4, frames=2, stride=2) -> ObservationSpec:
    return ObservationSpec(cameras=[f"observation.images.{c}" for c in CAMS], frames=frames, frame_stride=stride,
                           image_size=SIZE, render_size=SIZE, instruction_tokens=6, text_tokens=4, chunk=chunk,
                           **normalization_from_stats(d.stats))


def _demo(d, spec, **kw):
    tok = train_bpe(d.tasks + ["phase 0", "phase 1", "phase 2"], 300)
    return DemoDataset(d, spec, tok, seed=0, shift=kw.get("shift", 0), color=kw.get("color", 0.0),
                       cache_mb=kw.get("cache_mb", 64), text_column="annotation.phase")


@pytest.mark.parametrize("cache_mb", [64, 0.01])  # everything decoded up front / LRU decoding on demand
def test_action_chunks_stay_inside_episodes(dataset, cache_mb):
    root, eps = dataset
    d = LeRobotDataset(root)
    spec = _spec(d)
    ds = _demo(d, spec, cache_mb=cache_mb)
    assert ds.store.preloaded == (cache_mb == 64)
    # past the cache, training says so when it starts (each batch decodes video), naming the size that fits
    total = d.num_frames * len(spec.cameras) * spec.render_size ** 2 * 3 / 2**20
    assert (ds.store.notice is None) == (cache_mb == 64)
    assert cache_mb == 64 or f"set data.cache_mb above {total:.0f}" in ds.store.notice
    for e_pos, e in enumerate(d.episodes):
        for t in range(e.length):
            s = ds[e.start + t]
            valid = min(spec.chunk, e.length - t)
            assert s.action_mask.tolist() == [True] * valid + [False] * (spec.chunk - valid)
            want = spec.normalize_action(eps[e_pos]["action"][t:t + valid])
            torch.testing.assert_close(s.actions[:valid], want)
            assert torch.all(s.actions[valid:] == 0)
            torch.testing.assert_close(s.state, spec.normalize_state(eps[e_pos]["state"][t]))
            # history: frames t-2 and t of each camera (clamped at the episode start), time-major
            assert s.images.shape == (spec.frames * len(CAMS), 3, SIZE, SIZE)
            for k, frame in enumerate(spec.history(t)):
                for v, cam in enumerate(CAMS):
                    ref = torch.from_numpy(eps[e_pos]["images"][cam][frame]).permute(2, 0, 1).float() / 127.5 - 1
                    assert (s.images[k * len(CAMS) + v] - ref).abs().mean() < 0.03
    # the instruction is the episode's task; the text target the frame's phase
    tok = ds.instr_ids
    assert torch.equal(ds[7].instruction_ids, tok[1]) and torch.equal(ds[0].instruction_ids, tok[0])


def test_augmentation_is_a_pure_function_of_the_index(dataset):
    root, _ = dataset
    d = LeRobotDataset(root)
    ds = _demo(d, _spec(d), shift=3, color=0.2)
    a, b = ds[3], ds[3]
    assert torch.equal(a.images, b.images)
    assert not torch.equal(ds[3].images, ds[3 + len(ds)].images)  # next epoch: a new draw of the same frame
    assert torch.equal(ds[3].actions, ds[3 + len(ds)].actions)
    assert a.images.min() >= -1 and a.images.max() <= 1


def _damaged(tmp_path, dataset, how: str):
    root = tmp_path / how
    shutil.copytree(dataset[0], root)
    if how == "corrupt_parquet":
        target = next((root / "data").rglob("*.parquet"))
        target.write_bytes(b"PAR1 this is not parquet" * 10)
    elif how == "missing_video":
        target = next((root / "videos" / "observation.images.top").rglob("*.mp4"))
        target.unlink()
    else:  # truncated mp4
        target = next((root / "videos" / "observation.images.front").rglob("*.mp4"))
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    return root, target


@pytest.mark.parametrize("how", ["corrupt_parquet", "missing_video", "truncated_mp4"])
def test_damaged_files_are_clear_errors(tmp_path, dataset, how):
    root, target = _damaged(tmp_path, dataset, how)
    with pytest.raises(VlaforgeError) as info:
        d = LeRobotDataset(root)
        ds = _demo(d, _spec(d))  # decodes everything up front
        ds[len(ds) - 1]
    assert str(target) in str(info.value)


@pytest.mark.slow
def test_damaged_dataset_exits_2_from_the_cli(tmp_path, dataset):
    root, target = _damaged(tmp_path, dataset, "truncated_mp4")
    proc = run_cli("train", "recipes/tiny_metaworld.toml", f"--data.path={root}", "--model.cameras=[\"front\",\"top\"]",
                   "--model.image_size=32", "--train.steps=1", f"--train.output_dir={tmp_path / 'run'}",
                   "--data.num_workers=0", "--train.progress=false", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and str(target) in lines[0] and "Traceback" not in proc.stderr


def test_interrupted_writer_leaves_nothing(tmp_path):
    root = tmp_path / "ds"
    e = _episode(0, 5)
    with pytest.raises(RuntimeError):
        with DatasetWriter(root, fps=10, cameras=CAMS, image_size=SIZE, state_names=list("abcd"),
                           action_names=list("wxyz")) as w:
            w.add_episode("t", e["images"], e["state"], e["action"])
            raise RuntimeError("interrupted")
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_generate_refuses_a_non_empty_folder(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_cli("data", "generate", f"--out={out}", "--episodes=1", "--tasks=reach-v3", timeout=60)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    proc = run_cli("data", "generate", f"--out={tmp_path / 'x'}", "--tasks=reach-v9", timeout=60)
    assert proc.returncode == 2 and "did you mean 'reach-v3'" in proc.stderr


def test_a_cut_recording_resumes_to_the_uncut_dataset(tmp_path, monkeypatch):
    """`data generate` cut after two attempts (their episodes spooled beside the output) and run again records only
    the attempts still missing, and writes the dataset an uncut run writes (frame for frame); the spool is gone."""
    import pyarrow.parquet as pq

    from vlaforge.data import generate as gen

    args = {"cameras": ["corner"], "image_size": 32, "workers": 1, "progress": False, "max_steps": 200}
    tasks = {"reach-v3": 3}
    gen.generate(tasks, 0, tmp_path / "whole", **args)
    real, calls = gen.record, []

    def cut(a):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(a)
        return real(a)

    monkeypatch.setattr(gen, "record", cut)
    with pytest.raises(KeyboardInterrupt):
        gen.generate(tasks, 0, tmp_path / "cut", **args)
    monkeypatch.setattr(gen, "record", real)
    spool = tmp_path / ".cut.episodes"
    assert len([f for f in spool.iterdir() if "__" in f.name]) == 2 and not (tmp_path / "cut" / "meta").exists()
    summary = gen.generate(tasks, 0, tmp_path / "cut", **args)
    assert summary["resumed_attempts"] == 2 and not spool.exists()
    files = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole" / "data").rglob("*.parquet"))
    assert files == sorted(p.relative_to(tmp_path / "cut") for p in (tmp_path / "cut" / "data").rglob("*.parquet"))
    for f in files:
        assert pq.read_table(tmp_path / "whole" / f).equals(pq.read_table(tmp_path / "cut" / f)), f
    videos = sorted((tmp_path / "whole").rglob("*.mp4"))
    assert videos and all(v.read_bytes() == (tmp_path / "cut" / v.relative_to(tmp_path / "whole")).read_bytes()
                          for v in videos)
