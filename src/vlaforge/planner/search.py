"""Search the configurations of one model on one cluster, keep what fits, rank by estimated throughput, and
explain the top choices.

Enumerated (each dimension only where `--fix` leaves it free):
- layout: tp in 1/2/4/8 (within a node; with Megatron-style sequence parallel, which pipeline stages do not
  take), pp in 1/2/4/8, cp in 1/2/4/8 with each `cp_method` (a pinned degree as given), and the rest data parallel
  as FSDP2 (full shard), HSDP (one replica per node) or DDP;
- the LLM's precision (bf16, and fp8 where the GPU has fp8 tensor cores); the other components compute in bf16;
- checkpointing: none / selective / full on the LLM, none / full on the vision tower;
- activation offload of the LLM to CPU memory;
- the micro-batch (1, 2, 4, ... 64, or the pinned one) where it divides a GPU's share of the global batch, and the
  accumulation that reaches it.
Every layout goes through the trainer's own checks (`VLAConfig` validation and
`distributed.parallel_dims.check_layout`) before it is estimated, so the search never proposes what `vlaforge train`
refuses (cp with pp or DDP, Ulysses whose heads do not split, ...). DeepSpeed is not searched (FSDP2 covers its
sharding); `--fix parallel.backend=deepspeed` evaluates it, and it is tried as an alternative when nothing fits. When
no candidate passes at all, `unplannable` names the pinned value that rules them all out, and why.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.planner.estimate import GB, Estimate, estimate
from vlaforge.planner.explain import explain, usable_gb
from vlaforge.planner.measured import refuse_sharded
from vlaforge.planner.types import Assumptions, Cluster, PlanModel, config_fields

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEGREES = (1, 2, 4, 8)  # tp, pp and cp where --fix leaves them free
LORA = "components.lora"  # the search's LoRA choice: adapters on planner.lora.LORA_COUNTED (or none)
RECIPE_HEADER = "# vlaforge plan:"  # a recipe's first line when plan wrote it: plan replaces only such a file
LORA_REFUSED = "lora: "  # marks, among the search's refusals, LoRA's own
GPU_OPTIMIZER = ("the optimizer on the GPU in ~4 bytes per parameter: bf16 weights with stochastic rounding, 8-bit "
                 "AdamW moments, each parameter stepped inside backward (no gradient clipping)")
HOST_OPTIMIZER = ("AdamW on the host without DeepSpeed: fp32 master weights and moments in host memory, bf16 "
                  "weights on the GPU, each parameter stepped inside backward (one GPU)")
# NOTE: the per-component options are set on the components that train (`_alternative_pins`); the first that fits,
# fastest, is the plan's `fallback`
ALTERNATIVES = {
    GPU_OPTIMIZER: {"train.precision_master": "bf16", "train.step_in_backward": True, "train.grad_clip": 0.0,
                    **{f"components.{c}.{k}": v for c in COMPONENTS
                       for k, v in (("optim_state", "8bit"), ("stochastic_rounding", True))}},
    HOST_OPTIMIZER: {"train.precision_master": "bf16", "train.step_in_backward": True, "train.grad_clip": 0.0,
                     **{f"components.{c}.optim_state": "cpu" for c in COMPONENTS}},
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
    with_blocks: tuple[str, ...] = ()  # the model's components with transformer blocks (the table's policy column)

    @property
    def fallback(self) -> tuple[str, Estimate] | None:
        """When nothing fits: the fastest alternative that fits, (its name, its estimate); else None."""
        fits = [(name, e) for name, e in self.alternatives.items() if e.fits]
        return max(fits, key=lambda x: x[1].tokens_per_s, default=None) if not self.ranked else None

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def _layouts(cluster: Cluster, fixed: dict[str, Any]):
    world = cluster.gpus
    # a pinned degree is tried as given (tp = 3 on 6 GPUs is a layout too), a free one in powers of two
    tps, pps, cps = ((fixed[k],) if k in fixed else DEGREES for k in ("parallel.tp", "parallel.pp", "parallel.cp"))
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if tp > cluster.gpus_per_node or world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        shardings = [("fsdp2", 1, dp)]
        if cluster.nodes > 1 and dp % cluster.nodes == 0 and dp > cluster.nodes:
            shardings.append(("fsdp2", cluster.nodes, dp // cluster.nodes))
        if dp > 1:
            shardings.append(("ddp", dp, 1))
        if fixed.get("parallel.backend") == "deepspeed":  # pinned (an alternative): ZeRO over every data rank
            shardings = [("deepspeed", 1, dp)]
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
    from vlaforge.models.blocks import components_with_blocks

    fixed = dict(fixed or {})
    validate(deep_merge(pm.cfg.model_dump(), nested(fixed)))  # a misspelt or out-of-range --fix is one line, first
    refuse_fp8(cluster, fixed)
    plan = Plan(cluster, global_batch, pm.tokens_per_sample, with_blocks=components_with_blocks(pm.model))
    refusals: Counter = Counter()
    candidates = [estimate(pm, cand, cluster, assume)
                  for cand in _configs(pm, cluster, global_batch, fixed, lora_rank, refusals)]
    plan.refused = sum(refusals.values())
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
            extra = _alternative_pins(pm.cfg, extra)
            if any(k in fixed for k in extra):
                continue
            try:
                alt = search(pm, cluster, global_batch, {**fixed, **extra}, assume, keep=1, alternatives=False)
            except VlaforgeError:  # a fallback the config refuses (DeepSpeed beside LoRA): not offered
                continue
            if alt.best is not None or alt.best_misfit is not None:
                plan.alternatives[name] = alt.best or alt.best_misfit
    plan.explanations = explain(plan, candidates, cluster, assume)
    if lora_rank and not any(_has_lora(e.config) for e in candidates):
        why = max((m for m in refusals if m.startswith(LORA_REFUSED)), key=refusals.get, default=None)
        plan.explanations.append(f"no LoRA / QLoRA candidate of rank {lora_rank}: "
                                 + (why[len(LORA_REFUSED):] if why else "no layout here takes LoRA"))
    return plan


def _alternative_pins(cfg, extra: dict[str, Any]) -> dict[str, Any]:
    """An alternative's pins for `cfg`: its per-component optimizer options only on the components that ever train
    (a frozen component has no optimizer state: the config refuses them there)."""
    from vlaforge.techniques.freezing import ever_trains

    def kept(key: str) -> bool:
        parts = key.split(".")
        return parts[0] != "components" or ever_trains(getattr(cfg.components, parts[1]))

    return {k: v for k, v in extra.items() if kept(k)}


def refuse_fp8(cluster: Cluster, fixed: dict[str, Any]) -> None:
    """fp8 pinned on a GPU without fp8 tensor cores: refused in one line (the search never offers it there).

    Raises:
        VlaforgeError: naming the pin and the GPU."""
    from vlaforge.planner.hardware import no_fp8

    for comp in COMPONENTS:
        if fixed.get(f"components.{comp}.precision") == "fp8" and not cluster.gpu.fp8_tflops:
            raise VlaforgeError(f"--fix components.{comp}.precision=fp8: {no_fp8(cluster.gpu.name)}")


def _has_lora(cfg) -> bool:
    return any(getattr(cfg.components, c).lora is not None for c in COMPONENTS)


def _configs(pm: PlanModel, cluster: Cluster, global_batch: int, fixed: dict[str, Any], lora_rank: int | None,
             refusals: Counter):
    """Every candidate config the trainer accepts (`VLAConfig` validation, `check_layout`, LoRA's own refusals),
    before any estimate; what it refuses is counted in `refusals` by message."""
    from vlaforge.config.loading import deep_merge, validate
    from vlaforge.distributed.parallel_dims import World, check_layout

    base = pm.cfg.model_dump()
    world = World(rank=0, local_rank=0, size=cluster.gpus)
    knobs = _knobs(cluster, lora_rank, policy=pm.measured is not None and pm.measured.policy)
    defaults = {"components.vision.precision": "bf16", "components.projector.precision": "bf16",
                "components.action_head.precision": "bf16"}
    defaults = {k: v for k, v in defaults.items() if k not in fixed}
    for layout in _layouts(cluster, fixed):
        if layout["parallel.cp"] == 1 and "parallel.cp_method" in fixed:  # no method choice without cp
            layout["parallel.cp_method"] = fixed["parallel.cp_method"]
        if "parallel.sequence_parallel" in fixed:  # a default of the layout, not a dimension of its own
            layout["parallel.sequence_parallel"] = fixed["parallel.sequence_parallel"]
        if any(k in fixed and fixed[k] != v for k, v in layout.items()):
            continue  # --fix pins this dimension to another value
        dp = layout["parallel.dp_replicate"] * layout["parallel.dp_shard"]
        if global_batch % dp:
            refusals[f"global batch {global_batch} does not split over {dp} data-parallel ranks"] += 1
            continue
        per_rank = global_batch // dp
        micros = [m for m in ((fixed["train.batch_size"],) if "train.batch_size" in fixed else MICRO_BATCHES)
                  if per_rank % m == 0]  # micro x accum x dp is the global batch, exactly
        if not micros:
            refusals[f"a GPU's share of the global batch ({per_rank} here, with {dp} data-parallel ranks) is not a "
                     "multiple of the pinned micro-batch; pin a divisor of it"] += 1
        for micro in micros:
            accum = per_rank // micro
            if "train.grad_accum" in fixed and fixed["train.grad_accum"] != accum:
                continue
            flat = {**defaults, **layout, "train.batch_size": micro, "train.grad_accum": accum}
            try:
                cfg = validate(deep_merge(base, nested({**flat, **fixed})))
                check_layout(cfg, world)
            except VlaforgeError as e:
                refusals[str(e)] += 1
                continue
            sharded = refuse_sharded(pm.measured_components, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp,
                                     cfg.parallel.backend)
            if sharded:
                refusals[sharded] += 1
                continue
            for knob in _free(knobs, fixed):
                cand = cfg if not knob else cfg.model_copy(update={"components": _components(cfg, knob)})
                if _has_lora(cand):  # LoRA's own refusals (tp, pp, fp8, DeepSpeed): the config's validation
                    try:
                        validate(cand.model_dump(mode="json"))
                    except VlaforgeError as e:
                        refusals[LORA_REFUSED + str(e)] += 1
                        continue
                yield cand


def unplannable(pm: PlanModel, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
                lora_rank: int | None = None) -> str:
    """Why the search has no candidate at all, in one line: a pinned value that rules every one out on its own, or
    whose release lets one through, and why; else the trainer's most frequent refusal."""
    refusals: Counter = Counter()
    for _ in _configs(pm, cluster, global_batch, fixed, lora_rank, refusals):
        pass
    common = max(refusals, key=refusals.get, default="no layout of these degrees")
    where = f"on {cluster.describe()} at global batch {global_batch}"
    for key, value in fixed.items():
        why = _refused_pin(pm, cluster, global_batch, key, value)
        if why is not None:
            return f"{_flag(key, value)} rules out every candidate {where}: {why}"
    for key, value in fixed.items():  # a pin whose release lets a candidate through: why that one refuses it
        rest = {k: v for k, v in fixed.items() if k != key}
        cand = next(_configs(pm, cluster, global_batch, rest, lora_rank, Counter()), None)
        if cand is not None:
            why = _refusal(cand.model_dump(), _repin(cand, key, value, cluster.gpus), cluster) or common
            return f"{_flag(key, value)} rules out every candidate {where}: {why}"
    if fixed:
        pins = ", ".join(_flag(k, v) for k, v in fixed.items())
        return f"the pinned values ({pins}) together rule out every candidate {where}: {common}"
    return f"no layout passes the trainer's checks {where} ({common}); change --global-batch or the GPU count"


def _flag(key: str, value: Any) -> str:
    return f"--micro-batch {value} (train.batch_size)" if key == "train.batch_size" else f"--fix {key}={value}"


def _refused_pin(pm: PlanModel, cluster: Cluster, global_batch: int, key: str, value: Any) -> str | None:
    """Why `key = value` alone admits no candidate: a micro-batch above the global batch, the trainer's check of a
    layout with that degree pinned (the rest data parallel), or a tensor-parallel degree beyond a node; None if none
    says."""
    if key == "train.batch_size" and value > global_batch:
        return (f"a micro-batch is part of one GPU's share of the global batch {global_batch}; pin at most "
                f"{global_batch}, or raise --global-batch")
    if key not in ("parallel.tp", "parallel.pp", "parallel.cp"):
        return None
    degrees = {"parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.dp_shard": -1,
               "parallel.dp_replicate": 1, "parallel.backend": "fsdp2", key: value}
    why = _refusal(pm.cfg.model_dump(), degrees, cluster)
    if why is None and key == "parallel.tp" and value > cluster.gpus_per_node:
        return f"the planner keeps tensor parallel within a node of {cluster.gpus_per_node} GPUs; pin a smaller tp"
    return why


def _repin(cfg, key: str, value: Any, world: int) -> dict[str, Any]:
    """`key = value` on a candidate, a degree with the data-parallel degree refilled to the GPUs (DDP's replicas,
    FSDP2's shards): the trainer then judges the pin, not the product."""
    flat = {key: value}
    if key in ("parallel.tp", "parallel.pp", "parallel.cp"):
        p = cfg.parallel
        degrees = {"parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp, key: value}
        others = degrees["parallel.tp"] * degrees["parallel.pp"] * degrees["parallel.cp"]
        if world % others == 0 and p.backend == "ddp":
            flat["parallel.dp_replicate"] = world // others
        elif world % (others * p.dp_replicate) == 0:
            flat["parallel.dp_shard"] = world // (others * p.dp_replicate)
    return flat


def _refusal(base: dict, flat: dict[str, Any], cluster: Cluster) -> str | None:
    """The trainer's refusal of `base` with `flat` set (`VLAConfig` validation, `check_layout`), None if it takes it."""
    from vlaforge.config.loading import deep_merge, validate
    from vlaforge.distributed.parallel_dims import World, check_layout

    try:
        check_layout(validate(deep_merge(base, nested(flat))), World(rank=0, local_rank=0, size=cluster.gpus))
    except VlaforgeError as e:
        return str(e)
    return None


def _knobs(cluster: Cluster, lora_rank: int | None, policy: bool = False) -> dict[str, tuple]:
    """The per-component choices the search tries (each only where --fix leaves it free). A LeRobot policy: what it
    trains with (docs/lerobot_policies.md): bf16 (the expert's blocks in the LLM's precision), its joint layers and
    tower checkpointed or not, no activation offload."""
    if policy:
        return {"components.llm.precision": ("bf16",), "components.llm.checkpointing": ("none", "full"),
                "components.vision.checkpointing": ("none", "full")}
    fp8 = ("bf16", "fp8") if cluster.gpu.fp8_tflops else ("bf16",)
    knobs = {"components.llm.precision": fp8, "components.llm.checkpointing": ("none", "selective", "full"),
             "components.vision.checkpointing": ("none", "full"), "components.llm.offload": ("none", "cpu")}
    if lora_rank:
        knobs[LORA] = (None, {"rank": lora_rank, "base": "bf16"}, {"rank": lora_rank, "base": "nf4"})
    return knobs


def _techniques(e: Estimate) -> int:
    """Memory techniques in use (on a tie in throughput the plan with fewer wins: less to go wrong)."""
    return sum((p.offload != "none") + (p.checkpointing != "none") for _, p in e.config.components.items())


def _components(cfg, knob: dict[str, Any]):
    from vlaforge.config.lora import LoraConfig
    from vlaforge.planner.lora import LORA_COUNTED

    comps = cfg.components
    updates: dict[str, dict[str, Any]] = {}
    for key, value in knob.items():
        if key == LORA:  # the same adapters on every component whose LoRA the planner counts
            for comp in LORA_COUNTED:
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

    head = (f"{RECIPE_HEADER} {cluster.describe()}, estimated {e.tokens_per_s:,.0f} tokens/s, "
            f"{e.memory['total']:.1f} GB per GPU, MFU {100 * e.mfu:.0f}%\n"
            f"# run: torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.gpus_per_node} "
            f"-m vlaforge train {Path(path).name}\n")
    write_atomic(path, head + dump_toml(e.config))
    return Path(path)


__all__ = ["GB", "Plan", "search", "explain", "write_config", "config_fields", "parse_fixes", "needed_nodes",
           "usable_gb", "unplannable"]
