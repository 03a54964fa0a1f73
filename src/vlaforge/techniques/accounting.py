"""Exact activation accounting: bytes saved for backward, per component and per block.

Measured with `saved_tensors_hooks` during a real forward pass (real tensors, or fake ones under
`FakeTensorMode`): every tensor autograd saves is attributed to the component and block whose forward is
running, deduplicated by storage (a tensor and its views, or two ops saving the same tensor, count once), and
parameters (and views of them) are excluded. Autocast's low-precision copies of fp32 master weights, which
matmuls save for backward (2 bytes per parameter in bf16, alive until that layer's backward), are counted apart
as `weight_casts`: they are real memory but scale with parameters, not with tokens. Where memory techniques act,
they report here too:
- activation offload (techniques/offload.py) records what it moved to CPU / NVMe, not on the device;
- selective checkpointing records the op outputs its policy keeps (they are cached outside autograd's saved
  tensors, so hooks alone would miss them); a fully checkpointed block saves only its inputs.
This is the ground truth the profiler (`vlaforge profile`) and the planner share.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from vlaforge import COMPONENTS
from vlaforge.models.blocks import blocks_of

DEVICE, CPU, NVME = "device", "cpu", "nvme"
_location: list[tuple[str, int | None]] = []  # (component, block index) stack, innermost last
_active: list["SavedBytes"] = []


def track_locations(model: nn.Module) -> None:
    """Register (once) forward hooks that keep `current_location()` up to date."""
    if getattr(model, "_vlaforge_locations", False):
        return
    model._vlaforge_locations = True
    for comp in COMPONENTS:
        if not hasattr(model, comp):  # any module can be counted; only a VLA's parts are located
            continue
        _push_pop(getattr(model, comp), comp, None)
        blocks = blocks_of(model, comp)
        for i, block in enumerate(blocks or ()):
            _push_pop(block, comp, i)


def _push_pop(module: nn.Module, comp: str, index: int | None) -> None:
    push_pop_hooks(module, _location, (comp, index))


def push_pop_hooks(module: nn.Module, stack: list, value: Any) -> None:
    """Forward hooks that push `value` on `stack` while `module`'s forward runs (hooks return None: a forward hook's
    return value would replace the module's output)."""
    def push(m: nn.Module, args: tuple) -> None:
        stack.append(value)

    def pop(m: nn.Module, args: tuple, out: Any) -> None:
        stack.pop()

    module.register_forward_pre_hook(push, prepend=True)
    module.register_forward_hook(pop, always_call=True)


def current_location() -> tuple[str, int | None]:
    return _location[-1] if _location else ("other", None)


_PASS_THROUGH = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                 "ExpandBackward0", "UnsafeViewBackward0"}


def is_weight_cast(t: torch.Tensor) -> bool:
    """True when `t` is a parameter converted (and maybe viewed), with no compute in between: its autograd history
    leads through casts and views straight to a parameter's AccumulateGrad."""
    fn = t.grad_fn
    seen_cast = False
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return seen_cast
        if name not in _PASS_THROUGH:
            return False
        seen_cast |= name == "ToCopyBackward0"
        fn = fn.next_functions[0][0]
    return False


def storage_key(t: torch.Tensor) -> Any:
    return StorageWeakRef(t.untyped_storage())


def tensor_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class SavedBytes:
    """Bytes saved for backward by place (device / cpu / nvme), component and block."""

    params: set = field(default_factory=set)
    casts: set = field(default_factory=set)  # storages of frozen parameters' casts (`_FrozenCasts`)
    seen: set = field(default_factory=set)
    by_block: dict = field(default_factory=lambda: defaultdict(int))  # (place, comp, block) -> bytes
    weight_casts: dict = field(default_factory=lambda: defaultdict(int))  # comp -> bytes

    def record(self, t: torch.Tensor, place: str = DEVICE) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        key = storage_key(t)
        if key in self.params or key in self.seen:
            return
        self.seen.add(key)
        comp, block = current_location()
        if key in self.casts or is_weight_cast(t):
            self.weight_casts[comp] += tensor_bytes(t)
        else:
            self.by_block[(place, comp, block)] += tensor_bytes(t)

    def total(self, place: str = DEVICE) -> int:
        return sum(v for (p, _, _), v in self.by_block.items() if p == place)

    def per_component(self, place: str = DEVICE) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (p, comp, _), v in self.by_block.items():
            if p == place:
                out[comp] += v
        return dict(out)

    def per_block(self, component: str, place: str = DEVICE) -> dict[str, int]:
        """Bytes per block index ('rest' = the component's non-block parts: embeddings, final norm, head)."""
        out: dict[str, int] = defaultdict(int)
        for (p, comp, block), v in self.by_block.items():
            if p == place and comp == component:
                out["rest" if block is None else str(block)] += v
        return dict(out)


def record(t: torch.Tensor, place: str = DEVICE) -> None:
    """Report a tensor kept for backward to the accounting in progress, if any."""
    if _active:
        _active[-1].record(t, place)


def counting() -> bool:
    """Whether an accounting is in progress (`count_saved`)."""
    return bool(_active)


@contextlib.contextmanager
def count_saved(model: nn.Module) -> Iterator[SavedBytes]:
    """Count what the forward passes run inside this block save for backward."""
    track_locations(model)
    # a torchao weight (LoRA's NF4 base) is a wrapper: its own storage and its inner tensors' are parameters
    acc = SavedBytes(params={storage_key(t) for p in model.parameters() for t in {p, *inner_tensors(p)}})

    def pack(t: torch.Tensor) -> torch.Tensor:
        acc.record(t)
        return t

    _active.append(acc)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FrozenCasts(acc):
            yield acc
    finally:
        _active.pop()


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data: itself, or a torchao subclass's inner tensors (an NF4 weight's)."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in inner_tensors(getattr(t, n))]
    return [t]


class _FrozenCasts(TorchDispatchMode):
    """Marks autocast's copies of *frozen* parameters as weight casts: a trainable parameter's copy is found by its
    autograd history (`is_weight_cast`), a frozen one's has none (LoRA's base weights under bf16 compute)."""

    def __init__(self, acc: "SavedBytes"):
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) \
                and not is_traceable_wrapper_subclass(args[0]) and storage_key(args[0]) in self.acc.params:
            self.acc.casts.add(storage_key(out))
        return out
