"""Loss-curve findings per term: spikes, divergence (non-finite values, a sustained rise), blow-ups the run
recovered from, a loss that does not move, oscillation, one term dominating the weighted objective, and learning rates
too far apart.

Spikes are scored as OLMo 2 scores them (distance from a rolling level in standard deviations, >= 7), made robust
and trend-proof: the level is the median of the previous 9 logged values (short, so it follows a falling curve), the
noise the median absolute residual from that level over the previous 200 (x 1.4826, a standard deviation for
Gaussian noise), in log space. A spike also has to be at least twice the level (a smooth, low-noise curve has a tiny
noise estimate, and a 1.5x bump in a small-batch run is noise, not a spike); a value 10x the largest seen before is
one too (Megatron's spiky-loss check). Neighbouring spike points form one episode. bench/diagnose.py measures the
detection rate and the false alarms on synthetic curves.
"""

from __future__ import annotations

import numpy as np

from vlaforge.diagnostics.findings import Finding
from vlaforge.diagnostics.signals import RunSignals, Series, aligned

SPIKE_Z = 7.0  # OLMo 2's threshold, in robust standard deviations
SPIKE_MIN_RATIO = 2.0  # and at least this many times the previous values' median
SPIKE_MEGATRON = 10.0  # a value this many times the largest seen before
SPIKE_MIN_HISTORY = 8  # logged values before the first one that can be scored
LEVEL_WINDOW = 9  # previous logged values whose median is the level (odd: a trailing median filter)
NOISE_WINDOW = 201  # previous residuals whose median absolute value is the noise
REL_FLOOR = 0.01  # the noise scale is at least 1% of the level (a flat curve has MAD 0)
RISE = 0.5  # divergence: the smoothed loss 50% above its best so far ...
RISE_SUSTAIN = 3  # ... for this many logged values (2% of them on a long curve), up to the last
INSTABILITY = 4.0  # a blow-up: the smoothed loss this many times its best so far, then back
STUCK_MIN_POINTS = 10
LR_RATIO = 50.0
DOMINANT_SHARE = 0.9


def trailing_median(x: np.ndarray, window: int) -> np.ndarray:
    """Median of x[max(0, i - window + 1) .. i] for every i: expanding over the first `window` values, then scipy's
    C median filter over a trailing window (`window` odd)."""
    from scipy.ndimage import median_filter

    n = len(x)
    out = np.empty(n)
    head = min(window, n)
    for i in range(head):
        out[i] = np.median(x[:i + 1])
    if n > window:
        out[window - 1:] = median_filter(x, size=window, origin=(window - 1) // 2, mode="nearest")[window - 1:]
    return out


def spike_scores(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(robust z-score, level) of each value against the values logged before it: the level is their trailing median
    (`LEVEL_WINDOW`, short enough to follow a falling curve), the noise the median absolute residual from that level
    over `NOISE_WINDOW` (x 1.4826). In log space for a positive curve (loss noise is multiplicative). NaN for the
    first `SPIKE_MIN_HISTORY` values."""
    x = np.asarray(values, dtype=np.float64)
    positive = bool(np.all(x > 0))
    y = np.log(x) if positive else x
    level = np.r_[np.nan, trailing_median(y, LEVEL_WINDOW)[:-1]]
    resid = y - level
    resid[0] = 0.0
    noise = np.r_[np.nan, trailing_median(np.abs(resid), NOISE_WINDOW)[:-1]]
    floor = REL_FLOOR if positive else REL_FLOOR * np.abs(level) + 1e-12
    z = resid / np.maximum(1.4826 * noise, floor)
    z[:SPIKE_MIN_HISTORY] = np.nan
    return z, (np.exp(level) if positive else level)


def spikes(series: Series, name: str) -> list[Finding]:
    finite = np.isfinite(series.values)
    steps, x = series.steps[finite], series.values[finite]
    if len(x) <= SPIKE_MIN_HISTORY:
        return []
    z, prev_med = spike_scores(x)
    largest_before = np.r_[np.inf, np.maximum.accumulate(np.abs(x))[:-1]]
    with np.errstate(invalid="ignore"):
        high = (z >= SPIKE_Z) & (x >= SPIKE_MIN_RATIO * np.abs(prev_med))
    hit = high | ((np.abs(x) > SPIKE_MEGATRON * largest_before) & (np.arange(len(x)) >= SPIKE_MIN_HISTORY))
    out = []
    for start, end in _episodes(hit):
        peak = start + int(np.nanargmax(np.where(np.isnan(z[start:end + 1]), -np.inf, z[start:end + 1])))
        base = float(np.median(x[max(0, start - 50):start]))
        out.append(Finding(
            "spike", "warning", f"{name} spiked to {x[peak]:.4g} at step {steps[peak]} ({x[peak] / base:.1f}x its "
            f"recent median, score {z[peak]:.0f} robust sigmas)", (int(steps[start]), int(steps[end])),
            {"peak_step": int(steps[peak]), "peak_value": float(x[peak]), "recent_median": base,
             "score": float(z[peak]), "points": int(end - start + 1)},
            ["a bad or out-of-distribution batch (check the samples of that step)",
             "a learning rate too high for the batch size (spikes that repeat)",
             "fp16 loss-scale overflow reaching the update (check precision/skipped_steps)"],
            ["lower train.grad_clip (e.g. 1.0) so one batch cannot move the weights far",
             "lower the peak learning rate or lengthen train.warmup_steps",
             "inspect the data around that step (vlaforge data info; the episode the sampler drew)"],
            subject=name, score=float(min(z[peak], 1e6))))
    return out


def _episodes(hit: np.ndarray, gap: int = 1) -> list[tuple[int, int]]:
    """Runs of True (indices), merged when at most `gap` - 1 False values apart."""
    idx = np.flatnonzero(hit)
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) > gap)
    starts, ends = np.r_[idx[0], idx[breaks + 1]], np.r_[idx[breaks], idx[-1]]
    return list(zip(starts.tolist(), ends.tolist()))


def non_finite(series: Series, name: str) -> list[Finding]:
    bad = ~np.isfinite(series.values)
    if not bad.any():
        return []
    first = int(np.argmax(bad))
    return [Finding(
        "non_finite", "critical", f"{name} became {series.values[first]} at step {series.steps[first]}",
        (int(series.steps[first]), int(series.steps[bad][-1])),
        {"first_step": int(series.steps[first]), "non_finite_points": int(bad.sum()),
         "last_finite": float(series.values[:first][np.isfinite(series.values[:first])][-1]) if first else None},
        ["a learning rate too high (the loss rose before it broke)", "fp16 overflow without loss scaling",
         "a division or log of zero in a loss term (a constant batch, an empty mask)"],
        ["resume from the last checkpoint before that step with half the learning rate",
         "run the failing component in bf16 instead of fp16, or enable loss_scale.mode = 'dynamic'",
         "set [numerics] every = 1 to stop at the first non-finite gradient with its parameter named"],
        subject=name, score=1e9)]


def divergence(series: Series, name: str) -> list[Finding]:
    finite = np.isfinite(series.values)
    steps, x = series.steps[finite], series.values[finite]
    if len(x) < 2 * RISE_SUSTAIN + 2 or np.any(x <= 0):
        return []
    span = max(RISE_SUSTAIN, len(x) // 50)  # a long, noisy curve needs a longer median and a longer rise
    smooth = trailing_median(x, 2 * (span // 2) + 3)
    best = np.minimum.accumulate(smooth)
    above = smooth > best * (1 + RISE)
    if not above[-span:].all():
        return []
    start = len(above) - int(np.argmax(~above[::-1])) if not above.all() else 0
    turn = int(np.argmin(smooth[:max(start, 1)]))
    return [Finding(
        "divergence", "critical", f"{name} rose from {smooth[turn]:.4g} (step {steps[turn]}) to {smooth[-1]:.4g} "
        f"(step {steps[-1]}) and stayed up", (int(steps[turn]), int(steps[-1])),
        {"best": float(smooth[turn]), "best_step": int(steps[turn]), "last": float(smooth[-1]),
         "rise": float(smooth[-1] / smooth[turn])},
        ["the learning rate is too high once warm-up ends", "the loss scale or precision lets updates blow up",
         "the data changed (a new dataset shard, a broken episode)"],
        ["lower the peak learning rate (start at a third)", "resume from a checkpoint before the rise",
         "clip gradients (train.grad_clip = 1.0)",
         "compare with a known good run: vlaforge diagnose RUN --compare GOOD"],
        subject=name, score=float(smooth[-1] / smooth[turn]))]


def instability(series: Series, name: str) -> list[Finding]:
    """Episodes where the smoothed loss climbs `INSTABILITY` x above its best so far and then comes back down (a
    blow-up the optimizer recovered from: typically the learning rate reaching its peak at the end of warm-up)."""
    finite = np.isfinite(series.values)
    steps, x = series.steps[finite], series.values[finite]
    if len(x) < 6 or np.any(x <= 0):
        return []
    smooth = trailing_median(x, 5)
    best = np.r_[smooth[0], np.minimum.accumulate(smooth)[:-1]]
    ratio = smooth / best
    out = []
    for start, end in _episodes(ratio >= INSTABILITY):
        if end == len(x) - 1 or end - start < 1:
            continue  # still up at the end: a divergence; one point: a spike's business
        peak = start + int(np.argmax(ratio[start:end + 1]))
        turn = int(np.argmin(smooth[:start + 1]))
        out.append(Finding(
            "instability", "warning", f"{name} climbed {ratio[peak]:.0f}x above its best ({smooth[turn]:.3g} at step "
            f"{steps[turn]}) over steps {steps[start]}-{steps[end]}, then came back down",
            (int(steps[start]), int(steps[end])), {"peak_ratio": float(ratio[peak]), "peak_step": int(steps[peak]),
                                                   "best": float(smooth[turn]), "best_step": int(steps[turn])},
            ["the learning rate is too high: the blow-up comes as it peaks (end of warm-up)",
             "too short a warm-up for the batch size"],
            ["lower the peak learning rate (start at a third)", "lengthen warm-up (train.warmup_steps)",
             "clip gradients (train.grad_clip = 1.0)"], subject=name, score=float(ratio[peak])))
    return out


def oscillation(series: Series, name: str) -> list[Finding]:
    """The loss swings up and down by more than a third of its level, step to step, over the second half of the run
    (a learning rate too high for the curvature), without a trend down."""
    finite = np.isfinite(series.values) & (series.values > 0)
    steps, x = series.steps[finite], series.values[finite]
    if len(x) < 16:
        return []
    half = x[len(x) // 2:]
    d = np.diff(np.log(half))
    swing = float(np.median(np.abs(d)))
    flips = float(np.mean(np.sign(d[1:]) != np.sign(d[:-1])))
    trend = float(np.log(np.median(half[-len(half) // 4:]) / np.median(half[:len(half) // 4])))
    if swing < 0.3 or flips < 0.5 or trend < -0.2:
        return []
    return [Finding(
        "oscillation", "warning", f"{name} swings by {np.expm1(swing):.0%} of its level from one logged step to the "
        f"next over steps {steps[len(x) // 2]}-{steps[-1]} without going down",
        (int(steps[len(x) // 2]), int(steps[-1])), {"median_step_change": swing, "sign_flips": flips,
                                                    "trend_log": trend},
        ["the learning rate is too high for the loss surface", "the batch is too small for the learning rate"],
        ["lower the learning rate (a third) or raise train.batch_size / train.grad_accum",
         "lengthen warm-up (train.warmup_steps)"], subject=name, score=swing)]


def stuck(series: Series, name: str) -> list[Finding]:
    """The loss did not move: the median of its last quarter is within the noise of its first quarter's (no
    learning at all). In log space for a positive curve (a fall from 1e5 to 10 and one from 2.8 to 0.6 are both
    falls). NOTE: the noise is taken from the step-to-step changes of the second half only, robustly (median
    absolute change): a run's fast initial fall, or a blow-up it recovered from, is signal, not noise."""
    finite = np.isfinite(series.values)
    steps, x = series.steps[finite], series.values[finite]
    if len(x) < STUCK_MIN_POINTS:
        return []
    q = max(len(x) // 4, 2)
    start, first, last = float(x[0]), float(np.median(x[:q])), float(np.median(x[-q:]))
    positive = bool(np.all(x > 0))
    y = np.log(x) if positive else x
    sigma = 1.4826 * float(np.median(np.abs(np.diff(y[len(y) // 2:])))) / np.sqrt(2) + 1e-12  # one value's noise
    fall = (lambda a: float(np.log(a / last))) if positive else (lambda a: a - last)
    floor = 0.02 if positive else 0.02 * abs(first)
    # a fall from the first quarter's median (beyond the noise of two q-value medians: 1.2533 sigma sqrt(2 / q)),
    # or from the first logged value (a short run can fall within its first quarter)
    noise = 1.2533 * sigma * np.sqrt(2 / q)
    if fall(first) > max(3 * noise, floor) or fall(start) > max(3 * sigma * np.sqrt(1 + 1.2533 ** 2 / q), floor):
        return []
    return [Finding(
        "stuck", "warning", f"{name} did not go down: {start:.4g} at first, {first:.4g} over its first quarter, "
        f"{last:.4g} over its last (steps {steps[0]}-{steps[-1]})", (int(steps[0]), int(steps[-1])),
        {"first": start, "first_quarter_median": first, "last_quarter_median": last, "noise": float(noise)},
        ["the learning rate is zero or tiny (a schedule, or a component frozen for the whole run)",
         "the term's weight is zero, or its gradients never reach the parameters (all frozen, detached)",
         "the targets carry no signal (constant actions, empty text)"],
        ["check lr/* in metrics.jsonl and components.<c>.freeze / trainable", "check the loss weights ([loss])",
         "train a few steps on one batch: the loss must fall (overfit test)"], subject=name, score=1.0)]


def lr_ratio(signals: RunSignals) -> list[Finding]:
    keys = signals.keys("lr/")
    peaks = {k.removeprefix("lr/"): float(np.nanmax(signals.series[k].values)) for k in keys}
    peaks = {k: v for k, v in peaks.items() if v > 0}
    if len(peaks) < 2:
        return []
    hi, lo = max(peaks, key=peaks.get), min(peaks, key=peaks.get)
    ratio = peaks[hi] / peaks[lo]
    limit = signals.cfg.train.lr_ratio_warning if signals.cfg is not None else LR_RATIO  # the trainer's warning
    if ratio <= limit:
        return []
    return [Finding(
        "lr_ratio", "warning", f"components.{hi}'s learning rate peaks at {ratio:.0f}x components.{lo}'s "
        f"({peaks[hi]:.2g} vs {peaks[lo]:.2g})", None, {"peaks": peaks, "ratio": ratio},
        [f"a typo in components.{hi}.lr or components.{lo}.lr",
         f"components.{lo} meant to be nearly frozen (then freeze it instead)"],
        [f"bring components.{hi}.lr within 50x of the others (pretrained towers usually take 0.1-0.5x the LLM's)",
         f"freeze components.{lo} (components.{lo}.freeze) if it should not train"],
        subject=hi, score=ratio)]


def dominant_term(signals: RunSignals) -> list[Finding]:
    """One term makes up more than 90% of the weighted objective over the second half while others are weighted."""
    terms = [k.removeprefix("weight/") for k in signals.keys("weight/") if signals.get(f"loss/{k[7:]}")]
    if len(terms) < 2:
        return []
    shares = {}
    for t in terms:
        common, w, loss = aligned(signals.series[f"weight/{t}"], signals.series[f"loss/{t}"])
        half = common >= (common[-1] + common[0]) / 2 if len(common) else common
        shares[t] = float(np.nanmedian(np.abs(w[half] * loss[half]))) if half.any() else 0.0
    total = sum(shares.values())
    if total <= 0:
        return []
    top = max(shares, key=shares.get)
    share = shares[top] / total
    others = [t for t in shares if t != top and shares[t] > 0]
    if share <= DOMINANT_SHARE or not others:
        return []
    return [Finding(
        "dominant_term", "info", f"loss term {top} is {share:.0%} of the weighted objective over the second half; "
        f"{', '.join(others)} barely pull", None, {"shares": {t: v / total for t, v in shares.items()}},
        [f"the static weights favour {top}, or its scale is larger (a sum where the others are means)"],
        [f"raise the weight of {', '.join(others)} ([loss] weights) or use loss.weighting = 'dynamic'",
         "if the other terms are auxiliary, this may be what you want"], subject=top, score=share)]


def loss_findings(signals: RunSignals) -> list[Finding]:
    out: list[Finding] = []
    for key in signals.keys("loss/"):
        if key == "loss/weighted":
            continue  # the same curve as loss/total with dynamic weights folded in
        s = signals.series[key]
        name = key.removeprefix("loss/")
        broken = non_finite(s, name)
        out += broken
        if broken:
            s = Series(s.steps[:int(np.argmax(~np.isfinite(s.values)))], s.values[:int(np.argmax(~np.isfinite(
                s.values)))])
        diverged = divergence(s, name)
        out += diverged + instability(s, name) + spikes(s, name)
        if not diverged and not broken:
            out += oscillation(s, name) + (stuck(s, name) if name == "total" else [])
    return out + lr_ratio(signals) + dominant_term(signals)
