"""`vlaforge diagnose` on synthetic curves: spike detection rate and false alarms, and the time to diagnose a
100k-step metrics.jsonl. Prints one JSON.

Curves: a loss falling exponentially to a floor, logged `--points` times, with multiplicative Gaussian noise of
sigma 0.02-0.2 (log units). Clean curves count false alarms (any finding of any kind). Spiked curves get 3 spikes
each at random positions (after the first 5% of the curve), of a size given in multiples of the curve's value; a spike
counts as found when a spike finding peaks at its step. Sizes below the detector's definition (7 robust sigmas and
2x the level) are reported apart: they are not spikes by that definition.

The timing writes a 100k-step run (the trainer's keys: 5 loss terms, weights, 5 gradient norms, 4 learning rates,
perf, 16 numerics keys every step) and times the diagnosis (read + findings + JSON), and the HTML report apart.

    python bench/diagnose.py [--curves 200] [--points 2000] [--steps 100000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from vlaforge.diagnostics.diagnose import diagnose_signals
from vlaforge.diagnostics.loss_curve import SPIKE_MIN_RATIO, SPIKE_Z
from vlaforge.diagnostics.signals import RunSignals, Series


def curve(g: np.random.Generator, n: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    steps = np.arange(1, n + 1) * 10
    start, floor, tau = g.uniform(2, 8), g.uniform(0.05, 0.5), g.uniform(0.1, 0.5) * steps[-1]
    return steps, (start * np.exp(-steps / tau) + floor) * np.exp(sigma * g.normal(size=n))


def signals_of(steps: np.ndarray, values: np.ndarray) -> RunSignals:
    return RunSignals(Path("synthetic"), None, {"loss/total": Series(steps, values)}, rows=len(steps))


def spike_rates(curves: int, points: int, seed: int) -> dict:
    g = np.random.default_rng(seed)
    out = {"curves_per_cell": curves, "points": points, "by_noise": {}}
    false_alarms = total_clean = found_total = injected_total = 0
    for sigma in (0.02, 0.05, 0.1, 0.2):
        cell = {"false_alarm_curves": 0, "sizes": {}}
        for _ in range(curves):
            steps, x = curve(g, points, sigma)
            report = diagnose_signals(signals_of(steps, x))
            cell["false_alarm_curves"] += bool(report["findings"])
        total_clean += curves
        false_alarms += cell["false_alarm_curves"]
        for size in (1.5, 2.5, 4.0, 10.0):
            defined = np.log(size) >= SPIKE_Z * sigma and size >= SPIKE_MIN_RATIO
            found = injected = 0
            for _ in range(curves):
                steps, x = curve(g, points, sigma)
                where = g.choice(np.arange(points // 20, points), 3, replace=False)
                x[where] *= size
                peaks = {f["evidence"]["peak_step"] for f in diagnose_signals(signals_of(steps, x))["findings"]
                         if f["kind"] == "spike"}
                found += sum(int(steps[w]) in peaks for w in where)
                injected += 3
            cell["sizes"][f"{size}x"] = {"detected": round(found / injected, 4), "a_spike_by_definition": bool(
                defined)}
            if defined:
                found_total, injected_total = found_total + found, injected_total + injected
        out["by_noise"][f"sigma_{sigma}"] = cell
    out["detection_rate_of_defined_spikes"] = round(found_total / max(injected_total, 1), 4)
    out["false_alarm_curves"] = f"{false_alarms} of {total_clean}"
    return out


def timing(steps: int, seed: int) -> dict:
    g = np.random.default_rng(seed)
    folder = Path(tempfile.mkdtemp(prefix="bench_diagnose_"))
    comps = ("vision", "projector", "llm", "action_head")
    terms = ("action", "contrastive", "language")
    t0 = time.perf_counter()
    with open(folder / "metrics.jsonl", "w") as f:
        s = np.arange(1, steps + 1)
        base = 3 * np.exp(-s / (steps / 5)) + 0.2
        noise = np.exp(0.05 * g.normal(size=(steps, 16)))
        for i in range(steps):
            row = {"step": int(s[i])}
            row |= {f"loss/{t}": float(base[i] * noise[i, k]) for k, t in enumerate(terms)}
            row |= {"loss/total": float(base[i] * noise[i, 3]), "loss/weighted": float(base[i] * noise[i, 3])}
            row |= {f"weight/{t}": 1.0 for t in terms}
            row |= {f"grad_norm/{c}": float(noise[i, 4 + k]) for k, c in enumerate(comps)}
            row |= {f"lr/{c}": 1e-3 for c in comps}
            row |= {"perf/step_s": 0.1 * float(noise[i, 8]), "perf/data_s": 0.001, "perf/world_size": 1.0}
            row |= {f"numerics/{c}/{k}": 0.0 for c in comps for k in ("zero_frac", "fp16_underflow_frac", "inf",
                                                                       "nan")}
            f.write(json.dumps(row) + "\n")
    write_s = time.perf_counter() - t0
    from vlaforge.diagnostics.diagnose import diagnose
    from vlaforge.diagnostics.report import write_html

    t0 = time.perf_counter()
    report, signals = diagnose(folder)
    json.dumps(report)
    diagnose_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_html(report, signals, folder / "report.html")
    html_s = time.perf_counter() - t0
    return {"steps": steps, "file_mb": round((folder / "metrics.jsonl").stat().st_size / 2**20, 1),
            "write_s": round(write_s, 1), "diagnose_s": round(diagnose_s, 3), "html_s": round(html_s, 3),
            "findings": len(report["findings"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curves", type=int, default=200, help="curves per noise level and spike size")
    ap.add_argument("--points", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    result = {"bench": "diagnose", "date": time.strftime("%Y-%m-%d"), "spikes": spike_rates(args.curves, args.points,
                                                                                            args.seed),
              "timing": timing(args.steps, args.seed)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
