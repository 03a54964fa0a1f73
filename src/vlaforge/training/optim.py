"""Optimizer and schedule: one AdamW group per component (plus its no-decay twin unless `train.decay_all`), warmup +
cosine/constant, or LeRobot 0.6.1's cosine_decay_with_warmup."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.techniques.freezing import ever_trains
from vlaforge.techniques.lora import full_parameters, lora_trains
from vlaforge.techniques.optimizer_state import apply_optimizer_state, uses_optimizer_state


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


def build_param_groups(model: nn.Module, components, decay_all: bool = False) -> list[dict]:
    """Groups named '<component>' and '<component>.no_decay' with the component's lr / weight decay.

    Every parameter is in a group from the start (frozen ones included) so staged unfreezing needs no rebuild;
    the frozen base of a LoRA component (which never trains) is left out: its adapters and `lora.full` modules are in.
    `decay_all` (`train.decay_all`): one '<component>' group of all its parameters at its weight decay, as LeRobot's
    AdamW over a policy's parameters (no '.no_decay' groups: the update of every element is the same either way).
    """
    groups = []
    for name, params in owned_parameters(model).items():
        policy = getattr(components, name)
        if getattr(policy, "lora", None) is not None:
            module = getattr(model, name)
            full = full_parameters(module, policy.lora)
            adapters = {id(p) for n, p in module.named_parameters() if lora_trains(n, full)}
            params = [p for p in params if id(p) in adapters]
        decay, no_decay = [], []
        for p in params:
            (no_decay if _no_decay(p) and not decay_all else decay).append(p)
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
                    projections: list[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """AdamW over per-component groups; `extra_params` (learned loss weights) get a 'loss_weighting' group, and
    `projections` (distillation's feature maps) a 'distill_projections' group at the llm's lr. Components that set
    `optim_state` / `stochastic_rounding` are stepped by torchao's optimizers, all behind one optimizer
    (techniques/optimizer_state.py); without them, one fused torch AdamW."""
    message = check_lr_spread(cfg.components, cfg.train.lr_ratio_warning)
    if message:
        warnings.warn(message, LRSpreadWarning, stacklevel=2)
    groups = build_param_groups(model, cfg.components, cfg.train.decay_all)
    extra = list(extra_params)
    if extra:
        groups.append({"params": extra, "lr": cfg.loss.weighting_lr, "weight_decay": 0.0,
                       "name": "loss_weighting", "component": "loss_weighting"})
    if projections:
        groups.append({"params": list(projections), "lr": cfg.components.llm.lr, "weight_decay": 0.0,
                       "name": "distill_projections", "component": "distill"})
    components = dict(cfg.components.items())
    if uses_optimizer_state(components):
        optimizer = apply_optimizer_state(groups, components, cfg.train.betas, cfg.train.eps)
    elif not fused_supported(groups):  # NOTE: foreach (multi-tensor) kernels; torch picks them on CUDA only
        return torch.optim.AdamW(groups, betas=cfg.train.betas, eps=cfg.train.eps, foreach=True)
    else:
        optimizer = torch.optim.AdamW(groups, betas=cfg.train.betas, eps=cfg.train.eps, fused=True)
    for group in optimizer.param_groups:  # the schedule sets them on the device (`StepSchedule`)
        group.setdefault("initial_lr", float(group["lr"]))  # the schedule's base (torch's LRScheduler key), unrounded
        group["lr"] = torch.tensor(group["initial_lr"], dtype=torch.float32, device=group["params"][0].device)
    return optimizer


FUSED_DEVICES = ("cpu", "cuda")


def fused_supported(groups: list[dict]) -> bool:
    """Fused AdamW (one kernel for every tensor of a device, step counters kept on the device, and a skipped step
    decided on the device through `found_inf`): on CUDA and CPU, for floating-point parameters.

    Why fused everywhere: the first H100 run measured ~17 ms of a 97 ms step in foreach AdamW's ten passes; on this
    2-core CPU bench/optimizer.py measured fused 7-8x faster than foreach (tiny flavor's 0.74 M parameters: 20.6 vs
    144 ms a step; small's 584 M: 2.1 vs 16.9 s)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float, decay: int | None = None
              ) -> float:
    """Multiplier of each group's base lr at optimizer step `step` (0-based) of `total`; `decay`: the
    cosine_decay_with_warmup schedule's decay steps (None: `total`)."""
    if schedule == "cosine_decay_with_warmup":
        return cosine_decay_with_warmup(step, total, warmup, decay or total, min_ratio)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def cosine_decay_with_warmup(step: int, total: int, warmup: int, decay: int, min_ratio: float) -> float:
    """LeRobot 0.6.1's `CosineDecayWithWarmupSchedulerConfig` lambda at `step` of a `total`-step run
    (lerobot/optim/schedulers.py), with its arithmetic in its order, so the floats are LeRobot's: a run shorter
    than `decay` scales warmup by total / decay and decays over `total`; warmup rises linearly from
    1 / (warmup + 1); the cosine runs over steps 0..decay (warmup included), then stays at `min_ratio`
    (LeRobot's decay_lr / peak_lr)."""
    if total < decay:
        warmup, decay = int(warmup * (total / decay)), total
    if step < warmup:
        if step <= 0:
            return 1 / (warmup + 1)
        frac = 1 - step / warmup
        return (1 / (warmup + 1) - 1) * frac + 1
    cosine = 0.5 * (1 + math.cos(math.pi * min(step, decay) / decay))
    return (1 - min_ratio) * cosine + min_ratio


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg):
    """`StepSchedule` for an optimizer whose learning rates are device tensors (`build_optimizer`'s fused AdamW);
    else torch's LambdaLR (a DeepSpeed engine's optimizer)."""
    def factor(step: int) -> float:
        return lr_factor(step, train_cfg.steps, train_cfg.warmup_steps, train_cfg.lr_schedule,
                         train_cfg.min_lr_ratio, train_cfg.decay_steps)

    if isinstance(optimizer.param_groups[0]["lr"], torch.Tensor):
        return StepSchedule(optimizer, [factor(s) for s in range(train_cfg.steps + 1)])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class StepSchedule:
    """The learning-rate schedule on the device: each group's lr is its base lr times `factors[taken]`, where
    `taken` counts the optimizer steps taken - a device counter that a skipped step (an overflow under loss
    scaling, a non-finite gradient) does not advance, so the schedule stays where it was without the host reading
    whether the step was skipped. `last_epoch` / `_step_count` read it (checkpoints, as LambdaLR names them)."""

    def __init__(self, optimizer: torch.optim.Optimizer, factors: list[float]):
        self.optimizer = optimizer
        device = optimizer.param_groups[0]["lr"].device
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self._bases = torch.tensor(self.base_lrs, dtype=torch.float64, device=device)
        self._factors = torch.tensor(factors, dtype=torch.float64, device=device)  # per step, as LambdaLR's
        self._taken = torch.zeros((), dtype=torch.int64, device=device)
        self._lrs = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    @property
    def last_epoch(self) -> int:
        return int(self._taken)

    def step(self, skipped: torch.Tensor | None = None) -> None:
        """One optimizer step: taken, or skipped where `skipped` (0-d, on the device) is nonzero."""
        self._taken += 1 if skipped is None else (skipped == 0).long()
        self._apply()

    def _apply(self) -> None:
        # NOTE: the optimizer's own lr tensors, refilled in place (a restored optimizer state replaced them)
        for group, lr in zip(self.optimizer.param_groups, self._lrs):
            group["lr"] = lr
        torch._foreach_copy_(self._lrs, list((self._bases * self._factor()).float().unbind()))

    def _factor(self) -> torch.Tensor:
        # (a gather: indexing with a 0-d tensor would read it on the host)
        return self._factors.gather(0, self._taken.clamp(max=len(self._factors) - 1).reshape(1))

    def get_last_lr(self) -> list[float]:
        """Each group's lr as the schedule computes it (float64, as LambdaLR reports it; the optimizer holds it
        rounded to float32, the dtype fused AdamW's kernels read)."""
        return (self._bases * self._factor()).tolist()

    def state_dict(self) -> dict:
        taken = self.last_epoch
        return {"last_epoch": taken, "_step_count": taken + 1, "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict) -> None:
        self._taken.fill_(int(state["last_epoch"]))
        self._apply()
