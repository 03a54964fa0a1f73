"""Analytic activation bytes of one transformer block, per checkpointing strategy and compute precision, derived
from the architecture (hidden, FFN width, heads, kv-heads, head dim) and the token count.

The byte counts follow what autograd keeps under vlaforge's design (fp32 master weights, autocast compute, an fp32
residual stream), term by term, and `tests/test_planner.py` checks them against the fake-tensor accounting of
`diagnostics.memory.count_saved` on the real modules. Notation: T tokens in the micro-batch (B x S), D hidden,
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
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("none", "full", "selective", "selective_attn", "selective_ffn")


@dataclass(frozen=True)
class BlockShape:
    kind: str  # "llama" | "siglip"
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int


def llm_shape(config) -> BlockShape:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return BlockShape("llama", config.hidden_size, config.intermediate_size, heads,
                      config.num_key_value_heads or heads, head_dim)


def vision_shape(config) -> BlockShape:
    heads = config.num_attention_heads
    return BlockShape("siglip", config.hidden_size, config.intermediate_size, heads, heads, config.hidden_size // heads)


def _compute_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def block_bytes(shape: BlockShape, batch: int, seq: int, precision: str, strategy: str) -> int:
    """Bytes one block keeps for backward for a micro-batch of `batch` sequences of `seq` tokens (the tokens of one
    image for the vision tower), without the once-per-model terms (`once_bytes`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")
    c = _compute_bytes(precision)
    t = batch * seq
    D, F, H, Hk, d = shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.head_dim
    if strategy == "full":
        return 4 * D * t
    if shape.kind == "llama":
        norm = (4 * D + 4 + 4 * D) * t
        proj_in = (4 * D if c == 4 else 3 * c * D) * t
        attn = proj_in + 4 * c * H * d * t + 4 * H * t + batch * seq * seq * c
        ffn = (4 * D if c == 4 else 2 * c * D) * t + 4 * c * F * t
        kept_input = 4 * D * t  # a checkpointed sub-layer's fp32 input
        if strategy == "selective":
            return 4 * D * t + c * (H * d + 2 * Hk * d + H * d + D) * t + 4 * H * t
        if strategy == "selective_attn":
            return 2 * norm + kept_input + ffn
        if strategy == "selective_ffn":
            return 2 * norm + attn + kept_input
        return 2 * norm + attn + ffn
    # siglip
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


def once_bytes(shape: BlockShape, batch: int, seq: int, strategy: str) -> int:
    """Tensors the LLM's blocks share, counted once per model: rotary cos/sin (kept by autograd under `none` /
    `selective_ffn`, or by a checkpoint's keyword inputs), and a checkpoint's boolean mask and position ids."""
    if shape.kind != "llama":
        return 0
    rope = 2 * 4 * shape.head_dim * batch * seq
    kwargs = batch * seq * seq + 8 * batch * seq  # bool (B, 1, S, S) mask + int64 position ids
    if strategy in ("none", "selective_ffn"):
        return rope
    return rope + kwargs
