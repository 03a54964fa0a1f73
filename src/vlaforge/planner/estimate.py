"""One configuration on one cluster: per-GPU memory by component and kind, host and NVMe bytes, step time,
tokens/s and MFU. The search (`planner/search.py`) calls `estimate` for every candidate; `vlaforge plan --fix`
evaluates one.

Memory per GPU (the busiest pipeline stage's GPU, the one that runs out first):
- **state** (`memory.model_state`): divided by the FSDP2 shard degree (dp_shard x cp, as torchtitan shards) or by
  ZeRO's stage rules, LLM block linears by tp, and split over pipeline stages with the trainer's own block plan
  (`pipeline.plan_stages`); DeepSpeed's optimizer / parameter offload moves those bytes to CPU memory or NVMe;
- **activations** (`activations.activation_parts`; what compiled blocks save with `train.compile`, no mask and K/V
  at their own heads for an unpadded batch): per micro-batch, with tp / cp shares of the LLM blocks, times
  the micro-batches a stage holds at once (1F1B: pp - stage, GPipe: all of them); activation offload moves the
  offloaded blocks' bytes to the host except two blocks in flight (the copy and the prefetch);
- **weight casts**: without FSDP2, autocast's bf16 copies of fp32 master weights live until that layer's backward
  (2 bytes per matmul parameter of a component computing below its master precision, except in checkpointed
  regions, which recompute them; this holds under DeepSpeed ZeRO-3 too, whose gathered fp32 weights are freed
  but not their casts); FSDP2 gathers parameters in the compute dtype per block instead, which is its buffers;
- **buffers**: FSDP2: the root unit (everything outside the blocks: embeddings, heads, projector) once and the
  largest block twice (current + prefetched), each in the compute dtype plus fp32 gradients for the
  reduce-scatter; DDP: two 25 MB gradient buckets;
  pipeline: the send/receive activations of one micro-batch.
- **the peak** (`planner/peak.py`): the step holds parameters, optimizer state and buffers throughout, and on top of
  them the most of (a) what backward holds at each of its parts - the activations not yet freed plus the gradients
  made so far plus that part's working set - and (b) every gradient at the optimizer step; with gradient
  accumulation or several micro-batches in flight, every gradient under the activations; with the step inside
  backward (`train.step_in_backward`, one micro-batch), one gradient at a time and no optimizer step holding them.
  `total` is that peak (`at_peak` what it holds besides the state and buffers, `grads_held` the most gradient bytes
  held at once); `grads` and `by_component` still count every gradient.
A candidate fits when the total is at most (device memory - `reserved_gb`) x (1 - `margin`): `reserved_gb` stands for
the CUDA context, cuBLAS and NCCL workspaces that torch's allocator does not see, `margin` for fragmentation.

Step time: `throughput.step_time`, whose docstring states its assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.planner.activations import activation_parts, compute_bytes
from vlaforge.planner.hardware import GB, no_fp8
from vlaforge.planner.lora import adapters_of, block_gather_bytes, cast_share
from vlaforge.planner.measured import refuse_sharded
from vlaforge.planner.memory import StateBytes, per_gpu
from vlaforge.planner.peak import backward_peak, grads_held, stage_parts
from vlaforge.planner.throughput import step_time
from vlaforge.planner.types import Assumptions, Case, Cluster, MemoryBytes, PlanModel, config_fields
from vlaforge.techniques.freezing import ever_trains

DDP_BUCKET = 25 * 2 ** 20


@dataclass
class Estimate:
    config: object
    memory: dict[str, float]  # GB per GPU: params, grads, optimizer, activations, buffers, total, cpu, nvme
    by_component: dict[str, dict[str, float]]
    fits: bool
    step_time_s: float
    tokens_per_s: float
    mfu: float
    time_s: dict[str, float] = field(default_factory=dict)  # the step time's parts
    reasons: list[str] = field(default_factory=list)
    stage: int = 0  # the pipeline stage whose GPU is reported
    recompute_share: float = 0.0  # FLOPs recomputed by checkpointing over the useful FLOPs
    trainable_share: float = 1.0  # parameters that train (LoRA: the adapters) over all

    def to_json(self) -> dict:
        return {"config": config_fields(self.config), "memory_gb": _round(self.memory),
                "by_component": {c: _round(v) for c, v in self.by_component.items()}, "fits": self.fits,
                "step_time_s": round(self.step_time_s, 4), "tokens_per_s": round(self.tokens_per_s, 1),
                "mfu": round(self.mfu, 4), "time_s": _round(self.time_s), "reasons": self.reasons,
                "trainable_share": round(self.trainable_share, 5)}


def _round(d: dict) -> dict:
    return {k: round(v, 3) for k, v in d.items()}


def build_case(pm: PlanModel, cfg, cluster: Cluster) -> Case:
    from vlaforge.distributed.sequence_parallel import cp_method_for

    par, tr = cfg.parallel, cfg.train
    tp, pp, cp, rep = par.tp, par.pp, par.cp, par.dp_replicate
    shard = par.dp_shard if par.dp_shard != -1 else cluster.gpus // (rep * tp * pp * cp)
    policies = dict(cfg.components.items())
    seq = replace(pm.seq, batch=tr.batch_size, instruction=cfg.data.max_instruction_tokens,
                  text=cfg.data.max_text_tokens)
    layers = pm.llm_dims.layers
    method = par.cp_method
    if cp > 1 and method == "auto":
        method = cp_method_for(par, seq.llm_tokens, pm.llm_dims.heads)[0]
    why = refuse_sharded(pm.measured_components, tp, cp, pp, par.backend)
    if why:
        raise VlaforgeError(why)
    parts = activation_parts(pm.model, seq, policies, pm.contrastive, tp=tp, cp=cp,
                             sequence_parallel=par.sequence_parallel, allgather=cp > 1 and method == "allgather",
                             zigzag=cp > 1 and method == "ring", master=tr.precision_master, compiled=tr.compile,
                             measured=pm.measured)
    trains = {c: ever_trains(policies[c]) for c in COMPONENTS}
    through = {"vision": trains["vision"], "projector": trains["vision"] or trains["projector"]}
    through["llm"] = through["projector"] or trains["llm"]
    through["action_head"] = True
    return Case(cfg=cfg, policies=policies, lora=adapters_of(pm.model, policies), tp=tp, pp=pp, cp=cp, rep=rep,
                shard=shard, micro=tr.batch_size,
                accum=tr.grad_accum, seq=seq, bounds=pm.stage_bounds(pp) if pp > 1 else ((0, layers),),
                state=pm.state(policies, tr.precision_master), parts=parts,
                fsdp=par.backend == "fsdp2" and shard * cp > 1, method=method, backward_through=through)


def estimate(pm: PlanModel, cfg, cluster: Cluster, assume: Assumptions = Assumptions()) -> Estimate:
    """Memory per GPU and step time of `cfg` (a full `VLAConfig`: layout, precision, checkpointing, offload, batch)
    on `cluster`.

    Raises:
        VlaforgeError: a component in fp8 on a GPU without fp8 tensor cores (`hardware.no_fp8`)."""
    if not cluster.gpu.fp8_tflops and any(p.precision == "fp8" for _, p in cfg.components.items()):
        raise VlaforgeError(no_fp8(cluster.gpu.name))
    case = build_case(pm, cfg, cluster)
    stages = [_stage_memory(pm, case, stage) for stage in range(case.pp)]
    stage = max(range(case.pp), key=lambda i: stages[i][0].total)
    totals, comp_mem = stages[stage]
    budget = (cluster.gpu.memory_gb - assume.reserved_gb) * GB * (1 - assume.margin)
    per_node = cluster.gpus_per_node
    cpu_node = sum(s[0].cpu for s in stages) / case.pp * per_node
    nvme_node = sum(s[0].nvme for s in stages) / case.pp * per_node
    reasons = []
    fits = totals.total <= budget
    if not fits:
        reasons.append(f"needs {totals.total / GB:.1f} GB per GPU, over the {budget / GB:.1f} GB usable of "
                       f"{cluster.gpu.memory_gb:g} GB")
    if cpu_node > cluster.cpu_mem_gb * GB * 0.8:
        fits = False
        reasons.append(f"offloads {cpu_node / GB:.0f} GB per node, over 80% of --cpu-mem-gb {cluster.cpu_mem_gb:g}")
    if nvme_node > cluster.nvme_gb * GB:
        fits = False
        reasons.append(f"offloads {nvme_node / GB:.0f} GB per node to NVMe, over --nvme-gb {cluster.nvme_gb:g}")

    times, flops = step_time(pm, case, cluster, assume, stages)
    step = sum(times.values())
    samples = case.micro * case.accum * case.dp
    tokens_per_s = samples * case.seq.llm_tokens / step
    mfu = flops.model_flops / case.micro * samples / (step * cluster.gpus * cluster.gpu.bf16_tflops * 1e12)
    by_component = {}
    for comp in COMPONENTS:
        m = comp_mem[comp]
        row = {"params": m.params / GB, "grads": m.grads / GB, "optimizer": m.optimizer / GB,
               "activations": m.activations / GB}
        row["buffers"] = 0.0  # the buffers belong to the communication, not to a component
        row["total"] = sum(row.values())
        row["cpu"], row["nvme"] = m.cpu / GB, m.nvme / GB
        by_component[comp] = row
    t = totals
    memory = {"params": t.params / GB, "grads": t.grads / GB, "optimizer": t.optimizer / GB,
              "activations": t.activations / GB, "buffers": t.buffers / GB, "at_peak": t.at_peak / GB,
              "grads_held": t.grads_held / GB,
              "total": t.total / GB,
              "cpu": cpu_node / per_node / GB, "nvme": nvme_node / per_node / GB}
    if fits:
        reasons.append(f"fits: {memory['total']:.1f} of {budget / GB:.1f} GB usable per GPU")
    slowest = max((k for k in times if k != "compute"), key=lambda k: times[k], default=None)
    if slowest and times[slowest] > 0.05 * step:
        reasons.append(f"{slowest.replace('_', ' ')} is {100 * times[slowest] / step:.0f}% of the step")
    numel = {c: case.state.by_component[c].numel for c in COMPONENTS}
    trains = sum(case.lora[c].numel if c in case.lora else numel[c] * ever_trains(case.policies[c]) for c in numel)
    return Estimate(config=cfg, memory=memory, by_component=by_component, fits=fits, step_time_s=step,
                    tokens_per_s=tokens_per_s, mfu=mfu, time_s=times, reasons=reasons, stage=stage,
                    recompute_share=sum(flops.recompute.values()) / flops.model_flops,
                    trainable_share=trains / max(1, sum(numel.values())))


def _stage_memory(pm: PlanModel, case: Case, stage: int) -> tuple[MemoryBytes, dict[str, MemoryBytes]]:
    """(totals, memory by component) on one GPU of pipeline stage `stage`."""
    pp, accum = case.pp, case.accum
    in_flight = 1 if pp == 1 else (accum if case.par.pp_schedule == "gpipe" else min(pp - stage, accum))
    comp_mem = {comp: _component_memory(pm, case, comp, stage, in_flight) for comp in COMPONENTS}
    parts = comp_mem.values()
    other = case.parts["other"] * in_flight if stage == pp - 1 else 0
    activations = sum(m.activations for m in parts) + other
    totals = MemoryBytes(params=sum(m.params for m in parts), grads=sum(m.grads for m in parts),
                         optimizer=sum(m.optimizer for m in parts), activations=activations,
                         buffers=_buffers(pm, case), cpu=sum(m.cpu for m in parts), nvme=sum(m.nvme for m in parts),
                         host_optimizer=sum(m.host_optimizer for m in parts))
    # the gradients the step holds at its peak (planner/peak.py): those backward has made so far, or all of them
    # where they outlive a backward (accumulation, several micro-batches in flight); the optimizer step holds all
    # (with the step inside backward each gradient is stepped and freed as it is made, and none is left for a step)
    held = totals.grads if accum > 1 or pp > 1 else 0.0
    in_backward = case.cfg.train.step_in_backward
    parts = stage_parts(pm, case, stage, comp_mem, other, in_flight)
    work = backward_peak(parts, activations, held, in_backward)
    totals.at_peak = work if in_backward else max(work, totals.grads)
    totals.grads_held = grads_held(parts, totals.grads, held, in_backward)
    return totals, comp_mem


def _component_memory(pm: PlanModel, case: Case, comp: str, stage: int, in_flight: int) -> MemoryBytes:
    """One component's bytes on a GPU of `stage`: state, activations (with the autocast weight casts), what
    activation offload moved and where the host holds it."""
    par, parts, pol = case.par, case.parts, case.policies[comp]
    first, last = stage == 0, stage == case.pp - 1
    a, b = case.bounds[stage]
    on = {"vision": first, "projector": first, "action_head": last, "llm": True}[comp]
    if comp == "llm":
        act = (b - a) * parts["llm_block"] + parts["llm_once"] + parts["llm_tail"] * last
    else:
        act = parts[comp] if on else 0
    act *= in_flight
    off = 0.0
    if pol.offload != "none" and act:
        per_block = parts["llm_block"] if comp == "llm" else act / max(1, _vision_layers(pm))
        n_blocks = (b - a) if comp == "llm" else _vision_layers(pm)
        moved_blocks = math.ceil(pol.offload_fraction * n_blocks)
        off = max(0.0, min(act, per_block * in_flight * moved_blocks) - 2 * per_block)
        act -= off
    casts = 0.0
    dtype_bytes = compute_bytes(pol.precision)
    master_bytes = 4 if pol.precision == "fp32" else compute_bytes(case.cfg.train.precision_master)
    if on and not case.fsdp and dtype_bytes < master_bytes and case.backward_through[comp]:
        blocks = (b - a) if comp == "llm" else _vision_layers(pm) if comp == "vision" else 0
        casts = dtype_bytes * pm.cast_numel(comp, pol.checkpointing, blocks, case.tp) * in_flight
        if comp in case.lora:  # the base's copies as stored (planner/lora.py), the adapters' by the same share
            kept = casts / max(1, dtype_bytes * sum(pm.matmul_numel[comp].values()))
            casts = casts * cast_share(case.lora[comp]) + dtype_bytes * case.lora[comp].numel * kept
    st = _state_share(pm, case, comp, stage)
    params, grads, opt = float(st.params), float(st.grads), float(st.optimizer)
    host = {"cpu": off if pol.offload == "cpu" else 0.0, "nvme": off if pol.offload == "nvme" else 0.0}
    hosted = 0.0
    if getattr(pol, "optim_state", "master") == "cpu":  # vlaforge's host AdamW: master and moments on the host
        host["cpu"] += opt
        hosted, opt = opt, 0.0
    if par.backend == "deepspeed" and par.offload_optimizer != "none":
        host[par.offload_optimizer] += opt
        opt = 0.0
    if par.backend == "deepspeed" and par.offload_param != "none":
        host[par.offload_param] += params
        params = 0.0
    return MemoryBytes(params=params, grads=grads, optimizer=opt, activations=act + casts, weight_casts=casts,
                       offloaded=off, cpu=host["cpu"], nvme=host["nvme"], host_optimizer=hosted)


def _state_share(pm: PlanModel, case: Case, comp: str, stage: int) -> StateBytes:
    """One GPU's share of a component's state on pipeline stage `stage`."""
    par, pp = case.par, case.pp
    s = case.state.by_component[comp]
    frac = 1.0
    if pp > 1:
        first, last = stage == 0, stage == pp - 1
        if comp in ("vision", "projector"):
            frac = float(first)
        elif comp == "action_head":
            frac = float(last)
        else:
            n = pm.llm_numel
            a, b = case.bounds[stage]
            own = (b - a) * n["block"] + n["embed"] * first + (n["tail"] + n["tied_head"]) * last
            frac = own / (n["embed"] + n["tail"] + case.layers * n["block"])
    s = _scaled(s, frac)
    if par.backend == "deepspeed":
        z, dp = par.zero_stage, case.dp
        return StateBytes(params=s.params // (dp if z == 3 else 1), grads=s.grads // (dp if z >= 2 else 1),
                          optimizer=s.optimizer // dp, numel=s.numel, tensors=s.tensors)
    return per_gpu(s, case.shard * case.cp if par.backend == "fsdp2" else 1, case.tp if comp == "llm" else 1)


def _vision_layers(pm: PlanModel) -> int:
    return pm.model.vision.config.num_hidden_layers


def _scaled(s: StateBytes, frac: float) -> StateBytes:
    if frac == 1.0:
        return s
    return StateBytes(*(int(getattr(s, f) * frac) for f in ("params", "grads", "optimizer", "tp_sharded_params")),
                      numel=int(s.numel * frac), tensors=s.tensors)


def _buffers(pm: PlanModel, case: Case) -> float:
    llm_c = compute_bytes(case.policies["llm"].precision)
    out = 0.0
    if case.fsdp:
        n = pm.llm_numel
        root = sum(n for c, n in pm.root_numel.items())
        block = max(pm.llm_unit_numel / case.tp, pm.vision_block_numel)  # a policy's: a joint layer
        out += (root + 2 * block) * (llm_c + 4)
        if "llm" in case.lora:  # its largest block gathered as stored, gradients for its adapters only
            master = 4 if case.policies["llm"].precision == "fp32" else compute_bytes(case.cfg.train.precision_master)
            lora_block = block_gather_bytes(case.lora["llm"], n["block"], llm_c, master)
            out += 2 * (max(lora_block, pm.vision_block_numel * (llm_c + 4)) - block * (llm_c + 4))
    elif case.par.backend == "ddp":
        out += 2 * DDP_BUCKET
    if case.pp > 1:
        out += 2 * case.micro * -(-case.seq.llm_tokens // case.cp) * pm.llm_dims.hidden * 4
    return out
