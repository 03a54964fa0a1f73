"""Why the plan's top choice is what it is: sentences computed from two estimates side by side (the best candidate
and the same configuration with one choice changed), and what nothing fitting leaves (`search.search` calls
`explain`)."""

from __future__ import annotations

from typing import Any

from vlaforge.planner.estimate import Estimate
from vlaforge.planner.types import Assumptions, Cluster, config_fields


def _same_but(e: Estimate, candidates: list[Estimate], **changes: Any) -> Estimate | None:
    want = {**config_fields(e.config), **changes}
    for c in candidates:
        if config_fields(c.config) == want:
            return c
    return None


def explain(plan, candidates: list[Estimate], cluster: Cluster, assume: Assumptions) -> list[str]:
    """Sentences on why the top choice is what it is, each from two estimates side by side (`plan`: the search's
    `Plan`, ranked)."""
    best = plan.best
    if best is None:
        if plan.best_misfit is None:
            return [f"no layout of {cluster.gpus} GPUs passes the trainer's checks for global batch "
                    f"{plan.global_batch}; change --global-batch or the GPU count"]
        m = plan.best_misfit
        usable = usable_gb(cluster, assume)
        out = [f"nothing fits on {cluster.describe()}: the smallest candidate needs {m.memory['total']:.1f} GB "
               f"per GPU ({usable:.1f} GB usable); add nodes, or take an alternative below"]
        for name, e in plan.alternatives.items():
            if e.fits:
                out.append(f"alternative, {name}: fits at {e.memory['total']:.1f} GB per GPU + "
                           f"{e.memory['cpu']:.1f} GB host per GPU, {e.tokens_per_s:,.0f} tokens/s "
                           f"(MFU {100 * e.mfu:.0f}%)")
            else:
                out.append(f"alternative, {name}: does not fit either ({'; '.join(e.reasons)})")
        return out
    out = []
    f = config_fields(best.config)
    ck = f["components.llm.checkpointing"]
    none = _same_but(best, candidates, **{"components.llm.checkpointing": "none"})
    if ck != "none" and none is not None:
        act, act_none = best.by_component["llm"]["activations"], none.by_component["llm"]["activations"]
        verdict = "does not fit" if not none.fits else "fits but runs slower"
        out.append(f"{ck} on llm: {act_none / max(act, 1e-9):.1f}x less activation memory than none at "
                   f"{100 * best.recompute_share:.0f}% recompute; none {verdict} here "
                   f"({none.memory['total']:.1f} GB per GPU)")
    elif ck == "none":
        out.append("no checkpointing on llm: its activations fit without recomputation")
    if f["components.llm.offload"] == "none":
        out.append("offload not needed: the state and activations fit on the GPUs")
    else:
        out.append(f"llm activations offloaded to CPU: {best.memory['cpu']:.1f} GB per GPU in host memory")
    if f["parallel.tp"] > 1:
        share = best.time_s.get("tp_comm", 0) / best.step_time_s
        out.append(f"tp = {f['parallel.tp']}: the LLM blocks' weights and activations split, at "
                   f"{100 * share:.0f}% of the step in all-reduces")
    if f["parallel.cp"] > 1:
        comm = best.time_s.get("cp_comm", 0) + best.time_s.get("cp_comm_exposed", 0)
        out.append(f"cp = {f['parallel.cp']} ({f['parallel.cp_method']}): each rank holds 1/{f['parallel.cp']} of the "
                   f"LLM's {plan.tokens_per_sample} tokens per sample; its communication shows as "
                   f"{100 * comm / best.step_time_s:.0f}% of the step")
    if f["parallel.pp"] > 1:
        share = best.time_s.get("pipeline_bubble", 0) / best.step_time_s
        out.append(f"pp = {f['parallel.pp']}: pipeline bubble {100 * share:.0f}% of the step with "
                   f"{best.config.train.grad_accum} micro-batches")
    if f["components.llm.lora"] is not None:
        out.append(_lora_tradeoff(best, candidates))
    if f["components.llm.precision"] == "fp8":
        bf16 = _same_but(best, candidates, **{"components.llm.precision": "bf16"})
        if bf16 is not None:
            out.append(f"fp8 on llm: {best.tokens_per_s / bf16.tokens_per_s:.2f}x the tokens/s of bf16")
    return out


def _lora_tradeoff(best: Estimate, candidates: list[Estimate]) -> str:
    """What LoRA gave up, from the estimates: its trainable share, and the best full fine-tune beside it."""
    lora = best.config.components.llm.lora
    full = [c for c in candidates if config_fields(c.config)["components.llm.lora"] is None]
    fits = [c for c in full if c.fits]
    kind = "QLoRA (NF4 base)" if lora.base == "nf4" else f"LoRA ({lora.base} base)"
    share = best.trainable_share
    head = (f"{kind}, rank {lora.rank} on vision + llm: trains {100 * share:.2f} % of the parameters (the rest "
            "frozen: what it gives up against full fine-tuning)")
    if fits:
        top = max(fits, key=lambda c: c.tokens_per_s)
        return (f"{head}; full fine-tuning fits here at {top.tokens_per_s:,.0f} tokens/s "
                f"({top.memory['total']:.1f} GB per GPU) vs {best.tokens_per_s:,.0f}")
    if full:
        low = min(full, key=lambda c: c.memory["total"])
        return f"{head}; full fine-tuning does not fit here (at least {low.memory['total']:.1f} GB per GPU)"
    return head


def usable_gb(cluster: Cluster, assume: Assumptions) -> float:
    return (cluster.gpu.memory_gb - assume.reserved_gb) * (1 - assume.margin)
