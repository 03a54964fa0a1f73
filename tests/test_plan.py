"""`vlaforge plan`: the search proposes only what the trainer accepts, pins what --fix pins, divides memory the way
the layouts do, writes recipes that train, and reports in the promised fields; bad input is one line and exit 2."""

import json

import pytest

from conftest import run_cli
from vlaforge.config.loading import load_config, validate
from vlaforge.distributed.parallel_dims import World
from vlaforge.planner.estimate import GB, Cluster, PlanModel, estimate
from vlaforge.planner.hardware import get_gpu
from vlaforge.planner.memory import per_gpu
from vlaforge.planner.search import config_fields, needed_nodes, search
from vlaforge.distributed.parallel_dims import check_layout


@pytest.fixture(scope="module")
def vla7b():
    return PlanModel(load_config(None, {"model": {"flavor": "vla-7b"}}))


def _cfg(pm, **flat):
    from vlaforge.config.loading import deep_merge
    from vlaforge.planner.search import nested

    return validate(deep_merge(pm.cfg.model_dump(), nested(flat)))


def test_search_never_recommends_what_the_trainer_refuses(vla7b):
    cluster = Cluster(get_gpu("h100-80"), 8, 2)
    plan = search(vla7b, cluster, 64, keep=50)
    assert plan.ranked and plan.refused > 0  # the enumeration includes layouts the checks refuse (cp + DDP)
    world = World(rank=0, local_rank=0, size=cluster.gpus)
    layouts = set()
    for e in plan.ranked:
        cfg = validate(e.config.model_dump(mode="json"))  # a full round trip through the config schema
        dims = check_layout(cfg, world)
        assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp * dims.cp == 16
        assert cfg.train.batch_size * cfg.train.grad_accum * dims.dp == 64  # the requested global batch
        assert e.fits and e.memory["total"] <= (80 - 1) * 0.9
        layouts.add((dims.tp, dims.pp, dims.dp_replicate))
    assert len(layouts) > 1  # more than one layout made the list
    tps = [e.tokens_per_s for e in plan.ranked]
    assert tps == sorted(tps, reverse=True)


def test_a_pipelined_tied_head_is_counted_on_the_last_stage_too():
    """The small flavor ties its LM head to the token embeddings: the first stage holds the embeddings and the last
    a copy for the head (distributed/pipeline.py), so each stage's LLM state is its own blocks plus that weight."""
    from vlaforge.planner.estimate import _state_share, build_case

    base = load_config(None, {"model": {"flavor": "small"}, "parallel": {"pp": 2, "dp_shard": 1},
                              "train": {"grad_accum": 2}})
    pm = PlanModel(base)
    n = pm.llm_numel
    assert n["tied_head"] == n["embed"] > 0
    case = build_case(pm, base, Cluster(get_gpu("a100-40"), 2, 1))
    (a0, b0), (a1, b1) = case.bounds
    whole = case.state.by_component["llm"].params
    total = n["embed"] + n["tail"] + pm.model.llm.config.num_hidden_layers * n["block"]  # the weight counted once
    first, last = (_state_share(pm, case, "llm", s).params for s in (0, 1))
    assert first == pytest.approx(whole * ((b0 - a0) * n["block"] + n["embed"]) / total, rel=1e-6)
    assert last == pytest.approx(whole * ((b1 - a1) * n["block"] + n["tail"] + n["embed"]) / total, rel=1e-6)


def test_fix_pins_fields_and_evaluates_one_configuration(vla7b):
    cluster = Cluster(get_gpu("h100-80"), 8, 1)
    fixed = {"parallel.tp": 2, "parallel.cp": 1, "components.llm.checkpointing": "full",
             "components.llm.precision": "bf16", "components.vision.checkpointing": "none",
             "components.llm.offload": "none", "train.batch_size": 4,
             "parallel.pp": 1, "parallel.backend": "fsdp2", "parallel.dp_replicate": 1}
    plan = search(vla7b, cluster, 64, fixed, keep=50)
    assert len(plan.ranked) == 1
    f = config_fields(plan.best.config)
    assert all(f[k] == v for k, v in fixed.items())
    assert f["parallel.dp_shard"] == 4 and f["train.grad_accum"] == 4


def test_state_and_activations_divide_as_the_layout_does(vla7b):
    cluster = Cluster(get_gpu("h100-80"), 8, 1)
    base = {"components.llm.precision": "bf16", "train.batch_size": 2}
    single = estimate(vla7b, _cfg(vla7b, **base, **{"parallel.dp_shard": 1}), Cluster(get_gpu("h100-80"), 1, 1))
    fsdp = estimate(vla7b, _cfg(vla7b, **base, **{"parallel.dp_shard": 8}), cluster)
    tp = estimate(vla7b, _cfg(vla7b, **base, **{"parallel.dp_shard": 4, "parallel.tp": 2}), cluster)
    state = vla7b.state(dict(fsdp.config.components.items()), "fp32")
    for comp in ("vision", "llm"):
        want = per_gpu(state.by_component[comp], 8)
        assert fsdp.by_component[comp]["params"] == pytest.approx(want.params / GB)
        assert fsdp.by_component[comp]["optimizer"] == pytest.approx(want.optimizer / GB)
        assert single.by_component[comp]["params"] == pytest.approx(state.by_component[comp].params / GB)
    # tp halves the llm blocks' head and FFN terms only
    ratio = tp.by_component["llm"]["activations"] / fsdp.by_component["llm"]["activations"]
    assert 0.5 < ratio < 0.9
    assert tp.by_component["vision"]["activations"] == pytest.approx(fsdp.by_component["vision"]["activations"])
    # data parallel leaves a rank's activations alone, but autocast's weight casts appear without FSDP2 (2 bytes
    # per matmul parameter of the bf16 llm)
    mm = vla7b.matmul_numel["llm"]
    casts = 2 * (mm["rest"] + 32 * (mm["attn"] + mm["ffn"])) / GB
    assert single.by_component["llm"]["activations"] - fsdp.by_component["llm"]["activations"] == \
        pytest.approx(casts)
    assert single.fits is False and fsdp.fits is True  # 7B with AdamW does not fit one H100


def test_pipeline_stage_zero_holds_vision_and_more_micro_batches(vla7b):
    cluster = Cluster(get_gpu("h100-80"), 8, 1)
    flat = {"components.llm.precision": "bf16", "train.batch_size": 1, "train.grad_accum": 8,
            "parallel.pp": 2, "parallel.dp_shard": 4}
    e = estimate(vla7b, _cfg(vla7b, **flat), cluster)
    one = estimate(vla7b, _cfg(vla7b, **{**flat, "parallel.pp": 1, "parallel.dp_shard": 8}), cluster)
    assert e.stage == 0 and e.by_component["vision"]["params"] > 0  # the busiest stage is the first (1F1B: 2 held)
    assert e.by_component["llm"]["activations"] > one.by_component["llm"]["activations"] * 0.9
    assert e.time_s["pipeline_bubble"] == pytest.approx(e.time_s["compute"] / 8)  # (pp - 1) of m + pp - 1 slots


def test_70b_needs_nodes_and_offload_moves_activations_to_the_host():
    pm = PlanModel(load_config(None, {"model": {"flavor": "vla-70b", "frames": 8}}))
    one = Cluster(get_gpu("h100-80"), 8, 1)
    narrow = {"components.llm.precision": "bf16", "components.vision.checkpointing": "full"}  # a quicker search
    plan = search(pm, one, 256, narrow)
    assert plan.best is None and plan.best_misfit.memory["total"] > 80
    assert "nothing fits on 1 x 8 x h100-80" in plan.explanations[0]
    nodes = needed_nodes(pm, one, 256, narrow)
    assert nodes is not None and nodes >= 2  # 16 bytes x 72 B parameters = 1.15 TB of state alone
    from dataclasses import replace

    fits = search(pm, replace(one, nodes=nodes), 256, {**narrow, "components.llm.offload": "cpu",
                                                       "components.llm.checkpointing": "none"})
    best = fits.best
    assert best is not None and best.memory["cpu"] > 0
    assert best.by_component["llm"]["cpu"] == pytest.approx(best.memory["cpu"])


@pytest.mark.slow
def test_write_config_trains_the_tiny_flavor_for_two_steps(tmp_path):
    recipe, chart = tmp_path / "plan.toml", tmp_path / "mem.png"
    r = run_cli("plan", "--model", "tiny", "--gpu", "a100-80", "--gpus-per-node", "1", "--global-batch", "4",
                "--write-config", str(recipe), "--plot", str(chart), "--json", "--top", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cand = out["candidates"][0]
    assert set(cand) >= {"config", "memory_gb", "fits", "step_time_s", "tokens_per_s", "mfu", "reasons",
                         "by_component"}
    assert set(cand["memory_gb"]) >= {"params", "grads", "optimizer", "activations", "buffers", "total", "cpu", "nvme"}
    assert set(cand["by_component"]) == {"vision", "projector", "llm", "action_head"}
    assert set(cand["by_component"]["llm"]) >= {"params", "grads", "optimizer", "activations", "total", "cpu"}
    assert out["reference"]["korthikanti_llm_blocks_gb"] > 0 and out["reference"]["vlaforge_llm_blocks_gb"] > 0
    from PIL import Image

    assert Image.open(chart).size[0] > 100
    cfg = load_config(recipe)
    assert cfg.train.batch_size * cfg.train.grad_accum == 4 and cfg.components.llm.precision == "bf16"
    r = run_cli("train", str(recipe), "--train.steps=2", f"--train.output_dir={tmp_path / 'run'}",
                "--train.progress=false", "--data.num_samples=16")
    assert r.returncode == 0, r.stderr
    assert "done: 2 steps" in r.stdout


@pytest.mark.parametrize("args, message", [
    (("--gpu", "v100"), "'v100' is not in the catalog"),
    (("--model", "vla-9b"), "neither a flavor"),
    (("--fix", "parallel.tpp=2"), "unknown key parallel.tpp"),
    (("--fix", "parallel.tp"), "write KEY=VALUE"),
    (("--seq", "10"), "leaves no room for instruction tokens"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = run_cli("plan", "--model", "tiny", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("strategy", ["none", "selective", "full", "selective_attn", "selective_ffn"])
def test_weight_casts_match_the_fake_tensor_measurement(strategy):
    from vlaforge.planner.measure import side_by_side

    comps = {c: {"precision": "bf16", "checkpointing": strategy if c in ("vision", "llm") else "none"}
             for c in ("vision", "projector", "llm", "action_head")}
    cfg = load_config(None, {"model": {"flavor": "tiny"}, "components": comps, "train": {"batch_size": 2}})
    pm = PlanModel(cfg)
    single = estimate(pm, cfg, Cluster(get_gpu("a100-80"), 1, 1))
    planned = sum(single.by_component[c]["activations"] for c in single.by_component) * GB
    rows = side_by_side(cfg, 2)
    measured = rows["weight_casts_measured"] + sum(r["analytic"] for r in rows["by_component"].values()
                                                    if r is not rows["by_component"]["other"])
    assert planned == pytest.approx(measured, rel=0.01)  # casts within 1% (the state projection's bias, 4 kB)


def test_whitepaper_has_a_row_and_a_chart_per_cluster(tmp_path):
    from vlaforge.planner.report import whitepaper

    path = whitepaper(tmp_path / "wp.md", global_batch=8, models=("tiny",), frames=(1, 2),
                      clusters=[Cluster(get_gpu("a100-80"), 2, 1), Cluster(get_gpu("h100-80"), 4, 1)])
    text = path.read_text()
    assert "16 bytes per trained parameter** (16.0" in text and text.count("| 1 x 2 x a100-80 |") == 2
    charts = sorted((tmp_path / "wp_charts").glob("*.png"))
    assert len(charts) == 4 and all(f"(wp_charts/{c.name})" in text for c in charts)


def test_measure_counts_offloaded_bytes_with_the_device_ones():
    from vlaforge.planner.measure import side_by_side

    cfg = load_config(None, {"model": {"flavor": "tiny"},
                             "components": {"llm": {"offload": "cpu", "offload_min_bytes": 0}}})
    rows = side_by_side(cfg, 2)
    assert rows["offloaded_measured"] > 0
    assert rows["by_component"]["llm"]["ratio"] == pytest.approx(1.0)  # offload moves bytes, it does not drop them


def test_context_parallel_splits_the_llm_activations(vla7b):
    cluster = Cluster(get_gpu("h100-80"), 8, 1)
    base = {"components.llm.precision": "bf16", "train.batch_size": 2, "parallel.dp_shard": 4}
    one = estimate(vla7b, _cfg(vla7b, **{**base, "parallel.dp_shard": 8}), cluster)
    ring = estimate(vla7b, _cfg(vla7b, **base, **{"parallel.cp": 2, "parallel.cp_method": "ring"}), cluster)
    gathered = estimate(vla7b, _cfg(vla7b, **base, **{"parallel.cp": 2, "parallel.cp_method": "allgather"}), cluster)
    ratio = ring.by_component["llm"]["activations"] / one.by_component["llm"]["activations"]
    assert 0.4 < ratio <= 0.5  # half the tokens, and no padding mask (the layout is compacted)
    assert gathered.by_component["llm"]["activations"] > ring.by_component["llm"]["activations"]  # whole K/V
    assert ring.by_component["vision"]["activations"] == pytest.approx(one.by_component["vision"]["activations"])
    assert ring.by_component["llm"]["params"] == pytest.approx(one.by_component["llm"]["params"])  # dp_shard x cp
    assert ring.time_s.get("cp_comm_exposed", 0) >= 0 and "cp_comm" in gathered.time_s
