"""Sequence parallelism for the VLA: choosing the method (the wiring into the model arrives with scale-out).

The kernels: `ring.ring_attention` (K/V around a ring, overlapped, zigzag-balanced for causal attention),
`ulysses.ulysses_attention` (two all-to-alls around local attention) and `ulysses.allgather_attention` (gather
K/V). All three are exact and take sequence shards of (B, H, S_local, D).
"""

from __future__ import annotations

from vlaforge.errors import VlaforgeError

RING_ABOVE = 16384  # tokens: from here a ring's O(S/cp) K/V memory and overlapped transfers win
ALLGATHER_BELOW = 4096  # tokens: below this gathering all of K/V is cheap and simplest


def choose_cp_method(method: str, seq_len: int, degree: int, heads: int) -> tuple[str, str]:
    """(method, why) for `parallel.cp_method`; 'auto' picks by sequence length and degree."""
    if method != "auto":
        if method == "ulysses" and heads % degree:
            raise VlaforgeError(f"parallel.cp_method = 'ulysses' needs cp = {degree} to divide the llm's {heads} "
                                "attention heads; use cp_method = 'ring' or a cp degree that divides them")
        return method, "set in parallel.cp_method"
    if seq_len >= RING_ABOVE:
        return "ring", (f"{seq_len} tokens >= {RING_ABOVE}: K/V stay sharded (1/{degree} per rank) and their "
                        "transfers overlap compute")
    if seq_len < ALLGATHER_BELOW:
        return "allgather", (f"{seq_len} tokens < {ALLGATHER_BELOW}: gathering K/V is cheap and needs one "
                             "collective per layer")
    if heads % degree == 0:
        return "ulysses", (f"{seq_len} tokens in [{ALLGATHER_BELOW}, {RING_ABOVE}) and cp = {degree} divides the "
                           f"{heads} heads: two all-to-alls move less than a ring at this length")
    return "ring", f"cp = {degree} does not divide the {heads} heads, which Ulysses needs"


def attention_function(method: str, group=None):
    """An attention function with the `transformers` AttentionInterface signature that runs `method` over the
    sequence shards of `group`. Causality comes from the module (Llama: causal; SigLIP: not). The local attention
    mask is ignored: the function applies the global causal pattern itself, so batches must not rely on padding
    masks (the VLA wiring passes key padding separately when it lands)."""
    from vlaforge.distributed.ring import ring_attention
    from vlaforge.distributed.ulysses import allgather_attention, ulysses_attention

    kernels = {"ring": lambda q, k, v, c, s: ring_attention(q, k, v, group, causal=c, zigzag=True, scale=s),
               "ring_contiguous": lambda q, k, v, c, s: ring_attention(q, k, v, group, causal=c, zigzag=False,
                                                                       scale=s),
               "ulysses": lambda q, k, v, c, s: ulysses_attention(q, k, v, group, causal=c, scale=s),
               "allgather": lambda q, k, v, c, s: allgather_attention(q, k, v, group, causal=c, scale=s)}
    kernel = kernels[method]

    def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = kernel(query, key, value, bool(causal), scaling)  # (B, H, S_local, D)
        return out.transpose(1, 2).contiguous(), None  # (B, S_local, H, D), as transformers expects

    return attend


def register_attention(method: str, group=None) -> str:
    """Register `method` over `group` in the `transformers` attention registry; returns the implementation name
    to pass as `attn_implementation` (or to `set_attn_implementation`)."""
    from transformers import AttentionInterface

    name = f"vlaforge_{method}"
    AttentionInterface.register(name, attention_function(method, group))
    return name
