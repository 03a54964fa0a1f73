"""`apply_precision`: per-component compute dtype as autocast regions around each component's forward.

Why autocast regions and not module casting: weights stay fp32 (they are the master copy the optimizer updates,
`train.precision_master = "fp32"`), matmuls run in bf16, and the ops autocast keeps in fp32 (softmax, norms,
losses) stay there - exact where it matters, fast where it counts, and no second weight copy to keep in sync.
A component in fp32 runs with autocast off and its floating inputs cast to fp32, so it is fp32 whatever its
neighbours do.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from vlaforge import COMPONENTS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True  # CPU autocast supports bf16 everywhere (fast with avx512_bf16/AMX).


def apply_precision(model: nn.Module, policies: Mapping[str, Any], device: torch.device) -> dict[str, str]:
    """Wrap each component's forward in an autocast region of its configured precision.

    Args:
        policies: component name -> object with a `precision` attribute ("fp32" | "bf16").
        device: where the model runs; bf16 falls back to fp32 (with one warning) where it is unsupported.

    Returns:
        The precision each component actually uses.
    """
    used = {}
    for name in COMPONENTS:
        precision = policies[name].precision
        if precision == "bf16" and not bf16_supported(device):
            warnings.warn(f"{device} does not support bf16; components.{name} runs in fp32", stacklevel=2)
            precision = "fp32"
        _AutocastRegion(getattr(model, name), device.type, DTYPES[precision])
        used[name] = precision
    return used


class _AutocastRegion:
    """Forward pre/post hooks that enter and leave `torch.autocast` around one module's forward."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype
        self.stack: list[torch.autocast] = []
        module.register_forward_pre_hook(self.enter, with_kwargs=True)
        module.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        enabled = self.dtype != torch.float32
        ctx = torch.autocast(self.device_type, dtype=torch.bfloat16 if not enabled else self.dtype,
                             enabled=enabled)
        ctx.__enter__()
        self.stack.append(ctx)
        if not enabled:
            args, kwargs = _to_fp32(args), _to_fp32(kwargs)
        return args, kwargs

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop().__exit__(None, None, None)


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() and obj.dtype != torch.float32 else obj
    if isinstance(obj, tuple):
        return tuple(_to_fp32(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_fp32(v) for k, v in obj.items()}
    return obj
