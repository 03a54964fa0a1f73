"""`report.html` of a diagnosis: one self-contained file (plots as embedded PNG data, no script, no network) that
opens offline in a browser - checklist, findings, and the curves they were read from, with each finding's step range
shaded: loss terms, gradient norms per component, fp16 numerics, learning rates, loss scale, and step / data time.
A compared run is drawn dashed on the same axes."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.diagnostics.signals import RunSignals

PANELS = [("Loss terms", "loss/", True), ("Gradient norm per component", "grad_norm/", True),
          ("fp16 numerics (share of gradient elements)", "numerics/", False), ("Learning rate", "lr/", True),
          ("Loss scale and skipped steps", "precision/", True), ("Step and data time (s)", "perf/", False)]
PERF_KEYS = ("perf/step_s", "perf/data_s", "perf/step_s_rank_max", "perf/step_s_rank_min")
WIDTH_PX, HEIGHT_PX, DPI = 900, 300, 100
COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def _keys(signals: RunSignals, prefix: str) -> list[str]:
    if prefix == "perf/":
        return [k for k in PERF_KEYS if signals.get(k) is not None]
    if prefix == "numerics/":
        return [k for k in signals.keys(prefix) if k.endswith(("zero_frac", "fp16_underflow_frac"))]
    return signals.keys(prefix)


def _panel(title: str, prefix: str, log: bool, runs: list[RunSignals], findings: list[dict]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = _keys(runs[0], prefix)
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    for style, signals in zip(("-", "--"), runs):
        for i, key in enumerate(keys):
            s = signals.get(key)
            if s is None:
                continue
            v = np.where(np.isfinite(s.values), s.values, np.nan)
            if log:
                v = np.where(v > 0, v, np.nan)
            ax.plot(s.steps, v, style, color=f"C{i % 10}", lw=1.2,
                    label=key.removeprefix(prefix) if style == "-" else None)
    for f in findings:
        if f["steps"] and (prefix != "loss/" or f["kind"] in ("spike", "divergence", "non_finite", "oscillation",
                                                                 "stuck")):
            lo, hi = f["steps"]
            ax.axvspan(lo - 0.5, hi + 0.5, color=COLORS[f["severity"]], alpha=0.15)
    if log and ax.has_data():
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def write_html(report: dict[str, Any], runs: list[RunSignals], path: str | Path) -> Path:
    """Write the report; returns its path (written to a temporary name and renamed)."""
    from vlaforge.outputs import write_atomic

    e = html.escape
    parts = [f"<h1>vlaforge diagnose: {e(report['run'])}</h1>",
             f"<p>{report['last_step']} steps, {len(report['findings'])} finding(s)"
             + (f"; compared with {e(report['compare']['run'])} (dashed)" if "compare" in report else "") + "</p>"]
    if report["checklist"]:
        parts.append("<h2>First things to try</h2><ol>" + "".join(f"<li>{e(x)}</li>" for x in report["checklist"])
                     + "</ol>")
    else:
        parts.append("<h2>No findings</h2><p>No spikes, divergence, numerics trouble or stalls.</p>")
    if report["findings"]:
        rows = "".join(
            f"<tr><td style='color:{COLORS[f['severity']]}'>{e(f['severity'])}</td><td>{e(f['kind'])}</td>"
            f"<td>{e(str(f['steps'][0]) + '-' + str(f['steps'][1]) if f['steps'] else '')}</td>"
            f"<td>{e(f['title'])}<br><small>likely: {e('; '.join(f['causes']))}</small></td>"
            f"<td>{'<br>'.join(e(x) for x in f['fixes'])}</td></tr>" for f in report["findings"])
        parts.append("<h2>Findings</h2><table><tr><th>severity</th><th>kind</th><th>steps</th><th>what</th>"
                     f"<th>try</th></tr>{rows}</table>")
    parts.append("<h2>Curves</h2>")
    for title, prefix, log in PANELS:
        png = _panel(title, prefix, log, runs, report["findings"])
        if png:
            parts.append(f"<img alt='{e(title)}' width='{WIDTH_PX}' height='{HEIGHT_PX}' "
                         f"src='data:image/png;base64,{png}'>")
    style = ("body{font-family:sans-serif;max-width:960px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px;vertical-align:top;font-size:13px}"
             "img{display:block;margin:1em 0}")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>vlaforge diagnose</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}</body></html>\n")
    write_atomic(path, page)
    return Path(path)


def write_reports(report: dict[str, Any], runs: list[RunSignals], run: Path, html_path: Path | None = None) -> None:
    """`RUN/diagnose.json` and the HTML report (default `RUN/report.html`, its path put in the report as "html").

    Raises:
        VlaforgeError: a file cannot be written (one line naming it).
    """
    from vlaforge.errors import VlaforgeError
    from vlaforge.outputs import write_atomic

    try:
        report["html"] = str(write_html(report, runs, html_path or Path(run) / "report.html"))
        write_atomic(Path(run) / "diagnose.json", json.dumps(report, indent=1) + "\n")
    except OSError as exc:
        raise VlaforgeError(f"cannot write the report ({exc.strerror or exc}: {exc.filename}); give a writable "
                            "--html FILE, and a run folder this user may write diagnose.json into") from None
