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
A block's attention and FFN sub-layers are where its family's row says (`block_sublayers`); a block no row names is
refused in one line by the strategies that need them. The projector and the action head have no blocks: `full`
checkpoints the whole module, other strategies are refused by the config. The block's `forward` is replaced on the
instance, so parameter names, hooks and checkpoints are unchanged. Autocast state and RNG are restored in the
recomputation by torch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.models.blocks import blocks_of
from vlaforge.models.families import LLM_BLOCKS, Sublayers
from vlaforge.models.vision import VISION_FAMILIES
from vlaforge.techniques import accounting as memory

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default}
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default}
_region: list[str] = []  # "attn" / "ffn" while that sub-layer's forward runs


def _kept(func) -> bool:
    """Whether selective checkpointing keeps `func`'s output: attention's matmuls and SDPA, inside attention."""
    return bool(_region) and _region[-1] == "attn" and (func in MATMULS or func in ATTENTION)


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep attention's matmuls and SDPA outputs, recompute everything else. It reads only `func`: torch 2.11 calls
    the policy before the op runs (no `ctx.op_output`), 2.13 after; the kept outputs reach the accounting through
    `_KeptRecorder`, which sees them in both."""
    return CheckpointPolicy.MUST_SAVE if _kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


class _KeptRecorder(TorchDispatchMode):
    """Below the SAC mode while an accounting counts (`memory.counting()`), in the forward only: reports the outputs
    the policy keeps, which the SAC mode caches outside autograd's saved tensors (so its hooks never see them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _kept(func):
            torch.utils._pytree.tree_map_only(torch.Tensor, memory.record, out)
        return out


def block_sublayers(block: nn.Module) -> Sublayers:
    """Where `block` keeps its attention and feed-forward sub-layers: its family's row (models/families.py for LLM
    blocks, models/vision.py for towers), found by the block's class (FSDP2 subclasses it).

    Raises:
        VlaforgeError: no row names the block's class.
    """
    rows = {**LLM_BLOCKS, **{fam.block: fam.sublayers for fam in VISION_FAMILIES if fam.block}}
    for cls in type(block).__mro__:
        if cls.__name__ in rows:
            return rows[cls.__name__]
    raise VlaforgeError(f"no family row (models/families.py, models/vision.py) says where a {type(block).__name__} "
                        "block keeps its attention and feed-forward sub-layers, by which selective checkpointing "
                        "recomputes and the planner counts; use checkpointing = 'full' for its component")


def sublayer(block: nn.Module, region: str) -> nn.Module:
    """The attention (`region` 'attn') or feed-forward ('ffn') sub-layer of `block`, as its family's row names it.

    Raises:
        VlaforgeError: no row for the block, or the block lacks the child its row names.
    """
    rows = block_sublayers(block)
    name = rows.attn if region == "attn" else rows.ffn
    sub = getattr(block, name, None)
    if not isinstance(sub, nn.Module):
        raise VlaforgeError(f"a {type(block).__name__} block has no '{name}', which its family's row names as its "
                            f"{region} sub-layer (another transformers release?); use checkpointing = 'full'")
    return sub


class _RoutedMode:
    """The context a selective checkpoint enters around its block (forward, then recomputation): it does not push
    the SAC dispatch mode over the whole block but makes it the one the block's attention sub-layer enters
    (`_in_sac_mode`). Only attention's ops then pass through torch's Python dispatch mode - the ops the policy may
    keep - and every other op runs at native speed; those are recomputed either way (the non-reentrant checkpoint's
    saved-tensor hooks see them), so what is kept and what is re-run is exactly the whole-block mode's."""

    def __init__(self, mode, recompute: bool):
        self.mode, self.recompute = mode, recompute

    def __enter__(self):
        _modes.append(self)

    def __exit__(self, *exc):
        _modes.pop()


_modes: list[_RoutedMode] = []  # the selective checkpoint running now (forward or recompute)


def routed_contexts():
    """`context_fn` of a selective checkpoint: torch's SAC modes (one storage), routed to the attention sub-layer."""
    forward, recompute = create_selective_checkpoint_contexts(selective_policy)
    return _RoutedMode(forward, recompute=False), _RoutedMode(recompute, recompute=True)


def _in_sac_mode(module: nn.Module) -> None:
    """Run `module` (a block's attention sub-layer) inside the running selective checkpoint's dispatch mode."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not _modes:
            return inner(*args, **kwargs)
        routed = _modes[-1]
        # NOTE: the recorder is entered first, so it sits below the SAC mode and sees each op's output
        with _KeptRecorder() if memory.counting() and not routed.recompute else contextlib.nullcontext(), routed.mode:
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
