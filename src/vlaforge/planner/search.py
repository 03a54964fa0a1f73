"""Search the configurations of one model on one cluster, keep what fits, rank by estimated throughput, and
explain the top choices.

Enumerated (each dimension only where `--fix` leaves it free):
- layout: tp in 1/2/4/8 (within a node; with Megatron-style sequence parallel, which pipeline stages do not
  take), pp in 1/2/4/8, cp in 1/2/4/8 with each `cp_method`, and the rest data parallel as FSDP2 (full shard),
  HSDP (one replica per node) or DDP;
- the LLM's precision (bf16, and fp8 where the GPU has fp8 tensor cores); the other components compute in bf16;
- checkpointing: none / selective / full on the LLM, none / full on the vision tower;
- activation offload of the LLM to CPU memory;
- the micro-batch (1, 2, 4, ... 64) and the accumulation that reach the global batch.
Every layout goes through the trainer's own checks (`VLAConfig` validation and `distributed.parallel_dims.check_layout`) before it
is estimated, so the search never proposes what `vlaforge train` refuses (cp with pp or DDP, Ulysses whose heads
do not split, ...). DeepSpeed is not searched (FSDP2 covers its sharding);
`--fix parallel.backend=deepspeed` evaluates it, and it is tried as an alternative when nothing fits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlaforge.errors import VlaforgeError
from vlaforge.planner.estimate import GB, Estimate, estimate
from vlaforge.planner.types import Assumptions, Cluster, PlanModel, config_fields

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
LORA = "components.lora"  # the search's LoRA choice: adapters on the vision tower and the LLM (or none)
ALTERNATIVES = {
    "DeepSpeed ZeRO-3 with optimizer and parameter offload to CPU": {
        "parallel.backend": "deepspeed", "parallel.zero_stage": 3, "parallel.offload_optimizer": "cpu",
        "parallel.offload_param": "cpu"},
    "bf16 master weights (train.precision_master = bf16: 8 bytes per parameter, bf16 rounding of the updates)": {
        "train.precision_master": "bf16"},
}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def parse_fixes(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs (values parsed as in config overrides) into a flat dict; unknown keys are refused when the
    config is validated."""
    from vlaforge.config.loading import parse_overrides

    flat: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise VlaforgeError(f"--fix {item!r}: write KEY=VALUE, e.g. --fix parallel.tp=2")
        key, value = item.split("=", 1)
        parsed = parse_overrides([f"--{key}={value}"])
        node: Any = parsed
        for part in key.split("."):
            node = node[part]
        flat[key] = node
    return flat


@dataclass
class Plan:
    cluster: Cluster
    global_batch: int
    tokens_per_sample: int
    ranked: list[Estimate] = field(default_factory=list)  # fitting candidates, fastest first
    best_misfit: Estimate | None = None  # the smallest one that does not fit, when none does
    considered: int = 0
    refused: int = 0  # layouts the trainer's checks refuse
    explanations: list[str] = field(default_factory=list)
    alternatives: dict[str, Estimate] = field(default_factory=dict)  # when nothing fits: what would, and how fast

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def _layouts(cluster: Cluster):
    world = cluster.gpus
    for tp, pp, cp in itertools.product((1, 2, 4, 8), repeat=3):
        if tp > cluster.gpus_per_node or world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        shardings = [("fsdp2", 1, dp)]
        if cluster.nodes > 1 and dp % cluster.nodes == 0 and dp > cluster.nodes:
            shardings.append(("fsdp2", cluster.nodes, dp // cluster.nodes))
        if dp > 1:
            shardings.append(("ddp", dp, 1))
        methods = ("ring", "ulysses", "allgather") if cp > 1 else ("ring",)
        for (backend, rep, shard), method in itertools.product(shardings, methods):
            yield {"parallel.tp": tp, "parallel.sequence_parallel": tp > 1 and pp == 1, "parallel.pp": pp,
                   "parallel.cp": cp, "parallel.cp_method": method, "parallel.backend": backend,
                   "parallel.dp_replicate": rep, "parallel.dp_shard": shard}


def _free(choices: dict[str, tuple], fixed: dict[str, Any]):
    """The product of `choices` over the keys `fixed` does not pin."""
    keys = [k for k in choices if k not in fixed]
    for values in itertools.product(*(choices[k] for k in keys)):
        yield dict(zip(keys, values))


def search(pm: PlanModel, cluster: Cluster, global_batch: int, fixed: dict[str, Any] | None = None,
           assume: Assumptions = Assumptions(), keep: int = 10, alternatives: bool = True,
           lora_rank: int | None = None) -> Plan:
    """Every candidate that the trainer accepts, estimated; the fitting ones ranked by tokens/s. When none fits,
    `plan.alternatives` holds the best of each of the fallbacks the search leaves out by default (`ALTERNATIVES`:
    they change the numerics or cost host memory and PCIe time). `lora_rank`: also try LoRA of that rank on the
    vision tower and the LLM over a bf16 base, and QLoRA (an NF4 base) - they train a few per cent of the
    parameters, which is what the explanation says they give up."""
    from vlaforge.config.loading import deep_merge, validate
    from vlaforge.distributed.parallel_dims import World, check_layout

    fixed = dict(fixed or {})
    base = pm.cfg.model_dump()
    validate(deep_merge(base, nested(fixed)))  # a misspelt or out-of-range --fix is one line, before the search
    plan = Plan(cluster, global_batch, pm.tokens_per_sample)
    world = World(rank=0, local_rank=0, size=cluster.gpus)
    fp8 = ("bf16", "fp8") if cluster.gpu.fp8_tflops else ("bf16",)
    knobs = {"components.llm.precision": fp8, "components.llm.checkpointing": ("none", "selective", "full"),
             "components.vision.checkpointing": ("none", "full"), "components.llm.offload": ("none", "cpu")}
    if lora_rank:
        knobs[LORA] = (None, {"rank": lora_rank, "base": "bf16"}, {"rank": lora_rank, "base": "nf4"})
    defaults = {"components.vision.precision": "bf16", "components.projector.precision": "bf16",
                "components.action_head.precision": "bf16"}
    defaults = {k: v for k, v in defaults.items() if k not in fixed}
    candidates: list[Estimate] = []
    for layout in _layouts(cluster):
        if layout["parallel.cp"] == 1 and "parallel.cp_method" in fixed:  # no method choice without cp
            layout["parallel.cp_method"] = fixed["parallel.cp_method"]
        if "parallel.sequence_parallel" in fixed:  # a default of the layout, not a dimension of its own
            layout["parallel.sequence_parallel"] = fixed["parallel.sequence_parallel"]
        if any(k in fixed and fixed[k] != v for k, v in layout.items()):
            continue  # --fix pins this dimension to another value
        dp = layout["parallel.dp_replicate"] * layout["parallel.dp_shard"]
        if global_batch % dp:
            plan.refused += 1
            continue
        per_rank = global_batch // dp
        micros = [m for m in MICRO_BATCHES if per_rank % m == 0]
        if "train.batch_size" in fixed:
            micros = [fixed["train.batch_size"]]
        for micro in micros:
            accum = per_rank // micro
            if "train.grad_accum" in fixed and fixed["train.grad_accum"] != accum:
                continue
            flat = {**defaults, **layout, "train.batch_size": micro, "train.grad_accum": accum}
            try:
                cfg = validate(deep_merge(base, nested({**flat, **fixed})))
                check_layout(cfg, world)
            except VlaforgeError:
                plan.refused += 1
                continue
            for knob in _free(knobs, fixed):
                cand = cfg if not knob else cfg.model_copy(update={"components": _components(cfg, knob)})
                if knob.get(LORA) or cand.components.llm.lora or cand.components.vision.lora:
                    # LoRA's own refusals (tp, pp, fp8, DeepSpeed): the config's validation
                    try:
                        validate(cand.model_dump(mode="json"))
                    except VlaforgeError:
                        plan.refused += 1
                        continue
                candidates.append(estimate(pm, cand, cluster, assume))
    plan.considered = len(candidates)
    fitting = [e for e in candidates if e.fits]
    fitting.sort(key=lambda e: (-round(e.tokens_per_s, 3), _techniques(e), e.memory["total"]))
    plan.ranked = _distinct(fitting)[:keep]
    if not plan.ranked and candidates:
        plan.best_misfit = min(candidates, key=lambda e: e.memory["total"])
    for e in plan.ranked:  # the recommended configs pass full validation, as `vlaforge train` will run them
        validate(e.config.model_dump(mode="json"))
    if not plan.ranked and alternatives:
        for name, extra in ALTERNATIVES.items():
            if any(k in fixed for k in extra):
                continue
            alt = search(pm, cluster, global_batch, {**fixed, **extra}, assume, keep=1, alternatives=False)
            if alt.best is not None or alt.best_misfit is not None:
                plan.alternatives[name] = alt.best or alt.best_misfit
    plan.explanations = explain(plan, candidates, cluster, assume)
    return plan


def _techniques(e: Estimate) -> int:
    """Memory techniques in use (on a tie in throughput the plan with fewer wins: less to go wrong)."""
    return sum((p.offload != "none") + (p.checkpointing != "none") for _, p in e.config.components.items())


def _components(cfg, knob: dict[str, Any]):
    from vlaforge.config.lora import LoraConfig

    comps = cfg.components
    updates: dict[str, dict[str, Any]] = {}
    for key, value in knob.items():
        if key == LORA:  # the same adapters on the tower and the LLM
            for comp in ("vision", "llm"):
                updates.setdefault(comp, {})["lora"] = LoraConfig(**value) if value else None
            continue
        _, comp, name = key.split(".")
        updates.setdefault(comp, {})[name] = value
    return comps.model_copy(update={c: getattr(comps, c).model_copy(update=u) for c, u in updates.items()})


def _distinct(ranked: list[Estimate]) -> list[Estimate]:
    """One entry per layout + precision + checkpointing (the best micro-batch of each)."""
    out, seen = [], set()
    for e in ranked:
        f = config_fields(e.config)
        key = tuple(repr(v) for k, v in f.items() if not k.startswith("train."))  # (LoRA settings: dicts)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _same_but(e: Estimate, candidates: list[Estimate], **changes: Any) -> Estimate | None:
    want = {**config_fields(e.config), **changes}
    for c in candidates:
        if config_fields(c.config) == want:
            return c
    return None


def explain(plan: Plan, candidates: list[Estimate], cluster: Cluster, assume: Assumptions) -> list[str]:
    """Sentences on why the top choice is what it is, each from two estimates side by side."""
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


def needed_nodes(pm: PlanModel, cluster: Cluster, global_batch: int, fixed: dict[str, Any] | None = None,
                 assume: Assumptions = Assumptions(), most: int = 64) -> int | None:
    """The fewest nodes (doubling) on which something fits, or None up to `most`."""
    from dataclasses import replace

    nodes = cluster.nodes
    while nodes <= most:
        trial = replace(cluster, nodes=nodes)
        if global_batch >= trial.gpus and search(pm, trial, global_batch, fixed, assume, keep=1,
                                                 alternatives=False).ranked:
            return nodes
        nodes *= 2
    return None


def write_config(e: Estimate, path: str | Path, cluster: Cluster) -> Path:
    """The candidate as a `vlaforge train` recipe (written to a temporary name, then renamed)."""
    from vlaforge.config.loading import dump_toml
    from vlaforge.outputs import write_atomic

    head = (f"# vlaforge plan: {cluster.describe()}, estimated {e.tokens_per_s:,.0f} tokens/s, "
            f"{e.memory['total']:.1f} GB per GPU, MFU {100 * e.mfu:.0f}%\n"
            f"# run: torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.gpus_per_node} "
            f"-m vlaforge train {Path(path).name}\n")
    write_atomic(path, head + dump_toml(e.config))
    return Path(path)


def usable_gb(cluster: Cluster, assume: Assumptions) -> float:
    return (cluster.gpu.memory_gb - assume.reserved_gb) * (1 - assume.margin)


__all__ = ["GB", "Plan", "search", "explain", "write_config", "config_fields", "parse_fixes", "needed_nodes",
           "usable_gb"]
