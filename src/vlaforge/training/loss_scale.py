"""Dynamic loss scaling for fp16 compute, Megatron-style: the scale grows by `growth_factor` after
`growth_interval` finite steps in a row and backs off by `backoff_factor` once `hysteresis` overflowing steps have
been seen since the last growth (hysteresis 1 is `torch.amp.GradScaler`'s rule). Overflowing steps are skipped:
no optimizer or schedule update.

The loss is multiplied by the scale before backward, so fp16 activation gradients stay above fp16's smallest
subnormal (2^-24); `unscale_` divides the gradients back before clipping and the optimizer see them.

The state (scale, growth tracker, hysteresis, skipped steps) lives on the gradients' device and `update` runs there:
no host read per step (as `torch.amp.GradScaler`'s `_amp_update_scale_`, plus the hysteresis). Reading `scale`,
`skipped_steps` or `state_dict()` waits for the device: logging and checkpoint steps do that.
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
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        # host values until the first step puts them on its device (`_on`)
        self._host = {"scale": float(initial) if enabled else 1.0, "growth_tracker": 0,
                      "hysteresis_left": hysteresis, "skipped_steps": 0}
        self._state: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_config(cls, cfg, precisions: dict[str, str], trainable: Iterable[str]) -> "LossScaler":
        """`cfg` is the `[loss_scale]` section; dynamic when forced or when a trainable component runs fp16."""
        fp16 = any(precisions[c] == "fp16" for c in trainable)
        enabled = cfg.mode == "always" or (cfg.mode == "auto" and fp16)
        return cls(enabled, cfg.initial, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval,
                   cfg.hysteresis, cfg.min_scale)

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The state as 0-d tensors on `device` (scale fp32, as GradScaler keeps it; counters int64)."""
        if self._state is None:
            h = self._host
            self._state = {k: torch.tensor(v, dtype=torch.float32 if k == "scale" else torch.int64, device=device)
                           for k, v in h.items()}
        return self._state

    def _read(self, key: str) -> float:
        return float(self._state[key]) if self._state is not None else self._host[key]

    @property
    def scale(self) -> float:
        return self._read("scale")

    @property
    def skipped_steps(self) -> int:
        return int(self._read("skipped_steps"))

    @property
    def hysteresis_left(self) -> int:
        return int(self._read("hysteresis_left"))

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The current scale as a 0-d fp32 tensor (a metric that stays on the device)."""
        return self._on(device)["scale"].clone() if self.enabled else torch.ones((), device=device)

    def skipped_tensor(self, device: torch.device) -> torch.Tensor:
        return self._on(device)["skipped_steps"].float() if self.enabled else torch.zeros((), device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._on(loss.device)["scale"] if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Divide `grads` by the scale in place; returns a 0-d fp32 tensor, 1.0 when any was inf/nan, else 0.0
        (None if disabled) - the value fused AdamW's `found_inf` takes.

        One fused kernel per (device, dtype) group, as `torch.amp.GradScaler` does; no host sync here.
        """
        if not self.enabled or not grads:
            return None
        state = self._on(grads[0].device)
        inv = state["scale"].double().reciprocal().float().reshape(1)  # as GradScaler: exact for powers of two
        found = torch.zeros((), device=grads[0].device)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in groups.items():
            flag = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv.to(device))
            found = found + flag.to(found.device).squeeze(0)
        return (found > 0).float()

    def update(self, found_inf: torch.Tensor | None) -> torch.Tensor | None:
        """Advance the growth / hysteresis state after one step, on the device; `found_inf` > 0 means the step was
        skipped. Returns a 0-d bool tensor: the step overflowed at the minimum scale with no hysteresis left (the
        run cannot recover; None if disabled)."""
        if not self.enabled or found_inf is None:
            return None
        s = self._on(found_inf.device)
        found = found_inf > 0
        s["skipped_steps"] += found.long()
        tracker = torch.where(found, 0, s["growth_tracker"] + 1)
        left = s["hysteresis_left"] - found.long()
        scale = torch.where(found & (left <= 0), (s["scale"] * self.backoff_factor).clamp_min(self.min_scale),
                            s["scale"])
        grown = scale * self.growth_factor
        due = tracker == self.growth_interval
        grow = due & torch.isfinite(grown)  # (a scale that would overflow fp32 stays)
        s["growth_tracker"] = torch.where(due, 0, tracker)
        s["hysteresis_left"] = torch.where(grow, self.hysteresis, left)
        s["scale"] = torch.where(grow, grown, scale)
        return found & (s["scale"] <= self.min_scale) & (s["hysteresis_left"] <= 0)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": int(self._read("growth_tracker")),
                "hysteresis_left": self.hysteresis_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return
        self._host = {"scale": float(state["scale"]), "growth_tracker": int(state["growth_tracker"]),
                      "hysteresis_left": int(state["hysteresis_left"]), "skipped_steps": int(state["skipped_steps"])}
        self._state = None  # back onto the device at the next step
