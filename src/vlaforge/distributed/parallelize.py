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
from vlaforge.models.blocks import blocks_of
from vlaforge.techniques.precision import DTYPES


@dataclass
class GradReducer:
    """Global views of per-rank gradient statistics. `shard_group`: ranks that hold different FSDP shards of a
    parameter; `tp_group`: ranks that hold different tensor-parallel slices of the LLM's TP-sharded weights. Sums
    of squares and counts add up over the shard group, and for TP-sharded weights over the TP group too (weights
    replicated over TP must not be counted once per TP rank). The world agrees on overflow and averages metrics."""

    shard_group: Any = None
    tp_group: Any = None
    pp_group: Any = None  # pipeline stages hold different parameters: their sums add up too

    def tp_sharded(self, t: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor, Shard

        if self.tp_group is None or not isinstance(t, DTensor):
            return False
        names = t.device_mesh.mesh_dim_names or ()
        return any(n == "tp" and isinstance(pl, Shard) for n, pl in zip(names, t.placements))

    def combine(self, replicated: torch.Tensor, tp_sharded: torch.Tensor) -> torch.Tensor:
        """Global sums from this rank's partial sums over weights replicated over TP and weights sharded by it."""
        if self.tp_group is not None:
            dist.all_reduce(tp_sharded, op=dist.ReduceOp.SUM, group=self.tp_group)
        return self.sum_shards(replicated + tp_sharded)

    @staticmethod
    def local(t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def sum_shards(self, t: torch.Tensor) -> torch.Tensor:
        """Summed over the ranks that hold different pieces of the model (FSDP shards, pipeline stages)."""
        for group in (self.shard_group, self.pp_group):
            if group is not None:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
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
    def spread(value: float, device: torch.device) -> tuple[float, float, int]:
        """(largest, smallest, rank of the largest) of one number over every rank (one all-reduce)."""
        t = torch.zeros(dist.get_world_size(), device=device)
        t[dist.get_rank()] = value
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.max()), float(t.min()), int(t.argmax())

    @staticmethod
    def any_rank(flag: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    @staticmethod
    def mean_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's metrics averaged (one all-reduce of the stacked values)."""
        if not values:
            return values
        keys = sorted(values)  # the same order on every rank
        stacked = torch.stack([torch.as_tensor(values[k]).detach().float().reshape(()) for k in keys])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        stacked /= dist.get_world_size()
        return dict(zip(keys, stacked.unbind()))


def _policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)


# Megatron's split of a Llama block: column-parallel into the heads / FFN width, row-parallel out of them.
LLM_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
               "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
               "mlp.down_proj": "rowwise"}


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    """Tensor-parallel the LLM's blocks (DTensor `parallelize_module`); the rest stays replicated over TP.

    `sequence_parallel` (Megatron-style SP): between the TP regions - the two RMSNorms and the residual adds - the
    blocks hold 1/tp of the tokens. Each sub-layer all-gathers its normed input (instead of taking it whole) and
    reduce-scatters its output (instead of all-reducing it), so the same bytes move and the norms' and residual
    stream's activations shrink by tp. The stack enters on a slice of the embeddings and leaves through an
    all-gather before the final norm, so everything outside the blocks is unchanged."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in LLM_TP_PLAN.items()}
    if sequence_parallel:
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),), "use_local_output": True}
        plan.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
            "mlp": PrepareModuleInput(**gather),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    blocks = blocks_of(model, "llm")
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(Shard(1),),
                                                                  use_local_output=True))
        parallelize_module(model.llm.model.norm, tp_mesh, PrepareModuleInput(**gather))


def parallelize(model: nn.Module, dims, mesh, policies: Mapping[str, Any], root: nn.Module | None = None
                ) -> GradReducer:
    """Tensor-parallel the LLM over `mesh["tp"]` when tp > 1, then shard (or replicate) over the data-parallel
    dimensions, in place: the two layout steps of `apply.apply_techniques`, for a model with no other technique."""
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel)
    return apply_data_parallel(model, dims, mesh, policies, root)


def apply_data_parallel(model: nn.Module, dims, mesh, policies: Mapping[str, Any], root: nn.Module | None = None
                        ) -> GradReducer:
    """Shard (FSDP2), shard and replicate (HSDP) or replicate (DDP on FSDP2's replicate dimension) every block and
    the root over the data-parallel dimensions (and cp). `root`: the module whose forward runs the step (a pipeline
    stage's module over `model`'s components; `model` by default) - FSDP2's root unit."""
    from torch.distributed.fsdp import fully_shard

    names = mesh.mesh_dim_names
    shard_dim = "dp_shard"
    if dims.cp > 1:  # context-parallel ranks hold the same weights and split the tokens: shard over them too
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        shard_dim = "dp_shard_cp"
    dp_mesh = mesh["dp_replicate", shard_dim]  # 2-D: HSDP in general, DDP when dp_shard = 1, FSDP when replicate = 1
    for comp in COMPONENTS:
        for block in blocks_of(model, comp) or ():
            fully_shard(block, mesh=dp_mesh, mp_policy=_policy(policies[comp].precision))
    fully_shard(root if root is not None else model, mesh=dp_mesh, reshard_after_forward=False,
                mp_policy=_policy("fp32"))
    shard_group = mesh.get_group(shard_dim) if "dp_shard" in names and dims.dp_shard * dims.cp > 1 else None
    return GradReducer(shard_group, mesh.get_group("tp") if dims.tp > 1 else None,
                       mesh.get_group("pp") if dims.pp > 1 else None)
