"""`vlaforge data info`: what a LeRobot dataset holds - features, episodes, frames, tasks and fps - read (and
checked) by the same reader training uses, so a damaged dataset is reported here before a run starts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from vlaforge.data.generate import recorded_hidden_distractors, recorded_tasks, recorded_tcp_steering
from vlaforge.data.lerobot_features import depth_cameras, feature_kind, rgb_cameras
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.errors import VlaforgeError

VIDEO_PREFIX = "observation.images."


def dataset_shapes(info: dict[str, Any], where: Path) -> dict[str, Any]:
    """Cameras (in the dataset's order), state and action sizes declared by a LeRobot `meta/info.json`.

    Raises:
        VlaforgeError: a feature is missing or has no size.
    """
    feats = info.get("features") or {}
    cameras = [k.removeprefix(VIDEO_PREFIX) for k in rgb_cameras(feats)]
    if not cameras:
        depth = depth_cameras(feats)
        images = [k for k, v in feats.items() if v.get("dtype") == "image"]
        why = (f" (only the depth map{'s' if len(depth) > 1 else ''} {', '.join(depth)}, which vlaforge does not "
               "train on)" if depth else f" ({', '.join(images)} are stored as images in parquet; vlaforge reads "
               "cameras stored as video: re-encode them with LeRobot's convert-to-video tool)" if images else "")
        raise VlaforgeError(f"{where / 'meta/info.json'} declares no RGB video features (cameras){why}; the dataset "
                            "has no images to train on")
    out: dict[str, Any] = {"cameras": cameras}
    for key, name in (("observation.state", "state_dim"), ("action", "action_dim")):
        shape = (feats.get(key) or {}).get("shape")
        if not shape or not isinstance(shape[0], int):
            raise VlaforgeError(f"{where / 'meta/info.json'} declares no size for {key!r}; regenerate the dataset")
        out[name] = shape[0]
    return out


def dataset_summary(path: str | Path) -> dict[str, Any]:
    """A JSON-able summary of the dataset at `path`.

    Raises:
        VlaforgeError: the dataset is missing, incomplete or damaged (one line naming the file).
    """
    reader = LeRobotDataset(path)  # the checks training runs when it opens the dataset
    reader.check_thoroughly()  # and what it would meet later: every vector column, a frame of every video file
    info = reader.info
    recorded = info.get("vlaforge", {})  # what `vlaforge data generate` recorded, absent for other datasets
    episodes = Counter(e.task for e in reader.episodes)
    frames: Counter = Counter()
    for e in reader.episodes:
        frames[e.task] += e.length
    features = [{"name": name, "dtype": feature_kind(spec), "shape": spec.get("shape")}
                for name, spec in info.get("features", {}).items()]
    text_columns = sorted(k for k, v in reader.columns.items() if v.dtype == object)
    return {"path": str(reader.root), "codebase_version": reader.version, "robot_type": info.get("robot_type"),
            "fps": reader.fps, "episodes": len(reader.episodes), "frames": reader.num_frames,
            "tasks": [{"task": t, "episodes": episodes[t], "frames": frames[t]} for t in reader.tasks],
            "features": features, "model_shapes": dataset_shapes(info, reader.root),
            "generator": recorded.get("generator"), "simulator_tasks": recorded_tasks(info),
            # episodes per simulator task (make demo compares them with the counts it asks for)
            "simulator_episodes": dict(Counter(recorded.get("episode_tasks", []))),
            "hide_distractors": recorded_hidden_distractors(info), "expert_steers_tcp": recorded_tcp_steering(info),
            "text_columns": text_columns, "notices": list(reader.notices)}


def render_dataset_summary(s: dict[str, Any]) -> str:
    """The summary as aligned text tables."""
    shapes = s["model_shapes"]
    lines = [f"dataset {s['path']}  (LeRobot {s['codebase_version']}, robot {s['robot_type'] or '-'}, "
             f"{s['fps']:g} fps)",
             f"{s['episodes']} episodes, {s['frames']} frames, {len(s['tasks'])} tasks",
             f"model shapes ('auto'): cameras = {shapes['cameras']}, state_dim = {shapes['state_dim']}, "
             f"action_dim = {shapes['action_dim']}", ""]
    width = max(len(f["name"]) for f in s["features"])
    lines.append(f"{'feature':<{width}}  {'dtype':<8}  shape")
    lines += [f"{f['name']:<{width}}  {str(f['dtype']):<8}  {f['shape']}" for f in s["features"]]
    lines.append("")
    width = max([len("task")] + [len(t["task"]) for t in s["tasks"]])
    lines.append(f"{'task':<{width}}  {'episodes':>8}  {'frames':>7}")
    lines += [f"{t['task']:<{width}}  {t['episodes']:>8}  {t['frames']:>7}" for t in s["tasks"]]
    if s["text_columns"]:
        lines += ["", f"per-frame text (data.text_column): {', '.join(s['text_columns'])}"]
    if s["notices"]:
        lines += ["", *(f"note: {n}" for n in s["notices"])]
    if s["simulator_tasks"]:
        by = f" ({s['generator']})" if s["generator"] else ""
        counts = s["simulator_episodes"]
        named = [f"{t} ({counts[t]} episodes)" if t in counts else t for t in s["simulator_tasks"]]
        lines += ["", f"recorded from: {', '.join(named)}{by}"]
        if s["hide_distractors"]:
            lines.append("distractors hidden in the images (--hide-distractors)")
        if s["expert_steers_tcp"]:
            lines.append(f"experts steering the fingertips (--steer-tcp): {', '.join(s['expert_steers_tcp'])}")
    return "\n".join(lines)
