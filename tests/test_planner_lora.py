"""The planner on LoRA and QLoRA (planner/lora.py): activation bytes per component equal the fake-tensor accounting of
the model `apply_lora` builds, state bytes equal what that model holds (its NF4 base's inner tensors, its adapters'
gradients and AdamW state), matmul FLOPs equal FlopCounterMode; vla-7b QLoRA agrees at 4k tokens; what it does not
count is one line."""

from __future__ import annotations

import pytest
import torch

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError

from conftest import tiny_config

CASES = [("fp32", "none", "auto"), ("fp32", "selective", "nf4"), ("bf16", "none", "nf4"), ("bf16", "full", "bf16"),
         ("bf16", "selective", "auto"), ("bf16", "selective_attn", "nf4"), ("bf16", "selective_ffn", "bf16")]


def _cfg(precision: str, strategy: str, base: str, comps=("vision", "llm"), rank: int = 8, **extra):
    c = {x: {"precision": precision, "checkpointing": strategy if x in ("vision", "llm") else "none"}
         for x in COMPONENTS}
    for comp in comps:
        c[comp]["lora"] = {"rank": rank, "base": base}
    return tiny_config(components=c, **extra)


@pytest.mark.parametrize("precision, strategy, base", CASES, ids=["-".join(c) for c in CASES])
def test_lora_activation_and_state_bytes_equal_the_fake_tensor_measurement(precision, strategy, base):
    from vlaforge.planner.measure import side_by_side

    report = side_by_side(_cfg(precision, strategy, base), batch_size=2)
    rows = report["by_component"]
    for comp in COMPONENTS:  # every component exact; the loss terms ('other') are approximated
        assert rows[comp]["analytic"] == rows[comp]["measured"], (comp, rows[comp])
    assert report["activations"]["ratio"] == pytest.approx(1.0, abs=0.02)
    assert report["state"] == report["state_measured"]


def test_lora_state_is_the_adapters_plus_the_stored_base():
    """What the planner's state counts, against a hand count on the tiny LLM: NF4 codes (4 bits) + int8 scales per
    64 + fp32 factors + the table, and the adapters' 4 fp32 copies (weights, gradients, two moments)."""
    from vlaforge.models.build import build_vla
    from vlaforge.planner.lora import adapted, base_weight_bytes
    from vlaforge.planner.memory import model_state

    cfg = _cfg("fp32", "none", "nf4", comps=("llm",))
    model = build_vla(cfg.model, cfg.loss)
    policies = dict(cfg.components.items())
    a = adapted(model, "llm", policies["llm"])
    assert a.numel == 8 * sum(i + o for i, o, _ in a.linears) and len(a.linears) == 14  # 7 per block, no head
    weights = sum(i * o for i, o, _ in a.linears)
    frozen = sum(p.numel() for p in model.llm.parameters()) - weights
    nf4 = sum(base_weight_bytes(o, i, "nf4", 4) for i, o, _ in a.linears)
    assert nf4 == weights // 2 + weights // 64 + sum(
        4 * (i * o // 64) // __import__("math").gcd(i * o // 64 // __import__("math").gcd(i * o // 64, 64), 256)
        + 68 for i, o, _ in a.linears)
    s = model_state(model, policies).by_component["llm"]
    assert s.params == nf4 + 4 * frozen + 4 * a.numel
    assert s.grads == 4 * a.numel and s.optimizer == 8 * a.numel + 4 * 2 * len(a.linears)


@pytest.mark.parametrize("strategy", ["none", "full", "selective", "selective_attn"])
def test_lora_step_flops_equal_the_flop_counter(strategy):
    """Frozen bases compute no weight gradient; adapters add 2r(in+out) per token forward and twice that backward;
    checkpointing recomputes a region up to its last matmul, the output projection's B (the base runs first)."""
    from vlaforge.planner.throughput import step_flops

    from test_planner import _counted_flops

    components = {c: {"checkpointing": strategy, "lora": {"rank": 8, "base": "nf4"}} for c in ("vision", "llm")}
    model, seq, policies, forward, backward = _counted_flops("tiny", None, components)
    flops = step_flops(model, seq, policies, model.objective.active("contrastive"))
    assert sum(flops.forward.values()) == forward
    assert sum(flops.backward.values()) + sum(flops.recompute.values()) == backward
    full_model, _, full_policies, _, full_backward = _counted_flops("tiny", None, {c: {"checkpointing": strategy}
                                                                                  for c in ("vision", "llm")})
    assert backward < full_backward  # no weight gradients of the frozen bases


@pytest.mark.slow
def test_vla_7b_qlora_agrees_with_the_fake_tensor_measurement():
    """vla-7b, QLoRA rank 32 on the tower and the LLM (NF4 base), selective checkpointing, 4k tokens, bf16: every
    component's activations and the state as the fake model holds it (its NF4 weights' inner tensors)."""
    from vlaforge.models.build import with_seq_len
    from vlaforge.planner.measure import side_by_side

    comps = {c: {"precision": "bf16"} for c in COMPONENTS}
    for c in ("vision", "llm"):
        comps[c] |= {"checkpointing": "selective", "lora": {"rank": 32, "base": "nf4"}}
    cfg = with_seq_len(tiny_config(model={"flavor": "vla-7b", "image_size": None}, components=comps), 4096)
    report = side_by_side(cfg, batch_size=1)
    for comp in COMPONENTS:
        assert report["by_component"][comp]["ratio"] == pytest.approx(1.0, abs=1e-9), comp
    assert report["activations"]["ratio"] == pytest.approx(1.0, abs=0.02)
    assert report["state"] == report["state_measured"]
    # NF4 linears (~0.52 bytes a weight), fp32 embeddings / norms / head, adapters with fp32 AdamW: 6.6 GB, where full
    # fine-tuning with fp32 masters holds 16 bytes a parameter (~120 GB)
    assert 6e9 < report["state"] < 7e9


def test_what_the_planner_does_not_count_is_one_line():
    from vlaforge.planner.types import PlanModel

    with pytest.raises(VlaforgeError, match="int8.*dequantized copy"):
        PlanModel(_cfg("bf16", "none", "int8")).state(dict(_cfg("bf16", "none", "int8").components.items()), "fp32")
    cfg = tiny_config(components={"projector": {"lora": {"rank": 4}}})
    with pytest.raises(VlaforgeError, match="projector.lora is not counted"):
        PlanModel(cfg).state(dict(cfg.components.items()), "fp32")


def test_the_recorder_counts_a_quantized_base_as_stored():
    """`[diagnostics] memory_steps` logs a LoRA component's parameters as held (NF4's inner tensors, adapters): what
    the planner plans for it."""
    from vlaforge.models.build import build_vla
    from vlaforge.planner.memory import model_state
    from vlaforge.training.recorder import component_memory
    from vlaforge.training.trainer import build_model

    cfg = _cfg("fp32", "none", "nf4", comps=("llm",))
    model, _ = build_model(cfg, torch.device("cpu"))
    logged = component_memory(model, optimizer=None)["memory/llm/params_gb"] * 1e9
    planned = model_state(build_vla(cfg.model, cfg.loss), dict(cfg.components.items())).by_component["llm"].params
    assert logged == pytest.approx(planned, abs=1)
