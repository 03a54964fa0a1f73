"""Analytic activation bytes of one transformer block, per checkpointing strategy and compute precision, derived
from the architecture (hidden, FFN width, heads, kv-heads, head dim) and the token count.

The byte counts follow what autograd keeps under vlaforge's design (fp32 master weights, autocast compute, an fp32
residual stream), term by term, and `tests/test_planner.py` checks them against the fake-tensor accounting of
`techniques.accounting.count_saved` on the real modules. Notation: T tokens in the micro-batch (B x S), D hidden,
F FFN width, H heads, Hk kv-heads, d head dim, c bytes of the compute dtype (4 fp32, 2 bf16 / fp16; fp8 linears
keep bf16 activations here), residual and norm statistics in fp32.

Llama block (`llm`), per token unless noted:
- RMSNorm: its fp32 input 4D, rsqrt 4, normalized input 4D (for the weight's gradient) - twice per block;
- attention: the projections' inputs (one shared fp32 tensor 4D in fp32; a cast per q/k/v, 3cD, under autocast),
  q, k, v (k and v expanded to H heads, as transformers hands them to SDPA with a padding mask), the SDPA output
  (4cHd in all), its log-sum-exp 4H, and the padding mask in the compute dtype (c x S per token: B x S x S);
- FFN: the gate/up inputs (4D shared, or 2cD of casts), gate and up outputs, SiLU output and down input (4cF);
- once per model (the first block that keeps them): rotary cos and sin (2 x 4 x d per token).
`full` keeps the block input (4D); `selective` (the SAC policy) keeps the input, the q/k/v/o projection outputs and
the SDPA output and log-sum-exp; `selective_attn` / `selective_ffn` checkpoint one sub-layer, which keeps its
(fp32) input; checkpointed regions also keep their keyword inputs alive (the boolean mask, position ids and
cos/sin: once per model).

SigLIP block (`vision`): LayerNorm keeps its input 4D and mean and rstd 8; no mask, no rotary; the projections
are biased; the MLP keeps fc1's input (4D shared, or cD cast), fc1's output and GELU's output (2cF).

Qwen2.5-VL block (`qwen_vit`, the tower transformers runs window by window): RMSNorm (fp32 input 4D, rsqrt 4,
normed output cD) twice; attention: the fused qkv projection's input (4D, or one cD cast), its output 3cD (its v
slice is what SDPA keeps), q and k after the rotary step (as SDPA gets them: cD each), the windows' SDPA outputs cD and
log-sum-exps 4H, the output projection's input (their concatenation) cD; the SwiGLU MLP as Llama's. Once per model:
the rotary cos / sin (2 x 4d per token; not kept by checkpointed blocks under bf16 autocast, as measured), the window
permutation's two indices (8 per merge unit each).

Unpadded (`Sequence.padded` False: the batch is known to hold no padding, `Batch.full`): the VLA hands the LLM no
mask and no position ids (`VLA.llm_mask`), so transformers builds no mask (`masking_utils.sdpa_mask` returns None and
SDPA runs `is_causal`), and with no mask `sdpa_attention.use_gqa_in_sdpa` sends K and V at their own heads with
`enable_gqa` instead of `repeat_kv` (transformers 5.17 and 5.25 alike; on CUDA the flash kernel takes GQA natively):
no B x S x S mask, K/V at Hk heads, and one row of position ids and rotary tables for the whole batch. A padded batch
keeps the mask, and repeated K/V, in every block (the LLM's SDPA never drops a given mask: `models/llm.py`).

Compiled (`train.compile`: one `torch.compile` graph per block): AOTAutograd's min-cut partitioner saves fewer tensors
and recomputes the cheap ones in backward. What it saves, counted with `saved_tensors_hooks` around a compiled block
on CPU (torch 2.13, inductor; the compiled autograd.Function's `save_for_backward` goes through the hooks), bytes per
token, weight casts apart (they are saved as in eager):
- Llama (small's shapes, bf16 autocast, unpadded): the fp32 block input 4D, the two rsqrt 8, three D-wide tensors in
  the compute dtype 3cD (the normed input of q/k/v, o_proj's output, the normed MLP input), q and the SDPA output
  2cHd, K and V 2cHk·d, the log-sum-exp 4H, gate's, up's and down's inputs 3cF: 42,304 B/token against eager's
  66,368 (norms' fp32 products, the three casts, the fp32 mid-block residual and SiLU's output are recomputed); the
  same formula at fp32 (c = 4: 80,960 against 107,584); padded, compiled adds the mask and repeated K/V as eager does;
- SigLIP (small's tower, 768 / 3072 / 12 heads): the fp32 input 4D, four LayerNorm statistics 16, 3cD, q / k / v /
  output 4cD, 4H and fc1's output and GELU's output 2cF: 26,176 B/token in bf16 (eager 30,784), 49,216 in fp32 (as
  eager). Qwen2.5-VL's tower, q/k-normed blocks and the checkpointed strategies are not measured compiled: planned
  as eager (an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlaforge import COMPONENTS

STRATEGIES = ("none", "full", "selective", "selective_attn", "selective_ffn")


@dataclass(frozen=True)
class BlockShape:
    kind: str  # "llama" | "siglip"
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = False  # per-head RMSNorms on q and k before the rotary step (Qwen3)


def llm_shape(config, block=None) -> BlockShape:
    """The LLM block's shape, from its family's own config fields (`families.llm_dims`: GPT-NeoX's multi-head
    attention has no kv-head field); `block` (a built one) says whether it norms q and k per head."""
    from vlaforge.models.families import llm_dims

    dims = llm_dims(config)
    qk_norm = block is not None and hasattr(getattr(block, "self_attn", None), "q_norm")
    return BlockShape("llama", dims.hidden, dims.ffn, dims.heads, dims.kv_heads, dims.head_dim, qk_norm)


def vision_shape(vision) -> BlockShape:
    """The shape of a built tower's blocks, of the kind its family's row names (`VisionFamily.planned`; "measured"
    for a tower whose blocks the planner measures, read from its first block: a fused tower's first tower's)."""
    from vlaforge.models.vision import tower_width, vision_blocks, vision_family

    fam = vision_family(vision)
    if fam.planned:
        config, width = vision.config, tower_width(vision)
        heads = config.num_attention_heads
        return BlockShape(fam.planned, width, config.intermediate_size, heads, heads, width // heads)
    from vlaforge.techniques.checkpointing import sublayer

    tower = vision.towers[0] if hasattr(vision, "towers") else vision
    block = vision_blocks(tower)[0]
    fc1 = next(p for p in sublayer(block, "ffn").parameters() if p.dim() == 2)
    heads = tower.config.num_attention_heads
    return BlockShape("measured", fc1.shape[1], fc1.shape[0], heads, heads, fc1.shape[1] // heads)


def compute_bytes(precision: str) -> int:
    """Bytes per activation element of a component computing in `precision` (fp8 linears keep bf16 activations)."""
    return 4 if precision == "fp32" else 2


def block_bytes(shape: BlockShape, batch: int, seq: int, precision: str, strategy: str,
                kv_seq: int | None = None, sp: int = 1, gathered_kv: int = 0, compiled: bool = False) -> int:
    """Bytes one block keeps for backward for a micro-batch of `batch` sequences of `seq` tokens (the tokens of one
    image for the vision tower), without the once-per-model terms (`once_bytes`). `kv_seq`: the keys each query's
    padding-mask row spans, 0 when no mask is built (an unpadded batch; context parallel compacts the layout).
    `gathered_kv`: tokens of K/V an all-gather context-parallel rank keeps beyond its own. `sp`: the
    Megatron sequence-parallel degree, which divides what the norms keep and the residual stream (a checkpointed
    block's or sub-layer's input); the projections keep their all-gathered input whole. `compiled`: the block runs as
    one `torch.compile` graph (what its partitioner saves, module docstring; `none` only)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")
    c = compute_bytes(precision)
    t = batch * seq
    D, F, H, Hk, d = shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.head_dim
    if strategy == "full":
        return 4 * D * t // sp
    if shape.kind == "llama":
        norm = (4 * D + 4 + 4 * D) * t // sp
        proj_in = (4 * D if c == 4 else 3 * c * D) * t
        mask = batch * seq * (seq if kv_seq is None else kv_seq) * c
        # SDPA's q, k, v, output and log-sum-exp. NOTE: with a mask transformers repeats K/V to every head first; with
        # none (unpadded, or context parallel's compacted layout) SDPA's GQA path and the cp kernels keep K/V at
        # their own heads
        kv_saved = Hk if kv_seq == 0 else H
        core = 2 * c * (H + kv_saved) * d * t + 4 * H * t + mask + 2 * c * Hk * d * batch * gathered_kv
        qk_norm = ((4 + c) * (H + Hk) * d * t + 4 * (H + Hk) * t) if shape.qk_norm else 0
        if compiled and strategy == "none":  # the block input and rsqrts, three D-wide tensors, the core, 3 x F
            return (4 * D + 8) * t // sp + 3 * c * D * t + core + qk_norm + 3 * c * F * t
        attn = proj_in + core
        # each head's RMSNorm (Qwen3) keeps its fp32 input, its rsqrt and its normed output (c bytes)
        attn += qk_norm
        ffn = (4 * D if c == 4 else 2 * c * D) * t + 4 * c * F * t
        kept_input = 4 * D * t // sp  # a checkpointed sub-layer's fp32 input
        if strategy == "selective":
            return kept_input + c * (H * d + 2 * Hk * d + H * d + D) * t + 4 * H * t
        if strategy == "selective_attn":
            return 2 * norm + kept_input + ffn
        if strategy == "selective_ffn":
            return 2 * norm + attn + kept_input
        return 2 * norm + attn + ffn
    if shape.kind == "qwen_vit":
        norm = (4 * D + 4 + c * D) * t  # its fp32 input and rsqrt, the normed output in the compute dtype
        proj_in = (4 * D if c == 4 else c * D) * t  # one fused qkv projection: one cast
        attn = proj_in + 3 * c * D * t + 2 * c * D * t + c * D * t + 4 * H * t + c * D * t
        ffn = (4 * D if c == 4 else 2 * c * D) * t + 4 * c * F * t
        kept_input = 4 * D * t
        if strategy == "selective":  # the block input, the qkv and output projections' and SDPA's outputs
            return kept_input + 5 * c * D * t + 4 * H * t
        if strategy == "selective_attn":
            return 2 * norm + kept_input + ffn
        if strategy == "selective_ffn":
            return 2 * norm + attn + kept_input
        return 2 * norm + attn + ffn
    # siglip
    if compiled and strategy == "none":  # the input and four LayerNorm statistics, 3cD + q/k/v/out, 4H, fc1 and GELU
        return (4 * D + 16) * t + 7 * c * D * t + 4 * H * t + 2 * c * F * t
    norm = (4 * D + 8) * t
    proj_in = (4 * D if c == 4 else 3 * c * D) * t
    attn = proj_in + 4 * c * D * t + 4 * H * t
    ffn = (4 * D if c == 4 else c * D) * t + 2 * c * F * t
    kept_input = 4 * D * t
    if strategy == "selective":
        return 4 * D * t + 5 * c * D * t + 4 * H * t
    if strategy == "selective_attn":
        return 2 * norm + kept_input + ffn
    if strategy == "selective_ffn":
        return 2 * norm + attn + kept_input
    return 2 * norm + attn + ffn


def once_bytes(shape: BlockShape, batch: int, seq: int, strategy: str, kv_seq: int | None = None,
               block_positions: bool = True, shared_positions: bool = False) -> int:
    """Tensors the LLM's blocks share, counted once per model: rotary cos/sin (kept by autograd under `none` /
    `selective_ffn`, or by a checkpoint's keyword inputs), and a checkpoint's boolean mask and position ids (which
    M-RoPE text models do not hand their blocks: `block_positions` False). See `block_bytes` for `kv_seq`.
    `shared_positions`: the model is given no position ids (an unpadded batch, `VLA.llm_mask`), so transformers makes
    one row of them and of the rotary tables for the whole batch."""
    if shape.kind != "llama":
        return 0
    rows = 1 if shared_positions else batch
    rope = 2 * 4 * shape.head_dim * rows * seq
    # bool mask + int64 position ids
    kwargs = batch * seq * (seq if kv_seq is None else kv_seq) + (8 * rows * seq if block_positions else 0)
    if strategy in ("none", "selective_ffn"):
        return rope
    return rope + kwargs


@dataclass(frozen=True)
class Sequence:
    """What one micro-batch puts through the model: `batch` samples of `frames` images (time steps x cameras) of
    `patches` LLM tokens each (the tower's patches, `merge` x `merge` of them per token with a merging connector),
    `instruction` instruction tokens, `chunk` action queries and `text` text targets."""

    batch: int
    frames: int
    patches: int
    image_size: int
    instruction: int
    chunk: int
    text: int
    action_dim: int
    state_dim: int
    merge: int = 1
    padded: bool = True  # some sample pads its instruction or text: transformers builds the B x S x S mask

    @property
    def tower_patches(self) -> int:
        """The vision tower's tokens per image."""
        return self.patches * self.merge * self.merge

    @property
    def llm_tokens(self) -> int:
        return self.frames * self.patches + self.instruction + self.chunk + self.text


def activation_parts(model, seq: Sequence, policies, contrastive: bool = True, tp: int = 1, cp: int = 1,
                     sequence_parallel: bool = False, allgather: bool = False, zigzag: bool = False,
                     master: str = "fp32", compiled: bool = False, measured=None) -> dict[str, int]:
    """Bytes kept for backward for one micro-batch, by part: 'vision', 'projector', 'llm_block' (one LLM block),
    'llm_once' (shared by the LLM's blocks), 'llm_tail' (final norm and LM-head input; under cp also the layout's
    indices), 'action_head' and 'other' (the loss terms). Under tensor parallel `tp` an LLM block holds its heads'
    and FFN columns' share (the norms' and projections' inputs stay whole: no sequence parallel); under context
    parallel `cp` it holds its 1 / cp share of the padded layout and no mask (the layout is compacted). The vision
    tower, projector and heads are replicated (every tp / cp rank computes them whole). `sequence_parallel`:
    Megatron SP inside the tp group (`block_bytes`'s `sp`). `allgather`: the all-gather cp method, whose ranks keep
    the whole K/V of every block. `zigzag`: the ring's
    layout, padded to a multiple of 2 x cp tokens (the other methods pad to a multiple of cp). `master`: the master
    dtype (`train.precision_master`), which LoRA adapters take under a lower compute precision (planner/lora.py).
    `compiled`: `train.compile`, each block one compiled graph (`block_bytes`); an unpadded `seq` builds no mask.
    `measured`: the model's `measured.MeasuredRows`, whose components' blocks, once-terms and rest are its measured
    rows (at tp = cp = 1: `measured.refuse_sharded`) instead of a formula."""
    from vlaforge.models.families import llm_dims
    from vlaforge.planner.lora import adapters_of, block_delta

    if measured is not None and measured.policy:  # a LeRobot policy: every part measured (tp = cp = 1)
        return measured.parts(seq.batch, seq.llm_tokens, policies, master)
    llm = model.llm.config
    b, s = seq.batch, seq.llm_tokens
    multiple = 2 * cp if zigzag and cp > 1 else cp
    s_pad = -(-s // multiple) * multiple  # the padded layout the ranks split (distributed/sequence_parallel.py)
    s_rank = s_pad // cp
    c = {name: compute_bytes(policies[name].precision) for name in COMPONENTS}
    strat = {name: policies[name].checkpointing for name in COMPONENTS}
    out: dict[str, int] = {}
    lora = adapters_of(model, policies)
    mb = {name: 4 if policies[name].precision == "fp32" else 4 if master == "fp32" else 2 for name in c}

    rows = {comp: measured.rows(comp, policies[comp].checkpointing, policies[comp].precision, master)
            for comp in (measured.components if measured is not None else ())}
    vshape = vision_shape(model.vision)
    if "vision" in rows:
        out["vision"] = rows["vision"].total(b, s)
    else:
        out["vision"] = _vision_bytes(model, seq, vshape, policies["vision"], mb["vision"], lora.get("vision"),
                                      compiled)
    out["projector"] = _projector_bytes(model, seq, vshape.hidden, strat["projector"], c["projector"])
    from vlaforge.models.llm import llm_blocks

    full = llm_shape(llm, llm_blocks(model.llm)[0])
    lshape = BlockShape(full.kind, full.hidden, full.ffn // tp, full.heads // tp, max(1, full.kv_heads // tp),
                        full.head_dim, full.qk_norm)
    D = lshape.hidden
    # context parallel compacts the layout instead of masking padding; unpadded, transformers builds no mask
    no_mask = 0 if cp > 1 or not seq.padded else None
    out["llm_block"] = block_bytes(lshape, b, s_rank, policies["llm"].precision, strat["llm"], kv_seq=no_mask,
                                   sp=tp if sequence_parallel else 1, gathered_kv=s_pad - s_rank if allgather else 0,
                                   compiled=compiled and "llm" not in lora)
    out["llm_once"] = once_bytes(lshape, b, s_rank, strat["llm"], kv_seq=no_mask,
                                 block_positions=not model.layout.mrope, shared_positions=cp == 1 and not seq.padded)
    out["llm_tail"] = ((4 * D + 4 + 4 * D) * b * s_rank  # final RMSNorm
                       + c["llm"] * b * (seq.text + 1) * D)  # LM head input: the text targets' positions (+1)
    if "llm" in rows:  # measured whole (tp = cp = 1), LoRA included
        r = rows["llm"]
        out["llm_block"], out["llm_once"], out["llm_tail"] = r.block.at(b, s), r.once.at(b, s), r.rest.at(b, s)
    elif "llm" in lora:
        a = lora["llm"]
        out["llm_block"] += block_delta(a, strat["llm"], "llama", c["llm"], mb["llm"], D, lshape.ffn, b * s_rank,
                                        first=False)
        # the final norm's frozen weight needs no normalized input, the frozen head no input
        out["llm_tail"] -= 4 * D * b * s_rank + c["llm"] * b * (seq.text + 1) * D
    if cp > 1:  # the layout's int64 indices: this rank's rows (and the batch index), the scatter back to the layout
        out["llm_tail"] += 8 * b * (s_rank + 1 + s_pad)
    ha, t = model.action_head.in_proj.out_features, seq.chunk
    out["action_head"] = (4 * D * b * t if strat["action_head"] == "full"
                          else c["action_head"] * (b * t * (D + 4 * ha) + b * seq.state_dim))
    out["other"] = _loss_bytes(seq, D, llm_dims(llm).vocab, contrastive, frozen_embeddings="llm" in lora)
    return out


def _projector_bytes(model, seq: Sequence, tower_hidden: int, checkpointing: str, compute: int) -> int:
    """The projector's kept bytes. Linear + GELU + linear: the first's input, the GELU's input and output; one
    linear: its input. A merging connector's linear reads merge^2 patches side by side (its input: the shuffled
    copy), after Qwen-VL's RMSNorm (fp32: its input, rsqrt, normed output)."""
    from vlaforge.models.vision import tower_width

    images = seq.batch * seq.frames
    tv = images * seq.patches  # vision tokens the LLM reads
    tvt = images * seq.tower_patches  # the tower's tokens (as many with a connector that does not merge)
    tower = tower_width(model.vision)
    width = tower * seq.merge * seq.merge
    proj = model.projector
    kept = width + 2 * proj.mlp[0].out_features if len(proj.mlp) == 3 else width
    norm = (8 * tower_hidden + 4) * tvt if proj.norm is not None else 0
    return 4 * tower * tvt if checkpointing == "full" else norm + compute * tv * kept


def _vision_bytes(model, seq: Sequence, vshape: BlockShape, policy, master_bytes: int, lora, compiled: bool = False
                  ) -> int:
    """The vision tower's part of `activation_parts`: its blocks (`lora`: an `Adapted` of it, or None; `compiled`:
    one graph per block) and what its embeddings and final norm keep."""
    from vlaforge.models.vision import vision_family
    from vlaforge.planner.lora import block_delta

    vis, strategy, c = model.vision.config, policy.checkpointing, compute_bytes(policy.precision)
    images = seq.batch * seq.frames
    tvt = images * seq.tower_patches  # the tower's tokens
    blocks = vis.num_hidden_layers * block_bytes(vshape, images, seq.tower_patches, policy.precision, strategy,
                                                 compiled=compiled and lora is None and vshape.kind == "siglip")
    if lora is not None:
        args = (strategy, vshape.kind, c, master_bytes, vshape.hidden, vshape.ffn, tvt)
        blocks += (vis.num_hidden_layers - 1) * block_delta(lora, *args, first=False)
        blocks += block_delta(lora, *args, first=True)
    if vshape.kind == "qwen_vit":  # its flattened 3-D patches (cast for the Conv3d), rotary cos / sin, window indices
        kept_args = strategy not in ("none", "selective_ffn")  # a checkpoint keeps its keyword tensors
        rope = 2 * 4 * vshape.head_dim * tvt if not kept_args or c == 4 else 0
        return (blocks + c * tvt * 3 * vis.temporal_patch_size * vis.patch_size ** 2 + rope
                + 2 * 8 * tvt // seq.merge ** 2 + (qwen_bounds(vis, images, seq) if kept_args else 0))
    # the pixels (cast for the patch conv), a conv stem's tensors and the position ids: kept for the embeddings'
    # gradients, which a LoRA tower (its embeddings frozen) does not compute
    embed = (c * images * 3 * seq.image_size ** 2 + conv_stem_bytes(model.vision, images, seq.image_size, c)
             + 8 * seq.tower_patches * (images if vision_family(model.vision).positions_per_image else 1))
    return blocks + (0 if lora is not None else embed) + (4 * vshape.hidden + 8) * tvt  # post-LayerNorm


def _loss_bytes(seq: Sequence, D: int, vocab: int, contrastive: bool, frozen_embeddings: bool) -> int:
    """What the loss terms keep ('other'): ids and masks, action targets, the text cross-entropy, the contrastive
    term's pooled embeddings; a LoRA LLM's frozen token embeddings keep no ids and no instruction-side pooling."""
    b, t = seq.batch, seq.chunk
    other = 8 * b * (seq.instruction + seq.text) + 4 * b * seq.instruction  # ids, instruction mask
    other += 2 * 4 * b * t * seq.action_dim + b * t * seq.action_dim  # action target / prediction, mask
    if seq.text:
        other += 4 * b * seq.text * vocab + 4 * b * seq.text  # cross-entropy's fp32 log-softmax, text mask
    if contrastive:
        other += 6 * 4 * b * D  # pooled, normalized embeddings and their products (fp32)
    if frozen_embeddings:
        other -= 8 * b * (seq.instruction + seq.text) + 4 * b * seq.instruction + (8 * b * (D + 1) if contrastive
                                                                                  else 0)
    return other


def conv_stem_bytes(vision, images: int, image_size: int, cb: int) -> int:
    """What a conv stem (`models.vision.ConvStem`, model.vision_stem = 'conv') saves beyond the pixels: per stage
    the GroupNorm's input, the GELU's input and the next convolution's input (the GELU's output), each the stage's
    channels x its (halved) grid, plus the GroupNorm's mean and rstd per group; 0 for a patch embedding."""
    from torch import nn

    stem = getattr(getattr(vision, "embeddings", None), "patch_embedding", None)
    stages = getattr(stem, "stages", None)
    if stages is None:
        return 0
    total, side = 0, image_size
    for m in stages:
        if isinstance(m, nn.Conv2d):
            side = (side + 2 * m.padding[0] - m.kernel_size[0]) // m.stride[0] + 1
            channels = m.out_channels
        elif isinstance(m, nn.GroupNorm):
            total += 3 * channels * side * side * cb + 2 * m.num_groups * cb
    return images * total


def qwen_window_grid(vis, seq: Sequence) -> tuple[int, int]:
    """(merge units per image side, merge units per window side) of a Qwen2.5-VL tower: `window_size` pixels
    square in whole merge units."""
    units = math.isqrt(seq.tower_patches) // vis.spatial_merge_size
    return units, max(1, vis.window_size // vis.spatial_merge_size // vis.patch_size)


def qwen_bounds(vis, images: int, seq: Sequence) -> int:
    """The int32 sequence bounds Qwen2.5-VL's checkpointed blocks keep as keyword inputs: the images' (full-attention
    blocks) and the windows' (its window index pads each side with whole windows, one more when it divides)."""
    units, w = qwen_window_grid(vis, seq)
    windows = (units // w + 1) ** 2
    full = any(i in vis.fullatt_block_indexes for i in range(vis.num_hidden_layers))
    windowed = any(i not in vis.fullatt_block_indexes for i in range(vis.num_hidden_layers))
    return 4 * (images + 1) * full + 4 * (images * windows + 1) * windowed


def model_activation_bytes(model, seq: Sequence, policies, contrastive: bool = True, master: str = "fp32",
                           measured=None) -> dict[str, int]:
    """Bytes kept for backward per component ('other': the loss terms) for one micro-batch, from the model's
    shapes: the blocks (`block_bytes`, `once_bytes`) plus each component's non-block parts.

    The regression action head is modeled; projector and action head with `checkpointing = "full"` keep their
    input only. `measured`: as `activation_parts`'s."""
    from vlaforge.models.families import llm_dims

    parts = activation_parts(model, seq, policies, contrastive, master=master, measured=measured)
    layers = llm_dims(model.llm.config).layers
    out = {k: v for k, v in parts.items() if not k.startswith("llm_")}
    out["llm"] = layers * parts["llm_block"] + parts["llm_once"] + parts["llm_tail"]
    return out


def sequence_of(model, batch) -> Sequence:
    """The `Sequence` a model sees for `batch` (from the batch's shapes and the model's layout; `padded` unless the
    batch is known to hold no padding, `Batch.full`, and the model then passes no mask: `VLA.llm_mask`)."""
    lay = model.layout
    return Sequence(batch=batch.size, frames=lay.frames, patches=lay.patches_per_frame, image_size=lay.image_size,
                    instruction=batch.instruction_ids.shape[1], chunk=model.action_head.chunk,
                    text=0 if batch.text_ids is None else batch.text_ids.shape[1],
                    action_dim=batch.actions.shape[-1], state_dim=batch.state.shape[-1],
                    merge=getattr(model.projector, "merge", getattr(model.projector, "scale_factor", 1)),
                    padded=not (getattr(batch, "full", None) and not lay.mrope))
