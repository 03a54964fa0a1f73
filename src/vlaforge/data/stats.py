"""The statistics a LeRobot policy's normalization reads, taken from the dataset (meta/stats.json) where it has them,
else computed exactly as LeRobot 0.6.1 computes them (`datasets/compute_stats.py` and
`scripts/augment_dataset_quantile_stats.py`): per episode, one `RunningQuantileStats` update over the episode's rows
(a 5,000-bin histogram per dimension between min and max, quantiles interpolated in it), then aggregated over
episodes (count-weighted means, pooled variance, count-weighted quantiles). Computed once per dataset content, with a
progress bar, and kept in vlaforge's cache (`VLAFORGE_CACHE`, else ~/.cache/vlaforge/stats); the user's dataset is
never written to.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from vlaforge.data.transforms import MODE_STATS
from vlaforge.errors import VlaforgeError

DEFAULT_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's DEFAULT_QUANTILES
QUANTILE_KEYS = tuple(f"q{int(q * 100):02d}" for q in DEFAULT_QUANTILES)
BINS = 5000  # RunningQuantileStats' num_quantile_bins
FEATURES = ("observation.state", "action")


def stats_dir() -> Path:
    """Where computed statistics are kept: VLAFORGE_CACHE/stats, else XDG_CACHE_HOME (~/.cache)/vlaforge/stats."""
    base = os.environ.get("VLAFORGE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache",
                                                            "vlaforge")
    return Path(base).expanduser() / "stats"


def feature_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot's `get_feature_stats(x, axis=0, keepdims=False)` of one episode's (N, D) rows: min, max, mean, std,
    count and the quantiles (from a histogram; with fewer than 2 rows every quantile is the mean)."""
    x = x.reshape(len(x), -1)
    if x.shape[0] < 2:
        stats = {"min": np.min(x, axis=0), "max": np.max(x, axis=0), "mean": np.mean(x, axis=0),
                 "std": np.std(x, axis=0), "count": np.array([x.shape[0]])}
        return stats | {q: stats["mean"].copy() for q in QUANTILE_KEYS}
    batch = x.astype(np.result_type(x.dtype, np.float32), copy=False)
    # NOTE: RunningQuantileStats.update's first batch, operation for operation (its running mean update adds 0)
    mean, mean_sq = np.mean(batch, axis=0), np.mean(batch**2, axis=0)
    low, high = np.min(batch, axis=0), np.max(batch, axis=0)
    edges = [np.linspace(low[i] - 1e-10, high[i] + 1e-10, BINS + 1) for i in range(batch.shape[1])]
    hists = [np.zeros(BINS) + np.histogram(batch[:, i], bins=edges[i])[0] for i in range(batch.shape[1])]
    count = batch.shape[0]
    mean += (np.mean(batch, axis=0) - mean) * (count / count)
    mean_sq += (np.mean(batch**2, axis=0) - mean_sq) * (count / count)
    stats = {"min": low.copy(), "max": high.copy(), "mean": mean.copy(),
             "std": np.sqrt(np.maximum(0, mean_sq - mean**2)), "count": np.array([count])}
    for key, q in zip(QUANTILE_KEYS, DEFAULT_QUANTILES, strict=True):
        stats[key] = np.array([_quantile(h, e, q * count) for h, e in zip(hists, edges, strict=True)])
    return stats


def _quantile(hist: np.ndarray, edges: np.ndarray, target: float) -> float:
    """RunningQuantileStats._compute_single_quantile: linear inside the bin where the cumulative count reaches
    `target`."""
    cumsum = np.cumsum(hist)
    idx = np.searchsorted(cumsum, target)
    if idx == 0:
        return edges[0]
    if idx >= len(cumsum):
        return edges[-1]
    before = cumsum[idx - 1]
    inside = cumsum[idx] - before
    if inside == 0:
        return edges[idx]
    return edges[idx] + (target - before) / inside * (edges[idx + 1] - edges[idx])


def aggregate(per_episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """LeRobot's `aggregate_feature_stats`: min of mins, max of maxes, count-weighted mean, pooled variance and
    count-weighted quantiles."""
    means = np.stack([s["mean"] for s in per_episode])
    variances = np.stack([s["std"] ** 2 for s in per_episode])
    counts = np.stack([s["count"] for s in per_episode])
    total = counts.sum(axis=0)
    while counts.ndim < means.ndim:
        counts = np.expand_dims(counts, axis=-1)
    mean = (means * counts).sum(axis=0) / total
    variance = ((variances + (means - mean) ** 2) * counts).sum(axis=0) / total
    out = {"min": np.min(np.stack([s["min"] for s in per_episode]), axis=0),
           "max": np.max(np.stack([s["max"] for s in per_episode]), axis=0),
           "mean": mean, "std": np.sqrt(variance), "count": total}
    for key in QUANTILE_KEYS:
        out[key] = (np.stack([s[key] for s in per_episode]) * counts).sum(axis=0) / total
    return out


def lerobot_stats(reader, progress: bool = True) -> dict[str, dict[str, list[float]]]:
    """State and action statistics of every kind, computed over the reader's episodes as LeRobot computes them."""
    from vlaforge.progress import progress_bar

    rows = {k: reader.columns[k] for k in FEATURES}
    per_feature: dict[str, list] = {k: [] for k in FEATURES}
    with progress_bar(progress, "dataset statistics", len(reader.episodes)) as advance:
        for e in reader.episodes:
            for key in FEATURES:
                per_feature[key].append(feature_stats(rows[key][e.start:e.start + e.length]))
            advance()
    return {key: {s: np.asarray(v, np.float64).reshape(-1).tolist() for s, v in aggregate(eps).items()}
            for key, eps in per_feature.items()}


def policy_stats(reader, norm_map: dict[str, str], progress: bool = True) -> tuple[dict, str | None]:
    """The dataset's state and action statistics for a policy normalizing with `norm_map`: meta/stats.json's, with
    any statistic a mode needs and the file lacks computed as LeRobot computes it (cached); and a line saying so,
    or None.

    Raises:
        VlaforgeError: a statistic the file gives is not finite or not as wide as its feature.
    """
    need = {MODE_STATS[m] for kind, m in norm_map.items() if kind in ("STATE", "ACTION") and m in MODE_STATS}
    needed = {s for pair in need for s in pair}
    stats = {key: _given(reader, key) for key in FEATURES}
    lacking = sorted({s for key in FEATURES for s in needed if s not in stats[key]})
    if not lacking:
        return stats, None
    computed = cached_stats(reader, progress)
    for key in FEATURES:
        stats[key] = {**computed[key], **stats[key]}  # the dataset's own where it has them
    return stats, (f"meta/stats.json lacks {', '.join(lacking)}, which the policy's normalization ({norm_map}) "
                   f"reads: computed as LeRobot computes them and cached in {stats_dir()}")


def _given(reader, key: str) -> dict[str, list[float]]:
    width = reader.columns[key].shape[1]
    out = {}
    for stat, value in (reader.stats.get(key) or {}).items():
        if stat == "count":
            continue
        values = np.asarray(value, np.float64).reshape(-1)
        if values.size != width or not np.isfinite(values).all():
            raise VlaforgeError(f"{reader.root / 'meta/stats.json'}: {key} {stat} is not {width} finite numbers; "
                                "recompute the statistics (regenerate the dataset)")
        out[stat] = values.tolist()
    return out


def cached_stats(reader, progress: bool = True) -> dict[str, dict[str, list[float]]]:
    """`lerobot_stats(reader)`, read from the cache when this dataset content was computed before."""
    from vlaforge.outputs import write_atomic

    path = stats_dir() / f"{dataset_digest(reader)}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass  # a damaged entry: computed again, below
    stats = lerobot_stats(reader, progress)
    write_atomic(path, json.dumps(stats))
    return stats


def dataset_digest(reader) -> str:
    """What the statistics depend on: the episodes read and their state and action rows."""
    h = hashlib.sha256(json.dumps([e.index for e in reader.episodes]).encode())
    for key in FEATURES:
        h.update(np.ascontiguousarray(reader.columns[key], np.float32).tobytes())
    return h.hexdigest()[:32]
