"""Optimizer and schedule: one AdamW group per component (plus its no-decay twin), warmup + cosine/constant."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.techniques.freezing import ever_trains
from vlaforge.techniques.lora import is_adapter


class LRSpreadWarning(UserWarning):
    """Component learning rates differ so much that optimizer state grows uneven and the loss oscillates."""


def _no_decay(param: torch.Tensor) -> bool:
    # Norm weights, biases, scalars (e.g. the contrastive temperature) are not decayed.
    return param.ndim < 2


def owned_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Each component's parameters, in module order; tied weights belong to the first component that owns them."""
    owned, seen = {}, set()
    for name in COMPONENTS:
        owned[name] = [p for p in getattr(model, name).parameters() if id(p) not in seen]
        seen.update(id(p) for p in owned[name])
    return owned


def build_param_groups(model: nn.Module, components) -> list[dict]:
    """Groups named '<component>' and '<component>.no_decay' with the component's lr / weight decay.

    Every parameter is in a group from the start (frozen ones included) so staged unfreezing needs no rebuild;
    the frozen base of a LoRA component (which never trains) is left out.
    """
    groups = []
    for name, params in owned_parameters(model).items():
        policy = getattr(components, name)
        if getattr(policy, "lora", None) is not None:
            adapters = {id(p) for n, p in getattr(model, name).named_parameters() if is_adapter(n)}
            params = [p for p in params if id(p) in adapters]
        decay, no_decay = [], []
        for p in params:
            (no_decay if _no_decay(p) else decay).append(p)
        for suffix, params, wd in (("", decay, policy.weight_decay), (".no_decay", no_decay, 0.0)):
            if params:
                groups.append({"params": params, "lr": policy.lr, "weight_decay": wd,
                               "name": name + suffix, "component": name})
    return groups


def check_lr_spread(components, limit: float) -> str | None:
    """A warning text when max/min lr over components that ever train exceeds `limit`."""
    lrs = {n: p.lr for n, p in components.items() if ever_trains(p)}
    if len(lrs) < 2:
        return None
    hi, lo = max(lrs, key=lrs.get), min(lrs, key=lrs.get)
    ratio = lrs[hi] / lrs[lo]
    if ratio <= limit:
        return None
    return (f"components.{hi}.lr ({lrs[hi]:g}) is {ratio:.0f}x components.{lo}.lr ({lrs[lo]:g}), more than "
            f"{limit:g}x: Adam state becomes uneven and the loss tends to oscillate; narrow the spread or freeze "
            f"{lo} instead")


def build_optimizer(model: nn.Module, cfg, extra_params: list[nn.Parameter] = (),
                    projections: list[nn.Parameter] = ()) -> torch.optim.AdamW:
    """AdamW over per-component groups; `extra_params` (learned loss weights) get a 'loss_weighting' group, and
    `projections` (distillation's feature maps) a 'distill_projections' group at the llm's lr."""
    message = check_lr_spread(cfg.components, cfg.train.lr_ratio_warning)
    if message:
        warnings.warn(message, LRSpreadWarning, stacklevel=2)
    groups = build_param_groups(model, cfg.components)
    extra = list(extra_params)
    if extra:
        groups.append({"params": extra, "lr": cfg.loss.weighting_lr, "weight_decay": 0.0,
                       "name": "loss_weighting", "component": "loss_weighting"})
    if projections:
        groups.append({"params": list(projections), "lr": cfg.components.llm.lr, "weight_decay": 0.0,
                       "name": "distill_projections", "component": "distill"})
    # NOTE: foreach (multi-tensor) kernels; torch picks them by default on CUDA only.
    return torch.optim.AdamW(groups, betas=cfg.train.betas, eps=cfg.train.eps, foreach=True)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of each group's base lr at optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, train_cfg.steps, train_cfg.warmup_steps, train_cfg.lr_schedule,
                         train_cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
