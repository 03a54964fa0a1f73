"""The joint layer: VLM block i beside the action-expert block it meets, as one module whose `forward` is the unit
techniques wrap (LeRobot's `compute_layer_complete` / `SmolVLMWithExpertModel.forward` call both blocks' sub-layers
directly, so a hook on a block's own `forward` never fires).

Two streams run through it: the prefix (images, language, and SmolVLA's state token) in the VLM block and the suffix
(pi0's state token, the noisy action tokens) in the expert block. A layer attends in one of two ways:
- `self`: one attention over both streams' queries, keys and values, one `scaled_dot_product_attention` call with the
  block mask (prefix-LM: the prefix never sees the suffix);
- `cross` (SmolVLA's odd layers): the prefix attends to itself, and the suffix's queries attend to the prefix only,
  through the expert's own key / value projections of the VLM's (rotated) keys and values.
At inference the prefix runs once (`suffix` None) and leaves its keys and values in a `PrefixCache`; every
denoising step runs the suffix alone (`prefix` None) against them, with no copy or crop of the cache. In training with
the VLM side frozen (`PolicyVLA.losses`), the prefix's context (the tokens no trained parameter reaches) fills a cache
the same way without autograd, and the rest of the prefix (SmolVLA's state token) continues it (`extend`) beside the
suffix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def rope_angles(positions: torch.Tensor, head_dim: int, base: float, style: str) -> torch.Tensor:
    """Rotary angles (B, L, head_dim / 2) in fp32 for positions (B, L): 'divide' (SmolVLA's `apply_rope`: position /
    base ** (2i / d)) or 'multiply' (transformers' Gemma rotary embedding: position * (1 / base ** (2i / d)))."""
    pos = positions.to(torch.float32)[..., None]
    if style == "divide":
        exponents = (2.0 / head_dim) * torch.arange(head_dim // 2, dtype=torch.float32, device=positions.device)
        return pos / (base ** exponents)
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    return pos * inv


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, L, H, D) by angles (B, L, D / 2): the two halves of D are the pair (as both references)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, Lq, H, D) queries over (B, Lk, Hkv, D) keys / values with an additive mask (B, 1, Lq, Lk) -> (B, Lq, H*D).
    One SDPA call; grouped keys through `enable_gqa`. A fully masked row (a padding token's) averages every value,
    as the references' eager softmax over a constant row does: no NaN reaches the gradients. The mask's large negative
    is clamped to the queries' dtype (fp16's is -65504: the references' -2.4e38 would be -inf there)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2),
                                         attn_mask=mask.clamp_min(torch.finfo(q.dtype).min).to(q.dtype), scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).flatten(2)


@dataclass
class PrefixCache:
    """Per joint layer: the prefix's rotated keys and values (B, Lp, Hkv, D), and for a cross layer the expert's
    projections of them, computed once per prediction and read by every denoising step."""

    keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    expert: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class JointContext:
    """What one pass through the joint layers shares: additive masks and rotary angles.

    mask: the self-attention mask (B, 1, Lq, Lk) over the present streams' queries (prefix then suffix) and the keys
        (the cached prefix's, then the present streams'); prefix_mask: (B, 1, Lp, Lp), for a cross layer's prefix;
        cross_mask: (B, 1, Ls, Lp), the suffix's queries over the prefix's keys. angles: (B, Lq, D/2) of the present
        streams' positions; cross_angles: the suffix's positions counted from 0 (a cross layer's queries)."""

    mask: torch.Tensor
    angles: torch.Tensor
    prefix_mask: torch.Tensor | None = None
    cross_mask: torch.Tensor | None = None
    cross_angles: torch.Tensor | None = None
    cache: PrefixCache | None = None  # given: fill it (prefix pass) or read it (suffix pass)
    cond: torch.Tensor | None = None  # the expert's norms' condition (B, C) (pi0.5's flow-time embedding)
    # the joint layer whose prefix output nothing reads (the last: only its keys and values matter): its VLM block
    # stops after attention. Saves its output projection and MLP, and leaves their parameters without gradients in
    # a compiled graph too (as in eager, where autograd never reaches them)
    last_prefix: int | None = None
    # the present prefix continues the cached one: its keys and values follow the cache's, which stays as it is
    extend: bool = False


class AdaRMSNorm(nn.Module):
    """pi0.5's time-conditioned RMS norm: scale, shift and a residual gate from the condition (B, C), each `dim` wide
    (`dense`: LeRobot's name); `forward(x, cond)` -> (normed x, gate)."""

    adaptive = True

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        mod = self.dense(cond)
        scale, shift, gate = (mod[:, None] if x.dim() == 3 else mod).chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def norm(module: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's norm over x: (normed, residual gate) for an adaptive norm, (normed, None) for a plain one."""
    if getattr(module, "adaptive", False):
        return module(x, cond)
    return module(x), None


def _gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def _qkv(block: nn.Module, hidden: torch.Tensor,
         cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decoder block's normed queries, keys and values (B, L, H, D), and its attention residual's gate."""
    attn = block.self_attn
    x, gate = norm(block.input_layernorm, hidden, cond)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    return attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape), gate


def _finish(block: nn.Module, hidden: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None = None,
            cond: torch.Tensor | None = None) -> torch.Tensor:
    """The rest of a pre-norm decoder block after attention: output projection, (gated) residual, MLP, residual."""
    h = _gated(hidden, block.self_attn.o_proj(attended), gate)
    x, gate = norm(block.post_attention_layernorm, h, cond)
    return _gated(h, block.mlp(x), gate)


class JointLayer(nn.Module):
    """VLM block `index` and the expert block it meets (None: the suffix passes this layer unchanged). The blocks
    stay where they are in the model (`llm`'s decoder, `action_head.blocks`): this module holds them without
    registering them, so parameter names are the components' own."""

    def __init__(self, index: int, vlm: nn.Module, expert: nn.Module | None, mode: str, scale: float):
        super().__init__()
        self.index, self.mode, self.scale = index, mode, scale
        self.__dict__["vlm"], self.__dict__["expert"] = vlm, expert  # NOTE: not children (see the class docstring)

    def fsdp_members(self) -> list[nn.Module]:
        """The blocks FSDP2 shards as this layer's unit (`distributed.parallelize._shard_joint`)."""
        return [self.vlm] + ([self.expert] if self.expert is not None else [])

    def forward(self, prefix: torch.Tensor | None, suffix: torch.Tensor | None,
                ctx: JointContext) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prefix (B, Lp, Dv) | None, suffix (B, Ls, De) | None) -> the same after this layer."""
        if self.expert is None or (self.mode == "cross" and prefix is not None):
            prefix_out = None if prefix is None else self._prefix_alone(prefix, ctx, joint=suffix is not None)
            if self.expert is None or suffix is None:
                return prefix_out, suffix
            return prefix_out, self._expert_cross(suffix, ctx)
        if self.mode == "cross":
            return None, self._expert_cross(suffix, ctx)
        return self._self(prefix, suffix, ctx)

    def _self(self, prefix, suffix, ctx: JointContext):
        streams = [(b, h, c) for b, h, c in ((self.vlm, prefix, None), (self.expert, suffix, ctx.cond))
                   if h is not None]
        qkv = [_qkv(b, h, c) for b, h, c in streams]
        q = apply_rope(torch.cat([x[0] for x in qkv], dim=1), ctx.angles)
        k = apply_rope(torch.cat([x[1] for x in qkv], dim=1), ctx.angles)
        v = torch.cat([x[2] for x in qkv], dim=1)
        k, v = self._through_cache(k, v, ctx, prefix_pass=prefix is not None)
        att = attend(q, k, v, ctx.mask, self.scale)
        outs, start = [], 0
        for (block, hidden, cond), parts in zip(streams, qkv):
            unread = block is self.vlm and ctx.last_prefix == self.index
            outs.append(None if unread else _finish(block, hidden, att[:, start:start + hidden.shape[1]], parts[3],
                                                    cond))
            start += hidden.shape[1]
        it = iter(outs)
        return (next(it) if prefix is not None else None), (next(it) if suffix is not None else None)

    def _through_cache(self, k: torch.Tensor, v: torch.Tensor, ctx: JointContext,
                       prefix_pass: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's rotated keys and values against the cache: a prefix pass keeps them there; a suffix pass, or
        the prefix's rest (`ctx.extend`), reads the cached prefix's and puts them first; no cache, as they are."""
        cache = ctx.cache
        if cache is None:
            return k, v
        if prefix_pass and not ctx.extend:
            cache.keys[self.index] = (k, v)
            return k, v
        pk, pv = cache.keys[self.index]
        return torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)

    def _prefix_alone(self, prefix: torch.Tensor, ctx: JointContext, joint: bool) -> torch.Tensor:
        """The prefix attending to itself (a cross layer's, or a layer without an expert block); its rotated keys
        and values go to the cache (the prefix pass) or to the suffix's cross attention in this pass."""
        q, k, v, _ = _qkv(self.vlm, prefix)
        angles = ctx.angles[:, :prefix.shape[1]]
        k, v = self._through_cache(apply_rope(k, angles), v, ctx, prefix_pass=True)
        if joint and self.expert is not None:  # for `_expert_cross` in this pass
            self.__dict__["_prefix_kv"] = (k, v)
        if ctx.last_prefix == self.index:
            return None
        att = attend(apply_rope(q, angles), k, v, ctx.prefix_mask if joint else ctx.mask, self.scale)
        return _finish(self.vlm, prefix, att)

    def _expert_cross(self, suffix: torch.Tensor, ctx: JointContext) -> torch.Tensor:
        """The suffix's queries over the expert's projections of the prefix's keys (rotated) and values: this
        pass's prefix, or the cache's (whose projections are kept after the first denoising step)."""
        attn = self.expert.self_attn
        cache = ctx.cache
        if cache is not None and self.index in cache.expert:
            ek, ev = cache.expert[self.index]
        else:
            ek, ev = self._expert_kv(*(self.__dict__.pop("_prefix_kv", None) or cache.keys[self.index]))
            if cache is not None and not ctx.extend:
                cache.expert[self.index] = (ek, ev)
        x, gate = norm(self.expert.input_layernorm, suffix, ctx.cond)
        q = attn.q_proj(x).view(*x.shape[:-1], -1, attn.head_dim)
        att = attend(apply_rope(q, ctx.cross_angles), ek, ev, ctx.cross_mask, self.scale)
        return _finish(self.expert, suffix, att, gate, ctx.cond)

    def _expert_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A cross layer's expert projections of the prefix's rotated keys and values (B, Lp, Hkv, D)."""
        attn = self.expert.self_attn
        shape = (*k.shape[:2], -1, attn.head_dim)
        return (attn.k_proj(k.flatten(2).to(attn.k_proj.weight.dtype)).view(shape),
                attn.v_proj(v.flatten(2).to(attn.v_proj.weight.dtype)).view(shape))

    def kept(self) -> tuple[nn.Module, str] | None:
        """What a denoising step reads of this layer's prefix: (the attention whose heads size it, 'keys' (the
        prefix's own) or 'expert' (a cross layer's expert projections of them)); None when the suffix skips the
        layer."""
        if self.expert is None:
            return None
        return (self.expert.self_attn, "expert") if self.mode == "cross" else (self.vlm.self_attn, "keys")


def pack_cache(layers: list[JointLayer], cache: PrefixCache) -> torch.Tensor:
    """The prefix's keys and values a denoising step reads, as one tensor (B, Lp, C): per layer in order its keys
    then its values, flattened over heads (a cross layer's expert projections, computed here once). An exported
    package's prefix graph returns it and its denoising graph takes it (`unpack_cache`)."""
    parts = []
    for layer in layers:
        if (kept := layer.kept()) is None:
            continue
        if kept[1] == "expert" and layer.index not in cache.expert:
            cache.expert[layer.index] = layer._expert_kv(*cache.keys[layer.index])
        parts += [t.flatten(2) for t in getattr(cache, kept[1])[layer.index]]
    return torch.cat(parts, dim=-1)


def unpack_cache(layers: list[JointLayer], packed: torch.Tensor) -> PrefixCache:
    """`pack_cache`'s inverse: the cache a suffix pass reads."""
    cache, start = PrefixCache(), 0
    for layer in layers:
        if (kept := layer.kept()) is None:
            continue
        attn, where = kept
        width = attn.config.num_key_value_heads * attn.head_dim  # keys' and values' (a cross layer's expert too)
        keys, values = (packed[..., s:s + width].unflatten(-1, (-1, attn.head_dim)) for s in (start, start + width))
        getattr(cache, where)[layer.index] = (keys, values)
        start += 2 * width
    if start != packed.shape[-1]:
        raise ValueError(f"a packed prefix of {packed.shape[-1]} values per token; these layers read {start}")
    return cache
