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

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

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
    tp_partial: list = field(default_factory=list)  # parameters whose gradients are partial sums over TP ranks

    pp_tied: list = field(default_factory=list)  # this stage's copy of a weight tied across the first and last stage
    pp_tied_group: Any = None  # the first and the last stage's rank of this pipeline
    norm_skip: set = field(default_factory=set)  # ids of gradients another stage counts in the norms (tied copies)

    def sum_tp_partial(self) -> None:
        """Add up, over the TP group, the gradients each TP rank holds a part of (per-head q/k norms: a rank's
        heads only), as transformers' `replicated_with_grad_allreduce` does; after backward, before any norm."""
        self._sum_grads(self.tp_partial, self.tp_group)

    def sum_pp_tied(self) -> None:
        """Add up the gradients of the weights the first and the last pipeline stage share (tied token embeddings
        and LM head: the lookup's gradient on stage 0, the head's on the last, as Megatron's embedding group does),
        so both copies take the same optimizer step; after backward, before any norm."""
        self._sum_grads(self.pp_tied, self.pp_tied_group)

    def _sum_grads(self, params: list, group) -> None:
        grads = [self.local(p.grad) for p in params if p.grad is not None]
        if grads and group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])

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


def _shard_joint(layer: nn.Module, blocks: list[nn.Module], mesh, mp_policy) -> None:
    """A LeRobot policy's joint layer (models/policies/joint.py) as one FSDP2 unit: its VLM block and expert block
    sharded as one group (`fully_shard([vlm, expert])`: one all-gather, one reduce-scatter), gathered around the joint
    layer's forward - the blocks stay where their components hold them (their parameter names unchanged), and the
    joint layer, which calls their sub-layers directly, is where the group's forward hooks go.

    NOTE: FSDP2 registers a unit's hooks on the modules given to `fully_shard`, whose own `forward` never runs here;
    they move to the joint layer (the state's `_pre_forward` / `_post_forward`, as FSDP2 registers them for a
    one-module unit). Checked against one process in tests/test_lerobot_policy_techniques.py."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(blocks if len(blocks) > 1 else blocks[0], mesh=mesh, mp_policy=mp_policy)
    state = blocks[0]._get_fsdp_state()
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    state._pre_forward_hook_handle = layer.register_forward_pre_hook(state._pre_forward, prepend=True,
                                                                     with_kwargs=True)
    state._post_forward_hook_handle = layer.register_forward_hook(state._post_forward, prepend=False)


def _policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)


def _styles(kind: str, sequence_parallel: bool):
    """transformers' TP style name -> a DTensor ParallelStyle (Megatron's split: column-parallel into the heads /
    FFN width, row-parallel out of them; `_gather_output` / `_split_input`: a fused projection whose output is
    gathered whole and the matching row-parallel layer that slices its replicated input). Under sequence parallel a
    row-parallel layer reduce-scatters its output over the sequence instead of all-reducing it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    return {"colwise": lambda: ColwiseParallel(),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise": lambda: RowwiseParallel(**out),
            "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), **out)}[kind]()


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> list[str]:
    """Tensor-parallel the LLM's blocks (DTensor `parallelize_module`) with the family's own plan
    (`families.tp_plan`: the config's `base_model_tp_plan`); the rest stays replicated over TP. Returns the names
    of the parameters whose gradients are partial sums over the TP ranks (per-head q/k norms: each rank holds some
    heads), which `GradReducer.sum_tp_partial` adds up after backward.

    `sequence_parallel` (Megatron-style SP): between the TP regions - the block's norms (two in Llama, four in
    Gemma3, one in Phi) and the residual adds - the blocks hold 1/tp of the tokens. Each sub-layer all-gathers its
    input (instead of taking it whole) and reduce-scatters its output (instead of all-reducing it), so the same
    bytes move and the norms' and residual stream's activations shrink by tp. The stack enters on a slice of the
    embeddings and leaves through an all-gather before the final norm, so everything outside the blocks is
    unchanged."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

    from vlaforge.models.families import block_norms, llm_parts, tp_plan

    parts = llm_parts(model.llm)
    styles = tp_plan(model.llm.config)
    plan: dict[str, Any] = {name: _styles(kind, sequence_parallel) for name, kind in styles.items()
                            if kind != "replicated_with_grad_allreduce"}
    partial = [name for name, kind in styles.items() if kind == "replicated_with_grad_allreduce"]
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),), "use_local_output": True}
    blocks = parts.blocks
    if sequence_parallel:
        first = blocks[0]
        # NOTE: local outputs: a post-norm's output (Gemma3, OLMo2) meets the local residual stream in an add
        plan.update({name: SequenceParallel(use_local_output=True) for name in block_norms(first)})
        # the sub-layers that open a TP region: the attention and the MLP modules holding the column-parallel
        # layers, whose input (the residual stream or a norm's output) is sequence-sharded
        for region in sorted({name.split(".")[0] for name in styles}):
            plan[region] = _GatherInput(tp_mesh)
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(Shard(1),),
                                                                  use_local_output=True))
        parallelize_module(parts.final_norm, tp_mesh, PrepareModuleInput(**gather))
    prefix = {id(m): n for n, m in model.named_modules()}
    names = []
    for block in blocks:
        for sub in partial:
            module = block.get_submodule(sub)
            names += [f"{prefix[id(module)]}.{p}" for p, _ in module.named_parameters()]
    return names


class _GatherInput(ParallelStyle):
    """A ParallelStyle: a forward pre-hook: the module's first tensor input (positional, or the `hidden_states`
    keyword as transformers' attention modules take it) arrives sequence-sharded and is all-gathered; its backward
    reduce-scatters. Families differ in how the block passes it, so one hook handles both forms."""

    def __init__(self, mesh):
        self.mesh = mesh

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return module

    def _gather(self, x):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, (Shard(1),), run_check=False)
        return x.redistribute(self.mesh, (Replicate(),)).to_local()

    def _hook(self, module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (self._gather(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": self._gather(kwargs["hidden_states"])}
        raise RuntimeError(f"sequence parallel: {type(module).__name__} got no hidden_states to gather")


def parallelize(model: nn.Module, dims, mesh, policies: Mapping[str, Any], root: nn.Module | None = None
                ) -> GradReducer:
    """Tensor-parallel the LLM over `mesh["tp"]` when tp > 1, then shard (or replicate) over the data-parallel
    dimensions, in place: the two layout steps of `apply.apply_techniques`, for a model with no other technique."""
    partial = apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel) if dims.tp > 1 else []
    return apply_data_parallel(model, dims, mesh, policies, root, tp_partial=partial)


def apply_data_parallel(model: nn.Module, dims, mesh, policies: Mapping[str, Any], root: nn.Module | None = None,
                        tp_partial: list[str] = ()) -> GradReducer:
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
            members = getattr(block, "fsdp_members", None)
            if members is not None:  # a LeRobot policy's joint layer: its two blocks, one unit
                _shard_joint(block, members(), dp_mesh, _policy(policies[comp].precision))
            elif next(block.parameters(), None) is not None:
                fully_shard(block, mesh=dp_mesh, mp_policy=_policy(policies[comp].precision))
    fully_shard(root if root is not None else model, mesh=dp_mesh, reshard_after_forward=False,
                mp_policy=_policy("fp32"))
    shard_group = mesh.get_group(shard_dim) if "dp_shard" in names and dims.dp_shard * dims.cp > 1 else None
    params = dict(model.named_parameters())  # FSDP2 keeps the names (its sharded parameters replace the originals)
    return GradReducer(shard_group, mesh.get_group("tp") if dims.tp > 1 else None,
                       mesh.get_group("pp") if dims.pp > 1 else None,
                       tp_partial=[params[n] for n in tp_partial if n in params])
