"""What a run recorded, as arrays: `metrics.jsonl` read column-wise (pyarrow's JSON reader, so a 100k-step file
reads in well under a second), each metric with the steps it was logged at, plus the run's config.

Rows differ in their keys (the trainer logs numerics at their own steps, scores at evaluation steps); a column holds
only the rows that have it. Non-finite values (a diverged run writes `NaN` / `Infinity`, which is not JSON) are kept
as NaN / inf: the file is then read line by line with Python's parser, which accepts them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.errors import VlaforgeError

METRICS = "metrics.jsonl"


@dataclass
class Series:
    """One metric: the steps it was logged at (ascending) and its values (float64, NaN / inf kept)."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def after(self, step: int) -> "Series":
        keep = self.steps >= step
        return Series(self.steps[keep], self.values[keep])


def aligned(a: Series, b: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps both logged, a's values there, b's values there)."""
    steps, ia, ib = np.intersect1d(a.steps, b.steps, return_indices=True)
    return steps, a.values[ia], b.values[ib]


@dataclass
class RunSignals:
    path: Path
    cfg: Any  # the run's VLAConfig (None when config.toml is missing or from another version)
    series: dict[str, Series] = field(default_factory=dict)
    rows: int = 0

    def get(self, key: str) -> Series | None:
        s = self.series.get(key)
        return s if s is not None and len(s) else None

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.series if k.startswith(prefix) and len(self.series[k]))

    @property
    def last_step(self) -> int:
        return int(max((s.steps[-1] for s in self.series.values() if len(s)), default=0))


def _columns_arrow(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """{key: (values, logged)}; None when the file is not strict JSON (NaN tokens, a cut line)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    try:
        table = pj.read_json(path, parse_options=pj.ParseOptions(unexpected_field_behavior="infer"),
                             read_options=pj.ReadOptions(block_size=1 << 24))
    except (pa.ArrowInvalid, OSError):
        return None
    out = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
            logged = pc.invert(pc.is_null(col)).to_numpy(zero_copy_only=False)
            out[name] = (col.to_numpy(zero_copy_only=False).astype(np.float64), logged)
    return out


def _columns_python(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
        if isinstance(row, dict):
            rows.append(row)
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
    out = {}
    for k in keys:
        logged = np.array([isinstance(r.get(k), (int, float)) for r in rows])
        out[k] = (np.array([float(r[k]) if ok else np.nan for r, ok in zip(rows, logged)]), logged)
    return out


def read_signals(run: str | Path) -> RunSignals:
    """The run folder's metrics and config.

    Raises:
        VlaforgeError: no metrics.jsonl, or nothing in it.
    """
    from vlaforge.config.loading import load_config

    run = Path(run)
    path = run / METRICS
    if not path.is_file():
        raise VlaforgeError(f"{run}: no {METRICS}; give a run folder `vlaforge train` wrote (train.output_dir)")
    cols = _columns_arrow(path) or _columns_python(path)
    if "step" not in cols or not len(cols["step"]):
        raise VlaforgeError(f"{path} holds no logged steps; the run stopped before train.log_every steps")
    try:
        cfg = load_config(run / "config.toml") if (run / "config.toml").is_file() else None
    except VlaforgeError:
        cfg = None  # a config from another version: the curves are still read
    steps, present = cols.pop("step")
    signals = RunSignals(run, cfg, rows=int(present.sum()))
    for key, (values, logged) in cols.items():
        keep = present & logged
        if keep.any():
            order = np.argsort(steps[keep], kind="stable")
            signals.series[key] = Series(steps[keep][order].astype(np.int64), values[keep][order])
    return signals
