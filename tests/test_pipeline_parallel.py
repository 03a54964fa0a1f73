"""Pipeline parallel: stage plans, the split keeps parameter names, and real `torchrun` runs of `vlaforge train` with
pp = 2 (GPipe and 1F1B) and pp = 2 x dp_shard = 2 that match one process taking the same micro-batches."""

import pytest
import torch

from conftest import run_cli
from launch import OFF, assert_same_weights, metrics, train_distributed, train_single, weights


def fake_model(flavor: str):
    from vlaforge.config.schema import ModelConfig
    from vlaforge.models.build import build_vla
    from vlaforge.models.fake import fake_build

    with fake_build():
        return build_vla(ModelConfig(flavor=flavor))


def test_stage_plan_balances_work_and_gives_every_stage_blocks():
    from vlaforge.distributed.pipeline import plan_stages

    model = fake_model("vla-7b")
    plan = plan_stages(model, 4, instruction_tokens=32, text_tokens=0)
    sizes = [b - a for a, b in plan.bounds]
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == 32 and sum(sizes) == 32
    assert all(a[1] == b[0] for a, b in zip(plan.bounds, plan.bounds[1:]))  # contiguous
    assert min(sizes) >= 1 and sizes[0] < sizes[-1]  # stage 0 also runs the vision tower: fewer LLM blocks
    assert plan.balance < 1.1
    assert "slowest/mean" in plan.summary()


def test_split_keeps_names_and_hands_every_parameter_to_exactly_one_stage():
    from vlaforge.distributed.pipeline import Removed, plan_stages, split_model
    from vlaforge.models.build import build_vla

    from conftest import tiny_config

    cfg = tiny_config()
    full = {n for n, _ in build_vla(cfg.model, cfg.loss).named_parameters()}
    parts = []
    for stage in (0, 1):
        torch.manual_seed(0)
        model = build_vla(cfg.model, cfg.loss)
        split_model(model, plan_stages(model, 2, 12, 8), stage)
        parts.append({n for n, _ in model.named_parameters()})
    assert parts[0] | parts[1] == full and not parts[0] & parts[1]
    assert "action_head.queries" in parts[0] and "llm.model.layers.1.mlp.up_proj.weight" in parts[1]
    assert isinstance(model.vision, Removed) and "llm.lm_head.weight" in parts[1]


@pytest.fixture(scope="module")
def single_accum2(tmp_path_factory):
    return train_single(tmp_path_factory.mktemp("single_accum2"), "--train.grad_accum=2")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_match_one_process(tmp_path, single_accum2, schedule):
    """pp = 2: the 2 accumulation micro-batches go through the pipeline; weights, losses (averaged on the last
    stage, reported by rank 0) and per-component gradient norms (summed over stages) equal one process's."""
    done = train_distributed(tmp_path, "--parallel.pp=2", f"--parallel.pp_schedule={schedule}",
                             "--train.grad_accum=2", "--train.progress=true")
    assert "pipeline: stage 0: blocks 0-0" in done.stdout
    assert_same_weights(tmp_path, single_accum2)
    got, want = metrics(tmp_path), metrics(single_accum2)
    ranks_only = {"perf/step_s_rank_max", "perf/step_s_rank_min", "perf/slowest_rank"}  # the straggler spread
    assert got[0].keys() == want[0].keys() | ranks_only
    for g, w in zip(got, want):
        assert g["loss/total"] == pytest.approx(w["loss/total"], abs=1e-5)
        for comp in ("vision", "llm", "action_head", "total"):
            assert g[f"grad_norm/{comp}"] == pytest.approx(w[f"grad_norm/{comp}"], rel=1e-5)
        assert g["numerics/llm/zero_frac"] == pytest.approx(w["numerics/llm/zero_frac"])  # counts over stages


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_times_data_parallel_on_four_ranks_and_resume_in_one_process(tmp_path):
    """pp = 2 x dp_shard = 2 (FSDP2 inside each stage): 2 ranks x 2 micro-batches of 4 give one batch of 16
    (contrastive off); its sharded checkpoint (each stage writes its own parameters, under their single-process
    names) resumes in one process."""
    reference = train_single(tmp_path / "single", OFF, "--train.batch_size=16", "--train.steps=4")
    train_distributed(tmp_path / "pp", OFF, "--parallel.pp=2", "--train.grad_accum=2",
                      "--train.checkpoint_format=sharded", nproc=4)
    for g, w in zip(metrics(tmp_path / "pp"), metrics(reference)):
        assert g["loss/total"] == pytest.approx(w["loss/total"], abs=1e-5)
        assert g["grad_norm/total"] == pytest.approx(w["grad_norm/total"], rel=1e-5)
    train_single(tmp_path / "pp", OFF, "--train.batch_size=16", "--train.steps=4", "--train.resume=latest",
                 "--train.checkpoint_format=sharded")
    assert run_cli("export", str(tmp_path / "pp")).returncode == 0
    a, b = weights(tmp_path / "pp", 4), weights(reference, 4)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
