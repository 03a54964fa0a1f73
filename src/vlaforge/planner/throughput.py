"""FLOPs of one training step, per component, from the architecture: the matmuls (linear layers, the patch
convolution, the LM head, the contrastive logits) forward, backward and recomputed by checkpointing, plus the
attention cores (QKᵀ and AV), which `torch.utils.flop_counter` does not count for CPU SDPA kernels and which are
kept apart. `tests/test_planner.py` checks the matmul counts against `FlopCounterMode` on the real modules.

Conventions: a matmul of (m, k) x (k, n) is 2mkn FLOPs; backward is 2x forward (input and weight gradients), minus
the gradients nobody needs (the pixels' and the robot state's input gradients, a frozen component's weight
gradients, and input gradients below the first component that trains). Checkpointing recomputes in backward:
`full` the whole block's forward, `selective` the FFN matmuls its policy does not keep, `selective_attn` /
`selective_ffn` that sub-layer's matmuls - each without the region's last matmul, whose output backward does not
need (torch stops recomputing once the tensors backward needs are back). MFU counts forward + backward, not
recomputation (PaLM's convention): recomputation costs time but is not useful work.

`step_time` turns the FLOPs into one step's seconds on a cluster (the overlap assumptions are the ones the
runtime makes):
- compute: matmul FLOPs (`throughput.step_flops`, forward + backward + recomputation) at the GPU's dense peak for
  the component's precision times `matmul_efficiency`; an fp8 LLM's block linears per GEMM shape
  (`launches.fp8_linear_seconds`: the fp8 GEMMs at `fp8_efficiency` plus their casts; the LM head, the attention
  cores and every other component in bf16; fp8 on a GPU without fp8 units is refused, not costed);
  attention cores at `attention_efficiency`; plus memory-bound kernels: every activation the forward makes
  (what `none` keeps; with `train.compile`, what the compiled blocks keep: their fused kernels do not move the
  rest) moved `elementwise_passes` times through HBM, and a third of that again for what recomputation rebuilds;
  an NF4 LoRA base's dequantization (its codes read, a dense copy written, forward and backward) at HBM speed;
  the LLM's work divided by tp x cp and over the stages, the vision tower and heads replicated; plus
  `micro_overhead_s` per micro-batch (launches and Python; 0 unless calibrated);
- the launch floor (`launches.py`): a micro-batch takes at least the host's time to launch its kernels (the
  catalog's `launch_us` each); where that is longer than the device's time, the difference is `launch_exposed`
  (off in a calibration, whose fitted `micro_overhead_s` stands for it);
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vlaforge import COMPONENTS
from vlaforge.models.families import llm_dims
from vlaforge.planner.activations import (
    Sequence,
    activation_parts,
    compute_bytes,
    qwen_window_grid,
    vision_shape,
)
from vlaforge.planner.hardware import GB
from vlaforge.planner.launches import fp8_block_seconds
from vlaforge.planner.matmuls import model_matmuls, outside_matmuls
from vlaforge.techniques.freezing import ever_trains

if TYPE_CHECKING:
    from vlaforge.planner.types import Assumptions, Case, Cluster, PlanModel



@dataclass
class StepFlops:
    forward: dict[str, float] = field(default_factory=dict)  # matmul FLOPs per component
    backward: dict[str, float] = field(default_factory=dict)
    recompute: dict[str, float] = field(default_factory=dict)
    attention: dict[str, float] = field(default_factory=dict)  # QKᵀ + AV, forward + backward (+ recompute)
    recompute_attention: dict[str, float] = field(default_factory=dict)  # the part of `attention` recomputed

    @property
    def model_flops(self) -> float:
        """Useful work of the step (forward + backward, attention included): MFU's numerator."""
        attn = sum(self.attention.values()) - sum(self.recompute_attention.values())
        return sum(self.forward.values()) + sum(self.backward.values()) + attn

    @property
    def hardware_flops(self) -> float:
        """Everything executed, recomputation included."""
        return (sum(self.forward.values()) + sum(self.backward.values()) + sum(self.recompute.values())
                + sum(self.attention.values()))


def _recomputed(strategy: str, attn_mm: float, ffn_mm: float, attn_out: float, ffn_out: float
                ) -> tuple[float, bool]:
    """(matmul FLOPs recomputed, whether the attention core is recomputed) for one block's strategy. Torch's
    non-reentrant checkpoint stops recomputing once the last tensor backward needs is back, so a region's final
    matmul (o_proj / out_proj for the attention sub-layer, down / fc2 for the FFN and the block) is not redone."""
    return {"none": (0.0, False), "full": (attn_mm + ffn_mm - ffn_out, True), "selective": (ffn_mm - ffn_out, False),
            "selective_attn": (attn_mm - attn_out, True), "selective_ffn": (ffn_mm - ffn_out, False)}[strategy]


def _attention_pairs(vis, seq: Sequence, block: int, qwen: bool) -> int:
    """(query, key) pairs a vision block attends per image: all of its patches', or, in Qwen2.5-VL's windowed
    blocks (all but `fullatt_block_indexes`), each window's (`qwen_window_grid`), smaller at the grid's far edges
    (transformers' `get_vision_window_index`)."""
    if not qwen or block in vis.fullatt_block_indexes:
        return seq.tower_patches ** 2
    m = vis.spatial_merge_size
    units, w = qwen_window_grid(vis, seq)
    sides = [w] * (units // w) + ([units % w] if units % w else [])
    return sum((a * b * m * m) ** 2 for a in sides for b in sides)


def step_flops(model, seq: Sequence, policies, contrastive: bool = True) -> StepFlops:
    """FLOPs of one micro-batch's forward and backward (times `grad_accum` for a step)."""
    llm = llm_dims(model.llm.config)  # the family's own fields (GPT-NeoX states no kv-heads: multi-head)
    b, s = seq.batch, seq.llm_tokens
    t, tp = b * s, b * seq.frames * seq.patches  # the LLM's tokens, the projected image tokens
    from vlaforge.planner.lora import adapters_of

    trains = {c: ever_trains(policies[c]) for c in COMPONENTS}
    lora = adapters_of(model, policies)
    out = StepFlops()

    v_hidden = _vision_flops(out, model, seq, policies, trains, lora)
    _projector_flops(out, model, v_hidden * seq.merge * seq.merge, tp, llm.hidden, trains,
                     policies["projector"].checkpointing)

    # llm: blocks (q, k, v, o; gate, up, down), LM head over the text positions (+1), causal attention core
    # each block's own weights (Llama's q, k, v, o; gate, up, down; a MoE block's routed experts' share)
    D, hd = llm.hidden, llm.heads * llm.head_dim
    lb = model_matmuls(model, "llm")[0]
    l_out, l_attn_mm, l_down, l_ffn_mm = (2.0 * t * sum(b[k] for b in lb) / len(lb)
                                          for k in ("attn_out", "attn", "ffn_out", "ffn"))
    l_blocks = llm.layers * (l_attn_mm + l_ffn_mm)
    head = 2.0 * b * (seq.text + 1) * D * llm.vocab
    l_core = llm.layers * 4.0 * b * s * s * hd
    upstream = trains["vision"] or trains["projector"]
    out.forward["llm"] = l_blocks + head
    out.backward["llm"] = (l_blocks + head) * (trains["llm"] + (trains["llm"] or upstream))
    needs_backward = trains["llm"] or upstream
    rec, core_again = _recomputed(policies["llm"].checkpointing, l_attn_mm, l_ffn_mm, l_out, l_down)
    out.recompute["llm"] = llm.layers * rec if needs_backward else 0.0
    if "llm" in lora:  # frozen block weights and head (its input gradient only); adapters train; the LLM's input
        # needs no gradient unless something below trains (its own token embeddings are frozen)
        _lora_flops(out, "llm", lora["llm"], llm.layers, t, policies["llm"].checkpointing,
                    (l_attn_mm, l_ffn_mm, l_out, l_down), extra=(head, head), input_free=not upstream)
    out.recompute_attention["llm"] = l_core if core_again and needs_backward else 0.0
    out.attention["llm"] = l_core + (2 * l_core if needs_backward else 0.0) + out.recompute_attention["llm"]

    _action_head_flops(out, model, seq, D, s, policies["action_head"].checkpointing, trains["action_head"])
    out.forward["other"] = 2.0 * b * b * D if contrastive else 0.0  # contrastive logits (B x B)
    out.backward["other"] = (1 if "llm" in lora else 2) * out.forward["other"]  # LoRA: frozen instruction side
    return out


def _vision_flops(out: StepFlops, model, seq: Sequence, policies, trains: dict, lora: dict) -> int:
    """The tower's FLOPs into `out`: patch convolution, blocks (q, k, v, o; fc1, fc2), attention core over each
    image's patches; returns its width (the projector's input per merged patch)."""
    vis = model.vision.config
    images = seq.batch * seq.frames
    tv = images * seq.tower_patches  # the tower's tokens
    vs = vision_shape(model.vision)
    patch = vis.patch_size
    qwen = vs.kind == "qwen_vit"  # a Conv3d over the repeated frame, a SwiGLU MLP, attention within windows
    if qwen:
        conv = 2.0 * tv * 3 * patch * patch * vs.hidden * vis.temporal_patch_size
        v_out = 2.0 * tv * vs.hidden * vs.hidden  # out_proj
        v_attn_mm = 4 * v_out
        v_fc2 = 2.0 * tv * vs.ffn * vs.hidden
        v_ffn_mm = 3 * v_fc2
        v_core = 4.0 * images * vs.hidden * sum(_attention_pairs(vis, seq, i, qwen)
                                                for i in range(vis.num_hidden_layers))
    else:  # any tower (a fused one's blocks of two widths): each block's own weights, patches^2 pairs per image
        blocks, outside = model_matmuls(model, "vision")
        conv = 2.0 * tv * outside
        v_out, v_attn_mm, v_fc2, v_ffn_mm = (2.0 * tv * sum(b[k] for b in blocks) / len(blocks)
                                             for k in ("attn_out", "attn", "ffn_out", "ffn"))
        v_core = 4.0 * images * seq.tower_patches ** 2 * sum(b["width"] for b in blocks)
    v_blocks = vis.num_hidden_layers * (v_attn_mm + v_ffn_mm)
    out.forward["vision"] = conv + v_blocks
    out.backward["vision"] = (conv + 2 * v_blocks) if trains["vision"] else 0.0
    rec, core_again = _recomputed(policies["vision"].checkpointing, v_attn_mm, v_ffn_mm, v_out, v_fc2)
    out.recompute["vision"] = vis.num_hidden_layers * rec if trains["vision"] else 0.0
    if "vision" in lora:  # a frozen patch embedding, frozen block weights; block 0's input needs no gradient
        _lora_flops(out, "vision", lora["vision"], vis.num_hidden_layers, tv, policies["vision"].checkpointing,
                    (v_attn_mm, v_ffn_mm, v_out, v_fc2), extra=(conv, 0.0), input_free=True)
    out.recompute_attention["vision"] = v_core if core_again and trains["vision"] else 0.0
    out.attention["vision"] = v_core + (2 * v_core if trains["vision"] else 0.0) + out.recompute_attention["vision"]
    return vs.hidden


def _action_head_flops(out: StepFlops, model, seq: Sequence, width: int, s: int, checkpointing: str,
                       trains: bool) -> None:
    """The action head's FLOPs into `out` (`width`: the LLM's hidden size, `s`: its tokens per sample)."""
    b = seq.batch
    ah = model.action_head
    if hasattr(ah, "in_proj"):  # vlaforge's regression head: in_proj and state_proj, then an MLP of two linears
        ha, chunk = ah.in_proj.out_features, seq.chunk
        body = 2.0 * b * chunk * (width * ha + ha * ha + ha * seq.action_dim)
        state = 2.0 * b * seq.state_dim * ha
    else:  # a policy's action expert over its action tokens: its blocks' and projections' weights, its attention
        # core over the prefix and itself (the state token and its projection counted as one more action token)
        expert, outside = model_matmuls(model, "action_head")
        per_token = sum(x["attn"] + x["ffn"] for x in expert) + outside
        body = 2.0 * b * (seq.chunk + 1) * per_token + 4.0 * b * (seq.chunk + 1) * s * sum(x["width"] for x in expert)
        state = 0.0
    out.forward["action_head"] = body + state
    out.backward["action_head"] = body * (trains + 1) + state * trains
    out.recompute["action_head"] = (body + state) if checkpointing == "full" else 0.0


def _projector_flops(out: StepFlops, model, width: int, tokens: int, hidden: int, trains: dict, strategy: str
                     ) -> None:
    """The projector's part of `step_flops`: two linears over the vision tokens, or one (after a pixel shuffle:
    merge^2 patches of `width` per token; a policy's connector: its linears' weights per token)."""
    if not hasattr(model.projector, "mlp"):
        fc1, fc2 = 0.0, 2.0 * tokens * outside_matmuls(model.projector, [])
    elif len(model.projector.mlp) == 3:
        hp = model.projector.mlp[0].out_features
        fc1, fc2 = 2.0 * tokens * width * hp, 2.0 * tokens * hp * hidden
    else:  # its one linear's input gradient reaches the vision tower, its weight gradient the projector
        fc1, fc2 = 0.0, 2.0 * tokens * width * hidden
    proj = fc1 + fc2
    out.forward["projector"] = proj
    # weight gradients when it trains; fc2's input gradient to reach fc1's weights or the vision tower; the first
    # linear's input gradient for what is below it: the vision tower, or a norm before it that trains (Qwen-VL's)
    below = trains["vision"] or (getattr(model.projector, "norm", None) is not None and trains["projector"])
    if fc1:
        out.backward["projector"] = (proj * trains["projector"] + fc2 * (trains["projector"] or trains["vision"])
                                     + fc1 * below)
    else:  # one linear: its weight gradient when it trains, its input gradient for what is below it
        out.backward["projector"] = proj * trains["projector"] + proj * below
    out.recompute["projector"] = proj if strategy == "full" and (trains["projector"] or trains["vision"]) else 0.0


def _lora_flops(out: StepFlops, comp: str, a, layers: int, tokens: float, strategy: str, block: tuple,
                extra: tuple[float, float], input_free: bool) -> None:
    """A LoRA component's matmul FLOPs (planner/lora.py): `layers` blocks of the (attention, FFN, attention output,
    FFN output) base matmuls `block`, plus `extra` (forward, backward) outside them; `input_free`: the first block's
    input needs no gradient."""
    from vlaforge.planner.lora import block_flops, first_block_input_free

    attn_mm, ffn_mm, attn_out, ffn_out = block
    f, bwd, rec = block_flops(a, tokens, strategy, attn_mm, ffn_mm, attn_out, ffn_out)
    out.forward[comp] = layers * f + extra[0]
    out.backward[comp] = layers * bwd + extra[1] - (first_block_input_free(a, tokens, attn_mm - attn_out)
                                                    if input_free else 0.0)
    out.recompute[comp] = layers * rec


def mfu(flops: StepFlops, steps_per_s: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: useful FLOPs per second over the GPUs' dense peak."""
    return flops.model_flops * steps_per_s / (gpus * peak_tflops * 1e12)


# ---- step time on a cluster ------------------------------------------------------------------------------------

def step_time(pm: "PlanModel", case: "Case", cluster: "Cluster", assume: "Assumptions", stages: list
              ) -> tuple[dict[str, float], StepFlops]:
    """(seconds per part of one optimizer step, the micro-batch's FLOPs). `stages`: each pipeline stage's
    (totals, per-component) bytes from `estimate`."""
    f = step_flops(pm.model, case.seq, case.policies, pm.contrastive)
    device = _stage_compute(pm, case, cluster, assume, f)
    t_micro = max(device) + assume.micro_overhead_s
    times = {"compute": case.accum * t_micro}
    slow = max(device)
    if assume.launch_floor and cluster.gpu.launch_us:  # the host launching the kernels sets the pace when slower
        from vlaforge.planner.launches import host_seconds

        # per stage: the host's launches against the device's kernels, whichever is slower (a stage's queue)
        slow = max(max(host_seconds(pm, case, cluster.gpu, i), d) for i, d in enumerate(device))
        times["launch_exposed"] = case.accum * (slow - max(device))
    if case.pp > 1:
        times["pipeline_bubble"] = (case.pp - 1) * (slow + assume.micro_overhead_s)
        span = case.tp * case.cp * case.shard * case.rep * 2  # neighbouring stages are a dp x tp x cp block apart
        times["pipeline_p2p"] = 2 * case.accum * _block_activation_bytes(pm, case) / _link(cluster, span, assume)
    busy = times["compute"] + times.get("launch_exposed", 0.0)  # what overlapped transfers hide behind
    times["dp_comm_exposed"] = max(0.0, _data_parallel_comm(case, cluster, assume) - busy)
    times.update(_model_parallel_comm(pm, case, cluster, assume, f))
    times.update(_host_traffic(case, cluster, assume, stages, busy))
    return times, f


def _link(cluster: "Cluster", span: int, assume: "Assumptions") -> float:
    """Bytes/s a collective over `span` consecutive ranks reaches: NVLink / PCIe within a node, else the network."""
    gbps = cluster.gpu.intra_node_gbps if span <= cluster.gpus_per_node else cluster.gpu.inter_node_gbps
    return gbps * GB * assume.comm_efficiency


def _ring(nbytes: float, n: int, bw: float, passes: float = 1.0) -> float:
    """Time of a ring all-gather / reduce-scatter of `nbytes` (the whole tensor) over n ranks (all-reduce: 2)."""
    return 0.0 if n <= 1 else passes * nbytes * (n - 1) / n / bw


def _block_activation_bytes(pm: "PlanModel", case: "Case") -> float:
    """A cp rank's hidden states of one micro-batch in the LLM's compute dtype (what TP reduces, PP sends)."""
    return (case.micro * -(-case.seq.llm_tokens // case.cp) * pm.llm_dims.hidden
            * compute_bytes(case.policies["llm"].precision))


def _stage_compute(pm: "PlanModel", case: "Case", cluster: "Cluster", assume: "Assumptions", f: StepFlops
                   ) -> list[float]:
    """Seconds of one micro-batch's compute on each pipeline stage: matmuls, attention cores and memory-bound
    kernels."""
    gpu, policies, parts, tp, cp = cluster.gpu, case.policies, case.parts, case.tp, case.cp

    def rate(comp: str) -> float:  # attention cores and the rest of an fp8 component run in bf16
        return gpu.tflops(_core_precision(policies[comp].precision)) * 1e12

    def mm_time(flops: float, comp: str) -> float:
        if policies[comp].precision != "fp8":
            return flops / (rate(comp) * assume.matmul_efficiency)
        # fp8 linears per GEMM shape (launches.fp8_linear_seconds), the LLM blocks' share of the FLOPs; the LM head
        # (never converted) and every other component's matmuls in bf16
        bf16 = flops / (gpu.bf16_tflops * 1e12 * assume.matmul_efficiency)
        if comp != "llm":
            return bf16
        fp8_s, bf16_s = fp8_block_seconds(pm, case, gpu, assume, case.micro * -(-case.seq.llm_tokens // cp))
        return bf16 * (1 - fp8_share) + bf16 * fp8_share * fp8_s / bf16_s

    def matmul(comp: str) -> float:
        return f.forward[comp] + f.backward[comp] + f.recompute[comp]

    # memory-bound kernels work on every activation the forward makes (what `none` keeps), again for what
    # recomputation rebuilds (a third of the passes: forward only)
    plain = {c: p.model_copy(update={"checkpointing": "none"}) for c, p in policies.items()}
    # a compiled block's fused kernels move what its partitioner saves, not every eager intermediate
    work = activation_parts(pm.model, case.seq, plain, pm.contrastive, tp=tp, cp=cp,
                            master=case.cfg.train.precision_master, compiled=case.cfg.train.compile,
                            measured=pm.measured)
    fp8_share = _block_linear_share(pm, case.seq, f) if policies["llm"].precision == "fp8" else 0.0
    out = []
    for stage, (a, b) in enumerate(case.bounds):
        first, last = stage == 0, stage == case.pp - 1
        t = 0.0
        made = kept = 0.0
        if first:
            for comp in ("vision", "projector"):
                t += mm_time(matmul(comp), comp)
                made, kept = made + work[comp], kept + parts[comp]
            t += f.attention["vision"] / (rate("vision") * assume.attention_efficiency)
        share = (b - a) / case.layers
        t += mm_time(matmul("llm") * share / (tp * cp), "llm")
        t += f.attention["llm"] * share / (tp * cp) / (rate("llm") * assume.attention_efficiency)
        made, kept = made + (b - a) * work["llm_block"], kept + (b - a) * parts["llm_block"]
        if last:
            t += mm_time(matmul("action_head") + f.forward["other"] + f.backward["other"], "action_head")
            made += work["llm_tail"] + work["action_head"] + work["other"]
            kept += parts["llm_tail"] + parts["action_head"] + parts["other"]
        passes = assume.elementwise_passes
        t += (made * passes + max(0.0, made - kept) * passes / 3) / (gpu.hbm_gbps * GB)
        # an NF4 base is dequantized for each use, forward and backward: its 4-bit codes read, a dense copy written
        for comp, on in (("vision", first), ("llm", True)):
            a_ = case.lora.get(comp)
            if a_ is not None and a_.base == "nf4" and on:
                n = sum(i * o for i, o, _ in a_.linears) * (share if comp == "llm" else 1.0)
                t += 2 * n * (0.5 + compute_bytes(policies[comp].precision)) / (gpu.hbm_gbps * GB)
        out.append(t)
    return out


def _core_precision(precision: str) -> str:
    """The dtype of a component's attention cores: fp8 converts linears only, the cores stay in bf16."""
    return "bf16" if precision == "fp8" else precision


def _block_linear_share(pm: "PlanModel", seq: Sequence, f: StepFlops) -> float:
    """The share of the LLM's forward matmul FLOPs in its blocks' linears (the rest: the LM head): what fp8
    converts."""
    ls = pm.llm_dims
    q, kv = ls.heads * ls.head_dim, ls.kv_heads * ls.head_dim
    block = 2.0 * seq.batch * seq.llm_tokens * (2 * ls.hidden * q + 2 * ls.hidden * kv + 3 * ls.hidden * ls.ffn)
    return min(1.0, ls.layers * block / f.forward["llm"]) if f.forward["llm"] else 0.0


def _data_parallel_comm(case: "Case", cluster: "Cluster", assume: "Assumptions") -> float:
    """Seconds of gathered parameters and reduced gradients per step (overlapped with compute by the caller)."""
    par, pp, tp, rep, shard = case.par, case.pp, case.tp, case.rep, case.shard
    total_state = case.state.total
    comm = 0.0
    group = shard * case.cp
    span_shard = group * tp
    if par.backend == "fsdp2" and group > 1:
        per_stage_params = total_state.params / pp / tp  # fp32 bytes, gathered in the compute dtype below
        gathered = (per_stage_params / 4 * compute_bytes(case.policies["llm"].precision) if total_state.params
                    else 0.0)
        bw = _link(cluster, span_shard, assume)
        comm += case.accum * _ring(gathered, group, bw, passes=2)  # forward and backward all-gathers
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
            comm += case.accum * _ring(total_state.params / 2, dp, bw, passes=2)
    return comm


def _model_parallel_comm(pm: "PlanModel", case: "Case", cluster: "Cluster", assume: "Assumptions", f: StepFlops
                         ) -> dict[str, float]:
    """Seconds per step of TP's all-reduces (critical path) and context parallel's traffic (the ring's overlapped
    with the attention cores, only the excess counts)."""
    tp, cp, accum, policies = case.tp, case.cp, case.accum, case.policies
    times = {}
    act_bytes = _block_activation_bytes(pm, case)
    stage_layers = max(b - a for a, b in case.bounds)
    if tp > 1:
        per_block = 6 if policies["llm"].checkpointing == "full" else 4
        times["tp_comm"] = accum * stage_layers * per_block * _ring(act_bytes, tp, _link(cluster, tp, assume), 2)
    if cp > 1:
        llm = pm.llm_dims
        kv = (2 * case.micro * -(-case.seq.llm_tokens // cp) * max(1, llm.kv_heads // tp) * llm.head_dim
              * compute_bytes(policies["llm"].precision))
        bw = _link(cluster, cp * tp, assume)
        if case.method == "ring":
            ring = accum * stage_layers * 3 * (cp - 1) * kv / bw  # forward K/V, backward K/V and dK/dV
            attn = f.attention["llm"] / case.layers * stage_layers / (tp * cp) / (cluster.gpu.tflops(_core_precision(
                policies["llm"].precision)) * 1e12 * assume.attention_efficiency) * accum
            times["cp_comm_exposed"] = max(0.0, ring - attn)
        elif case.method == "ulysses":
            times["cp_comm"] = accum * stage_layers * 8 * act_bytes / tp * (cp - 1) / cp / bw
        else:
            times["cp_comm"] = accum * stage_layers * 2 * _ring(kv * cp, cp, bw)
    return times


def _host_traffic(case: "Case", cluster: "Cluster", assume: "Assumptions", stages: list, compute: float
                  ) -> dict[str, float]:
    """Seconds per step of activation offload (overlapped with compute), the optimizer (vlaforge's host AdamW
    included), and DeepSpeed's offloaded optimizer state and parameters."""
    par, accum = case.par, case.accum
    totals, comp_mem = stages[0]
    pcie = cluster.gpu.pcie_gbps * GB
    times = {}
    moved = totals.cpu + totals.nvme
    act_off = sum(m.offloaded for m in comp_mem.values())
    if act_off:
        link = pcie
        if any(case.policies[c].offload == "nvme" for c in COMPONENTS):
            link = min(link, cluster.nvme_gbps * GB / cluster.gpus_per_node)
        times["offload_exposed"] = max(0.0, accum * 2 * act_off / link - compute)
    opt_gpu = totals.optimizer + totals.params + totals.grads
    times["optimizer"] = 2 * opt_gpu / (cluster.gpu.hbm_gbps * GB)
    hosted = sum(m.host_optimizer for m in comp_mem.values())
    if hosted:  # vlaforge's host AdamW: each gradient out and its weights back over PCIe, the node's CPU Adam
        trips = sum(2 * m.params for m in comp_mem.values() if m.host_optimizer)
        times["optimizer"] += trips / pcie + hosted * cluster.gpus_per_node / (assume.cpu_adam_gbps * GB)
    if moved - act_off - hosted > 0:  # DeepSpeed's offloaded optimizer / parameters: gradients out, parameters back
        times["optimizer"] += 2 * (moved - act_off - hosted) / pcie
        if par.offload_optimizer != "none":  # CPU Adam on the node's cores, shared by its GPUs
            times["optimizer"] += totals.cpu * cluster.gpus_per_node / (assume.cpu_adam_gbps * GB)
        if par.offload_param != "none":  # ZeRO-3 fetches the parameters for every forward and backward
            times["offload_params"] = 2 * accum * comp_mem["llm"].cpu / pcie
    return times
