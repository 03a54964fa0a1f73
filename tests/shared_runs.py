"""Runs (and other folders) that tests start from, made once per test session.

`shared_folder(tmp_path_factory, name, build)` makes SESSION/shared_runs/NAME with `build(path)` on first use; under
xdist the first worker to ask builds it and the other waits for it (a file lock), so it is built once even when the
tests that read it run on both workers or in several files. `shared_run` is `vlaforge train` of the tiny recipe on
the fake LeRobot dataset (written once too); `base_run` is the full run that test_lora, test_lora_adapters and
test_quantize start from: 2 steps with a checkpoint each, two different bases for LoRA.

Tests never write into these folders: a test that resumes one writes into its own tmp_path (a resumed run may write
into an empty folder), and a test that damages or exports one works on a copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from conftest import train_on_dataset
from fake_lerobot import write_dataset


def session_root(tmp_path_factory) -> Path:
    """One folder for the whole test session: under xdist the workers' common parent of their base temps."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_runs"


def shared_folder(tmp_path_factory, name: str, build) -> Path:
    """SESSION/shared_runs/NAME, made by `build(path)` on first use in the session (any worker; the others wait)."""
    from filelock import FileLock

    root = session_root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    out, done = root / name, root / f"{name}.complete"  # written last: the folder is whole
    with FileLock(str(out) + ".lock"):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            done.touch()
    return out


def dataset(tmp_path_factory) -> Path:
    """The fake LeRobot dataset of fake_lerobot.write_dataset, written once per session."""
    return shared_folder(tmp_path_factory, "ds", write_dataset)


def shared_run(tmp_path_factory, name: str, *overrides: str, steps: int = 2) -> Path:
    """`train_on_dataset(SESSION/shared_runs, NAME, *overrides, steps=steps)`, trained once per session."""
    dataset(tmp_path_factory)
    return shared_folder(tmp_path_factory, name,
                         lambda out: train_on_dataset(out.parent, out.name, *overrides, steps=steps))


def base_run(tmp_path_factory) -> Path:
    """The full run of 2 steps with a checkpoint at each (two bases)."""
    return shared_run(tmp_path_factory, "base", "--train.checkpoint_every=1")


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def link_dataset(tmp: Path, run: Path) -> Path:
    """TMP/ds -> the shared dataset beside `run`, so that `train_on_dataset(TMP, ...)` trains on it; returns TMP."""
    if not (tmp / "ds").exists():
        (tmp / "ds").symlink_to(run.parent / "ds")
    return tmp


# ---- tests/launch.py's synthetic runs (3 steps, batch 4) shared by test_data_parallel, test_deepspeed and
# test_sharded_checkpoint ------------------------------------------------------------------------------------------

DDP = ("--parallel.backend=ddp", "--parallel.dp_replicate=2", "--parallel.dp_shard=1")


def single_run(tmp_path_factory, name: str, *args: str) -> Path:
    """`launch.train_single(OUT, *args)` into SESSION/shared_runs/NAME, once per session (NAME stands for ARGS)."""
    from launch import train_single

    return shared_folder(tmp_path_factory, name, lambda out: train_single(out, *args))


def plain_run(tmp_path_factory) -> Path:
    """One process, launch.COMMON alone (3 steps of batch 4, the full checkpoint format)."""
    return single_run(tmp_path_factory, "single_batch4")


def two_rank_run(tmp_path_factory, name: str, *args: str, fresh: bool = False) -> Path:
    """`launch.train_distributed(OUT, *args)` on 2 ranks (`fresh`: under the real torchrun) with checkpoints at
    steps 2 (to resume from) and 3, once per session; rank 0 alone reports the run."""
    from launch import train_distributed

    def build(out):
        done = train_distributed(out, *args, "--train.checkpoint_every=2", fresh=fresh)
        assert done.stdout.count("done: 3 steps") == 1  # rank 0 reports

    return shared_folder(tmp_path_factory, name, build)


def ddp_run(tmp_path_factory) -> Path:
    """DDP on 2 ranks: test_data_parallel's DDP cell and test_deepspeed's reference for ZeRO."""
    return two_rank_run(tmp_path_factory, "ddp", *DDP)


_WARM_STEPS: set = set()


def warm_optimizer_steps(component: str, **policy) -> None:
    """One training step of the tiny recipe with `components.COMPONENT = POLICY` in THIS process, once per process:
    torchao compiles its AdamW step once per parameter shape (techniques/optimizer_state.py), and the runs a test
    forks from this process afterwards (run_cli, the ranks of tests/launch.py:torchrun) inherit those graphs instead
    of each compiling them again."""
    key = (component, tuple(sorted(policy.items())))
    if key in _WARM_STEPS:
        return
    from vlaforge.training.step import train_step

    from conftest import make_batch, step_setup, tiny_config

    cfg = tiny_config(components={component: policy})
    model, weighting, opt, sched, guards = step_setup(cfg)
    train_step(model, [make_batch(cfg, model)], opt, sched, weighting, 1.0, guards)
    _WARM_STEPS.add(key)
