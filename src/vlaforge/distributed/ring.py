"""Ring attention: each rank holds a sequence shard of Q, K, V; K/V blocks travel around the ring.

Forward, at step i rank r attends its queries to the K/V block of rank (r - i) mod W. The transfer of the next
block (`batch_isend_irecv` to r + 1, from r - 1) is started *before* the current block is computed, so
communication overlaps compute. Blocks are merged with their log-sum-exp in fp32. Backward is its own autograd
function: K/V go around the ring again together with their dK/dV accumulators, and the accumulators take one last
hop home.

Causal attention uses zigzag sharding: the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r
(`zigzag_shard`), so every rank does the same amount of causal work. GQA: K/V keep their kv-heads on the wire and
are expanded to the query heads only for the local block computation.

Shapes: q (B, H, S_local, D); k, v (B, Hkv, S_local, D), H a multiple of Hkv.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

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

# Test hook: called with ("send", step) when a transfer is issued and ("compute", step) before a block's math.
trace: Callable[[str, int], None] | None = None


def _note(event: str, step: int) -> None:
    if trace is not None:
        trace(event, step)


# ---- sharding ------------------------------------------------------------------------------------------------

def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of the full-sequence tensor `x`: chunks rank and 2W-1-rank of 2W."""
    if x.shape[dim] % (2 * world):
        raise ValueError(f"zigzag sharding cuts the sequence into 2 x {world} equal chunks; its length "
                         f"{x.shape[dim]} is not a multiple of {2 * world}: pad it first")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard, in rank order."""
    world = len(shards)
    pieces = [None] * (2 * world)
    for r, s in enumerate(shards):
        early, late = s.chunk(2, dim=dim)
        pieces[r], pieces[2 * world - 1 - r] = early, late
    return torch.cat(pieces, dim=dim)


def causal_work(rank: int, world: int, zigzag: bool) -> int:
    """Query x key chunk pairs rank `rank` computes under causal masking (a diagonal pair counts as one)."""
    mine = (rank, 2 * world - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)
    return sum(1 for q in mine for kv in range(2 * world) if kv <= q)


def _plan(rank: int, src: int, causal: bool, zigzag: bool, n: int):
    """Which query rows attend which key columns of the block from rank `src`, as (q slice, k slice, diagonal)
    triples; empty when the block is masked out entirely."""
    every = slice(0, n)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]  # the local block, in global order: causal over the concatenation
    if not zigzag:
        return [(every, every, False)] if src < rank else []
    half = n // 2
    if src < rank:  # all my queries see src's early chunk, none of its late one
        return [(every, slice(0, half), False)]
    return [(slice(half, n), every, False)]  # only my late chunk sees src's chunks, both entirely


# ---- ring communication --------------------------------------------------------------------------------------

class _Ring:
    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        """Send `tensors` to the next rank and receive the same shapes from the previous one (asynchronously).

        Returns (requests + the sent buffers, which must live until the requests complete; received buffers)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]  # (contiguous, like `sent`)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return (dist.batch_isend_irecv(ops), sent), received

    @staticmethod
    def wait(pending: tuple) -> None:
        for req in pending[0]:
            req.wait()


def _block_mask(places, window, rank: int, src: int, qs: slice, ks: slice):
    """The sliding-window mask of rank `rank`'s queries `qs` against rank `src`'s keys `ks` (None: no window)."""
    return None if window is None else window_mask(places[rank][:, qs], places[src][:, ks], window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, zigzag, scale, window, softcap, places):
        ring = _Ring(group)
        heads, n = q.shape[1], q.shape[2]
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(ring.world):
            pending = None
            if step < ring.world - 1:
                pending = ring.start(kv)  # NOTE: issued before this step's math: the transfer overlaps it
                _note("send", step + 1)
            src = (ring.rank - step) % ring.world
            _note("compute", step)
            kb, vb = expand_kv(kv[0], heads).float(), expand_kv(kv[1], heads).float()
            for qs, ks, diag in _plan(ring.rank, src, causal, zigzag, n):
                mask = _block_mask(places, window, ring.rank, src, qs, ks)
                o_b, lse_b = block_forward(qf[:, :, qs], kb[:, :, ks], vb[:, :, ks], scale, diag, mask, softcap)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o_b, lse_b)
            if pending is not None:
                ring.wait(pending[0])
                kv = pending[1]
        out = out.to(q.dtype)  # NOTE: saved in the input dtype, as SDPA saves its output (fp32 inputs: no copy)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.zigzag, ctx.scale = group, causal, zigzag, scale
        ctx.window, ctx.softcap, ctx.places = window, softcap, places
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        out = out.float()
        ring = _Ring(ctx.group)
        heads, kv_heads, n = q.shape[1], k.shape[1], q.shape[2]
        qf, doutf = q.float(), dout.float()
        delta = (doutf * out).sum(-1)  # (B, H, Sq)
        dq = torch.zeros_like(qf)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(ring.world):
            pending = ring.start(kv) if step < ring.world - 1 else None  # next K/V travels during the math
            src = (ring.rank - step) % ring.world
            kb, vb = expand_kv(kv[0], heads).float(), expand_kv(kv[1], heads).float()
            dk_b, dv_b = torch.zeros_like(kb), torch.zeros_like(vb)
            for qs, ks, diag in _plan(ring.rank, src, ctx.causal, ctx.zigzag, n):
                mask = _block_mask(ctx.places, ctx.window, ring.rank, src, qs, ks)
                g = block_backward(qf[:, :, qs], kb[:, :, ks], vb[:, :, ks], out[:, :, qs], lse[:, :, qs],
                                   doutf[:, :, qs], delta[:, :, qs], ctx.scale, diag, mask, ctx.softcap)
                dq[:, :, qs] += g[0]
                dk_b[:, :, ks] += g[1]
                dv_b[:, :, ks] += g[2]
            dkv = [dkv[0] + fold_kv_grad(dk_b, kv_heads), dkv[1] + fold_kv_grad(dv_b, kv_heads)]
            if ring.world == 1:  # one rank: its own block is the whole sequence, nothing travels
                break
            grads = ring.start(dkv)  # the accumulators follow their block (the last hop takes them home)
            if pending is not None:
                ring.wait(pending[0])
                kv = pending[1]
            ring.wait(grads[0])
            dkv = grads[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None


def shard_places(places: torch.Tensor | None, n: int, world: int, zigzag: bool, device) -> list[torch.Tensor]:
    """Every rank's shard of `places` (B, S): each position's index in the layout a sliding window counts in
    (default: the positions themselves), cut as the sequence is (zigzag or contiguous)."""
    full = places_or_positions(places, n * world, device)
    return [zigzag_shard(full, r, world, dim=1) if zigzag else full.chunk(world, 1)[r] for r in range(world)]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = False,
                   zigzag: bool = True, scale: float | None = None, window: int | None = None,
                   softcap: float | None = None, places: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over the sequence split across `group` (default: the world).

    With `causal` and `zigzag`, the shards must come from `zigzag_shard`; otherwise rank r holds the r-th
    contiguous chunk. Each shard's length must be even under zigzag. `window`: a query sees the keys whose place is
    less than `window` behind its own (transformers' sliding window), `places` (B, S) the whole sequence's places
    (default: positions); `softcap`: logits -> softcap * tanh(logits / softcap) (Gemma2's).
    """
    group = group or dist.group.WORLD
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv-heads {k.shape[1]}")
    if causal and zigzag and q.shape[2] % 2:
        raise ValueError(f"zigzag sharding needs an even local sequence length, got {q.shape[2]}")
    check_equal_shards(q.shape[2], group)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    zigzag = zigzag and causal
    shards = None if window is None else shard_places(places, q.shape[2], dist.get_world_size(group), zigzag,
                                                      q.device)
    return _RingAttention.apply(q, k, v, group, causal, zigzag, scale, window, softcap, shards)
