"""Sharded checkpoints (torch.distributed.checkpoint): resume bit for bit, export to one safetensors file equal to the
full-format run's, load for inference, refuse damaged shards with one line; saved at 4 ranks and resumed at 2."""

import shutil

import pytest
import torch
from shared_runs import shared_folder

from conftest import run_cli
from launch import OFF, assert_same_weights, train_distributed, train_single, weights

SHARDED = "--train.checkpoint_format=sharded"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """3 steps in the full format, once per session (tests/shared_runs.py)."""
    return shared_folder(tmp_path_factory, "full_format", train_single)


def _sharded_then_resumed(out):
    train_single(out, SHARDED, "--train.steps=2")
    step2 = out / "checkpoints" / "step_00000002"
    assert (step2 / "dcp" / ".metadata").is_file() and not (step2 / "model.safetensors").exists()
    assert "optimizer" not in torch.load(step2 / "trainer_state.pt", weights_only=True)  # it is in the shards
    train_single(out, SHARDED, "--train.resume=latest")


@pytest.fixture(scope="module")
def resumed_sharded(tmp_path_factory):
    """2 sharded steps, then resumed from its sharded checkpoint for step 3, once per session; tests that write
    (export, damage) work on a copy."""
    return shared_folder(tmp_path_factory, "sharded_resumed", _sharded_then_resumed)


def test_sharded_resume_then_export_equals_the_full_format_run(resumed_sharded, full_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(resumed_sharded, run)
    done = run_cli("export", str(run))
    assert done.returncode == 0, done.stderr
    assert "step_00000003/model.safetensors" in done.stdout
    a, b = weights(run), weights(full_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint_loads_for_inference_without_export(resumed_sharded, full_run, tmp_path):
    from vlaforge.checkpoints.load import load_weights
    from vlaforge.models.build import build_vla

    from conftest import tiny_config

    ckpt = tmp_path / "ckpt"
    src = resumed_sharded / "checkpoints" / "step_00000003"
    ckpt.mkdir()
    (ckpt / "dcp").symlink_to(src / "dcp")
    cfg = tiny_config()
    model = build_vla(cfg.model, cfg.loss)
    load_weights(ckpt, model)
    want = weights(full_run)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_damaged_shards_are_one_line_and_exit_2(resumed_sharded, tmp_path):
    """A copy of the sharded run with its latest checkpoint's shard truncated."""
    run = tmp_path / "run"
    shutil.copytree(resumed_sharded, run)
    shard = next((run / "checkpoints" / "step_00000003" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    for args in (["train", "--resume", str(run)], ["export", str(run)]):
        done = run_cli(*args)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert "\n" not in line and "cannot be read" in line and "Traceback" not in line
    assert not (run / "checkpoints" / "step_00000003" / "model.safetensors").exists()


def test_export_of_a_full_checkpoint_needs_out(full_run, tmp_path):
    done = run_cli("export", str(full_run))
    assert done.returncode == 2 and "already holds model.safetensors" in done.stderr
    done = run_cli("export", str(full_run), "--out", str(tmp_path / "copy.safetensors"))
    assert done.returncode == 0 and (tmp_path / "copy.safetensors").is_file()


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_at_four_ranks_resumes_at_two(tmp_path):
    """Every rank writes its FSDP2 shards (no gather); DCP reshards them for 2 ranks: 2 steps on 4 ranks (batch 4
    each) then step 3 on 2 ranks (batch 8 each) equal 3 steps of one process with batch 16 (contrastive off)."""
    reference = train_single(tmp_path / "single", OFF, "--train.batch_size=16")
    train_distributed(tmp_path / "dp", OFF, SHARDED, "--train.steps=2", nproc=4)
    assert len(list((tmp_path / "dp" / "checkpoints" / "step_00000002" / "dcp").glob("*.distcp"))) == 4
    train_distributed(tmp_path / "dp", OFF, SHARDED, "--train.batch_size=8", "--train.resume=latest")
    assert run_cli("export", str(tmp_path / "dp")).returncode == 0
    assert_same_weights(tmp_path / "dp", reference)
