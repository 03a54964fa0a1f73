"""`vlaforge diagnose RUN`: read what a run recorded and say what went wrong and what to try.

Findings come from the loss curves (`loss_curve.py`), the gradient numerics (`numerics.py`) and throughput and memory
(`comms.py`), each with its step range, evidence, likely causes and fixes; they are ranked (critical first, then by
score) and the first fixes of the top ones make a three-line checklist. `--compare RUN_B` diagnoses a second run and
sets the two side by side (final losses, step time, findings). Output: a terminal summary, `diagnose.json`, and a
self-contained `report.html` with the plots (`report.py`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.diagnostics.comms import throughput_findings
from vlaforge.diagnostics.findings import checklist, ranked
from vlaforge.diagnostics.loss_curve import loss_findings
from vlaforge.diagnostics.numerics import numerics_findings
from vlaforge.diagnostics.signals import RunSignals, aligned, read_signals


def diagnose_signals(signals: RunSignals, gpu: str | None = None, calibration: str | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    throughput, plan = throughput_findings(signals, gpu, calibration)
    findings = ranked(loss_findings(signals) + numerics_findings(signals) + throughput)
    return {"run": str(signals.path), "rows": signals.rows, "last_step": signals.last_step,
            "checklist": checklist(findings), "findings": [f.as_dict() for f in findings],
            "summary": summary(signals), "planner": plan, "seconds": round(time.perf_counter() - t0, 3)}


def summary(signals: RunSignals) -> dict[str, Any]:
    """Where the run ended: the last finite value of each loss term, and median step / data time."""
    out: dict[str, Any] = {"losses": {}}
    for key in signals.keys("loss/"):
        v = signals.series[key].values
        finite = v[np.isfinite(v)]
        out["losses"][key.removeprefix("loss/")] = float(finite[-1]) if len(finite) else None
    llm = signals.get("grad_norm/llm")
    if llm is not None:  # each component's gradient norm over the LLM's, first and last quarter (medians)
        ratios = {}
        for key in signals.keys("grad_norm/"):
            comp = key.removeprefix("grad_norm/")
            if comp in ("llm", "total"):
                continue
            _, mine, theirs = aligned(signals.series[key], llm)
            r = mine / np.where(theirs > 0, theirs, np.nan)
            q = max(len(r) // 4, 1)
            if len(r):
                ratios[comp] = {"first_quarter": float(np.nanmedian(r[:q])), "last_quarter": float(np.nanmedian(
                    r[-q:]))}
        out["grad_norm_ratio_to_llm"] = ratios
    for key in ("perf/step_s", "perf/data_s", "perf/tokens_per_s"):
        s = signals.get(key)
        if s is not None:
            out[key.removeprefix("perf/")] = float(np.median(s.values[1:] if len(s) > 1 else s.values))
    return out


def diagnose(run: str | Path, compare: str | Path | None = None, gpu: str | None = None,
             calibration: str | None = None) -> tuple[dict[str, Any], list[RunSignals]]:
    """The report of `run` (and `compare`), and the signals it was made from (for the plots)."""
    signals = [read_signals(run)] + ([read_signals(compare)] if compare else [])
    reports = [diagnose_signals(s, gpu, calibration) for s in signals]
    report = reports[0]
    if compare:
        report["compare"] = {"run": reports[1]["run"], "findings": reports[1]["findings"],
                             "checklist": reports[1]["checklist"], "summary": reports[1]["summary"],
                             "delta": _delta(reports[0]["summary"], reports[1]["summary"])}
    return report, signals


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B relative to A: final loss per common term (B / A) and step time."""
    out = {f"loss/{k}": b["losses"][k] / a["losses"][k] for k in a["losses"]
           if a["losses"].get(k) and b["losses"].get(k) is not None}
    if a.get("step_s") and b.get("step_s"):
        out["step_s"] = b["step_s"] / a["step_s"]
    return {k: round(v, 4) for k, v in out.items()}


def render(report: dict[str, Any]) -> str:
    """The terminal summary: the checklist, a table of the findings, then each finding's likely cause and fixes."""
    import io

    from rich.console import Console
    from rich.table import Table

    lines = [f"{report['run']}: {len(report['findings'])} finding(s) over {report['last_step']} steps"]
    if report["checklist"]:
        lines.append("first things to try:")
        lines += [f"  {i}. {fix}" for i, fix in enumerate(report["checklist"], 1)]
    else:
        lines.append("nothing to fix: no spikes, divergence, numerics trouble or stalls found")
    if report["findings"]:
        table = Table(title_justify="left")
        for col in ("#", "severity", "kind", "steps", "finding"):
            table.add_column(col, overflow="fold")
        for i, f in enumerate(report["findings"], 1):
            table.add_row(str(i), f["severity"], f["kind"], f"{f['steps'][0]}-{f['steps'][1]}" if f["steps"] else "",
                          f["title"])
        buf = io.StringIO()
        Console(file=buf, width=140, force_terminal=False, color_system=None).print(table)
        lines.append(buf.getvalue().rstrip())
        for i, f in enumerate(report["findings"], 1):
            lines.append(f"{i}. likely: {f['causes'][0]}" if f["causes"] else f"{i}.")
            lines += [f"   try: {fix}" for fix in f["fixes"][:2]]
    plan = report.get("planner") or {}
    if "predicted_step_s" in plan:
        lines.append(f"step time: measured {plan['measured_step_s']:.4g} s, planner {plan['predicted_step_s']:.4g} s "
                     f"on {plan['gpu']} ({plan['gap']:+.0%}; {plan['calibration'] or 'uncalibrated'})")
    if "memory" in plan:
        lines.append(f"memory at step {plan['memory']['step']}: the biggest part is {plan['memory']['biggest']}; "
                     f"lever: {plan['memory']['lever']}")
    if "compare" in report:
        c = report["compare"]
        lines.append(f"compared with {c['run']}: {len(c['findings'])} finding(s); B/A " +
                     ", ".join(f"{k} {v:.3g}" for k, v in c["delta"].items()))
    return "\n".join(lines)
