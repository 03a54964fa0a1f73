"""Gradient numerics per component: norms, zeros, fp16 underflow, inf/nan; warnings that say what to do.

The phenomenon this watches for: a vision encoder's gradients are 10-100x smaller (L2) than the LLM's; computed in
fp16 without enough loss scale they flush to zero and the encoder silently stops learning while the loss still
falls. Measured on the unscaled gradients after backward and before clipping.
"""

from __future__ import annotations

import warnings
from typing import Iterator

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError

FP16_TINY = 2.0 ** -24  # smallest positive fp16 subnormal; smaller magnitudes round to zero
SHOWN_PARAMETERS = 5


class GradientUnderflowWarning(UserWarning):
    """A component's gradients underflow in fp16: it has stopped learning."""


class NonFiniteGradientError(VlaforgeError):
    """A gradient is inf or nan where no loss scaler can skip the step; names the parameters."""


def trainable_grads(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, torch.Tensor | None]]:
    for name, p in module.named_parameters():
        if p.requires_grad:
            yield name, p, p.grad


@torch.no_grad()
def grad_counts(grad: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[numel, zeros, tiny, inf, nan, sum of squares] of one (local) gradient, float64 on its device."""
    absolute = grad.detach().abs().float()
    finite = torch.isfinite(absolute)
    row = torch.stack([torch.tensor(absolute.numel(), device=absolute.device), (absolute == 0).sum(),
                       ((absolute > 0) & (absolute * scale < FP16_TINY)).sum(), torch.isinf(absolute).sum(),
                       torch.isnan(absolute).sum()]).double()
    return torch.cat([row, torch.where(finite, absolute, 0.0).double().square().sum()[None]])


@torch.no_grad()
def component_stats(module: nn.Module, scale: float = 1.0, reducer=None,
                    counted: dict[nn.Parameter, torch.Tensor] | None = None) -> dict[str, float] | None:
    """Gradient statistics of one component's trainable parameters (None when nothing in it trains).

    With `reducer` (sharded gradients), counts are summed over the shards. `counted`: rows `grad_counts` took of
    gradients that are gone (the step inside backward), by parameter.
    zero_frac: exactly-zero elements (a parameter without a gradient counts as all zeros);
    fp16_underflow_frac: nonzero elements with |g * scale| < 2^-24, i.e. lost if computed in fp16 at this scale;
    inf, nan: counts; grad_norm: L2 in fp32.
    """
    # [numel, zeros (incl. missing gradients), tiny, inf, nan, sum of squares] over this rank's elements; row 1
    # holds tensor-parallel-sharded weights (their sums also run over the TP group)
    counts = torch.zeros(2, 6, dtype=torch.float64)
    for _, p, g in trainable_grads(module):
        local = reducer.local(p) if reducer is not None else p
        row_of = int(reducer is not None and reducer.tp_sharded(p))
        if counted is not None and p in counted:
            row = counted[p]
        elif g is None:
            counts[row_of, :2] += local.numel()
            continue
        else:
            row = grad_counts(reducer.local(g) if reducer is not None else g, scale)
        counts = counts.to(row.device)
        counts[row_of] += row
    counts = reducer.combine(counts[0].contiguous(), counts[1].contiguous()) if reducer is not None else counts.sum(0)
    numel, zeros, tiny, inf, nan, square = counts.tolist()
    if numel == 0:
        return None
    return {"grad_norm": square ** 0.5, "zero_frac": zeros / numel, "fp16_underflow_frac": tiny / numel,
            "inf": inf, "nan": nan}


def nonfinite_parameters(model: nn.Module) -> list[tuple[str, int, int]]:
    """(qualified name, inf count, nan count) of every parameter with a non-finite gradient."""
    found = []
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            found.append((name, int(torch.isinf(p.grad).sum()), int(torch.isnan(p.grad).sum())))
    return found


def nonfinite_error(model: nn.Module, precisions: dict[str, str], step: int, why: str,
                    components: list[str] = ()) -> NonFiniteGradientError:
    """The stop, naming the parameters whose gradients on `model` are non-finite now, else `components` (those
    whose gradient norm was non-finite at `step`, when the check ran at a later logging step)."""
    bad = nonfinite_parameters(model)
    comps = sorted({n.split(".")[0] for n, _, _ in bad} or set(components), key=COMPONENTS.index)
    shown = ", ".join(f"{n} ({i} inf, {q} nan)" for n, i, q in bad[:SHOWN_PARAMETERS])
    more = f" and {len(bad) - SHOWN_PARAMETERS} more" if len(bad) > SHOWN_PARAMETERS else ""
    where = ", ".join(f"components.{c} ({precisions.get(c, '?')})" for c in comps) or "the loss weighting"
    shown = shown or ("non-finite gradient norm" if comps else "learned loss weights")
    return NonFiniteGradientError(
        f"non-finite gradients at step {step} {why} in {where}: {shown}{more}; the "
        f"optimizer step was not taken and the last checkpoint is intact; lower the learning rate or grad_clip, "
        f"check the data for inf/nan, or keep the component in bf16")


class NumericsMonitor:
    """Measures every `cfg.every` steps, warns on fp16 underflow, stops on non-finite gradients."""

    def __init__(self, cfg, precisions: dict[str, str]):
        self.cfg = cfg
        self.precisions = precisions
        self.lowest_zero: dict[str, float] = {}
        self.firing: set[str] = set()

    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def measure(self, model: nn.Module, scale: float, step: int, reducer=None, counted=None) -> dict[str, float]:
        """Metrics `numerics/<component>/<stat>` for the gradients now on `model` (and those `counted` before they
        were freed, `component_stats`); warns on underflow."""
        stats = {c: s for c in COMPONENTS
                 if (s := component_stats(getattr(model, c), scale, reducer, counted)) is not None}
        out = {f"numerics/{c}/{k}": v for c, s in stats.items() for k, v in s.items() if k != "grad_norm"}
        for c, s in stats.items():
            self.check_underflow(c, s, stats.get("llm"), step)
        return out

    def check_underflow(self, comp: str, s: dict[str, float], llm: dict[str, float] | None, step: int) -> None:
        lowest = min(self.lowest_zero.get(comp, s["zero_frac"]), s["zero_frac"])
        self.lowest_zero[comp] = lowest
        if self.precisions.get(comp) != "fp16":
            return
        reasons = []
        if s["zero_frac"] - lowest >= self.cfg.zero_jump:
            reasons.append(f"{s['zero_frac']:.0%} of its gradient elements are exactly zero (lowest {lowest:.0%})")
        if comp != "llm" and llm is not None and llm["grad_norm"] > 0:
            ratio = s["grad_norm"] / llm["grad_norm"]
            if ratio < self.cfg.norm_ratio:
                reasons.append(f"its gradient norm is {ratio:.1e}x the llm's (threshold {self.cfg.norm_ratio:g})")
        if not reasons:
            self.firing.discard(comp)
            return
        if comp in self.firing:
            return
        self.firing.add(comp)
        warnings.warn(f"step {step}: components.{comp} gradients underflow in fp16: {'; '.join(reasons)}; it has "
                      f"stopped learning. Switch components.{comp}.precision to 'bf16' or raise the loss scale "
                      f"(loss_scale.initial, loss_scale.mode = 'always')", GradientUnderflowWarning, stacklevel=2)
