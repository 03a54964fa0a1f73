"""Activation checkpointing, offload and saved-bytes accounting: exact gradients, real recomputation, files
cleaned up, bytes that match a hand computation."""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.techniques import accounting as memory
from vlaforge.techniques import offload as off
from vlaforge.training.trainer import build_model

from conftest import make_batch, tiny_config

CPU = torch.device("cpu")
aten = torch.ops.aten


def _cfg(tmp_path, strategy="none", place="none", **extra):
    comps = {}
    for c in COMPONENTS:
        blocks = c in ("vision", "llm")
        comps[c] = {"checkpointing": strategy if blocks else "none", "offload": place, "offload_min_bytes": 0,
                    **({"offload_path": str(tmp_path / "nvme")} if place == "nvme" else {}), **extra}
    return tiny_config(tmp_path, components=comps)


def _grads(cfg, size: int = 4):
    torch.manual_seed(0)
    model, _ = build_model(cfg, CPU)
    batch = make_batch(cfg, model, size=size)
    with memory.count_saved(model) as acc:
        loss, _ = model.compute_loss(batch)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, acc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _grads(_cfg(tmp_path_factory.mktemp("ref")))


@pytest.mark.parametrize("strategy, place", [
    ("full", "none"), ("selective", "none"), ("selective_attn", "none"), ("selective_ffn", "none"),
    ("every_nth", "none"), ("none", "cpu"), ("none", "nvme"), ("full", "cpu"), ("full", "nvme"),
    ("selective", "cpu"), ("selective", "nvme")])
def test_gradients_equal_the_plain_run(tmp_path, reference, strategy, place):
    ref, ref_acc = reference
    grads, acc = _grads(_cfg(tmp_path, strategy, place))
    assert grads.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=0, atol=1e-6, msg=name)
    if strategy != "none":
        assert acc.per_component().get("llm", 0) < ref_acc.per_component()["llm"]  # checkpointing saved memory
    if place != "none":
        assert acc.total(place) > 0  # what moved is accounted off the device
        assert acc.per_component().get("llm", 0) < ref_acc.per_component()["llm"]


@pytest.mark.filterwarnings("ignore::vlaforge.techniques.fp8.Fp8SlowWarning")
@pytest.mark.parametrize("precision, strategy", [
    ("bf16", "full"), ("bf16", "selective"),
    pytest.param("fp8", "selective", marks=pytest.mark.slow)])  # CPU fp8 matmuls are slow emulations
def test_checkpointing_composes_with_precision(tmp_path, precision, strategy):
    """Recomputation runs in the forward's autocast state and through fp8 linears: gradients are bit-equal."""
    def run(ckpt):
        # 2 samples of 28 tokens (32 px, 8 instruction tokens): CPU fp8 matmuls cost ~M*N*K in emulation
        cfg = tiny_config(tmp_path, components={"llm": {"precision": precision, "checkpointing": ckpt},
                                                "vision": {"precision": "bf16", "checkpointing": ckpt}},
                          model={"image_size": 32}, data={"max_instruction_tokens": 8})
        return _grads(cfg, size=2)[0]

    ref, got = run("none"), run(strategy)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_offload_fraction_moves_the_earliest_blocks_only(tmp_path):
    cfg = tiny_config(tmp_path, components={"llm": {"offload": "cpu", "offload_fraction": 0.5,
                                                    "offload_min_bytes": 0}})
    _, acc = _grads(cfg)
    assert set(acc.per_block("llm", memory.CPU)) == {"0"}  # block 0 of 2; not block 1, not the embeddings/head
    assert {"1", "rest"} <= set(acc.per_block("llm", memory.DEVICE))


def test_projector_and_action_head_full_checkpointing(tmp_path, reference):
    cfg = tiny_config(tmp_path, components={"projector": {"checkpointing": "full"},
                                            "action_head": {"checkpointing": "full"}})
    grads, _ = _grads(cfg)
    for name, g in reference[0].items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = self.sdpa = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func in (aten.mm.default, aten.addmm.default)
        self.sdpa += func is aten._scaled_dot_product_flash_attention_for_cpu.default
        return func(*args, **(kwargs or {}))


def _backward_ops(tmp_path, strategy):
    cfg = tiny_config(tmp_path, components={"llm": {"checkpointing": strategy}})
    model, _ = build_model(cfg, CPU)
    loss, _ = model.compute_loss(make_batch(cfg, model))
    with CountOps() as ops:
        loss.backward()
    return ops.mm, ops.sdpa, len(model.llm.model.layers)


# Recomputation stops early once every tensor backward needs exists again, so a region's last matmul (down_proj
# in the FFN, o_proj in attention: backward needs only their inputs) is not re-run.
@pytest.mark.parametrize("strategy, extra_mm, extra_sdpa", [
    ("selective", 2, 0),  # gate and up re-run; attention matmuls and SDPA come from the cache
    ("selective_ffn", 2, 0),
    ("selective_attn", 3, 1),  # q, k, v and SDPA re-run; the FFN is not
    ("full", 6, 1),  # q, k, v, o, gate, up and SDPA
])
def test_what_is_recomputed_in_backward(tmp_path, strategy, extra_mm, extra_sdpa):
    base_mm, base_sdpa, blocks = _backward_ops(tmp_path, "none")
    mm, sdpa, _ = _backward_ops(tmp_path, strategy)
    assert (mm - base_mm, sdpa - base_sdpa) == (extra_mm * blocks, extra_sdpa * blocks)


def test_offload_releases_the_original_tensor():
    offloader = off._Offloader("cpu", CPU, min_bytes=0, blocks=None, folder=None)
    x = torch.randn(64, 64, requires_grad=True)
    refs = {}
    for name, hooks in (("kept", None), ("offloaded", (offloader.pack, offloader.unpack))):
        with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else torch.enable_grad():
            t = x * 2
            refs[name] = weakref.ref(t)
            y = t.sin()  # sin saves its input
            del t
        gc.collect()
        assert (refs[name]() is None) == (name == "offloaded")  # the graph holds a host copy, not the tensor
        y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * 2 * torch.cos(2 * x))  # both backward passes were exact


def test_nvme_files_are_removed_after_backward_and_after_an_exception(tmp_path):
    cfg = _cfg(tmp_path, "none", "nvme")
    model, _ = build_model(cfg, CPU)
    batch = make_batch(cfg, model)
    folder = tmp_path / "nvme" / "vlaforge-offload"

    def files():
        return [p for p in folder.iterdir() if not p.name.startswith(".")]

    loss, _ = model.compute_loss(batch)
    assert files()
    loss.backward()
    assert not files()

    def failing_step():
        loss, _ = model.compute_loss(batch)
        raise RuntimeError("step failed after forward")

    with pytest.raises(RuntimeError):
        failing_step()
    gc.collect()  # the graph is gone; each handle's finalizer removes its file once its write has finished
    for component in ("vision", "projector", "llm", "action_head"):
        getattr(model, component)._vlaforge_offload.drain()
    assert not files()


def test_unusable_nvme_path_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(VlaforgeError, match=r"components.llm.offload_path: cannot write to .*writable NVMe folder"):
        build_model(tiny_config(tmp_path, components={"llm": {"offload": "nvme", "offload_path": str(blocker)}}),
                    CPU)
    monkeypatch.setattr(off.shutil, "disk_usage", lambda p: type("U", (), {"free": 10 << 20})())
    with pytest.raises(VlaforgeError, match="has 10 MiB free"):
        build_model(tiny_config(tmp_path, components={"llm": {"offload": "nvme",
                                                               "offload_path": str(tmp_path)}}), CPU)


def test_saved_bytes_of_a_small_transformer_by_hand():
    """Pre-LN MLP block, fp32, batch B x D -> H -> D. Saved for backward: LayerNorm's input, mean and rstd; the
    first linear's input (LayerNorm output); GELU's input; the second linear's input (GELU output). Weights are
    parameters and excluded."""
    b, d, h = 8, 32, 128
    block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
    x = torch.randn(b, d)
    with memory.count_saved(block) as acc:
        block(x).sum()
    hand = 4 * (b * d + b + b + b * d + b * h + b * h)
    assert acc.total() == hand
    assert sum(acc.weight_casts.values()) == 0
    with memory.count_saved(block) as acc, torch.autocast("cpu", dtype=torch.bfloat16):
        block(x).sum()
    assert sum(acc.weight_casts.values()) == 2 * (d * h + h * d)  # bf16 copies of the two weight matrices


def test_accounting_under_fake_tensors_matches_real(tmp_path):
    from vlaforge.diagnostics.profile import profile_one

    cfg = tiny_config(tmp_path, components={"llm": {"checkpointing": "selective"}})
    real = profile_one(cfg, CPU, batch_size=2, fake=False, repeats=1)
    fake = profile_one(cfg, CPU, batch_size=2, fake=True, repeats=1)
    assert real["per_component"] == fake["per_component"]
    assert real["weight_cast_bytes"] == fake["weight_cast_bytes"]


def test_profile_cli_tiny_json_and_budget(tmp_path):
    from conftest import TINY_RECIPE, run_cli

    out = run_cli("profile", str(TINY_RECIPE), "--json", "--repeats", "2", "--budget-gb", "1", "--offload",
                  "--components.llm.offload_min_bytes=0")
    assert out.returncode == 0, out.stderr
    import json

    report = json.loads(out.stdout)
    rows = report["strategies"]
    assert list(rows)[:2] == ["none", "none+cpu_offload"] and len(rows) == 12
    assert rows["full"]["activation_bytes"] < rows["selective"]["activation_bytes"] < rows["none"]["activation_bytes"]
    assert rows["none+cpu_offload"]["per_component"].get("llm", 0) == 0  # all of it left the device
    assert all("step_s" in r and "overhead_vs_none" in r for r in rows.values())
    # the spread beside each figure: min and median of the timed steps, and how many there were
    for r in rows.values():
        assert r["repeats"] == len(r["step_times_s"]) == 2
        assert r["step_s"] == r["step_min_s"] == min(r["step_times_s"]) <= r["step_median_s"]
    assert report["timing"]["statistic"] == "min" and report["timing"]["warmup_steps"] == 1
    assert report["recommendation"]["strategy"] in rows


@pytest.mark.slow
def test_profile_vla_7b_fake_at_4096_tokens():
    from conftest import ROOT, run_cli

    out = run_cli("profile", str(ROOT / "recipes" / "vla_7b.toml"), "--fake", "--seq-len", "4096",
                  "--budget-gb", "141", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("vla-7b on fake, batch 1, 4096 tokens/sample")
    names = [line.split()[0] for line in lines[2:8]]
    assert names == ["none", "selective_attn", "selective_ffn", "selective", "recommended", "full"]
    assert "budget 141 GB ->" in out.stdout


def test_profile_seq_len_too_short_is_one_line():
    from conftest import TINY_RECIPE, run_cli

    out = run_cli("profile", str(TINY_RECIPE), "--fake", "--seq-len", "10", fresh=True)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: --seq-len 10 leaves no room for instruction tokens")
    assert len(out.stderr.strip().splitlines()) == 1


def test_training_with_memory_techniques_matches_the_plain_run(tmp_path):
    from safetensors.torch import load_file

    from vlaforge.training.trainer import train

    def run(name, **comps):
        cfg = tiny_config(tmp_path, components=comps, train={"steps": 3, "output_dir": str(tmp_path / name)})
        train(cfg)
        return load_file(str(tmp_path / name / "checkpoints" / "step_00000003" / "model.safetensors"))

    plain = run("plain")
    techniques = run("techniques", vision={"checkpointing": "full"},
                     llm={"checkpointing": "selective", "offload": "nvme", "offload_min_bytes": 0,
                          "offload_path": str(tmp_path / "nvme")},
                     action_head={"checkpointing": "full"})
    assert plain.keys() == techniques.keys()
    assert all(torch.equal(plain[k], techniques[k]) for k in plain)
    assert not [p for p in (tmp_path / "nvme" / "vlaforge-offload").iterdir() if not p.name.startswith(".")]


def test_profile_table_keeps_wide_columns_apart():
    """A per-block range fills its column ("27.31-27.84"): every cell still stands apart from its neighbour."""
    from vlaforge.diagnostics.profile import render

    row = {"activation_bytes": 9.5e9, "per_component": {"llm": 9e9, "vision": 4e8}, "activation_vs_none": 1.0,
           "per_block": {"llm": {"0": 9.5e7, "1": 9.5e7}, "vision": {"0": 2.731e10, "1": 2.784e10}},
           "offloaded_bytes": 0, "weight_cast_bytes": 0, "peak_bytes": 1.2e10, "peak_source": "fake",
           "step_s": 1.5, "step_min_s": 1.5, "step_median_s": 1.625, "repeats": 3, "overhead_vs_none": 0.0}
    text = render({"flavor": "small", "device": "cpu", "batch_size": 2, "tokens_per_sample": 1024,
                   "strategies": {"none": row}})
    header, line = text.splitlines()[1:3]
    two_word = ("vs none", "peak GB", "min s")  # header labels of two words
    assert all(w in header for w in two_word)
    assert len(line.split()) == len(header.split()) - len(two_word) == 17  # no two cells run together
    assert line.split()[-4:] == ["1.500", "1.625", "3", "+0%"]  # min, median, n timed steps, overhead
    assert "0.095 27.31-27.84" in line


def test_fake_profile_ranks_by_the_planners_step_time_calibrated_when_it_can(tmp_path):
    """Under fake tensors the strategies are ranked by the planner's predicted step time on the chosen GPU (their
    recomputation priced by its efficiencies), with a calibration file's entry for that GPU when there is one;
    the recommendation is the fastest predicted that fits, never an assumed order."""
    from vlaforge.diagnostics.profile import profile

    cfg = tiny_config(tmp_path)
    plain = profile(cfg, fake=True, budget_gb=100, gpu="cpu")
    rows = plain["strategies"]
    assert "uncalibrated" in plain["predicted_on"]
    assert rows["none"]["predicted_step_s"] < rows["full"]["predicted_step_s"]  # full recomputes whole blocks
    assert rows["selective"]["predicted_step_s"] < rows["full"]["predicted_step_s"]
    fastest = min(rows, key=lambda k: rows[k]["predicted_step_s"])
    assert plain["recommendation"]["strategy"] == fastest == "none"  # everything fits 100 GB
    assert plain["recommendation"]["reason"].startswith("fastest predicted on one cpu")

    # a calibration whose matmuls are 100x slower: the same ranking, every predicted time longer
    (tmp_path / "cal.toml").write_text("[calibration.cpu]\nmatmul_efficiency = 0.006\nattention_efficiency = 0.45\n"
                                       "elementwise_passes = 6.0\nmicro_overhead_s = 0.0\nruns = ['a', 'b']\n")
    cal = profile(cfg, fake=True, gpu="cpu", calibration=str(tmp_path / "cal.toml"))
    assert cal["predicted_on"].startswith("one cpu, calibrated for cpu from 2 run(s)")
    assert all(cal["strategies"][k]["predicted_step_s"] > rows[k]["predicted_step_s"] for k in rows)
    tight = rows["full"]["peak_bytes"] / 1e9 * 1.001  # only full (and what is smaller) fits
    assert profile(cfg, fake=True, budget_gb=tight, gpu="cpu")["recommendation"]["strategy"] == "full"


def test_profile_warms_up_every_strategy_then_interleaves_the_timed_steps(tmp_path, monkeypatch):
    """Every strategy steps once untimed, then the timed steps go in rounds, each the reverse of the one before
    (s1 s2 s3, s3 s2 s1): no strategy pays alone for the first allocations, a slow spell of the machine hits all of
    them, and a steady drift favours no slot. Recorded through the step function, with synthetic seconds: no
    wall-clock value is asserted."""
    from vlaforge.diagnostics import profile as prof

    calls: list[str] = []
    weights: set[int] = set()
    real_step = prof.step

    def recording_step(run, device, backward=True):
        real_step(run, device, backward)
        calls.append(run.label)
        weights.add(run.model.llm.get_input_embeddings().weight.data_ptr())
        return float(len(calls))  # "seconds": the call's position

    monkeypatch.setattr(prof, "step", recording_step)
    assert prof.schedule(["a", "b"], 2) == [("a", False), ("b", False), ("a", True), ("b", True), ("b", True),
                                            ("a", True)]
    report = prof.profile(tiny_config(tmp_path), strategies=("full", "selective"), repeats=2, budget_gb=1,
                          device=CPU)
    order = ["full", "selective", "none"]
    assert calls == order * 2 + order[::-1]  # the warm-up round, then two timed rounds
    assert len(weights) == 1  # all three models alive at once, with one copy of the weights
    rows = report["strategies"]
    for i, name in enumerate(order):  # the warm-up call (position i + 1) is not among the timed ones
        assert rows[name]["step_times_s"] == [i + 4.0, 9.0 - i]
        assert (rows[name]["step_min_s"], rows[name]["step_median_s"], rows[name]["repeats"]) == (i + 4, 6.5, 2)
    assert report["recommendation"]["strategy"] == "full"  # the smallest min
    assert rows["selective"]["overhead_vs_none"] == 5.0 / 6.0 - 1


def test_spread_larger_than_the_differences_is_said():
    """When strategies' step times lie closer together than their own steps vary (min to median), the output says
    so and how to get a ranking that holds; apart, nothing is said; one timed step has no spread to judge by."""
    from vlaforge.diagnostics.profile import render, spread_notes

    def rows(**times):
        return {k: {"step_times_s": v, "step_min_s": min(v), "step_median_s": sorted(v)[len(v) // 2]}
                for k, v in times.items()}

    close = spread_notes(rows(none=[10.0, 10.6, 13.0], full=[10.2, 10.3, 10.4], selective=[12.0, 12.1, 12.2]))
    assert close == ["the differences between none and full are within the measurement spread (min to median of "
                     "3 steps each): repeat with --repeats 6 or on a quiet machine"]
    assert spread_notes(rows(none=[10.0, 10.1, 10.2], full=[11.0, 11.1, 11.2])) == []
    assert "--repeats 3" in spread_notes(rows(none=[10.0], full=[10.5]))[0]

    row = {"activation_bytes": 1e6, "per_component": {"llm": 1e6}, "activation_vs_none": 1.0,
           "per_block": {"llm": {"0": 1e6}}, "offloaded_bytes": 0, "weight_cast_bytes": 0, "peak_bytes": 1e7,
           "peak_source": "x", "overhead_vs_none": 0.0}
    timed = rows(none=[10.0, 10.6, 13.0], full=[10.2, 10.3, 10.4])
    text = render({"flavor": "tiny", "device": "cpu", "batch_size": 1, "tokens_per_sample": 48,
                   "strategies": {k: {**row, **timed[k], "step_s": timed[k]["step_min_s"], "repeats": 3}
                                  for k in timed},
                   "timing": {"why": "the min", "notes": spread_notes(timed)}})
    assert "\nnote: the differences between none and full are within the measurement spread" in text


def test_profile_asks_the_model_which_components_have_blocks(tmp_path, monkeypatch):
    """The strategies checkpoint, and the table shows per block, the components the model says have blocks
    (`models.blocks.components_with_blocks`), not a list written in the profiler."""
    from vlaforge.diagnostics import profile as prof

    monkeypatch.setattr(prof, "components_with_blocks", lambda model: ("llm",))
    report = prof.profile(tiny_config(tmp_path), fake=True, strategies=("full",), gpu="cpu")
    rows = report["strategies"]
    assert list(rows["full"]["per_block"]) == ["llm"]
    assert rows["full"]["per_component"]["vision"] == rows["none"]["per_component"]["vision"]  # not checkpointed
    assert rows["full"]["per_component"]["llm"] < rows["none"]["per_component"]["llm"]
    header = prof.render(report).splitlines()[1]
    assert "llm/block" in header and "vis/block" not in header


def test_the_selective_policy_decides_before_the_op_runs():
    """torch 2.11 calls a selective-checkpoint policy before the op runs, with no `ctx.op_output` (2.13 calls it
    after): the policy decides from the op alone (the first H100 run crashed here on `ctx.op_output`); the kept
    outputs reach the accounting through the recorder below the SAC mode (the byte tests above)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from vlaforge.techniques import checkpointing as ck

    before_the_op = SimpleNamespace(is_recompute=False)  # what 2.11's SelectiveCheckpointContext carries
    a = torch.ones(2, 2)
    ck._region.append("attn")
    try:
        assert ck.selective_policy(before_the_op, torch.ops.aten.mm.default, a, a) == CheckpointPolicy.MUST_SAVE
        assert ck.selective_policy(before_the_op, torch.ops.aten.mul.Tensor, a, a) == \
            CheckpointPolicy.PREFER_RECOMPUTE
    finally:
        ck._region.pop()
    assert ck.selective_policy(before_the_op, torch.ops.aten.mm.default, a, a) == CheckpointPolicy.PREFER_RECOMPUTE
