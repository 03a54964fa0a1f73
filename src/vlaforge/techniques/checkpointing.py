"""`apply_checkpointing`: per-component activation checkpointing, per transformer block, non-reentrant.

Strategies (`components.<name>.checkpointing`):
- `full`: a block keeps only its inputs and recomputes everything in backward;
- `selective`: an op-level policy (`create_selective_checkpoint_contexts`) keeps the attention's matmuls (the
  q/k/v/o projections) and the SDPA output and recomputes the FFN and every elementwise op (norms, rotary,
  activations, residual adds); its dispatch mode runs over the attention sub-layer only (`_RoutedMode`);
- `selective_attn`: recompute only the attention sub-layer (checkpointed as a module: it keeps its input), and
  the rest of the block saves what autograd saves;
- `selective_ffn`: the same for the FFN sub-layer;
- `every_nth`: `full` on one block of every `checkpoint_every_n` (blocks 0, N, 2N, ...).
The projector and the action head have no blocks: `full` checkpoints the whole module, other strategies are
refused by the config. The block's `forward` is replaced on the instance, so parameter names, hooks and
checkpoints are unchanged. Autocast state and RNG are restored in the recomputation by torch.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vlaforge import COMPONENTS
from vlaforge.models.blocks import blocks_of
from vlaforge.techniques import accounting as memory

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default}
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default}
# Sub-layer names inside a block: transformers' Llama, SigLIP and CLIP (self_attn, mlp); DINOv2 and GPT-NeoX
# (attention, mlp); Qwen-VL's tower (attn, mlp).
SUBLAYERS = {"attn": ("self_attn", "attention", "attn"), "ffn": ("mlp",)}
_region: list[str] = []  # "attn" / "ffn" while that sub-layer's forward runs


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep attention's matmuls and SDPA outputs, recompute everything else; report kept outputs to the accounting
    (they are cached outside autograd's saved tensors)."""
    keep = bool(_region) and _region[-1] == "attn" and (func in MATMULS or func in ATTENTION)
    if keep and not ctx.is_recompute:
        torch.utils._pytree.tree_map_only(torch.Tensor, memory.record, ctx.op_output)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def sublayer(block: nn.Module, region: str) -> nn.Module:
    for name in SUBLAYERS[region]:
        sub = getattr(block, name, None)
        if sub is not None:
            return sub
    raise ValueError(f"{type(block).__name__} has no {region} sub-layer (looked for {SUBLAYERS[region]})")


class _RoutedMode:
    """The context a selective checkpoint enters around its block (forward, then recomputation): it does not push
    the SAC dispatch mode over the whole block but makes it the one the block's attention sub-layer enters
    (`_in_sac_mode`). Only attention's ops then pass through torch's Python dispatch mode - the ops the policy may
    keep - and every other op runs at native speed; those are recomputed either way (the non-reentrant checkpoint's
    saved-tensor hooks see them), so what is kept and what is re-run is exactly the whole-block mode's."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        _modes.append(self.mode)

    def __exit__(self, *exc):
        _modes.pop()


_modes: list = []  # the SAC dispatch mode of the selective checkpoint running now (forward or recompute)


def routed_contexts():
    """`context_fn` of a selective checkpoint: torch's SAC modes (one storage), routed to the attention sub-layer."""
    forward, recompute = create_selective_checkpoint_contexts(selective_policy)
    return _RoutedMode(forward), _RoutedMode(recompute)


def _in_sac_mode(module: nn.Module) -> None:
    """Run `module` (a block's attention sub-layer) inside the running selective checkpoint's dispatch mode."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not _modes:
            return inner(*args, **kwargs)
        with _modes[-1]:
            return inner(*args, **kwargs)

    module.forward = forward


def checkpoint_block(block: nn.Module, strategy: str) -> None:
    if strategy in ("full", "every_nth"):
        checkpoint_module(block)
    elif strategy == "selective":
        attn = sublayer(block, "attn")
        memory.push_pop_hooks(attn, _region, "attn")
        _in_sac_mode(attn)
        checkpoint_module(block, selective=True)
    else:  # selective_attn / selective_ffn
        checkpoint_module(sublayer(block, strategy.removeprefix("selective_")))


def checkpoint_module(module: nn.Module, selective: bool = False) -> None:
    """Make `module`'s forward recompute in backward: all of it, or what `selective_policy` does not keep."""
    inner = module.forward
    whole = functools.partial(create_selective_checkpoint_contexts, selective_policy)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        # NOTE: torch.compile takes only torch's own SAC modes over the whole region (the policy's region check
        # then keeps the same ops)
        extra = {"context_fn": whole if torch.compiler.is_compiling() else routed_contexts} if selective else {}
        # checkpoint keeps keyword tensors (Llama's attention input, mask, rotary cos/sin) alive by reference,
        # outside autograd's saved tensors (positional ones go through them): report them to the accounting
        for value in torch.utils._pytree.tree_leaves(kwargs):
            memory.record(value)
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def apply_checkpointing(model: nn.Module, policies: Mapping[str, Any]) -> dict[str, list[int] | str]:
    """Apply each component's `checkpointing` strategy. Returns what was wrapped: block indices per component
    with blocks, 'module' for a whole checkpointed module."""
    done: dict[str, list[int] | str] = {}
    memory.track_locations(model)
    for name in COMPONENTS:
        strategy = policies[name].checkpointing
        if strategy == "none":
            continue
        blocks = blocks_of(model, name)
        if blocks is None:  # projector / action head: the config allows only 'full' here
            checkpoint_module(getattr(model, name))
            done[name] = "module"
            continue
        every = getattr(policies[name], "checkpoint_every_n", 2)
        chosen = [i for i in range(len(blocks)) if strategy != "every_nth" or i % every == 0]
        for i in chosen:
            checkpoint_block(blocks[i], strategy)
        done[name] = chosen
    return done
