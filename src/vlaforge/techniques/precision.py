"""`apply_precision`: per-component compute dtype as autocast regions around each component's forward.

Why autocast regions and not module casting: weights stay in the master dtype (fp32 by default,
`train.precision_master`), which is what the optimizer updates, while matmuls and convolutions run in bf16/fp16.
Ops that autocast keeps in fp32 stay there: on CUDA that includes softmax, log_softmax, layer_norm and the losses;
on CPU, layer_norm and softmax run in their input's dtype (accumulating in fp32 inside the kernel). Llama's RMSNorm
upcasts to fp32 itself, SDPA accumulates its softmax in fp32, and vlaforge's losses upcast their inputs. Casting
the modules instead would need a second (master) weight copy kept in sync by hand and would push the norms into
half precision too. A component in fp32 runs with autocast off and its floating inputs cast to fp32, so it is fp32
whatever its neighbours do.

`fp8`: the component's eligible linears become torchao `Float8Linear` (techniques/fp8.py) and the rest of it
computes in bf16.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.models.blocks import blocks_of, components_with_blocks
from vlaforge.techniques.fp8 import Fp8Report, convert_fp8, warn_if_slow

# Compute dtype of the autocast region per precision (fp8: linears in fp8, everything else in bf16).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class PrecisionSetup:
    """What `apply_precision` did."""

    used: dict[str, str]  # component -> precision it computes in
    master: dict[str, torch.dtype]  # component -> dtype of its weights, gradients and optimizer state
    fp8: dict[str, Fp8Report] = field(default_factory=dict)

    def computes_in(self, precision: str) -> list[str]:
        return [c for c, p in self.used.items() if p == precision]

    def to_json(self) -> dict:
        return {"compute": self.used, "master": {c: str(d).removeprefix("torch.") for c, d in self.master.items()},
                "fp8": {c: {"converted": r.converted, "skipped": r.skipped} for c, r in self.fp8.items()}}

    def summary(self) -> str:
        parts = [" ".join(f"{c}={p}" for c, p in self.used.items())]
        parts += [r.summary(c) for c, r in self.fp8.items()]
        return "; ".join(parts)


def master_dtype(precision: str, master: str = "fp32") -> torch.dtype:
    """The dtype of a component's weights: `train.precision_master` unless it computes in fp32."""
    return MASTER_DTYPES[master] if precision != "fp32" else torch.float32


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True  # CPU autocast supports bf16 everywhere (fast with avx512_bf16/AMX).


def apply_precision(model: nn.Module, policies: Mapping[str, Any], device: torch.device,
                    master: str = "fp32") -> PrecisionSetup:
    """Give each component its compute precision; call before the optimizer is built.

    Args:
        policies: component name -> object with `precision` ("fp32" | "bf16" | "fp16" | "fp8") and `fp8_recipe`.
        device: where the model runs (bf16 falls back to fp32 with one warning where it is unsupported).
        master: dtype of the weights of components that do not compute in fp32 ("fp32" | "bf16").
    """
    used, masters, reports = {}, {}, {}
    for name in COMPONENTS:
        module = getattr(model, name)
        precision = policies[name].precision
        if precision in ("bf16", "fp8") and not bf16_supported(device):
            if precision == "fp8":
                raise VlaforgeError(f"components.{name}.precision = 'fp8' needs bf16 support, which {device} "
                                    "lacks; use 'fp16' or 'fp32'")
            warnings.warn(f"{device} does not support bf16; components.{name} runs in fp32", stacklevel=2)
            precision = "fp32"
        if precision == "fp8":
            warn_if_slow(device)
            reports[name] = convert_fp8(module, policies[name].fp8_recipe)
        masters[name] = master_dtype(precision, master)
        if masters[name] != torch.float32:
            module.to(masters[name])
        units = {id(b) for c in components_with_blocks(model) for b in blocks_of(model, c)}
        for region in _regions(model, name):
            _AutocastRegion(region, device.type, DTYPES[precision], eager=id(region) in units)
        used[name] = precision
    return PrecisionSetup(used, masters, reports)


def _regions(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules whose forwards compute component `name`: the component itself, or what the model names (a
    LeRobot policy's joint layers call their blocks' sub-layers directly: `PolicyVLA.precision_regions`)."""
    find = getattr(model, "precision_regions", None)
    return find(name) if find is not None else [getattr(model, name)]


class _AutocastRegion:
    """Forward pre/post hooks that enter and leave `torch.autocast` around one module's forward."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype, eager: bool = False):
        self.device_type, self.dtype = device_type, dtype
        self.stack: list[torch.autocast] = []
        # NOTE: `eager`: the region is itself a block `train.compile` compiles (a LeRobot policy's joint layer): its
        # hooks run outside the graph (traced, the autocast would be entered in the graph and left outside it)
        wrap = torch._dynamo.disable if eager else (lambda f: f)
        module.register_forward_pre_hook(wrap(self.enter), with_kwargs=True)
        module.register_forward_hook(wrap(self.leave), always_call=True)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        enabled = self.dtype != torch.float32
        ctx = torch.autocast(self.device_type, dtype=torch.bfloat16 if not enabled else self.dtype,
                             enabled=enabled)
        ctx.__enter__()
        self.stack.append(ctx)
        if not enabled:
            args, kwargs = cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)
        return args, kwargs

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop().__exit__(None, None, None)


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every floating tensor in it (tensors, tuples, lists, dicts, ModelOutputs) cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if hasattr(obj, "to_tuple"):  # a transformers ModelOutput: its fields are its items, set in place
        for k, v in obj.items():
            obj[k] = cast_floating(v, dtype)
        return obj
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [cast_floating(o, dtype) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
