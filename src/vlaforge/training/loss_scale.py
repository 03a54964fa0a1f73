"""Dynamic loss scaling for fp16 compute, Megatron-style: the scale grows by `growth_factor` after
`growth_interval` finite steps in a row and backs off by `backoff_factor` once `hysteresis` overflowing steps have
been seen since the last growth (hysteresis 1 is `torch.amp.GradScaler`'s rule). Overflowing steps are skipped:
no optimizer or schedule update.

The loss is multiplied by the scale before backward, so fp16 activation gradients stay above fp16's smallest
subnormal (2^-24); `unscale_` divides the gradients back before clipping and the optimizer see them.
"""

from __future__ import annotations

from typing import Iterable

import torch


class LossScaler:
    """Scale 1.0 and no checks (`enabled = False`), or dynamic scaling (`enabled = True`)."""

    def __init__(self, enabled: bool, initial: float = 2.0 ** 10, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = float(initial) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        self.growth_tracker = 0
        self.hysteresis_left = hysteresis
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, cfg, precisions: dict[str, str], trainable: Iterable[str]) -> "LossScaler":
        """`cfg` is the `[loss_scale]` section; dynamic when forced or when a trainable component runs fp16."""
        fp16 = any(precisions[c] == "fp16" for c in trainable)
        enabled = cfg.mode == "always" or (cfg.mode == "auto" and fp16)
        return cls(enabled, cfg.initial, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval,
                   cfg.hysteresis, cfg.min_scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Divide `grads` by the scale in place; returns a 0-d tensor > 0 when any was inf/nan (None if disabled).

        One fused kernel per (device, dtype) group, as `torch.amp.GradScaler` does; no host sync here.
        """
        if not self.enabled or not grads:
            return None
        found = torch.zeros((), device=grads[0].device)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in groups.items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            found = found + flag.to(found.device).squeeze(0)
        return found

    def update(self, found_inf: bool) -> None:
        """Advance the growth / hysteresis state after one step; `found_inf` means the step was skipped."""
        if not self.enabled:
            return
        if found_inf:
            self.skipped_steps += 1
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def at_floor(self) -> bool:
        return self.enabled and self.scale <= self.min_scale

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "hysteresis_left": self.hysteresis_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
