"""Datasets written by the real LeRobot (tests/fixtures/lerobot, written once by its own writers: 0.4.4 plain,
0.6.1 with its language columns, 0.6.1 with a 12-bit depth camera) train with the tiny recipe and no other flag;
what vlaforge does not read is named in one line; the stats vlaforge writes are what LeRobot's quantile
normalizations read (checked with the real package), and a dataset LeRobot's own tools edited still reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from vlaforge.config import load_config
from vlaforge.config.shapes import resolve_shapes, resolve_terms
from vlaforge.data.episodes import resolve_cameras
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.summary import dataset_summary
from vlaforge.errors import VlaforgeError

from conftest import ROOT, TINY_RECIPE, run_cli
from fake_lerobot import write_dataset
from real_lerobot import run_lerobot

FIXTURES = ROOT / "tests" / "fixtures" / "lerobot"
FAST = ("--train.steps=2", "--train.batch_size=4", "--train.progress=false", "--train.tensorboard=false",
        "--train.log_every=1")


def _train(data: Path, out: Path, *extra: str):
    return run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={data}",
                   f"--train.output_dir={out}", *FAST, *extra, timeout=240)


@pytest.mark.parametrize("name, said, metric", [
    ("v044_plain", "loss.weights.language = 0.2 -> 0: the dataset has no per-frame text", None),
    ("v061_language", "data.text_column = 'language_persistent.subtask'", "loss/language"),
    ("v061_depth", "'observation.images.front_depth' is a depth map", None),
])
def test_lerobot_written_datasets_train_with_no_flags(tmp_path, name, said, metric):
    done = _train(FIXTURES / name, tmp_path / "run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert said in done.stdout, done.stdout
    saved = load_config(tmp_path / "run" / "config.toml")
    assert saved.model.cameras == ["front", "wrist"]  # the depth map is not a camera
    assert (saved.loss.weights["language"] > 0) == (metric is not None)
    assert ("loss/language" in done.stdout) == (metric is not None)


@pytest.mark.parametrize("flag, words", [
    ("--loss.weights.language=0.3", "has no per-frame text (data.text_column) for the language loss"),
    ("--model.cameras=[\"front_depth\"]", "'front_depth', a depth map in dataset"),
])
def test_what_a_dataset_cannot_give_is_refused_in_one_line(tmp_path, flag, words):
    """A weight set on the command line is an explicit ask (no silent turning off); a depth camera asked for."""
    data = FIXTURES / ("v061_depth" if "depth" in flag else "v044_plain")
    done = _train(data, tmp_path / "run", flag)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not any((tmp_path / "run").glob("*"))  # nothing written (at most the empty output folder)


def test_language_persistent_becomes_per_frame_text():
    """Each style of LeRobot 0.6's language_persistent is a text column: the content of the latest row of that
    style at or before the frame (the fixture: a subtask from the start, another and a memory from mid-episode)."""
    root = FIXTURES / "v061_language"
    d = LeRobotDataset(root)
    table = pq.read_table(root / "data" / "chunk-000" / "file-000.parquet").to_pydict()
    named = pq.read_table(root / "meta" / "tasks.parquet").to_pydict()  # (its pandas index, named "task")
    tasks = dict(zip(named["task_index"], named["task"]))
    for ep in d.episodes:
        rows = [i for i, e in enumerate(table["episode_index"]) if e == ep.index]
        times = np.asarray([table["timestamp"][i] for i in rows])
        half = times[len(times) // 2]
        task = tasks[table["task_index"][rows[0]]]
        subtask = d.columns["language_persistent.subtask"][ep.start:ep.start + ep.length]
        memory = d.columns["language_persistent.memory"][ep.start:ep.start + ep.length]
        assert list(subtask) == ["reach the object" if t < half else f"now {task}" for t in times]
        assert list(memory) == ["" if t < half else "the object is reached" for t in times]
        assert set(d.columns["language_persistent.plan"][ep.start:ep.start + ep.length]) == {f"1. reach  2. {task}"}
    assert any("language_events" in n for n in d.notices)


def test_data_info_shows_depth_language_and_unread_features(tmp_path):
    s = dataset_summary(FIXTURES / "v061_depth")
    kinds = {f["name"]: f["dtype"] for f in s["features"]}
    assert kinds["observation.images.front_depth"] == "depth" and kinds["observation.images.front"] == "video"
    assert any("front_depth" in n and "depth map" in n for n in s["notices"])
    s = dataset_summary(FIXTURES / "v061_language")
    assert {"language_persistent.subtask", "language_persistent.plan", "language_persistent.memory"} <= \
        set(s["text_columns"])
    # a feature of a dtype vlaforge does not know: named once, the rest reads
    copy = tmp_path / "odd"
    shutil.copytree(FIXTURES / "v044_plain", copy)
    info = json.loads((copy / "meta" / "info.json").read_text())
    info["features"]["observation.audio"] = {"dtype": "audio", "shape": [1600], "names": None}
    (copy / "meta" / "info.json").write_text(json.dumps(info))
    notes = dataset_summary(copy)["notices"]
    assert notes == ["feature 'observation.audio' has dtype 'audio', which vlaforge does not read; it is left out"]
    done = run_cli("data", "info", str(FIXTURES / "v061_depth"))
    assert done.returncode == 0 and "depth" in done.stdout and "note: camera" in done.stdout, done.stderr


def test_auto_terms_follow_the_columns(tmp_path):
    """A recipe's data-dependent terms are on where the column is, off (one line each) where it is not, required
    where loss.required names them."""
    def resolved(data, *o):
        cfg = load_config(TINY_RECIPE, ["--data.source=lerobot", f"--data.path={data}", *o])
        return resolve_terms(resolve_shapes(cfg)[0])

    cfg, lines = resolved(FIXTURES / "v044_plain")
    assert cfg.loss.weights["language"] == 0 and len(lines) == 1
    cfg, lines = resolved(FIXTURES / "v044_plain", '--loss.required=["language"]')
    assert cfg.loss.weights["language"] == 0.2 and lines == []
    write_dataset(tmp_path / "ours")  # vlaforge's own: annotation.phase and the env state
    cfg, lines = resolved(tmp_path / "ours", "--loss.weights.env_state=0.1", "--model.env_state_dim=3")
    assert cfg.data.text_column == "annotation.phase" and cfg.loss.weights["env_state"] == 0.1
    with pytest.raises(VlaforgeError, match="a depth map"):
        resolve_cameras(LeRobotDataset(FIXTURES / "v061_depth"), ["front_depth"])


@pytest.mark.slow
def test_lerobot_normalizes_with_our_quantiles_and_its_edits_still_read(tmp_path):
    """The real LeRobot 0.4.4 reads the stats vlaforge writes: QUANTILE10 / QUANTILES normalization equals the
    formula on quantiles computed here from the frames; its delete_episodes (which rewrites info.json without the
    `vlaforge` block and re-aggregates the stats) gives a dataset vlaforge still reads, quantiles kept."""
    write_dataset(tmp_path / "ds")
    out = run_lerobot("stats_check.py", str(tmp_path / "ds"), str(tmp_path / "edited"))
    ours = LeRobotDataset(tmp_path / "ds")
    for key, mode, lo, hi in (("observation.state", "state_q10", 0.10, 0.90), ("action", "action_q01", 0.01, 0.99)):
        values = ours.columns[key].astype(np.float64)
        q_lo, q_hi = np.quantile(values, lo, axis=0), np.quantile(values, hi, axis=0)
        first = values[0]
        want = 2 * (first - q_lo) / (q_hi - q_lo) - 1
        np.testing.assert_allclose(out["original"][mode], want, rtol=1e-5, atol=1e-6)
        assert {"q01", "q10", "q50", "q90", "q99"} <= set(out["edited"]["stats_keys"][key])
    edited = LeRobotDataset(tmp_path / "edited")
    assert "vlaforge" not in edited.info
    np.testing.assert_array_equal(edited.columns["action"], ours.columns["action"][ours.episodes[1].start:])
    assert dataset_summary(tmp_path / "edited")["text_columns"] == ["annotation.phase"]
