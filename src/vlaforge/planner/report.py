"""What `vlaforge plan` prints and writes: the ranked table (rich), the JSON report, the per-GPU memory chart (PNG),
Korthikanti et al.'s activation formula for reference, and the configuration white paper."""

from __future__ import annotations

import io
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vlaforge import COMPONENTS
from vlaforge.planner.estimate import GB, Estimate
from vlaforge.planner.search import GPU_OPTIMIZER, HOST_OPTIMIZER, Plan
from vlaforge.planner.types import Assumptions, Cluster, PlanModel, config_fields

KINDS = ("params", "grads", "optimizer", "activations")
CHART_SOFTWARE = "vlaforge plan"  # the PNG's Software field: `--plot` replaces only a chart plan wrote


def korthikanti_bytes(pm: PlanModel, batch: int, tp: int = 1, strategy: str = "none") -> int:
    """The LLM blocks' activations by Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", eq. 2 with tensor parallel, no sequence parallel): s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes
    per layer for 16-bit training with dropout and materialized attention scores; 2·s·b·h with full
    recomputation. It assumes MHA, a 4h GELU FFN, half-precision residuals and no flash attention, which is why
    vlaforge derives its own terms from the architecture instead."""
    dims = pm.llm_dims
    s, h, a = pm.tokens_per_sample, dims.hidden, dims.heads
    per_layer = 2 * s * batch * h if strategy == "full" else s * batch * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    return int(per_layer * dims.layers)


def plan_json(pm: PlanModel, plan: Plan, assume: Assumptions) -> dict[str, Any]:
    best = plan.best
    ref = None
    if best is not None:  # like for like: one micro-batch through all LLM blocks, split by tp only
        from dataclasses import replace

        from vlaforge.planner.activations import activation_parts

        f = config_fields(best.config)
        micro, tp = best.config.train.batch_size, f["parallel.tp"]
        ck = f["components.llm.checkpointing"]
        parts = activation_parts(pm.model, replace(pm.seq, batch=micro), dict(best.config.components.items()),
                                 pm.contrastive, tp=tp, measured=pm.measured)
        ours = pm.llm_dims.layers * parts["llm_block"] + parts["llm_once"]
        ref = {"korthikanti_llm_blocks_gb": round(korthikanti_bytes(pm, micro, tp, "full" if ck == "full" else "none")
                                                  / GB, 3),
               "vlaforge_llm_blocks_gb": round(ours / GB, 3), "micro_batch": micro, "tp": tp, "checkpointing": ck}
    return {"model": pm.cfg.model.flavor, "cluster": {"gpu": plan.cluster.gpu.name, "gpus_per_node":
                                                      plan.cluster.gpus_per_node, "nodes": plan.cluster.nodes},
            "global_batch": plan.global_batch, "tokens_per_sample": plan.tokens_per_sample,
            "assumptions": asdict(assume),
            "considered": plan.considered, "refused_layouts": plan.refused,
            "candidates": [e.to_json() for e in plan.ranked],
            "smallest_misfit": plan.best_misfit.to_json() if plan.best_misfit else None,
            "explanations": plan.explanations, "reference": ref}


def _short(e: Estimate) -> str:
    f = config_fields(e.config)
    par = [f"{k}{f['parallel.' + k]}" for k in ("tp", "pp", "cp") if f["parallel." + k] > 1]
    if f["parallel.sequence_parallel"]:
        par.append("sp")
    if f["parallel.cp"] > 1:
        par.append(f["parallel.cp_method"])
    dp = f"{f['parallel.backend']} {f['parallel.dp_replicate']}x{f['parallel.dp_shard']}"
    return " ".join([dp, *par])


TAGS = {"vision": "vis"}  # the policy column's short names (a component not here by its own name)


def _policy(e: Estimate, with_blocks: tuple[str, ...]) -> str:
    """Precision / checkpointing / offload of each component with blocks (`Plan.with_blocks`), the LLM first."""
    f = config_fields(e.config)
    out = []
    for comp in sorted(with_blocks, key=lambda c: c != "llm"):
        tag = TAGS.get(comp, comp)
        p, ck, off = (f[f"components.{comp}.{k}"] for k in ("precision", "checkpointing", "offload"))
        out.append(f"{tag} {p}/{ck}" + (f"/off-{off}" if off != "none" else ""))
    lora = f["components.llm.lora"]
    if lora is not None:
        out.append(f"{'qlora' if lora['base'] == 'nf4' else 'lora'} r{lora['rank']}")
    return ", ".join(out)


def render(plan: Plan, top: int = 5) -> str:
    """The ranked candidates as a rich table, then the explanations."""
    from rich.console import Console
    from rich.table import Table

    title = (f"{plan.cluster.describe()}, global batch {plan.global_batch}, {plan.tokens_per_sample} tokens/sample "
             f"({plan.considered} candidates, {plan.refused} layouts refused by the trainer's checks)")
    table = Table(title=title, title_justify="left")
    for col in ("#", "layout", "precision/checkpointing", "micro x accum", "GB/GPU", "act GB", "host GB", "step s",
                "tokens/s", "MFU"):
        table.add_column(col, justify="left" if col in ("layout", "precision/checkpointing") else "right")
    rows = plan.ranked[:top] or ([plan.best_misfit] if plan.best_misfit else [])
    for i, e in enumerate(rows, 1):
        table.add_row(str(i) if e.fits else "no fit", _short(e), _policy(e, plan.with_blocks),
                      f"{e.config.train.batch_size} x {e.config.train.grad_accum}", f"{e.memory['total']:.1f}",
                      f"{e.memory['activations']:.1f}", f"{e.memory['cpu'] + e.memory['nvme']:.1f}",
                      f"{e.step_time_s:.3f}", f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.0f}%")
    buf = io.StringIO()
    Console(file=buf, width=160, force_terminal=False, color_system=None).print(table)
    lines = [buf.getvalue().rstrip()]
    lines += [f"- {x}" for x in plan.explanations]
    if plan.best is not None:
        b = plan.best
        parts = ", ".join(f"{k} {v:.1f}" for k, v in b.memory.items() if k != "total" and v)
        lines.append(f"best: {b.memory['total']:.1f} GB per GPU ({parts}); step {b.step_time_s:.3f} s = "
                     + " + ".join(f"{k} {v:.3f}" for k, v in b.time_s.items() if v))
    return "\n".join(lines)


def plot(e: Estimate, path: str | Path, title: str) -> Path:
    """The per-GPU memory of `e` as a stacked bar per component (params, grads, optimizer, activations) plus the
    buffers, with the GPU's usable memory as a line; a PNG written to a temporary name, then renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vlaforge.outputs import write_atomic

    names = [*COMPONENTS, "buffers"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    bottoms = [0.0] * len(names)
    colors = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52", "activations": "#8172b2"}
    for kind in KINDS:
        vals = [e.by_component[c][kind] if c in e.by_component else 0.0 for c in names]
        ax.bar(names, vals, bottom=bottoms, label=kind, color=colors[kind])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.bar(["buffers"], [e.memory["buffers"]], color="#937860", label="buffers")
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"{title}\ntotal {e.memory['total']:.1f} GB per GPU", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": CHART_SOFTWARE})
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return Path(path)


WHITEPAPER_MODELS = ("smolvla_vlm", "pi0_vlm", "qwen2.5-vl-3b", "openvla-7b", "vla-7b", "vla-30b", "vla-70b")
WHITEPAPER_FRAMES = (1, 8)
FAMILY_MODELS = ("openvla-7b", "gemma3-4b-vla", "qwen3-moe-vla")  # a fused tower, LLM families measured
FAMILY_GLOBAL_BATCH = 64


def whitepaper_clusters(catalog=None) -> list[Cluster]:
    from vlaforge.planner.hardware import get_gpu

    return [Cluster(get_gpu("a100-80", catalog), 8, 1), Cluster(get_gpu("h100-80", catalog), 8, 1),
            Cluster(get_gpu("h100-80", catalog), 8, 4)]


def whitepaper(path: str | Path, global_batch: int = 256, assume: Assumptions = Assumptions(),
               models=WHITEPAPER_MODELS, frames=WHITEPAPER_FRAMES, clusters: list[Cluster] | None = None,
               families=FAMILY_MODELS) -> Path:
    """`docs/whitepaper.md`: the planner's recommended configuration for each model x input x cluster, with the
    per-GPU memory chart of each recommendation (PNG files in a folder beside it), then `families` (models whose
    towers the planner measures) on one and eight GPUs, then LoRA."""
    from vlaforge.config.loading import load_config
    from vlaforge.outputs import write_atomic
    from vlaforge.planner.search import needed_nodes, search

    path = Path(path)
    charts = path.parent / (path.stem + "_charts")
    clusters = clusters or whitepaper_clusters()
    lines = ["# Which configuration for which VLA: the planner's white paper", "",
             "Generated by `vlaforge plan --whitepaper` from the planner's arithmetic (`src/vlaforge/planner/`); do "
             "not edit by hand, rerun it. Every figure below is an estimate of the model the planner documents in "
             "`docs/planner.md`, with its stated assumptions:", ""]
    lines += [f"- `{k}` = {getattr(assume, k)}" for k in assume.__dataclass_fields__]
    lines += ["", f"Global batch {global_batch} samples; one camera; frames are time steps; instruction, action "
              "queries and text targets as in the flavor's defaults. The efficiencies are not yet calibrated on a GPU "
              "(no device run has been made for this table), so read tokens/s and MFU as a ranking, memory as the "
              "firmer figure.", "", "## The arithmetic rules of thumb get wrong", ""]
    first = True
    for flavor in models:
        for n in frames:
            cfg = load_config(None, {"model": {"flavor": flavor, "frames": n}})
            pm = PlanModel(cfg)
            if first:
                lines += _arithmetic(pm) + [""]
                first = False
            lines += [f"## {flavor}, {n} frame{'s' if n > 1 else ''} ({pm.tokens_per_sample} tokens per sample)", "",
                      "| cluster | layout | precision / checkpointing | micro × accum | GB per GPU | tokens/s | "
                      "MFU | why |", "|---|---|---|---|---|---|---|---|"]
            for cluster in clusters:
                plan = search(pm, cluster, global_batch, assume=assume, keep=3)
                if plan.best is None:
                    nodes = needed_nodes(pm, cluster, global_batch, assume=assume)
                    need = (f"needs ≥ {nodes} nodes of {cluster.gpus_per_node} × {cluster.gpu.name}" if nodes
                            else "does not fit up to 64 nodes")
                    smallest = plan.best_misfit.memory["total"] if plan.best_misfit else float("nan")
                    alts = "; ".join(x for x in plan.explanations if x.startswith("alternative"))
                    lines.append(f"| {cluster.describe()} | — | — | — | {smallest:.0f} (no fit) | — | — | "
                                 f"{need} without offload{'; ' + alts if alts else ''} |")
                    continue
                b = plan.best
                chart = charts / f"{flavor}_{n}f_{cluster.nodes}x{cluster.gpus_per_node}_{cluster.gpu.name}.png"
                plot(b, chart, f"{flavor}, {n} frames, {cluster.describe()}")
                why = "; ".join(plan.explanations[:3])
                lines.append(f"| {cluster.describe()} | {_short(b)} | {_policy(b, plan.with_blocks)} | "
                             f"{b.config.train.batch_size} × {b.config.train.grad_accum} | "
                             f"[{b.memory['total']:.1f}]({charts.name}/{chart.name}) | "
                             f"{b.tokens_per_s:,.0f} | {100 * b.mfu:.0f}% | {why} |")
            lines.append("")
    lines += _families_section(assume, families) if families else []
    lines += policy_section(assume) if families else []
    lines += _lora_section(assume, charts)
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def family_clusters(catalog=None) -> list[Cluster]:
    from vlaforge.planner.hardware import get_gpu

    return [Cluster(get_gpu(g, catalog), n, 1) for g, n in (("rtx-4090", 1), ("h100-80", 1), ("h100-80", 8))]


def _families_section(assume: Assumptions, models=FAMILY_MODELS) -> list[str]:
    """What fits of a VLA on a fused tower and on two LLM families no formula counts (their blocks measured,
    planner/measured.py) on one 24 GB GPU, one 80 GB GPU and eight."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.search import search

    lines = ["## The fused tower, Gemma3 and Qwen3-MoE on 1 × 24 / 1 × 80 / 8 × 80 GB", "",
             f"Global batch {FAMILY_GLOBAL_BATCH}, one frame, full fine-tuning. openvla-7b's fused DINOv2 + SigLIP "
             "tower, Gemma3's and Qwen3-MoE's blocks are counted from rows measured under fake tensors "
             "(docs/planner.md, \"Measured rows\"); tensor and context parallel are not planned for a measured LLM.",
             "", "| model | cluster | fits | layout | precision / checkpointing | micro × accum | GB per GPU | "
             "step s | tokens/s | why |", "|---|---|---|---|---|---|---|---|---|---|"]
    for flavor in models:
        pm = PlanModel(load_config(None, {"model": {"flavor": flavor}}))
        for cluster in family_clusters():
            lines.append(_fit_row(flavor, cluster, search(pm, cluster, FAMILY_GLOBAL_BATCH, assume=assume, keep=1),
                                  why=True))
    return lines + [""]


def _fit_row(lead: str, cluster: Cluster, plan, why: bool, fallback: str | None = None) -> str:
    """One row of a what-fits table: `lead` (the model or setup) and the cluster, then the plan's best candidate
    (layout, policy, micro x accum, GB per GPU, step s, tokens/s) or the smallest misfit's need; `why`: a last column
    with the plan's first two explanations (nothing fits: its alternatives). `fallback`: the alternative
    (`search.ALTERNATIVES`) shown, marked in the layout, when nothing else fits; it adds a CPU GB column."""
    b = plan.best or (plan.alternatives.get(fallback) if fallback else None)
    if plan.best is None and fallback and plan.fallback is not None:  # the fastest alternative that fits
        fallback, b = plan.fallback
    cpu = [] if fallback is None else ["—"]
    if b is None or not b.fits:
        m = plan.best_misfit or b
        cells = [lead, cluster.describe(), "no", "—", "—", "—", f"{m.memory['total']:.1f} needed" if m else "—",
                 *cpu, "—", "—"]
        alts = "; ".join(x for x in plan.explanations if x.startswith("alternative"))
        cells += [alts or "no alternative fits"] if why else []
    else:
        layout = _short(b) + (f" {ALTERNATIVE_TAGS.get(fallback, fallback)}" if b is not plan.best else "")
        cpu = [] if fallback is None else [f"{b.memory.get('cpu', 0.0):.1f}"]
        cells = [lead, cluster.describe(), "yes", layout, _policy(b, plan.with_blocks),
                 f"{b.config.train.batch_size} × {b.config.train.grad_accum}", f"{b.memory['total']:.1f}", *cpu,
                 f"{b.step_time_s:.2f}", f"{b.tokens_per_s:,.0f}"]
        cells += ["; ".join(plan.explanations[:2])] if why else []
    return "| " + " | ".join(cells) + " |"


_FROZEN_VLM = {c: {"trainable": False} for c in ("vision", "projector", "llm")}
POLICY_SETUPS = {
    "full fine-tuning": {},
    "train_expert_only (VLM frozen)": _FROZEN_VLM,
    "LoRA r32, LeRobot's targets (VLM frozen)": {**_FROZEN_VLM, "action_head": {
        "lora": {"rank": 32, "alpha": 32, "targets": "lerobot"}}},
    "QLoRA r32 (NF4 VLM and expert)": {"vision": {"trainable": False}, **{
        c: {"lora": {"rank": 32, "alpha": 32, "base": "nf4"}} for c in ("llm", "action_head")}},
}
POLICY_GLOBAL_BATCH = 32  # LeRobot's pi0.5 fine-tuning batch
OFFLOAD = "DeepSpeed ZeRO-3 with optimizer and parameter offload to CPU"  # search.ALTERNATIVES' name
# the layout column's mark of an alternative (else its name)
ALTERNATIVE_TAGS = {OFFLOAD: "zero3 cpu", GPU_OPTIMIZER: "8-bit in backward", HOST_OPTIMIZER: "host adamw"}


def policy_section(assume: Assumptions, flavor: str = "pi05") -> list[str]:
    """Fine-tuning LeRobot's pi0.5 (its `pi05` flavor, LeRobot's default sizes): full, `train_expert_only`, LoRA on
    LeRobot's targets and QLoRA, on the LoRA table's clusters (1 x 24 / 48 / 80, 8 x 80 GB); where nothing fits on
    the GPUs as searched, the plan's fastest fitting alternative (`Plan.fallback`)."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.search import search

    lines = [f"## Fine-tune pi0.5 ({flavor}) on 1 × 24 / 1 × 48 / 1 × 80 / 8 × 80 GB", "",
             f"Global batch {POLICY_GLOBAL_BATCH} (LeRobot's), 3 cameras at 224 px, a 200-token prompt, chunk 50. "
             "Searched as vlaforge trains a LeRobot policy (docs/lerobot_policies.md): bf16 compute over fp32 master "
             "weights, the joint layers (VLM block + expert block) and the tower checkpointed or not, FSDP2 with each "
             "joint layer one unit, or DDP; where nothing fits, the fastest alternative that fits: bf16 weights with "
             "stochastic rounding, 8-bit AdamW moments and each parameter stepped inside backward, no gradient "
             "clipping (`8-bit in backward` below), or DeepSpeed ZeRO-3 with the AdamW state, its step and the "
             "parameters on the CPU (`zero3 cpu`). Every part's activations are measured under fake "
             "tensors (docs/planner.md, \"Measured rows\"). LoRA: rank 32, alpha 32 on LeRobot's default targets "
             "(the expert's q / v projections, the action projections), the VLM frozen; QLoRA: every linear of the "
             "VLM and the expert adapted over an NF4 base, the tower frozen. The full fine-tune on one 24 GB GPU is "
             "`recipes/pi05_24gb.toml`.", "",
             "| setup | cluster | fits | layout | precision / checkpointing | micro × accum | GB per GPU | CPU GB | "
             "step s | tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for setup, comps in POLICY_SETUPS.items():
        pm = PlanModel(load_config(None, {"model": {"flavor": flavor}, "components": comps}))
        for cluster in lora_clusters():
            lines.append(_fit_row(setup, cluster, search(pm, cluster, POLICY_GLOBAL_BATCH, assume=assume, keep=1),
                                  why=False, fallback=OFFLOAD))
    return lines + [""]


LORA_SETUPS = {"full fine-tuning": None, "LoRA r32 (bf16 base)": {"rank": 32, "base": "bf16"},
               "QLoRA r32 (NF4 base)": {"rank": 32, "base": "nf4"}}
LORA_GLOBAL_BATCH = 16  # OpenVLA's fine-tuning batch


def lora_clusters(catalog=None) -> list[Cluster]:
    from vlaforge.planner.hardware import get_gpu

    return [Cluster(get_gpu(g, catalog), n, 1) for g, n in (("rtx-4090", 1), ("l40s", 1), ("h100-80", 1),
                                                            ("h100-80", 8))]


def lora_plans(flavor: str = "vla-7b", assume: Assumptions = Assumptions(), clusters: list[Cluster] | None = None,
               global_batch: int = LORA_GLOBAL_BATCH):
    """(setup, cluster, plan) for full fine-tuning, LoRA and QLoRA (adapters on the vision tower and the LLM) of
    `flavor` on each cluster."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.lora import LORA_COUNTED
    from vlaforge.planner.search import search

    for setup, lora in LORA_SETUPS.items():
        comps = {c: {"precision": "bf16"} | ({"lora": lora} if lora and c in LORA_COUNTED else {})
                 for c in COMPONENTS}
        pm = PlanModel(load_config(None, {"model": {"flavor": flavor}, "components": comps}))
        for cluster in clusters or lora_clusters():
            yield setup, cluster, pm, search(pm, cluster, global_batch, assume=assume, keep=1)


def _lora_section(assume: Assumptions, charts: Path) -> list[str]:
    lines = ["## Full fine-tuning, LoRA and QLoRA: vla-7b on one GPU and on eight", "",
             f"Global batch {LORA_GLOBAL_BATCH} (OpenVLA's fine-tuning batch), one frame. Adapters of rank 32 on every "
             "linear of the vision tower and the LLM (the LM head excepted), alpha 16; the projector and the action "
             "head train in full. The frozen base is stored in bf16 (LoRA) or NF4 (QLoRA); the planner counts "
             "both (docs/lora.md).", "",
             "| setup | cluster | fits | layout | precision / checkpointing | micro × accum | GB per GPU | step s | "
             "tokens/s | trains |", "|---|---|---|---|---|---|---|---|---|---|"]
    for setup, cluster, _, plan in lora_plans(assume=assume):
        b = plan.best
        if b is None:
            m = plan.best_misfit
            lines.append(f"| {setup} | {cluster.describe()} | no | — | — | — | "
                         f"{m.memory['total']:.1f} needed | — | — | — |" if m else
                         f"| {setup} | {cluster.describe()} | no | — | — | — | — | — | — | — |")
            continue
        lines.append(f"| {setup} | {cluster.describe()} | yes | {_short(b)} | "
                     f"{_policy(b, plan.with_blocks)} | "
                     f"{b.config.train.batch_size} × {b.config.train.grad_accum} | {b.memory['total']:.1f} | "
                     f"{b.step_time_s:.2f} | {b.tokens_per_s:,.0f} | {100 * b.trainable_share:.2f} % |")
    return lines + [""]


def _arithmetic(pm: PlanModel) -> list[str]:
    """The bytes-per-parameter facts, computed on the first model rather than asserted."""
    from vlaforge.planner.memory import model_state

    policies = dict(pm.cfg.components.items())
    state = model_state(pm.model, policies, "fp32").total
    per = state.total / state.numel
    bf16_state = model_state(pm.model, {c: p.model_copy(update={"precision": "bf16"}) for c, p in policies.items()},
                             "bf16").total
    return [f"- **Mixed-precision AdamW with fp32 masters is 16 bytes per trained parameter** ({per:.3f} measured on "
            f"{pm.cfg.model.flavor}'s {state.numel / 1e9:.2f} B parameters, the extra from AdamW's step counters): "
            "4 weight + 4 gradient + 8 moments. bf16 autocast keeps no second weight copy; its bf16 casts are "
            "transient activation memory, and FSDP2 gathers weights in bf16 per block instead.",
            f"- **bf16 masters (`train.precision_master = \"bf16\"`) are 8 bytes per parameter** "
            f"({bf16_state.total / bf16_state.numel:.3f} here). The often-quoted \"2 + 2 + 12 = 16 with an fp32 "
            "master copy\" is DeepSpeed's fp16 recipe, not this design.",
            "- **Activations are not a multiple of parameters.** They scale with micro-batch × tokens and, without "
            "flash attention, with tokens²; Korthikanti et al.'s 34·s·b·h + 5·a·s²·b per layer assumes MHA, a "
            "4h GELU FFN, half-precision residuals and materialized scores. `vlaforge plan` prints it next to "
            "vlaforge's own count (`reference` in `--json`)."]
