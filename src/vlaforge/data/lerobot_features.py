"""What a LeRobot dataset's features are to vlaforge: RGB cameras, depth cameras, LeRobot 0.6's language columns,
and dtypes vlaforge does not read (each named once in a notice, never a traceback). docs/lerobot.md has the rules.

LeRobot 0.6 (`lerobot-annotate`) adds two per-frame columns, each a list of message structs:
  language_persistent  {role, content, style, timestamp, ...}: the episode's whole slice on every frame; a row of
                       style S is the active S from its timestamp until the next row of style S
                       (styles: subtask, plan, memory, motion, task_aug)
  language_events      {role, content, style, ...}: only on the frame an event fires (interjection, vqa, trace,
                       speech tool calls)
vlaforge turns each persistent style S into a per-frame text column `language_persistent.S` (the content active at
that frame; "" before the first row), usable as data.text_column; `language_persistent.subtask` is the language
target that data.text_column = "auto" picks when the dataset has no `annotation.phase`. Events are dialogue at single
frames, which vlaforge's policies do not model: they are left out with a notice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

LANGUAGE_PERSISTENT = "language_persistent"
LANGUAGE_EVENTS = "language_events"
LANGUAGE_COLUMNS = (LANGUAGE_PERSISTENT, LANGUAGE_EVENTS)
PHASE_COLUMN = "annotation.phase"  # the per-frame text `vlaforge data generate` writes
# feature dtypes LeRobot writes that vlaforge reads (video cameras, vector/scalar columns, text, language)
READ_DTYPES = {"video", "image", "float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
               "string", "language"}
TIME_TOLERANCE_S = 1e-4  # LeRobot's own tolerance_s default


def is_depth(spec: dict[str, Any]) -> bool:
    """A video feature holding a depth map (LeRobot 0.6: `info.is_depth_map`, or the older `video.is_depth_map`)."""
    info = spec.get("info") or {}
    return bool(spec.get("dtype") == "video" and (info.get("is_depth_map") or info.get("video.is_depth_map")))


def rgb_cameras(features: dict[str, Any]) -> list[str]:
    """The RGB cameras, in info.json's order: video features (depth maps are not cameras) and image features (PNG /
    JPEG bytes in the data files, as the openpi / LeRobot LIBERO datasets store them)."""
    return [k for k, v in features.items() if v.get("dtype") in ("video", "image") and not is_depth(v)]


def frame_size(spec: dict[str, Any]) -> tuple[int, int]:
    """(height, width) of a camera feature: its shape is (H, W, C), or (C, H, W) where its names say so."""
    shape, names = list(spec.get("shape") or ()), spec.get("names") or []
    if len(shape) == 3 and isinstance(names, list) and names and str(names[0]).startswith("channel"):
        return int(shape[1]), int(shape[2])
    return int(shape[0]), int(shape[1])


def depth_cameras(features: dict[str, Any]) -> list[str]:
    return [k for k, v in features.items() if is_depth(v)]


def feature_kind(spec: dict[str, Any]) -> str:
    """The dtype `vlaforge data info` shows: info.json's, with depth maps as 'depth'."""
    return "depth" if is_depth(spec) else str(spec.get("dtype"))


def auto_text_column(features: dict[str, Any]) -> str | None:
    """The language target data.text_column = "auto" picks from a dataset's features, or None."""
    if PHASE_COLUMN in features:
        return PHASE_COLUMN
    if LANGUAGE_PERSISTENT in features:
        return f"{LANGUAGE_PERSISTENT}.subtask"  # the active subtask (persistent_columns)
    return None


def feature_notices(features: dict[str, Any]) -> list[str]:
    """One line per feature that training leaves out: depth cameras, event annotations, unknown dtypes."""
    out = []
    for key in depth_cameras(features):
        out.append(f"camera {key!r} is a depth map (is_depth_map): vlaforge's vision towers take RGB, so it is not "
                   "used (model.cameras = 'auto' skips it)")
    for key, spec in features.items():
        dtype = spec.get("dtype")
        if key == LANGUAGE_EVENTS:
            out.append(f"{key}: event annotations (interjections, VQA, speech) fire at single frames; vlaforge "
                       "does not train on them")
        elif dtype not in READ_DTYPES:
            out.append(f"feature {key!r} has dtype {dtype!r}, which vlaforge does not read; it is left out")
    return out


def persistent_columns(rows: list[Any], timestamps: np.ndarray, episodes: np.ndarray) -> dict[str, np.ndarray]:
    """Per-frame text columns `language_persistent.<style>` from the `language_persistent` column's rows.

    Args:
        rows: per frame, the list of persistent message dicts (the episode's slice, repeated on every frame).
        timestamps, episodes: per frame, its timestamp and episode index (rows in the same order).

    Returns:
        style -> (N,) object array of str: the content of the latest row of that style at or before the frame.
    """
    n = len(rows)
    starts = np.flatnonzero(np.r_[True, episodes[1:] != episodes[:-1]]) if n else np.zeros(0, int)
    # the slice is the same on every frame of an episode: its first frame's rows are the episode's
    styles = sorted({m.get("style") for i in starts for m in (rows[i] or []) if m.get("style")})
    out = {s: np.full(n, "", dtype=object) for s in styles}
    for begin, end in zip(starts, [*starts[1:], n]):
        messages = sorted((m for m in (rows[begin] or []) if m.get("style") in out and m.get("content")),
                          key=lambda m: float(m.get("timestamp") or 0.0))
        for style in styles:
            picked = [m for m in messages if m["style"] == style]
            if not picked:
                continue
            times = np.asarray([float(m.get("timestamp") or 0.0) for m in picked])
            # the latest row whose timestamp is at or before the frame's (within LeRobot's tolerance)
            which = np.searchsorted(times, timestamps[begin:end] + TIME_TOLERANCE_S, side="right") - 1
            texts = np.asarray([""] + [str(m["content"]) for m in picked], dtype=object)
            out[style][begin:end] = texts[which + 1]
    return {f"{LANGUAGE_PERSISTENT}.{s}": v for s, v in out.items()}

