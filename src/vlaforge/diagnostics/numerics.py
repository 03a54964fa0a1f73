"""Gradient-numerics findings per component: fp16 underflow episodes (the trainer's own rule, `[numerics]`
zero_jump and norm_ratio, applied to the whole history), non-finite gradients, and loss-scale trouble (skipped steps,
a scale that keeps falling)."""

from __future__ import annotations

import numpy as np

from vlaforge import COMPONENTS
from vlaforge.diagnostics.findings import Finding
from vlaforge.diagnostics.loss_curve import _episodes
from vlaforge.diagnostics.signals import RunSignals, aligned

SKIPPED_SHARE = 0.05  # more than 5% of the logged steps skipped by the loss scaler
SCALE_FLOOR = 1.0  # a dynamic loss scale that ends at or below 1 no longer protects fp16 gradients


def _precisions(signals: RunSignals) -> dict[str, str]:
    cfg = signals.cfg
    if cfg is None:
        return {}
    return {c: getattr(getattr(cfg.components, c), "precision", "fp32") for c in COMPONENTS}


def underflow(signals: RunSignals) -> list[Finding]:
    """fp16 components whose gradients flush to zero (zero share jumping above its lowest) or fall far below the
    LLM's (norm ratio): the trainer's warning, as episodes with step ranges."""
    cfg = signals.cfg
    zero_jump = getattr(getattr(cfg, "numerics", None), "zero_jump", 0.3)
    norm_ratio = getattr(getattr(cfg, "numerics", None), "norm_ratio", 1e-3)
    out = []
    for comp, precision in _precisions(signals).items():
        if precision != "fp16":
            continue
        zero = signals.get(f"numerics/{comp}/zero_frac")
        hit_steps, reasons = [], set()
        if zero is not None:
            jumped = zero.values - np.minimum.accumulate(zero.values) >= zero_jump
            hit_steps += zero.steps[jumped].tolist()
            if jumped.any():
                reasons.add("zero_frac")
        mine, llm = signals.get(f"grad_norm/{comp}"), signals.get("grad_norm/llm")
        if comp != "llm" and mine is not None and llm is not None:
            steps, a, b = aligned(mine, llm)
            low = (b > 0) & (a / np.where(b > 0, b, 1) < norm_ratio)
            hit_steps += steps[low].tolist()
            if low.any():
                reasons.add("norm_ratio")
        if not hit_steps:
            continue
        steps = np.unique(hit_steps)
        evidence = {"steps_flagged": int(len(steps)), "rules": sorted(reasons)}
        if zero is not None:
            evidence["zero_frac_last"] = float(zero.values[-1])
            evidence["zero_frac_lowest"] = float(zero.values.min())
        out.append(Finding(
            "underflow", "critical", f"components.{comp} gradients underflow in fp16 from step {steps[0]} "
            f"({len(steps)} logged steps): it has stopped learning", (int(steps[0]), int(steps[-1])), evidence,
            [f"{comp}'s gradients are 10-100x smaller than the LLM's and fall below fp16's smallest subnormal "
             "(2^-24)", "the loss scale is too low for them (or loss scaling is off)"],
            [f"switch components.{comp}.precision to 'bf16'",
             "raise the loss scale (loss_scale.initial) or set loss_scale.mode = 'always'"],
            subject=comp, score=float(len(steps))))
    return out


def non_finite_gradients(signals: RunSignals) -> list[Finding]:
    out = []
    for comp in COMPONENTS:
        bad = [signals.get(f"numerics/{comp}/{k}") for k in ("inf", "nan")]
        bad = [s for s in bad if s is not None]
        if not bad:
            continue
        steps = np.unique(np.concatenate([s.steps[s.values > 0] for s in bad]))
        if not len(steps):
            continue
        eps = _episodes(np.isin(np.arange(steps[0], steps[-1] + 1), steps), gap=50)
        out.append(Finding(
            "overflow", "warning" if signals.get("precision/loss_scale") is not None else "critical",
            f"components.{comp} had non-finite gradients at {len(steps)} logged steps (first {steps[0]}, "
            f"{len(eps)} episodes)", (int(steps[0]), int(steps[-1])), {"steps": steps[:20].tolist()},
            ["fp16 overflow: the loss scale is too high for this component (the scaler skips those steps)",
             "a learning rate that lets activations grow"],
            [f"run components.{comp} in bf16 (same range as fp32)", "lower loss_scale.initial or the learning rate"],
            subject=comp, score=float(len(steps))))
    return out


def loss_scale(signals: RunSignals) -> list[Finding]:
    out = []
    skipped = signals.get("precision/skipped_steps")
    if skipped is not None and len(skipped) >= 2:
        # the trainer logs the running count of skipped steps; its growth over the logged span is the share
        span = float(skipped.steps[-1] - skipped.steps[0]) or 1.0
        share = float(skipped.values[-1] - skipped.values[0]) / span
        if share > SKIPPED_SHARE:
            out.append(Finding(
                "skipped_steps", "warning", f"the loss scaler skipped {share:.0%} of the optimizer steps between "
                f"steps {skipped.steps[0]} and {skipped.steps[-1]}", (int(skipped.steps[0]), int(skipped.steps[-1])),
                {"skipped_share": share, "skipped_total": float(skipped.values[-1])},
                ["fp16 gradients overflow often: the scale grows into overflow, or a component cannot live in fp16"],
                ["run the overflowing component in bf16 (see the overflow finding)",
                 "lengthen loss_scale.growth_interval so the scale does not keep climbing into overflow"],
                score=share))
    scale = signals.get("precision/loss_scale")
    if scale is not None and len(scale) >= 2 and scale.values[-1] <= SCALE_FLOOR < scale.values[0]:
        out.append(Finding(
            "loss_scale_collapse", "warning", f"the dynamic loss scale fell from {scale.values[0]:.3g} to "
            f"{scale.values[-1]:.3g}", (int(scale.steps[0]), int(scale.steps[-1])),
            {"first": float(scale.values[0]), "last": float(scale.values[-1])},
            ["repeated overflow halves the scale until fp16's small gradients underflow"],
            ["switch fp16 components to bf16"], score=float(scale.values[0] / max(scale.values[-1], 1e-30))))
    return out


def numerics_findings(signals: RunSignals) -> list[Finding]:
    return underflow(signals) + non_finite_gradients(signals) + loss_scale(signals)
