"""`vlaforge plan --calibrate RUN...`: fit the planner's compute efficiencies for one catalog entry to measured runs.

What is measured: each run's `metrics.jsonl` gives `perf/step_s` (seconds per optimizer step inside `train_step`,
data wait excluded; the median over the logged windows after the first), `perf/world_size` and on CUDA
`perf/peak_gb` (compared with the planner's memory per GPU, not fitted: the memory model has no free terms); its
`config.toml` gives everything else. What is fitted: the planner's step time for that config is linear in four of its
assumptions - 1 / `matmul_efficiency` (the matmuls), 1 / `attention_efficiency` (the attention cores),
`elementwise_passes` (the memory-bound kernels) and `micro_overhead_s` (fixed seconds per micro-batch: launches,
Python) - plus parts that do not depend on them (the optimizer's HBM traffic, the communication at
`comm_efficiency`). The coefficients come from the planner itself, by evaluating `estimate` with one term switched
on at a time, so the fit uses exactly the arithmetic the plan uses. `fit` says how many terms a number of runs
can separate. The result is written as `[calibration.<gpu>]` in a TOML file that `vlaforge plan --calibration
FILE` reads back; a plan without it says its step time is uncalibrated.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.errors import VlaforgeError, first_line
from vlaforge.planner.types import Assumptions, Cluster

FITTED = ("matmul_efficiency", "attention_efficiency", "elementwise_passes", "micro_overhead_s")
OFF = 1e30  # an efficiency so high its term vanishes


@dataclass
class MeasuredRun:
    path: str
    cfg: Any
    step_s: float  # measured seconds per optimizer step (median)
    world_size: int
    peak_gb: float | None = None  # CUDA peak of rank 0 (GB), when the run logged it
    predicted_gb: float | None = None  # the planner's per-GPU total for it (set by `terms`)


def read_run(path: str | Path) -> MeasuredRun:
    """A run folder's config and measured step time.

    Raises:
        VlaforgeError: no config.toml / metrics.jsonl, or no `perf/step_s` in it (a run from before it was logged).
    """
    from vlaforge.config.loading import load_config

    run = Path(path)
    if not (run / "config.toml").is_file() or not (run / "metrics.jsonl").is_file():
        raise VlaforgeError(f"--calibrate {run}: not a run folder (needs config.toml and metrics.jsonl from "
                            "`vlaforge train`)")
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
        if isinstance(row, dict) and isinstance(row.get("perf/step_s"), (int, float)):
            rows.append(row)
    if not rows:
        raise VlaforgeError(f"--calibrate {run}: metrics.jsonl has no perf/step_s (runs log it since vlaforge 0.1 "
                            "issue 26); train the run again, with train.log_every below train.steps")
    steady = rows[1:] or rows  # the first window holds warm-up (allocator, compile, first batches)
    peaks = [r["perf/peak_gb"] for r in rows if isinstance(r.get("perf/peak_gb"), (int, float))]
    return MeasuredRun(str(run), load_config(run / "config.toml"), statistics.median(r["perf/step_s"] for r in steady),
                       int(rows[-1].get("perf/world_size", 1)), max(peaks) if peaks else None)


def terms(run: MeasuredRun, gpu, base: Assumptions) -> np.ndarray:
    """(matmul, attention, elementwise, overhead, fixed) seconds of the planner's step time for `run` at efficiency
    1, one elementwise pass and one second of overhead per micro-batch: the step time at assumptions (m, a, p, o) is
    t = [1/m, 1/a, p, o, 1] . terms."""
    from vlaforge.planner.estimate import estimate
    from vlaforge.planner.types import PlanModel

    pm = PlanModel(run.cfg)
    cluster = Cluster(gpu, gpus_per_node=run.world_size, nodes=1)

    def t(m: float = OFF, a: float = OFF, p: float = 0.0, o: float = 0.0) -> float:
        # no launch floor: a max() is not linear in the terms; the fitted overhead stands for the host's time
        return estimate(pm, run.cfg, cluster, replace(base, matmul_efficiency=m, attention_efficiency=a,
                                                      elementwise_passes=p, micro_overhead_s=o,
                                                      launch_floor=False)).step_time_s

    fixed = t()
    if run.peak_gb is not None:  # the planner's memory does not depend on the fitted terms: compared, not fitted
        run.predicted_gb = estimate(pm, run.cfg, cluster, base).memory["total"]
    return np.array([t(m=1.0) - fixed, t(a=1.0) - fixed, t(p=1.0) - fixed, t(o=1.0) - fixed, fixed])


def _vector(assume: Assumptions) -> np.ndarray:
    return np.array([1 / assume.matmul_efficiency, 1 / assume.attention_efficiency, assume.elementwise_passes,
                     assume.micro_overhead_s, 1.0])


def predict(x: np.ndarray, assume: Assumptions) -> float:
    return float(x @ _vector(assume))


def fit(rows: list[np.ndarray], measured: list[float], base: Assumptions) -> Assumptions:
    """The assumptions whose step times best match `measured` (non-negative least squares on the relative error).
    Four runs or more fit the four terms apart; two or three fit one factor on the three compute terms (the
    defaults' proportions kept) and the overhead; one run fits the factor alone."""
    from scipy.optimize import nnls

    x, y = np.stack(rows), np.asarray(measured)
    w = 1 / y  # relative error: every run counts alike, short or long
    target = (y - x[:, 4]) * w
    start = _vector(base)[:3]
    if len(rows) >= 4:
        coef, _ = nnls(x[:, :4] * w[:, None], target)
        if np.all(coef[:3] > 0):
            return replace(base, matmul_efficiency=1 / coef[0], attention_efficiency=1 / coef[1],
                           elementwise_passes=float(coef[2]), micro_overhead_s=float(coef[3]))
    columns = [x[:, :3] @ start] + ([x[:, 3]] if len(rows) >= 2 else [])
    coef, _ = nnls(np.stack(columns, 1) * w[:, None], target)
    k, overhead = coef[0], (coef[1] if len(coef) > 1 else 0.0)
    if k <= 0:
        raise VlaforgeError(
            "the measured step times are no longer than the planner's fixed parts (optimizer, communication): "
            "nothing to calibrate; check that --gpu names the hardware of the runs" if np.all(target <= 0) else
            "the measured step times do not grow with the planner's compute (a run with more compute measured "
            "faster): nothing to calibrate; time more steps per run, or runs further apart in size")
    return replace(base, matmul_efficiency=base.matmul_efficiency / k, attention_efficiency=base.attention_efficiency
                   / k, elementwise_passes=base.elementwise_passes * k, micro_overhead_s=float(overhead))


def calibrate(runs: list[str | Path], gpu_name: str, out: str | Path, catalog: Path | None = None,
              base: Assumptions = Assumptions(), held_out: list[str | Path] = ()) -> dict[str, Any]:
    """Fit to `runs`, write `[calibration.<gpu>]` into `out` (other GPUs' tables kept), and report predicted vs
    measured before / after for the fitted runs and for the `held_out` ones (measured, not fitted)."""
    from vlaforge.planner.hardware import get_gpu, load_catalog

    gpu = get_gpu(gpu_name, load_catalog(catalog))
    measured = [read_run(r) for r in runs]
    rows = [terms(m, gpu, base) for m in measured]
    fitted = fit(rows, [m.step_s for m in measured], base)
    report = {"gpu": gpu.name, "before": {k: getattr(base, k) for k in FITTED},
              "after": {k: round(getattr(fitted, k), 6) for k in FITTED},
              "runs": _compare(measured, rows, base, fitted)}
    checks = [read_run(r) for r in held_out]
    report["held_out"] = _compare(checks, [terms(m, gpu, base) for m in checks], base, fitted)
    for key in ("runs", "held_out"):
        for when in ("before", "after"):
            errors = [abs(r[f"error_{when}"]) for r in report[key]]
            report[f"{key}_mean_abs_error_{when}"] = round(float(np.mean(errors)), 4) if errors else None
    write_calibration(out, gpu.name, report)
    report["wrote"] = str(out)
    return report


def _compare(measured: list[MeasuredRun], rows: list[np.ndarray], base: Assumptions, fitted: Assumptions
             ) -> list[dict[str, Any]]:
    out = []
    for m, x in zip(measured, rows):
        before, after = predict(x, base), predict(x, fitted)
        out.append({"run": m.path, "measured_step_s": round(m.step_s, 6), "predicted_before_s": round(before, 6),
                    "predicted_after_s": round(after, 6), "error_before": round(before / m.step_s - 1, 4),
                    "error_after": round(after / m.step_s - 1, 4)})
        if m.peak_gb is not None and m.predicted_gb is not None:
            out[-1] |= {"measured_peak_gb": round(m.peak_gb, 3), "predicted_gb": round(m.predicted_gb, 3),
                        "memory_ratio": round(m.predicted_gb / m.peak_gb, 4)}
    return out


def write_calibration(path: str | Path, gpu: str, report: dict[str, Any]) -> None:
    import tomli_w

    from vlaforge.outputs import write_atomic

    path = Path(path)
    data = _read(path) if path.exists() else {}
    data.setdefault("calibration", {})[gpu] = {
        **report["after"], "runs": [r["run"] for r in report["runs"]],
        "mean_abs_error_before": report["runs_mean_abs_error_before"],
        "mean_abs_error_after": report["runs_mean_abs_error_after"]}
    write_atomic(path, "# written by `vlaforge plan --calibrate`; read by `vlaforge plan --calibration`\n"
                 + tomli_w.dumps(data))


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise VlaforgeError(f"--calibration {path}: not a readable TOML file ({first_line(exc, 120)}); give the "
                            "file `vlaforge plan --calibrate` wrote") from None


def calibrated(path: str | Path | None, gpu: str, base: Assumptions) -> tuple[Assumptions, str | None]:
    """`base` with the fitted fields of `[calibration.<gpu>]` from `path`, and where they came from (None when the
    file has no entry for that GPU: the plan is uncalibrated)."""
    if path is None:
        return base, None
    entry = _read(Path(path)).get("calibration", {}).get(gpu)
    if entry is None:
        return base, None
    try:
        values = {k: float(entry[k]) for k in FITTED}
    except (KeyError, TypeError, ValueError):
        raise VlaforgeError(f"--calibration {path}: [calibration.{gpu}] needs {', '.join(FITTED)} as numbers; "
                            "run `vlaforge plan --calibrate` again") from None
    if not (all(0 < values[k] < 1e6 for k in FITTED[:3]) and 0 <= values["micro_overhead_s"] < 1e3):
        raise VlaforgeError(f"--calibration {path}: [calibration.{gpu}] holds a value out of range {values}")
    runs = entry.get("runs", [])
    # the fitted per-micro-batch overhead replaces the catalog's launch floor (the fit was made without it)
    return replace(base, launch_floor=False, **values), f"calibrated for {gpu} from {len(runs)} run(s) in {path}"


def uncalibrated_note(assume: Assumptions) -> str:
    return (f"step time / MFU uncalibrated: assumes matmuls at {assume.matmul_efficiency:g} and attention at "
            f"{assume.attention_efficiency:g} of the datasheet peak, {assume.elementwise_passes:g} memory passes "
            "per activation" + (", the catalog's host time per kernel launch as a floor" if assume.launch_floor
                                else "") + "; calibrate with `vlaforge plan --calibrate RUN...`")


def render(report: dict[str, Any]) -> str:
    changes = ", ".join(f"{k} {report['before'][k]:g} -> {report['after'][k]:.4g}" for k in FITTED)
    lines = [f"calibration for {report['gpu']}: {changes}"]
    lines.append(f"{'run':<32} {'measured s':>11} {'before s':>10} {'after s':>10} {'err before':>11} "
                 f"{'err after':>10}")
    for key, label in (("runs", "fitted"), ("held_out", "held out")):
        for r in report[key]:
            name = f"{Path(r['run']).name[-22:]} ({label})"
            lines.append(f"{name:<32} {r['measured_step_s']:>11.4f} {r['predicted_before_s']:>10.4f} "
                         f"{r['predicted_after_s']:>10.4f} {r['error_before']:>+11.1%} {r['error_after']:>+10.1%}")
        if report[key]:
            lines.append(f"mean |error| {label}: {report[f'{key}_mean_abs_error_before']:.1%} before, "
                         f"{report[f'{key}_mean_abs_error_after']:.1%} after")
    lines.append(f"wrote {report['wrote']}")
    return "\n".join(lines)
