"""`parallelize`: data parallelism for the VLA on a device mesh - FSDP2 (`fully_shard`), HSDP, or DDP semantics.

FSDP2 units (torchtitan's layout): every transformer block of the vision tower and of the LLM is its own unit, and
the root unit holds the rest (patch and token embeddings, final norms, LM head, projector, action head). The root
stays gathered for the whole step, which matters here: the VLA embeds text, reads the action queries and the
contrastive temperature outside the LLM's and the heads' forwards. Mixed precision per unit follows the component
(`MixedPrecisionPolicy(param_dtype=<compute dtype>, reduce_dtype=fp32)`); the root, shared by components, keeps
fp32 parameters and relies on the autocast regions. `dp_replicate > 1` gives HSDP (2-D mesh); `backend = "ddp"`
replicates (a 1-sized shard dimension: gradients all-reduced, nothing sharded).

Gradients are then DTensor shards; `GradReducer` turns per-rank partial statistics (norms, counts, overflow flags,
metrics) into global ones with one collective each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.diagnostics.memory import blocks_of
from vlaforge.techniques.precision import DTYPES


@dataclass
class GradReducer:
    """Global views of per-rank gradient statistics. `shard_group`: ranks that hold different shards of a
    parameter (sums of squares and counts add up over it); the world agrees on overflow and averages metrics."""

    shard_group: Any = None

    @staticmethod
    def local(t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def sum_shards(self, t: torch.Tensor) -> torch.Tensor:
        if self.shard_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.shard_group)
        return t

    @staticmethod
    def world_size() -> int:
        return dist.get_world_size()

    @staticmethod
    def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
        """Summed over every rank (all of them are data-parallel ranks today)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    @staticmethod
    def mean_grads(params: list[torch.Tensor]) -> None:
        """Average the gradients of plain (unsharded, replicated) parameters over every rank, in place."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= dist.get_world_size()
            chunks = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(chunks, grads)])

    @staticmethod
    def any_rank(flag: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    @staticmethod
    def mean_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's metrics averaged (one all-reduce of the stacked values)."""
        if not values:
            return values
        keys = list(values)
        stacked = torch.stack([torch.as_tensor(values[k]).detach().float().reshape(()) for k in keys])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        stacked /= dist.get_world_size()
        return dict(zip(keys, stacked.unbind()))


def _policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)


def parallelize(model: nn.Module, dims, mesh, policies: Mapping[str, Any]) -> GradReducer:
    """Shard (or replicate) `model` over the data-parallel dimensions of `mesh`, in place."""
    from torch.distributed.fsdp import fully_shard

    names = mesh.mesh_dim_names
    dp_mesh = mesh["dp_replicate", "dp_shard"]  # 2-D: HSDP in general, DDP when dp_shard = 1, FSDP when replicate = 1
    for comp in COMPONENTS:
        for block in blocks_of(model, comp) or ():
            fully_shard(block, mesh=dp_mesh, mp_policy=_policy(policies[comp].precision))
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=_policy("fp32"))
    shard_group = mesh.get_group("dp_shard") if "dp_shard" in names and dims.dp_shard > 1 else None
    return GradReducer(shard_group)
