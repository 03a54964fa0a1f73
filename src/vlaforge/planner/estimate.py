"""One configuration on one cluster: per-GPU memory by component and kind, host and NVMe bytes, step time,
tokens/s and MFU. The search (`planner/search.py`) calls `estimate` for every candidate; `vlaforge plan --fix`
evaluates one.

Memory per GPU (the busiest pipeline stage's GPU, the one that runs out first):
- **state** (`memory.model_state`): divided by the FSDP2 shard degree (dp_shard x cp, as torchtitan shards) or by
  ZeRO's stage rules, LLM block linears by tp, and split over pipeline stages with the trainer's own block plan
  (`pipeline.plan_stages`); DeepSpeed's optimizer / parameter offload moves those bytes to CPU memory or NVMe;
- **activations** (`activations.activation_parts`): per micro-batch, with tp / cp shares of the LLM blocks, times
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
A candidate fits when the total is at most (device memory - `reserved_gb`) x (1 - `margin`): `reserved_gb` stands for
the CUDA context, cuBLAS and NCCL workspaces that torch's allocator does not see, `margin` for fragmentation.

Step time (the overlap assumptions are the ones the runtime makes):
- compute: matmul FLOPs (`throughput.step_flops`, forward + backward + recomputation) at the GPU's dense peak for
  the component's precision times `matmul_efficiency` (`fp8_efficiency` of the fp8 peak for fp8 linears);
  attention cores at `attention_efficiency`; plus memory-bound kernels: every activation the forward makes
  (what `none` keeps) moved `elementwise_passes` times through HBM, and a third of that again for what
  recomputation rebuilds;
  the LLM's work divided by tp x cp and over the stages, the vision tower and heads replicated;
- FSDP all-gathers (forward and backward of every micro-batch) and the reduce-scatter (once per step), DDP's and
  HSDP's all-reduce: overlapped with compute (only the excess counts);
- TP's four all-reduces per block per micro-batch (six with `full` recomputation) and Ulysses' all-to-alls: on the
  critical path; ring attention's K/V passes: overlapped with the attention cores;
- pipeline: the bubble, (pp - 1) idle micro-batch slots per step, and activations sent between stages;
- activation offload: device-host copies at PCIe (or NVMe) speed, overlapped with the component's compute;
- optimizer: its state read and written once at HBM speed; with DeepSpeed's optimizer offload, gradients and
  parameters cross PCIe and the node's CPU Adam streams the state at `cpu_adam_gbps`; with parameter offload,
  ZeRO-3 fetches the parameters over PCIe for every forward and backward.
A link's collectives run at `comm_efficiency` of its per-direction bandwidth; a group that spans nodes runs at the
network's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from torch import nn

from vlaforge import COMPONENTS
from vlaforge.planner.activations import Sequence, activation_parts, sequence_of  # noqa: F401 (re-export)
from vlaforge.planner.hardware import GPU
from vlaforge.planner.memory import StateBytes, model_state, per_gpu
from vlaforge.planner.throughput import step_flops
from vlaforge.techniques.freezing import trainable_at

GB = 1e9
EVER = 1 << 62
DDP_BUCKET = 25 * 2 ** 20
ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    cpu_mem_gb: float = 1024.0  # host memory per node
    nvme_gb: float = 0.0  # NVMe per node
    nvme_gbps: float = 6.0  # NVMe read/write per node

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} x {self.gpu.name}"


@dataclass(frozen=True)
class Assumptions:
    """The stated constants of the throughput and fit model (each overridable on the command line)."""

    matmul_efficiency: float = 0.6  # share of the dense peak large bf16 GEMMs reach (no GPU calibration yet)
    fp8_efficiency: float = 0.4  # share of the fp8 peak torchao's fp8 linears reach, casts and scaling included
    attention_efficiency: float = 0.45  # flash-attention kernels, forward and backward together
    comm_efficiency: float = 0.8  # share of a link's bandwidth ring collectives reach
    elementwise_passes: float = 6.0  # HBM passes over the saved activations by norms, activations, casts, adds
    cpu_adam_gbps: float = 20.0  # optimizer state a node's CPU Adam streams through per second (DeepSpeed offload)
    margin: float = 0.10  # allocator fragmentation
    reserved_gb: float = 1.0  # CUDA context, cuBLAS and NCCL workspaces


class PlanModel:
    """The model of a base config, built once under fake tensors, with the facts every candidate reuses."""

    def __init__(self, cfg):
        from vlaforge.diagnostics.profile import synthetic_batch
        from vlaforge.models.build import build_vla, fake_build
        from vlaforge.distributed.parallel_dims import model_facts

        self.cfg = cfg
        with fake_build():
            self.model = build_vla(cfg.model, cfg.loss)
            self.seq = sequence_of(self.model, synthetic_batch(cfg, self.model, 1))
        self.facts = model_facts(cfg.model)
        self.contrastive = self.model.objective.active("contrastive")
        self._states: dict = {}
        self._plans: dict = {}

    @property
    def tokens_per_sample(self) -> int:
        return self.seq.llm_tokens

    def state(self, policies, master: str):
        key = (master, tuple((c, policies[c].precision, trainable_at(policies[c], EVER)) for c in COMPONENTS))
        if key not in self._states:
            self._states[key] = model_state(self.model, policies, master)
        return self._states[key]

    def stage_bounds(self, pp: int) -> tuple[tuple[int, int], ...]:
        if pp not in self._plans:
            from vlaforge.distributed.pipeline import plan_stages

            d = self.cfg.data
            self._plans[pp] = plan_stages(self.model, pp, d.max_instruction_tokens, d.max_text_tokens).bounds
        return self._plans[pp]

    @cached_property
    def llm_numel(self) -> dict[str, int]:
        """The LLM's parameters by place: the token embeddings, one block, and the tail (final norm + LM head)."""
        llm = self.model.llm
        block = sum(p.numel() for p in llm.model.layers[0].parameters())
        embed = llm.model.embed_tokens.weight.numel()
        total = sum(p.numel() for p in llm.parameters())
        return {"embed": embed, "block": block, "tail": total - embed - block * len(llm.model.layers)}

    @cached_property
    def matmul_numel(self) -> dict[str, dict[str, int]]:
        """Parameters of the linears and convolutions per component, what autocast casts: 'attn' and 'ffn' of one
        block (vision, llm), 'rest' outside the blocks."""
        from vlaforge.diagnostics.memory import blocks_of

        def numel(module) -> int:
            return sum(p.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                       for p in m.parameters(recurse=False))

        out = {}
        for comp in COMPONENTS:
            blocks = blocks_of(self.model, comp)
            row = {"rest": numel(getattr(self.model, comp)), "attn": 0, "ffn": 0}
            if blocks is not None:
                row["attn"], row["ffn"] = numel(blocks[0].self_attn), numel(blocks[0].mlp)
                row["rest"] -= len(blocks) * (row["attn"] + row["ffn"])
            out[comp] = row
        return out

    def cast_numel(self, comp: str, strategy: str, blocks: int, tp: int = 1) -> int:
        """Matmul parameters whose casts autograd keeps until backward: a checkpointed region recomputes its casts
        (`full` and `selective` keep none of a block's; `selective_attn` keeps the FFN's, `selective_ffn` the
        attention's); tensor parallel holds 1/tp of the LLM blocks' linears."""
        row = self.matmul_numel[comp]
        kept = {"none": row["attn"] + row["ffn"], "every_nth": row["attn"] + row["ffn"],
                "selective_attn": row["ffn"], "selective_ffn": row["attn"]}.get(strategy, 0)
        return row["rest"] + blocks * kept // (tp if comp == "llm" else 1)

    @cached_property
    def root_numel(self) -> dict[str, int]:
        """Parameters outside the transformer blocks per component: FSDP2's root unit, gathered whole."""
        from vlaforge.diagnostics.memory import blocks_of

        out = {}
        for comp in COMPONENTS:
            blocks = blocks_of(self.model, comp)
            inside = sum(p.numel() for p in blocks.parameters()) if blocks is not None else 0
            out[comp] = sum(p.numel() for p in getattr(self.model, comp).parameters()) - inside
        return out

    @cached_property
    def vision_block_numel(self) -> int:
        from vlaforge.models.vision import vision_blocks

        return sum(p.numel() for p in vision_blocks(self.model.vision)[0].parameters())


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

    def to_json(self) -> dict:
        from vlaforge.planner.search import config_fields

        return {"config": config_fields(self.config), "memory_gb": _round(self.memory),
                "by_component": {c: _round(v) for c, v in self.by_component.items()}, "fits": self.fits,
                "step_time_s": round(self.step_time_s, 4), "tokens_per_s": round(self.tokens_per_s, 1),
                "mfu": round(self.mfu, 4), "time_s": _round(self.time_s), "reasons": self.reasons}


def _round(d: dict) -> dict:
    return {k: round(v, 3) for k, v in d.items()}


def _link(cluster: Cluster, span: int, assume: Assumptions) -> float:
    """Bytes/s a collective over `span` consecutive ranks reaches: NVLink / PCIe within a node, else the network."""
    gbps = cluster.gpu.intra_node_gbps if span <= cluster.gpus_per_node else cluster.gpu.inter_node_gbps
    return gbps * GB * assume.comm_efficiency


def _ring(nbytes: float, n: int, bw: float, passes: float = 1.0) -> float:
    """Time of a ring all-gather / reduce-scatter of `nbytes` (the whole tensor) over n ranks (all-reduce: 2)."""
    return 0.0 if n <= 1 else passes * nbytes * (n - 1) / n / bw


def estimate(pm: PlanModel, cfg, cluster: Cluster, assume: Assumptions = Assumptions()) -> Estimate:
    """Memory per GPU and step time of `cfg` (a full `VLAConfig`: layout, precision, checkpointing, offload, batch)
    on `cluster`."""
    par, tr = cfg.parallel, cfg.train
    policies = dict(cfg.components.items())
    world = cluster.gpus
    tp, pp, cp, rep = par.tp, par.pp, par.cp, par.dp_replicate
    shard = par.dp_shard if par.dp_shard != -1 else world // (rep * tp * pp * cp)
    dp = rep * shard
    micro, accum = tr.batch_size, tr.grad_accum
    seq = replace(pm.seq, batch=micro, instruction=cfg.data.max_instruction_tokens, text=cfg.data.max_text_tokens)
    tokens = seq.llm_tokens
    layers = pm.model.llm.config.num_hidden_layers
    bounds = pm.stage_bounds(pp) if pp > 1 else ((0, layers),)
    master = tr.precision_master
    state = pm.state(policies, master)
    method = _cp_method(pm, par, tokens)
    parts = activation_parts(pm.model, seq, policies, pm.contrastive, tp=tp, cp=cp,
                             sequence_parallel=par.sequence_parallel, allgather=cp > 1 and method == "allgather")
    fsdp = par.backend == "fsdp2" and shard * cp > 1
    trains = {c: trainable_at(policies[c], EVER) for c in COMPONENTS}
    backward_through = {"vision": trains["vision"], "projector": trains["vision"] or trains["projector"]}
    backward_through["llm"] = backward_through["projector"] or trains["llm"]
    backward_through["action_head"] = True

    def state_share(comp: str, s: StateBytes, stage: int) -> StateBytes:
        """One GPU's share of a component's state on pipeline stage `stage`."""
        frac = 1.0
        if pp > 1:
            first, last = stage == 0, stage == pp - 1
            if comp in ("vision", "projector"):
                frac = float(first)
            elif comp == "action_head":
                frac = float(last)
            else:
                n = pm.llm_numel
                a, b = bounds[stage]
                own = (b - a) * n["block"] + n["embed"] * first + n["tail"] * last
                frac = own / (n["embed"] + n["tail"] + layers * n["block"])
        s = _scaled(s, frac)
        if par.backend == "deepspeed":
            z = par.zero_stage
            return StateBytes(params=s.params // (dp if z == 3 else 1), grads=s.grads // (dp if z >= 2 else 1),
                              optimizer=s.optimizer // dp, numel=s.numel, tensors=s.tensors)
        return per_gpu(s, shard * cp if par.backend == "fsdp2" else 1, tp if comp == "llm" else 1)

    stages = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        a, b = bounds[stage]
        in_flight = 1 if pp == 1 else (accum if par.pp_schedule == "gpipe" else min(pp - stage, accum))
        comp_mem: dict[str, dict[str, float]] = {}
        cpu = nvme = 0.0
        for comp in COMPONENTS:
            st = state_share(comp, state.by_component[comp], stage)
            on = {"vision": first, "projector": first, "action_head": last, "llm": True}[comp]
            if comp == "llm":
                blocks = b - a
                act = blocks * parts["llm_block"] + parts["llm_once"] + parts["llm_tail"] * last
            else:
                act = parts[comp] if on else 0
            act *= in_flight
            pol = policies[comp]
            off = 0.0
            if pol.offload != "none" and act:
                per_block = parts["llm_block"] if comp == "llm" else act / max(1, _vision_layers(pm))
                n_blocks = (b - a) if comp == "llm" else _vision_layers(pm)
                moved_blocks = math.ceil(pol.offload_fraction * n_blocks)
                off = max(0.0, min(act, per_block * in_flight * moved_blocks) - 2 * per_block)
                act -= off
            casts = 0.0
            compute_dtype_bytes = ELEMENT[pol.precision]
            master_bytes = 4 if pol.precision == "fp32" else ELEMENT[master]
            if on and not fsdp and compute_dtype_bytes < master_bytes and backward_through[comp]:
                blocks = (b - a) if comp == "llm" else _vision_layers(pm) if comp == "vision" else 0
                casts = compute_dtype_bytes * pm.cast_numel(comp, pol.checkpointing, blocks, tp) * in_flight
            params, grads, opt = float(st.params), float(st.grads), float(st.optimizer)
            host = {"cpu": off if pol.offload == "cpu" else 0.0, "nvme": off if pol.offload == "nvme" else 0.0}
            if par.backend == "deepspeed" and par.offload_optimizer != "none":
                host[par.offload_optimizer] += opt
                opt = 0.0
            if par.backend == "deepspeed" and par.offload_param != "none":
                host[par.offload_param] += params
                params = 0.0
            cpu, nvme = cpu + host["cpu"], nvme + host["nvme"]
            comp_mem[comp] = {"params": params, "grads": grads, "optimizer": opt, "activations": act + casts,
                              "weight_casts": casts, "offloaded": off, **host}
        other_act = parts["other"] * in_flight if last else 0
        buffers = _buffers(pm, cfg, policies, fsdp, tp, micro, tokens, cp, pp)
        totals = {k: sum(m[k] for m in comp_mem.values()) for k in ("params", "grads", "optimizer", "activations")}
        totals["activations"] += other_act
        totals["buffers"] = buffers
        totals["total"] = sum(totals.values())
        totals["cpu"], totals["nvme"] = cpu, nvme
        stages.append((totals, comp_mem))
    stage = max(range(pp), key=lambda i: stages[i][0]["total"])
    totals, comp_mem = stages[stage]
    budget = (cluster.gpu.memory_gb - assume.reserved_gb) * GB * (1 - assume.margin)
    per_node = cluster.gpus_per_node
    cpu_node = sum(s[0]["cpu"] for s in stages) / pp * per_node
    nvme_node = sum(s[0]["nvme"] for s in stages) / pp * per_node
    reasons = []
    fits = totals["total"] <= budget
    if not fits:
        reasons.append(f"needs {totals['total'] / GB:.1f} GB per GPU, over the {budget / GB:.1f} GB usable of "
                       f"{cluster.gpu.memory_gb:g} GB")
    if cpu_node > cluster.cpu_mem_gb * GB * 0.8:
        fits = False
        reasons.append(f"offloads {cpu_node / GB:.0f} GB per node, over 80% of --cpu-mem-gb {cluster.cpu_mem_gb:g}")
    if nvme_node > cluster.nvme_gb * GB:
        fits = False
        reasons.append(f"offloads {nvme_node / GB:.0f} GB per node to NVMe, over --nvme-gb {cluster.nvme_gb:g}")

    times, flops = _step_time(pm, cfg, cluster, assume, seq, policies, parts, bounds, state, fsdp, shard, stages)
    step = sum(times.values())
    samples = micro * accum * dp
    tokens_per_s = samples * tokens / step
    mfu = flops.model_flops / micro * samples / (step * world * cluster.gpu.bf16_tflops * 1e12)
    by_component = {}
    for comp in COMPONENTS:
        m = comp_mem[comp]
        row = {k: m[k] / GB for k in ("params", "grads", "optimizer", "activations")}
        row["buffers"] = 0.0  # the buffers belong to the communication, not to a component
        row["total"] = sum(row.values())
        row["cpu"], row["nvme"] = m["cpu"] / GB, m["nvme"] / GB
        by_component[comp] = row
    memory = {k: v / GB for k, v in totals.items()}
    memory["cpu"], memory["nvme"] = cpu_node / per_node / GB, nvme_node / per_node / GB
    if fits:
        reasons.append(f"fits: {memory['total']:.1f} of {budget / GB:.1f} GB usable per GPU")
    slowest = max((k for k in times if k != "compute"), key=lambda k: times[k], default=None)
    if slowest and times[slowest] > 0.05 * step:
        reasons.append(f"{slowest.replace('_', ' ')} is {100 * times[slowest] / step:.0f}% of the step")
    return Estimate(cfg, memory, by_component, fits, step, tokens_per_s, mfu, times, reasons, stage,
                    sum(flops.recompute.values()) / flops.model_flops)


def _cp_method(pm: PlanModel, par, tokens: int) -> str:
    """The context-parallel method the trainer will run (`auto` resolved as `apply_sequence_parallel` does)."""
    if par.cp == 1 or par.cp_method != "auto":
        return par.cp_method
    from vlaforge.distributed.sequence_parallel import choose_cp_method

    return choose_cp_method("auto", tokens, par.cp, pm.model.llm.config.num_attention_heads // par.tp)[0]


def _vision_layers(pm: PlanModel) -> int:
    return pm.model.vision.config.num_hidden_layers


def _scaled(s: StateBytes, frac: float) -> StateBytes:
    if frac == 1.0:
        return s
    return StateBytes(*(int(getattr(s, f) * frac) for f in ("params", "grads", "optimizer", "tp_sharded_params")),
                      numel=int(s.numel * frac), tensors=s.tensors)


def _buffers(pm: PlanModel, cfg, policies, fsdp: bool, tp: int, micro: int, tokens: int, cp: int, pp: int) -> float:
    llm_c = ELEMENT[policies["llm"].precision]
    out = 0.0
    if fsdp:
        n = pm.llm_numel
        root = sum(n for c, n in pm.root_numel.items())
        block = max(n["block"] / tp, pm.vision_block_numel)
        out += (root + 2 * block) * (llm_c + 4)
    elif cfg.parallel.backend == "ddp":
        out += 2 * DDP_BUCKET
    if pp > 1:
        out += 2 * micro * -(-tokens // cp) * pm.model.llm.config.hidden_size * 4
    return out


def _step_time(pm, cfg, cluster, assume, seq, policies, parts, bounds, state, fsdp, shard, stages):
    par, tr = cfg.parallel, cfg.train
    tp, pp, cp, rep = par.tp, par.pp, par.cp, par.dp_replicate
    micro, accum = tr.batch_size, tr.grad_accum
    gpu = cluster.gpu
    f = step_flops(pm.model, seq, policies, pm.contrastive)
    layers = pm.model.llm.config.num_hidden_layers

    def rate(comp: str) -> float:
        return gpu.tflops(policies[comp].precision) * 1e12

    def mm_time(flops: float, comp: str) -> float:
        fp8 = policies[comp].precision == "fp8" and gpu.fp8_tflops
        return flops / (rate(comp) * (assume.fp8_efficiency if fp8 else assume.matmul_efficiency))

    def matmul(comp: str) -> float:
        return f.forward[comp] + f.backward[comp] + f.recompute[comp]

    # memory-bound kernels work on every activation the forward makes (what `none` keeps), again for what
    # recomputation rebuilds (a third of the passes: forward only)
    plain = {c: p.model_copy(update={"checkpointing": "none"}) for c, p in policies.items()}
    work = activation_parts(pm.model, seq, plain, pm.contrastive, tp=tp, cp=cp)

    stage_compute = []
    for stage, (a, b) in enumerate(bounds):
        first, last = stage == 0, stage == pp - 1
        t = 0.0
        made = kept = 0.0
        if first:
            for comp in ("vision", "projector"):
                t += mm_time(matmul(comp), comp)
                made, kept = made + work[comp], kept + parts[comp]
            t += f.attention["vision"] / (rate("vision") * assume.attention_efficiency)
        share = (b - a) / layers
        t += mm_time(matmul("llm") * share / (tp * cp), "llm")
        t += f.attention["llm"] * share / (tp * cp) / (rate("llm") * assume.attention_efficiency)
        made, kept = made + (b - a) * work["llm_block"], kept + (b - a) * parts["llm_block"]
        if last:
            t += mm_time(matmul("action_head") + f.forward["other"] + f.backward["other"], "action_head")
            made += work["llm_tail"] + work["action_head"] + work["other"]
            kept += parts["llm_tail"] + parts["action_head"] + parts["other"]
        passes = assume.elementwise_passes
        t += (made * passes + max(0.0, made - kept) * passes / 3) / (gpu.hbm_gbps * GB)
        stage_compute.append(t)
    t_micro = max(stage_compute)
    times = {"compute": accum * t_micro}
    if pp > 1:
        times["pipeline_bubble"] = (pp - 1) * t_micro
        hop = micro * -(-seq.llm_tokens // cp) * pm.model.llm.config.hidden_size * ELEMENT[policies["llm"].precision]
        span = tp * cp * shard * rep * 2  # neighbouring stages are a dp x tp x cp block apart
        times["pipeline_p2p"] = 2 * accum * hop / _link(cluster, span, assume)
    exposed_base = times["compute"]

    # data parallel: gathered parameters and reduced gradients, overlapped with compute
    total_state = state.total
    per_stage_params = total_state.params / pp / tp  # compute-dtype bytes gathered per micro-batch below
    comm = 0.0
    group = shard * cp
    span_shard = group * tp
    if par.backend == "fsdp2" and group > 1:
        compute_bytes = per_stage_params / 4 * ELEMENT[policies["llm"].precision] if total_state.params else 0.0
        bw = _link(cluster, span_shard, assume)
        comm += accum * _ring(compute_bytes, group, bw, passes=2)  # forward and backward all-gathers
        comm += _ring(total_state.grads / pp / tp, group, bw)  # reduce-scatter (fp32)
    if rep > 1 or par.backend == "ddp":
        n = rep if par.backend == "fsdp2" else shard * rep
        grads = total_state.grads / pp / tp / (group if par.backend == "fsdp2" else 1)
        comm += _ring(grads, n, _link(cluster, cluster.gpus + 1 if rep > 1 else span_shard, assume), passes=2)
    if par.backend == "deepspeed":
        dp = shard * rep
        bw = _link(cluster, dp, assume)
        comm += _ring(total_state.grads, dp, bw) + _ring(total_state.params, dp, bw)
        if par.zero_stage == 3:
            comm += accum * _ring(total_state.params / 2, dp, bw, passes=2)
    times["dp_comm_exposed"] = max(0.0, comm - exposed_base)

    # tensor parallel: all-reduces of the block activations, on the critical path
    llm_c = ELEMENT[policies["llm"].precision]
    act_bytes = micro * -(-seq.llm_tokens // cp) * pm.model.llm.config.hidden_size * llm_c
    stage_layers = max(b - a for a, b in bounds)
    if tp > 1:
        per_block = 6 if policies["llm"].checkpointing == "full" else 4
        times["tp_comm"] = accum * stage_layers * per_block * _ring(act_bytes, tp, _link(cluster, tp, assume), 2)
    if cp > 1:
        llm = pm.model.llm.config
        hd = llm.hidden_size // llm.num_attention_heads
        kv = 2 * micro * -(-seq.llm_tokens // cp) * (llm.num_key_value_heads // tp or 1) * hd * llm_c
        bw = _link(cluster, cp * tp, assume)
        method = _cp_method(pm, par, seq.llm_tokens)
        if method == "ring":
            ring = accum * stage_layers * 3 * (cp - 1) * kv / bw  # forward K/V, backward K/V and dK/dV
            attn = f.attention["llm"] / layers * stage_layers / (tp * cp) / (gpu.tflops(
                policies["llm"].precision) * 1e12 * assume.attention_efficiency) * accum
            times["cp_comm_exposed"] = max(0.0, ring - attn)
        elif method == "ulysses":
            times["cp_comm"] = accum * stage_layers * 8 * act_bytes / tp * (cp - 1) / cp / bw
        else:
            times["cp_comm"] = accum * stage_layers * 2 * _ring(kv * cp, cp, bw)

    # activation offload: copies out in forward and back in backward, overlapped with the component's compute
    moved = stages[0][0]["cpu"] + stages[0][0]["nvme"]
    act_off = sum(m["offloaded"] for m in stages[0][1].values())
    if act_off:
        link = cluster.gpu.pcie_gbps * GB
        if any(policies[c].offload == "nvme" for c in COMPONENTS):
            link = min(link, cluster.nvme_gbps * GB / cluster.gpus_per_node)
        times["offload_exposed"] = max(0.0, accum * 2 * act_off / link - times["compute"])
    opt_gpu = stages[0][0]["optimizer"] + stages[0][0]["params"] + stages[0][0]["grads"]
    times["optimizer"] = 2 * opt_gpu / (gpu.hbm_gbps * GB)
    if moved - act_off > 0:  # DeepSpeed's offloaded optimizer / parameters: gradients out, parameters back
        times["optimizer"] += 2 * (moved - act_off) / (cluster.gpu.pcie_gbps * GB)
        if par.offload_optimizer != "none":  # CPU Adam on the node's cores, shared by its GPUs
            times["optimizer"] += stages[0][0]["cpu"] * cluster.gpus_per_node / (assume.cpu_adam_gbps * GB)
        if par.offload_param != "none":  # ZeRO-3 fetches the parameters for every forward and backward
            times["offload_params"] = 2 * accum * stages[0][1]["llm"]["cpu"] / (cluster.gpu.pcie_gbps * GB)
    return times, f
