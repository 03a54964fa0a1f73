"""Bad datasets, generation and evaluation input (issue 55): each is one line naming the problem and the fix, exit 2,
no traceback, nothing written; valid input next to it is served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlaforge.data.lerobot_v3 import LeRobotDataset

from conftest import ROOT, TINY_RECIPE, run_cli
from fake_lerobot import CAMS, write_dataset
from test_safety import one_line

LIBERO_FIXTURE = ROOT / "tests" / "fixtures" / "lerobot" / "v044_libero"
MILK = "pick_up_the_milk_and_place_it_in_the_basket"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clean") / "ds"
    write_dataset(root)
    return root


def _column(name: str, fn):
    """An edit of the data file: column `name` replaced by fn(its values as Python lists) -> pyarrow array."""
    def edit(table: pa.Table) -> pa.Table:
        return table.set_column(table.schema.get_field_index(name), name, fn(table.column(name).to_pylist()))
    return edit


def _lengths(table: pa.Table) -> pa.Table:
    lengths = table.column("length").to_pylist()
    lengths[1] = 0  # episode 1's 12 rows stay in the data file
    return table.set_column(table.schema.get_field_index("length"), "length", pa.array(lengths, pa.int64()))


def _declare_front_as_image(root: Path) -> None:
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.images.front"]["dtype"] = "image"
    (root / "meta" / "info.json").write_text(json.dumps(info))


# (what is broken, the file edited, the edit, fragments of the one-line error)
BROKEN = {
    "episode_length_0": ("meta/episodes", _lengths, ["episode 1 a length of 0", "12 rows of it"]),
    "no_rows": ("data", lambda t: t.slice(0, 0), ["holds no frames", "0 rows"]),
    "scalar_state": ("data", _column("observation.state", lambda v: pa.array([0.5] * len(v), pa.float32())),
                     ["declares 'observation.state' with shape [4]", "hold 1 values"]),
    "json_actions": ("data", _column("action", lambda v: pa.array([json.dumps(x) for x in v], pa.string())),
                     ["column 'action' holds string values, not numbers"]),
    "task_index_past_the_table": ("data", _column("task_index", lambda v: pa.array([5 if x else 0 for x in v],
                                                                                    pa.int64())),
                                  ["task_index 5", "meta/tasks.parquet lists 2 tasks"]),
    "int_actions": ("data", _column("action", lambda v: pa.array([[round(a) for a in x] for x in v],
                                                                 pa.list_(pa.int64(), 4))),
                    ["declares 'action' as float32 but the data files store int64"]),
    "image_declared_video_stored": ("meta/info.json", None, ["meta/info.json declares 'observation.images.front' as "
                                                             "dtype 'image'", "declare it 'video'"]),
}


def _broken(clean: Path, tmp: Path, case: str) -> Path:
    root = tmp / case
    shutil.copytree(clean, root)
    where, edit, _ = BROKEN[case]
    if edit is None:
        _declare_front_as_image(root)
    else:
        path = next((root / where).rglob("*.parquet"))
        pq.write_table(edit(pq.read_table(path)), path)
    return root


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_lerobot_dataset_is_one_line_in_data_info(clean, tmp_path, case):
    root = _broken(clean, tmp_path, case)
    one_line(run_cli("data", "info", str(root)), *BROKEN[case][2])


@pytest.mark.parametrize("case", ["episode_length_0", "no_rows", "task_index_past_the_table",
                                  "image_declared_video_stored"])
def test_a_broken_lerobot_dataset_is_one_line_in_train(clean, tmp_path, case):
    """Training opens the dataset with the same checks: refused before a step (it used to train on the wrong rows,
    or end in a traceback)."""
    root = _broken(clean, tmp_path, case)
    one_line(_train(root, tmp_path / "run"), *BROKEN[case][2])
    assert not (tmp_path / "run" / "checkpoints").exists()


def _train(root: Path, run: Path, *overrides: str):
    return run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={root}",
                   f"--model.cameras={json.dumps(CAMS)}", "--model.image_size=32", "--data.max_instruction_tokens=8",
                   "--train.steps=1", "--train.batch_size=4", "--train.progress=false", "--train.tensorboard=false",
                   "--data.num_workers=0", f"--train.output_dir={run}", *overrides, timeout=240)


def test_a_list_column_as_text_column_is_one_line(clean, tmp_path):
    one_line(_train(clean, tmp_path / "run", "--data.text_column=action"),
             "data.text_column = 'action' is not a text column", "annotation.phase")


def test_a_one_wide_state_stored_as_scalars_is_read(clean, tmp_path):
    """LeRobot stores a feature of shape [1] as plain scalars: read as a column of width 1."""
    root = tmp_path / "one_wide"
    shutil.copytree(clean, root)
    path = next((root / "data").rglob("*.parquet"))
    table = pq.read_table(path)
    first = [row[0] for row in table.column("observation.state").to_pylist()]
    pq.write_table(_column("observation.state", lambda v: pa.array(first, pa.float32()))(table), path)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.state"] |= {"shape": [1], "names": ["a"]}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    stats = json.loads((root / "meta" / "stats.json").read_text())
    stats["observation.state"] = {k: v[:1] if k != "count" else v for k, v in stats["observation.state"].items()}
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    d = LeRobotDataset(root)
    assert d.columns["observation.state"].shape == (24, 1) and d.columns["observation.state"].dtype == np.float32
    np.testing.assert_array_equal(d.columns["observation.state"][:, 0], np.asarray(first, np.float32))


# ---- data generate ----

@pytest.mark.parametrize("args,fragments", [
    (["--tasks=reach-v3,reach-v3:3"], ["task reach-v3 is listed twice"]),
    (["--tasks=reach-v3", "--max-steps=600"], ["--max-steps 600 is beyond Meta-World's episode limit of 500"]),
    (["--suite=libero_object", "--tasks=milk"], [f"did you mean '{MILK}'"]),
    (["--suite=libero_object", f"--tasks={MILK},libero_object/{MILK}:2"], [f"task {MILK} is listed twice"]),
    (["--suite=libero_object", "--max-steps=300"], ["--max-steps 300 is beyond libero_object's episode limit of 280"]),
    (["--suite=libero_object", "--hide-distractors"], ["--hide-distractors apply to Meta-World's tasks"]),
    (["--suite=libero_object", "--steer-tcp"], ["--steer-tcp apply to Meta-World's tasks"]),
])
def test_generate_refuses_bad_task_lists_and_options(tmp_path, args, fragments):
    one_line(run_cli("data", "generate", f"--out={tmp_path / 'ds'}", "--no-progress", *args, timeout=120), *fragments)
    assert not (tmp_path / "ds").exists()


@pytest.mark.slow
def test_generate_names_a_too_short_step_limit(tmp_path):
    """20 expert attempts of 3 steps fail: the step limit is named, not the Meta-World installation."""
    proc = run_cli("data", "generate", f"--out={tmp_path / 'ds'}", "--tasks=reach-v3", "--episodes=1",
                   "--max-steps=3", "--workers=1", "--image-size=32", "--cameras=corner", "--no-progress", timeout=120)
    line = one_line(proc, "within --max-steps 3", "too short for it to succeed", "raise --max-steps")
    assert "installation" not in line and not (tmp_path / "ds").exists()


# ---- eval ----

@pytest.fixture(scope="module")
def libero_run(tmp_path_factory) -> Path:
    """recipes/libero.toml trained one step on the LeRobot-written LIBERO fixture (cameras image, wrist_image)."""
    run = tmp_path_factory.mktemp("libero") / "run"
    proc = run_cli("train", "recipes/libero.toml", f"--data.path={LIBERO_FIXTURE}", "--train.steps=1",
                   "--train.batch_size=2", "--model.image_size=32", f"--train.output_dir={run}",
                   "--data.num_workers=0", "--train.progress=false", "--train.tensorboard=false", timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.mark.parametrize("args,fragments", [
    (["--tasks=reach-v3"], ["the policy takes LIBERO's cameras (image, wrist_image)", "--benchmark SUITE"]),
    (["--benchmark=libero_object", "--max-steps=300"], ["--max-steps 300 is beyond libero_object's episode limit"]),
    (["--benchmark=libero_object", "--tasks=0,0"], ["names task 0", "twice"]),
    (["--benchmark=libero_object", "--tasks=milk"], [f"did you mean '{MILK}'"]),
    (["--benchmark=libero_object", "--distractors=hidden"], ["--distractors hidden applies to Meta-World's tasks"]),
])
def test_eval_of_a_libero_run_refuses_before_any_rollout(libero_run, tmp_path, args, fragments):
    """A LIBERO policy on a Meta-World task used to end in a worker's traceback (camera "image" does not exist)."""
    proc = run_cli("eval", str(libero_run), "--episodes=1", "--workers=1", "--no-progress",
                   f"--out={tmp_path / 'eval'}", *args, timeout=120)
    one_line(proc, *fragments)
    assert not (tmp_path / "eval").exists()


@pytest.fixture(scope="module")
def metaworld_run(tmp_path_factory) -> Path:
    """The tiny recipe trained one step on the fake dataset with Meta-World's camera names (Meta-World can run it)."""
    from conftest import train_on_dataset

    tmp = tmp_path_factory.mktemp("mw")
    cams = ["corner", "behindGripper"]
    write_dataset(tmp / "ds", cams=cams)
    return train_on_dataset(tmp, "run", "--train.tensorboard=false", steps=1, cams=cams)


@pytest.mark.parametrize("args,fragments", [
    (["--tasks=reach-v3", "--max-steps=600"], ["--max-steps 600 is beyond Meta-World's episode limit of 500"]),
    (["--tasks=reach-v3,reach-v3"], ["task reach-v3 is listed twice"]),
    (["--tasks=reach-v3:5"], ["takes no task:N counts", "--episodes"]),
])
def test_eval_of_a_metaworld_run_refuses_bad_tasks_and_limits(metaworld_run, tmp_path, args, fragments):
    proc = run_cli("eval", str(metaworld_run), "--episodes=1", "--workers=1", "--no-progress",
                   f"--out={tmp_path / 'eval'}", *args, timeout=120)
    one_line(proc, *fragments)
    assert not (tmp_path / "eval").exists()


def test_eval_of_a_synthetic_run_says_what_it_lacks(tmp_path):
    """It used to say 'dataset None names no Meta-World tasks'."""
    run = tmp_path / "run"
    proc = run_cli("train", str(TINY_RECIPE), "--train.steps=1", "--train.batch_size=2", "--data.num_samples=8",
                   f"--train.output_dir={run}", "--train.progress=false", "--train.tensorboard=false", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = one_line(run_cli("eval", str(run), "--no-progress", timeout=120), "data.source = 'synthetic'",
                    "vlaforge data generate")
    assert "None" not in line
