"""The block math the context-parallel kernels share (`ring.py`, `ulysses.py`'s all-gather): one query block
against one K/V block with its log-sum-exp (fp32), and its exact backward given the merged output and log-sum-exp.
GQA: K/V are expanded to the query heads for a block and their gradients folded back."""

from __future__ import annotations

import torch
import torch.distributed as dist

_EQUAL: set = set()  # (group ranks, local length) pairs already checked: a run checks each shape once


def check_equal_shards(length: int, group) -> None:
    """Every rank of `group` must hold `length` tokens: the collectives move equal pieces, and unequal ones abort
    the process group (gloo: "Received data size doesn't match"). One small all-reduce the first time a length
    is seen on a group, none after.

    Raises:
        ValueError: the ranks hold different lengths, naming them.
    """
    key = (tuple(dist.get_process_group_ranks(group)), length)  # the same on every rank of the group
    if key in _EQUAL:
        return
    both = torch.tensor([length, -length], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # (longest, -shortest)
    if int(both[0]) != -int(both[1]):
        raise ValueError(f"sequence shards differ in length across the {dist.get_world_size(group)} ranks (from "
                         f"{-int(both[1])} to {int(both[0])} tokens); pad the sequence to a multiple of the world size "
                         "(2 x the world size for zigzag) before sharding it")
    _EQUAL.add(key)


def group_device(group) -> torch.device:
    """The device whose tensors `group`'s collectives take: the CPU when a backend of the group serves it (gloo, or
    a 'cpu:gloo,cuda:nccl' group), else this process's current accelerator (NCCL has no CPU collectives: a CPU
    tensor all-reduced over it killed the first multi-GPU context-parallel run)."""
    kind = dist.distributed_c10d._get_object_coll_device(group)  # torch's own rule for object collectives
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def expand_kv(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, S, D) K or V repeated onto the H query heads (GQA)."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def fold_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a (B, H, S, D) gradient of expanded K/V back onto its kv-heads."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def places_or_positions(places: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """(B or 1, n) each position's index in the layout a sliding window counts in: `places`, else the positions."""
    return (places if places is not None else torch.arange(n, device=device)[None]).to(device)


def window_mask(q_places: torch.Tensor, k_places: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """(B, 1, Sq, Sk) bool, key visible to query under a sliding window (transformers': places_q - places_k <
    window), from each position's index in the layout the window counts in; None without a window."""
    if window is None:
        return None
    return ((q_places[:, :, None] - k_places[:, None, :]) < window)[:, None]


def _scores(q, k, scale, causal_diag: bool, mask=None, softcap=None):
    """(masked logits, tanh of the soft-capped ones or None): logits -> softcap * tanh(logits / softcap) (Gemma2's),
    then the causal diagonal and `mask` (False: not visible) set to -inf."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if causal_diag:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s, t


def finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with -inf (a row that sees no key of the block: a sliding window, a padding row) as 0, so exp(s - lse)
    of its -inf logits is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention outputs over disjoint key sets merged by their log-sum-exps (rows that saw no key in
    either stay at 0 with lse -inf)."""
    new = torch.logaddexp(lse, lse_b)
    safe = finite(new)
    return out * torch.exp(lse - safe)[..., None] + o_b * torch.exp(lse_b - safe)[..., None], new


def _fused(q: torch.Tensor, k: torch.Tensor, causal_diag: bool, mask=None, softcap=None) -> bool:
    """Whether torch's fused CPU flash kernel runs this block: on CPU, with no window mask or soft-cap, and for a
    diagonal block only when it is square (its causal mask is then plain `is_causal`)."""
    return (q.device.type == "cpu" and mask is None and softcap is None
            and (not causal_diag or q.shape[2] == k.shape[2]))


def block_forward(q, k, v, scale, causal_diag, mask=None, softcap=None):
    """(out, lse) of q against one K/V block; fp32. On CPU the fused flash kernel (which returns the log-sum-exp);
    elsewhere, or with a window `mask` or a `softcap`, explicit math (a CUDA flash/efficient kernel with
    log-sum-exp is the GPU path still to add)."""
    if _fused(q, k, causal_diag, mask, softcap):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal_diag, scale=scale)
    s, _ = _scores(q, k, scale, causal_diag, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
    return torch.matmul(torch.exp(s - finite(lse)[..., None]), v), lse


def block_backward(q, k, v, out, lse, dout, delta, scale, causal_diag, mask=None, softcap=None):
    """(dq, dk, dv) of one block, from the merged output's lse and delta = rowsum(dout * out): the flash backward
    given the merged output and lse yields this block's share exactly (through the soft-cap's tanh too)."""
    if _fused(q, k, causal_diag, mask, softcap):
        c = [t.contiguous() for t in (dout, q, k, v, out, lse)]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*c, 0.0, causal_diag, scale=scale)
    s, t = _scores(q, k, scale, causal_diag, mask, softcap)
    p = torch.exp(s - finite(lse)[..., None])  # (B, H, Sq, Sk)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta[..., None])
    if t is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh^2
        ds = ds * (1 - t * t)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv
