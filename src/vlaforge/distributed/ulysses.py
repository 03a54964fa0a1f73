"""Ulysses sequence parallelism and the all-gather-KV variant: two exact alternatives to ring attention.

Ulysses: an all-to-all turns sequence shards of all heads into full sequences of H / W heads, attention runs
locally (`F.scaled_dot_product_attention`), and a second all-to-all turns the result back into sequence shards.
GQA: when the kv-heads are fewer than the degree (or not divisible by it) K/V heads are replicated up to the query
heads first. All-gather KV: every rank gathers the whole K and V and attends its own queries to them; simple and
good at short sequences. Both take contiguous shards (rank r holds the r-th chunk of the sequence).

Shapes: q (B, H, S_local, D); k, v (B, Hkv, S_local, D).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vlaforge.distributed.attention_blocks import (
    block_backward,
    block_forward,
    check_equal_shards,
    expand_kv,
    fold_kv_grad,
    merge,
    places_or_positions,
    window_mask,
)


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (chunk j goes to rank j); it is its own adjoint, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # NOTE: before empty_like, which would copy a permuted gradient's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every rank's shard along the sequence (dim 2); backward sums the full gradient over ranks
    (all-reduce, which gloo has; it lacks reduce-scatter) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        world, rank = _world(group)
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[2]
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(pieces, x, group=group)
        return torch.cat(pieces, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def _seq_to_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H, S/W, D) sequence shard -> (B, H/W, S, D) head shard (autograd-aware all-to-all)."""
    b, h, s, d = x.shape
    send = x.reshape(b, world, h // world, s, d).transpose(0, 1).contiguous()  # (W, B, H/W, S/W, D) by head group
    recv = _AllToAll.apply(send, group)  # (W, B, H/W, S/W, D) by source rank
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def _heads_to_seq(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H/W, S, D) head shard -> (B, H, S/W, D) sequence shard."""
    b, hl, s, d = x.shape
    send = x.reshape(b, hl, world, s // world, d).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, H/W, S/W, D)
    recv = _AllToAll.apply(send, group)  # by source rank = head group
    return recv.transpose(0, 1).reshape(b, world * hl, s // world, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = False,
                      scale: float | None = None, window: int | None = None,
                      softcap: float | None = None, places: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention with sequence shards, via two all-to-alls around local full-sequence attention. Each rank
    then holds whole sequences, so `window` (a query sees the `window` latest keys up to itself, transformers'
    sliding window) and `softcap` (logits -> softcap * tanh(logits / softcap), Gemma2's) are computed as one
    process computes them. `places` (B, S): each position's index in the layout the window counts in (the
    trainer's uncompacted one; default: the positions themselves)."""
    group = group or dist.group.WORLD
    world, _ = _world(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world:
        raise ValueError(f"Ulysses degree {world} does not divide the {heads} attention heads; use a cp degree "
                         f"that divides them, or cp_method = 'ring'")
    check_equal_shards(q.shape[2], group)
    if kv_heads % world:  # GQA with fewer kv-heads than ranks: replicate K/V heads up to the query heads
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    qh, kh, vh = (_seq_to_heads(t, world, group) for t in (q, k, v))
    if window is None and softcap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale,
                                             enable_gqa=kh.shape[1] != qh.shape[1])
    else:
        out = _local_attention(qh, kh, vh, causal, scale, window, softcap, places)
    return _heads_to_seq(out, world, group)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                     window: int | None, softcap: float | None, places: torch.Tensor | None) -> torch.Tensor:
    """Whole-sequence attention with a sliding window and / or soft-capped logits (transformers' eager math:
    softmax in fp32, then the input dtype)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    allowed = _allowed(q.shape[2], causal, window, places, q.device)
    if softcap is None:  # a window alone: SDPA with its boolean mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    logits = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _allowed(n: int, causal: bool, window: int | None, places: torch.Tensor | None, device) -> torch.Tensor:
    """(B or 1, 1, n, n) bool: key j visible to query i: j <= i when causal (in the order attended, where padding
    sits behind every real token), and under a sliding window places[i] - places[j] < window."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    allowed = ((j <= i) if causal else torch.ones(n, n, dtype=torch.bool, device=device))[None, None]
    if window is not None:
        at = places_or_positions(places, n, device)
        allowed = allowed & window_mask(at, at, window)
    return allowed


class _GatheredAttention(torch.autograd.Function):
    """This rank's queries against the gathered K/V without a mask: under causal attention the keys before the
    rank's chunk are one fully visible block and its own chunk a causal diagonal block, merged by log-sum-exp (the
    ring's block math); no S_local x S mask is built or saved."""

    @staticmethod
    def forward(ctx, q, kf, vf, rank, causal, scale, window, softcap, places):
        heads, n = q.shape[1], q.shape[2]
        blocks = _gathered_blocks(rank, n, kf.shape[2], causal)
        qf, kb, vb = q.float(), expand_kv(kf, heads).float(), expand_kv(vf, heads).float()
        masks = [None if window is None else window_mask(places[:, rank * n:(rank + 1) * n], places[:, ks], window)
                 for ks, _ in blocks]
        out = lse = None
        for (ks, diag), mask in zip(blocks, masks):
            o_b, l_b = block_forward(qf, kb[:, :, ks], vb[:, :, ks], scale, diag, mask, softcap)
            if out is None:
                out, lse = o_b, l_b
                continue
            out, lse = merge(out, lse, o_b, l_b)
        # NOTE: saved in the input dtype, as SDPA saves its output, and laid out (B, S, H, D) behind the (B, H, S, D)
        # view: the caller's transpose to transformers' layout is then a view, so the output projection's saved
        # input shares this storage instead of keeping a second copy (as the ring's output does)
        out = out.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format).transpose(1, 2)
        ctx.save_for_backward(q, kf, vf, out, lse)
        ctx.blocks, ctx.scale, ctx.masks, ctx.softcap = blocks, scale, masks, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kf, vf, out, lse = ctx.saved_tensors
        out = out.float()
        heads, kv_heads = q.shape[1], kf.shape[1]
        qf, doutf = q.float(), dout.float()
        kb, vb = expand_kv(kf, heads).float(), expand_kv(vf, heads).float()
        delta = (doutf * out).sum(-1)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kb), torch.zeros_like(vb)
        for (ks, diag), mask in zip(ctx.blocks, ctx.masks):
            g = block_backward(qf, kb[:, :, ks], vb[:, :, ks], out, lse, doutf, delta, ctx.scale, diag, mask,
                               ctx.softcap)
            dq += g[0]
            dk[:, :, ks] += g[1]
            dv[:, :, ks] += g[2]
        return (dq.to(q.dtype), fold_kv_grad(dk, kv_heads).to(kf.dtype), fold_kv_grad(dv, kv_heads).to(vf.dtype),
                None, None, None, None, None, None)


def _gathered_blocks(rank: int, n: int, total: int, causal: bool) -> list[tuple[slice, bool]]:
    """(key slice, causal diagonal) blocks rank `rank`'s n contiguous queries attend among `total` keys."""
    if not causal:
        return [(slice(0, total), False)]
    own = (slice(rank * n, (rank + 1) * n), True)
    return [(slice(0, rank * n), False), own] if rank else [own]


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = False,
                        scale: float | None = None, window: int | None = None, softcap: float | None = None,
                        places: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of local queries against the gathered K/V (gradients reduce-scatter back). `window`,
    `softcap`, `places` (B, S: the whole sequence's): as `ring.ring_attention`'s."""
    import math

    group = group or dist.group.WORLD
    world, rank = _world(group)
    check_equal_shards(q.shape[2], group)
    kf = _AllGatherSeq.apply(k, group)  # (B, Hkv, S, D)
    vf = _AllGatherSeq.apply(v, group)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if window is not None:
        places = places_or_positions(places, kf.shape[2], q.device)
    return _GatheredAttention.apply(q, kf, vf, rank, causal, scale, window, softcap, places)
