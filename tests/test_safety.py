"""Untrusted files never run code, no command destroys earlier work, and bad input ends in one line (exit 2).

Every loader is handed a file holding a pickle that would create a marker file when unpickled; the marker must never
appear. Folders a command must not touch are hashed before and after.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from vlaforge.errors import VlaforgeError

from conftest import ROOT, TINY_RECIPE, run_cli
from fake_lerobot import write_dataset

LEROBOT = ("recipes/tiny_metaworld.toml", '--model.cameras=["front","top"]', "--model.image_size=32",
           "--data.num_workers=0", "--train.progress=false", "--train.tensorboard=false", "--train.batch_size=4")


class Plant:
    """Unpickling this creates `marker`: what a crafted file would do instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def one_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The single error line of a failed command (exit 2, no traceback), which names every fragment."""
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "Warning" not in x and not x.startswith("  ")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: "), lines
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _train(out: Path, *args: str, data: Path | None = None) -> subprocess.CompletedProcess:
    base = (*LEROBOT, f"--data.path={data}") if data else (str(TINY_RECIPE), "--train.progress=false",
                                                            "--data.num_samples=16", "--train.batch_size=4")
    return run_cli("train", *base, "--train.steps=1", f"--train.output_dir={out}", *args, timeout=180)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safety") / "ds"
    write_dataset(root)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset) -> dict[str, Path]:
    """A full and a sharded one-step run on the small LeRobot dataset (policy.json and tokenizer.json included)."""
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for fmt in ("full", "sharded"):
        proc = _train(base / fmt, f"--train.checkpoint_format={fmt}", data=dataset)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[fmt] = base / fmt
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


# ---- files from outside never run code ---------------------------------------------------------------------------

PLANTS = {  # which file of a run gets the crafted pickle, and which commands read it
    "dcp_metadata": ("sharded", "dcp/.metadata", ("resume", "export", "eval")),
    "trainer_state": ("full", "trainer_state.pt", ("resume",)),
    "model_weights": ("full", "model.safetensors", ("resume", "export", "eval")),
    "tokenizer": ("full", "tokenizer.json", ("eval",)),
    "policy_spec": ("full", "policy.json", ("eval",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("what", sorted(PLANTS))
def test_a_crafted_checkpoint_file_never_runs_code(tmp_path, runs, what):
    fmt, name, commands = PLANTS[what]
    marker = tmp_path / "MARKER"
    for command in commands:
        run = _copy(runs[fmt], tmp_path / f"{command}_run")
        target = _ckpt(run) / name
        if name.endswith(".pt"):
            torch.save(Plant(marker), target)
        else:
            target.write_bytes(pickle.dumps(Plant(marker)))
        args = {"resume": ("train", "--resume", str(run), "--train.steps=3"),
                "export": ("export", str(run), "--out", str(tmp_path / f"{command}.safetensors")),
                "eval": ("eval", str(run), "--episodes=1", "--tasks=reach-v3", "--no-progress")}[command]
        one_line(run_cli(*args, timeout=180))
        assert not marker.exists(), f"{what} ran code through {command}"


def test_dcp_non_tensor_items_are_read_without_code(tmp_path):
    from vlaforge.distributed.state import SafeLoadPlanner

    marker, buf = tmp_path / "MARKER", io.BytesIO()
    torch.save(Plant(marker), buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    planner.state_dict, planner.flatten_state_dict = {}, False
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(type("Item", (), {"dest_index": type("I", (), {"fqn": "x"})()})(), buf)
    assert not marker.exists()
    ok = io.BytesIO()
    torch.save({"lr": 1e-3, "betas": (0.9, 0.95)}, ok)
    ok.seek(0)
    planner.load_bytes(type("Item", (), {"dest_index": type("I", (), {"fqn": "x"})()})(), ok)
    assert planner.state_dict["x"] == {"lr": 1e-3, "betas": (0.9, 0.95)}


def test_deepspeed_state_files_are_read_as_data_only(tmp_path):
    pytest.importorskip("deepspeed")
    from vlaforge.distributed.deepspeed_backend import _data_only_engine

    marker = tmp_path / "MARKER"
    evil, good = tmp_path / "evil.pt", tmp_path / "good.pt"
    torch.save(Plant(marker), evil)
    torch.save({"module": {"w": torch.ones(2)}, "step": 3}, good)
    engine = _data_only_engine(type("Engine", (), {})())
    with pytest.raises(VlaforgeError, match="evil.pt"):
        engine.load(str(evil))
    assert not marker.exists()
    assert engine.load(str(good))["step"] == 3


@pytest.mark.slow
@pytest.mark.over_budget("the first DeepSpeed run on a machine JIT-compiles its CPU ops")
def test_a_crafted_deepspeed_checkpoint_never_runs_code(tmp_path):
    pytest.importorskip("deepspeed")
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    assert _train(run, "--parallel.backend=deepspeed").returncode == 0
    files = sorted((_ckpt(run) / "deepspeed").rglob("*.pt"))
    assert files
    for f in files:
        torch.save(Plant(marker), f)
    one_line(run_cli("train", "--resume", str(run), "--train.steps=2", timeout=300), "DeepSpeed state file")
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["meta/info.json", "meta/stats.json", "meta/tasks.parquet", "episodes", "data"])
def test_a_crafted_dataset_file_never_runs_code(tmp_path, dataset, name):
    root, marker = _copy(dataset, tmp_path / "ds"), tmp_path / "MARKER"
    target = root / name if "." in name else next((root / ("meta/episodes" if name == "episodes" else name)).rglob(
        "*.parquet"))
    target.write_bytes(pickle.dumps(Plant(marker)))
    one_line(_train(tmp_path / "run", data=root), str(target))
    assert not marker.exists()


# ---- nothing already written is lost -----------------------------------------------------------------------------

@pytest.mark.slow
def test_training_into_an_earlier_run_is_refused(tmp_path, runs):
    run = _copy(runs["full"], tmp_path / "run")
    before = hashes(run)
    one_line(_train(run), "not empty", "--resume")
    assert hashes(run) == before


@pytest.mark.slow
def test_resuming_a_copy_writes_into_the_copy(tmp_path, runs):
    original = _copy(runs["full"], tmp_path / "original")
    copy = _copy(original, tmp_path / "copy")
    before = hashes(original)
    proc = run_cli("train", "--resume", str(copy), "--train.steps=2", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert hashes(original) == before
    assert (copy / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    # an explicit output folder that holds another run is refused
    other = _copy(runs["sharded"], tmp_path / "other")
    one_line(run_cli("train", "--resume", str(copy), "--train.steps=3", f"--train.output_dir={other}"),
             "not the run of the resumed checkpoint")


@pytest.mark.slow
def test_export_never_replaces_what_it_did_not_write(tmp_path, runs):
    run = _copy(runs["sharded"], tmp_path / "run")
    ckpt = _ckpt(run)
    mine = tmp_path / "mine.bin"
    mine.write_bytes(b"someone's file")
    before = hashes(run)
    for out, why in ((ckpt / "trainer_state.pt", "lies inside checkpoint"), (run, "is a folder"),
                     (mine, "not written by vlaforge export"),
                     (Path("/proc/vlaforge-test/model.safetensors"), "cannot write")):
        one_line(run_cli("export", str(run), "--out", str(out)), why)
    assert hashes(run) == before and mine.read_bytes() == b"someone's file"
    exported = tmp_path / "w.safetensors"
    for _ in range(2):  # a file export wrote may be written again
        assert run_cli("export", str(run), "--out", str(exported)).returncode == 0


def test_generate_removes_a_killed_runs_partial_folder_and_replaces_atomically(tmp_path):
    from vlaforge.data.generate import check_output
    from vlaforge.data.lerobot_v3 import LeRobotDataset
    from vlaforge.data.lerobot_writer import partial_folder

    out = tmp_path / "ds"
    stale = partial_folder(out)
    (stale / "meta").mkdir(parents=True)
    check_output(out, overwrite=False)
    assert not stale.exists()
    write_dataset(out)
    with pytest.raises(VlaforgeError, match="--overwrite"):
        check_output(out, overwrite=False)
    write_dataset(out, edit=lambda eps: eps[0]["action"].__imul__(0))  # --overwrite: replaced in one rename
    assert np.all(LeRobotDataset(out).columns["action"][:7] == 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    with pytest.raises(VlaforgeError, match="cannot write"):
        check_output(Path("/proc/vlaforge-test/ds"), overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(VlaforgeError, match="is a file"):
        check_output(tmp_path / "file", overwrite=True)


# ---- bad input ends in one line ------------------------------------------------------------------------------------

CONFIG_CASES = [
    ("--train.betas=[nan,0.95]", "train.betas"),
    ("--train.betas=[inf,nan]", "train.betas"),
    ("--train.betas=[1.0,0.95]", "train.betas"),
    (f"--train.seed={2 ** 70}", "train.seed"),
    ("--train.seed=-1", "train.seed"),
    ("--train.batch_size=1000000000000", "train.batch_size"),
    ("--model.image_size=1000000", "model.image_size"),
    ("--model.image_size=30", "model.image_size"),
    ("--model.action_chunk=1000000000", "model.action_chunk"),
    ("--data.max_instruction_tokens=1000000000", "data.max_instruction_tokens"),
    ("--data.max_instruction_tokens=5000", "positions"),
    ("--components.llm.lr=inf", "components.llm.lr"),
    ("--components.llm.lr=1e400", "components.llm.lr"),
    ("--components.vision.weight_decay=inf", "components.vision.weight_decay"),
    ("--loss.weights={contrastive=nan,language=0.1,action=1.0}", "loss.weights.contrastive"),
    ("--loss.huber_delta=inf", "loss.huber_delta"),
    ("--train.eps=inf", "train.eps"),
    ("--eval.seed=1000000", "eval.seed"),
]


@pytest.mark.parametrize("override, field", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_values_are_refused_before_anything_is_built(override, field):
    from vlaforge.config import load_config

    with pytest.raises(VlaforgeError) as err:
        load_config(ROOT / LEROBOT[0], [override])
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_config_show_and_cli_usage_errors_are_one_line():
    one_line(run_cli("config", "show", LEROBOT[0], "--train.betas=[inf,nan]"), "train.betas")
    one_line(run_cli("train", LEROBOT[0], f"--train.seed={2 ** 70}"), "train.seed")
    one_line(run_cli("eval", "runs/none", "--episodes", "0"), "--episodes")
    one_line(run_cli("eval", "runs/none", "--seed", str(10 ** 9)), "--seed")


@pytest.mark.slow
def test_bad_output_folders_are_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    one_line(_train(tmp_path / "file"), "is a file")
    one_line(_train(tmp_path / "file" / "run"), "is a file")
    one_line(_train(Path("/proc/vlaforge-test/run")), "cannot be created")
    one_line(run_cli("data", "generate", "--out=/proc/vlaforge-test/ds", "--tasks=reach-v3", "--episodes=1"),
             "cannot write")
    assert (tmp_path / "file").read_text() == "x"


def _state(run: Path, **change) -> Path:
    path = _ckpt(run) / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    for key, value in change.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    torch.save(state, path)
    return path


@pytest.mark.slow
def test_damaged_checkpoints_are_one_line(tmp_path, runs):
    run = _copy(runs["full"], tmp_path / "latest_bytes")
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    one_line(run_cli("train", "--resume", str(run), "--train.steps=3"), "latest")
    for name, change in (("step", {"step": "abc"}), ("rng", {"rng": None}), ("list", {"scheduler": [1, 2]})):
        run = _copy(runs["full"], tmp_path / name)
        path = _state(run, **change)
        one_line(run_cli("train", "--resume", str(run), "--train.steps=3"), str(path))
    run = _copy(runs["full"], tmp_path / "garbled")
    weights = _ckpt(run) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    one_line(run_cli("export", str(run), "--out", str(tmp_path / "w.safetensors")), str(weights))
    run = _copy(runs["full"], tmp_path / "done")
    one_line(run_cli("train", "--resume", str(run), "--train.steps=1"), "nothing to train")


def _edit_info(root: Path, **change) -> None:
    info = json.loads((root / "meta" / "info.json").read_text())
    info.update(change)
    (root / "meta" / "info.json").write_text(json.dumps(info))


@pytest.mark.slow
def test_inconsistent_datasets_are_one_line(tmp_path, dataset):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cases = {}
    root = cases["total_episodes"] = _copy(dataset, tmp_path / "episodes_count")
    _edit_info(root, total_episodes=7)
    root = cases["fps"] = _copy(dataset, tmp_path / "fps")
    _edit_info(root, fps=0)
    root = cases["as 16x16"] = _copy(dataset, tmp_path / "resolution")
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.images.front"]["shape"] = [16, 16, 3]
    _edit_info(root, features=info["features"])
    root = cases["no episode rows"] = _copy(dataset, tmp_path / "empty")
    ep = next((root / "meta" / "episodes").rglob("*.parquet"))
    pq.write_table(pq.read_table(ep).schema.empty_table(), ep)
    root = cases["NaN"] = tmp_path / "nan"
    write_dataset(root, edit=lambda eps: eps[1]["action"].__setitem__((3, 2), np.nan))
    root = cases["data.text_column"] = tmp_path / "no_text"
    write_dataset(root, text=False)
    for why, root in cases.items():
        # a recipe's language weight is "auto" (off where the dataset has no text): naming the column is an ask
        asked = ("--data.text_column=annotation.phase",) if why == "data.text_column" else ()
        one_line(_train(tmp_path / f"run_{root.name}", *asked, data=root), why)
    assert pa  # pyarrow is what wrote the empty table


@pytest.mark.slow
def test_a_damaged_video_in_a_loader_worker_is_one_line(tmp_path, dataset):
    root = _copy(dataset, tmp_path / "ds")
    video = next((root / "videos" / "observation.images.front").rglob("*.mp4"))
    video.write_bytes(video.read_bytes()[: video.stat().st_size // 3])
    proc = _train(tmp_path / "run", "--data.cache_mb=0", "--data.num_workers=1", data=root)
    one_line(proc, str(video))
    assert "Original Traceback" not in proc.stderr and "DataLoader worker" not in proc.stderr


def test_sizes_that_cannot_fit_are_refused_before_they_are_allocated(tmp_path):
    from vlaforge.models.build import build_vla, tokens_per_sample
    from vlaforge.training.memory_check import check_memory, memory_errors

    from conftest import tiny_config

    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    tps = tokens_per_sample(model, cfg.data.max_instruction_tokens, cfg.data.max_text_tokens)
    check_memory(cfg, model, torch.device("cpu"), tps)  # the recipe's batch fits
    cfg.train.batch_size = 1 << 20
    with pytest.raises(VlaforgeError, match="lower train.batch_size"):
        check_memory(cfg, model, torch.device("cpu"), tps)
    with pytest.raises(VlaforgeError, match="out of memory .*train.batch_size"):
        with memory_errors():
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # other errors are not disguised
        with memory_errors():
            raise RuntimeError("shape mismatch")


def test_loader_workers_are_capped_at_the_cores():
    from vlaforge.data.loader import build_loader

    cores = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match="num_workers = 100000"):
        loader = build_loader(list(range(8)), 2, 0, 0, num_workers=100_000)
    assert loader.num_workers == cores
