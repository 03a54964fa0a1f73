"""Fake-tensor measurement of a configured model next to the planner's arithmetic (`vlaforge plan --measure`).

The model is built under `FakeTensorMode` (seconds even for vla-70b), one forward runs on a synthetic batch with
the configured precision and checkpointing, and `techniques.accounting.count_saved` counts what it keeps for backward
per component; model-state bytes come from the real parameter shapes (planned from the bare model, measured on the
built one: a LoRA component's quantized base and adapters as they are held). The analytic side is computed from the
same model and sequence.
"""

from __future__ import annotations

import torch

from vlaforge import COMPONENTS
from vlaforge.planner.activations import model_activation_bytes, sequence_of
from vlaforge.planner.measured import MeasuredRows, measured_components
from vlaforge.planner.memory import model_state


def side_by_side(cfg, batch_size: int) -> dict:
    """Per component (and 'other' for the loss terms): activation bytes analytic vs measured (on the device and
    offloaded together) and their ratio; the measured offloaded bytes and autocast weight copies; model-state bytes
    (exact by construction: both count the real shapes)."""
    from vlaforge.models.build import synthetic_batch
    from vlaforge.models.fake import fake_build
    from vlaforge.techniques import accounting as memory
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.training.trainer import build_bare, build_model

    policies = dict(cfg.components.items())
    with fake_build():
        bare = build_bare(cfg, torch.device("cpu"))  # what the planner counts state from (LoRA: not injected)
        model, _ = build_model(cfg, torch.device("cpu"))
        apply_freezing(model, policies, 0)
        batch = synthetic_batch(cfg, model, batch_size)
        with memory.count_saved(model) as acc:
            model.compute_loss(batch)
    seq = sequence_of(model, batch)
    comps = measured_components(bare)
    rows = MeasuredRows(cfg, bare, comps, seq.padded) if comps else None
    analytic = model_activation_bytes(model, seq, policies, model.objective.active("contrastive"),
                                      cfg.train.precision_master, measured=rows)
    # offload only moves what is saved: compare everything saved, wherever it went, and report what moved
    measured: dict[str, int] = {}
    for place in (memory.DEVICE, memory.CPU, memory.NVME):
        for comp, n in acc.per_component(place).items():
            measured[comp] = measured.get(comp, 0) + n
    offloaded = acc.total(memory.CPU) + acc.total(memory.NVME)
    state = model_state(bare, policies, cfg.train.precision_master)
    rows = {}
    for comp in (*COMPONENTS, "other"):
        a, m = analytic.get(comp, 0), measured.get(comp, 0)
        rows[comp] = {"analytic": a, "measured": m, "ratio": a / m if m else None,
                      "state": state.by_component[comp].total if comp in state.by_component else 0}
    total_a, total_m = sum(analytic.values()), sum(measured.values())
    return {"tokens_per_sample": seq.llm_tokens, "micro_batch": batch_size, "by_component": rows,
            "activations": {"analytic": total_a, "measured": total_m, "ratio": total_a / total_m},
            "weight_casts_measured": sum(acc.weight_casts.values()), "offloaded_measured": offloaded,
            "state": state.total.total, "state_measured": measured_state(model)}


def measured_state(model) -> int:
    """Bytes of the built model's state as it holds it: every parameter as stored (a quantized LoRA base's inner
    tensors), and gradients and AdamW state (two moments in the parameter's dtype and a 4-byte step) of the ones
    that train."""
    from vlaforge.techniques.lora import stored_bytes

    total = 0
    for p in model.parameters():
        total += stored_bytes(p)
        if p.requires_grad:
            total += 3 * p.numel() * p.element_size() + 4
    return total
