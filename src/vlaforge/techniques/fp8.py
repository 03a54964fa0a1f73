"""FP8 training of a component's linear layers with torchao's float8 (`convert_to_float8_training`).

Eligible: `nn.Linear` whose in and out features are multiples of 16 (the FP8 GEMM tile constraint), except the
LM head (its logits feed a softmax over the vocabulary, the classic fp8 casualty). Everything else in the component
computes in bf16 (the autocast region `apply_precision` puts around it). Weights stay in the master dtype under the
same parameter names, so checkpoints do not change.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

EXCLUDED_NAMES = ("lm_head",)
DIM_MULTIPLE = 16


class Fp8SlowWarning(UserWarning):
    """The device has no FP8 matmul units: fp8 layers run for correctness and are slower than bf16."""


@dataclass
class Fp8Report:
    """What one conversion did, by qualified name inside the component."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason

    def summary(self, component: str) -> str:
        skipped = ", ".join(f"{n} ({why})" for n, why in self.skipped.items()) or "none"
        return f"{component}: {len(self.converted)} linears in fp8; skipped: {skipped}"


def eligibility(name: str, module: nn.Module) -> str | None:
    """None when `module` may run in fp8, else why not."""
    if name.split(".")[-1] in EXCLUDED_NAMES:
        return "LM head"
    dims = (module.in_features, module.out_features)
    if any(d % DIM_MULTIPLE for d in dims):
        return f"dims {dims[0]}x{dims[1]} not multiples of {DIM_MULTIPLE}"
    return None


def fp8_matmul_available(device: torch.device) -> bool:
    """True on GPUs with FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def convert_fp8(module: nn.Module, recipe: str) -> Fp8Report:
    """Swap the eligible `nn.Linear` layers of `module` for torchao `Float8Linear` in place."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from vlaforge.models.families import expert_modules

    report = Fp8Report()
    for name in expert_modules(module):  # named, not silently left in the component's dtype
        report.skipped[name] = "mixture-of-experts weights (3-D stacked experts; Float8Linear converts nn.Linear)"
    for name, sub in module.named_modules():
        if type(sub) is nn.Linear:
            reason = eligibility(name, sub)
            if reason is None:
                report.converted.append(name)
            else:
                report.skipped[name] = reason
    if report.converted:
        chosen = set(report.converted)
        convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda _mod, fqn: fqn in chosen)
    return report


_warned: set[str] = set()


def warn_if_slow(device: torch.device) -> None:
    """Warn once per device kind that fp8 will be slower here, not faster."""
    if fp8_matmul_available(device) or device.type in _warned:
        return
    _warned.add(device.type)
    what = "CPU" if device.type == "cpu" else \
        f"this GPU (compute capability {torch.cuda.get_device_capability(device)})"
    warnings.warn(f"{what} has no FP8 matmul units: fp8 layers run for correctness only and are slower than bf16; "
                  "use bf16 here and fp8 on H100/H200/B200-class GPUs", Fp8SlowWarning, stacklevel=3)
