"""LeRobotDataset v3.0 writer on pyarrow + PyAV: streams episodes into multi-episode parquet and mp4 files,
writes meta/ at the end, and appears at its destination only when complete. Layout: docs/lerobot_format.md;
the reader is `lerobot_v3.py`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.data.video import VideoWriter
from vlaforge.errors import VlaforgeError

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
ENV_STATE = "observation.environment_state"  # LeRobot's name for privileged scene state (object / goal positions)
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's DEFAULT_QUANTILES: its QUANTILES / QUANTILE10 modes read them


def _quantile_key(q: float) -> str:
    return f"q{round(q * 100):02d}"


def _stats(values: np.ndarray, axis: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """min/max/mean/std/count (+ q01/q10/q50/q90/q99 for vectors) over `axis`, as lists for JSON."""
    v = values.astype(np.float64)
    out = {"min": v.min(axis), "max": v.max(axis), "mean": v.mean(axis), "std": v.std(axis),
           "count": np.array([values.shape[0]])}
    if axis == (0,):
        for q in QUANTILES:
            out[_quantile_key(q)] = np.quantile(v, q, axis=0)
    return {k: np.asarray(x).tolist() for k, x in out.items()}


def _image_stats(frames: np.ndarray) -> dict[str, Any]:
    """Per-channel stats in [0, 1], shaped (3, 1, 1) as LeRobot stores them (quantiles too); every 4th frame is
    enough."""
    v = frames[::4].astype(np.float32) / 255.0  # (T, H, W, C)
    out = {"min": v.min((0, 1, 2)), "max": v.max((0, 1, 2)), "mean": v.mean((0, 1, 2)), "std": v.std((0, 1, 2))}
    flat = v.reshape(-1, v.shape[-1])
    out.update({_quantile_key(q): np.quantile(flat, q, axis=0) for q in QUANTILES})
    res = {k: x.reshape(3, 1, 1).tolist() for k, x in out.items()}
    res["count"] = [int(frames.shape[0])]
    return res


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine per-episode stats (count-weighted mean and pooled variance; quantiles count-weighted)."""
    counts = np.array([p["count"][0] for p in parts], dtype=np.float64)
    w = counts / counts.sum()
    mean = sum(wi * np.asarray(p["mean"]) for wi, p in zip(w, parts))
    var = sum(wi * (np.asarray(p["std"]) ** 2 + (np.asarray(p["mean"]) - mean) ** 2) for wi, p in zip(w, parts))
    out = {"min": np.min([p["min"] for p in parts], 0), "max": np.max([p["max"] for p in parts], 0),
           "mean": mean, "std": np.sqrt(var), "count": np.array([int(counts.sum())])}
    for key in parts[0]:
        if key.startswith("q"):
            out[key] = sum(wi * np.asarray(p[key]) for wi, p in zip(w, parts))
    return {k: np.asarray(v).tolist() for k, v in out.items()}


@dataclass
class _FileCursor:
    """Which chunk/file the next episode goes to; files roll over at a size limit, chunks every `chunks_size`."""

    chunks_size: int
    chunk: int = 0
    file: int = 0

    def advance(self) -> None:
        self.file += 1
        if self.file >= self.chunks_size:
            self.chunk, self.file = self.chunk + 1, 0

    def fmt(self, template: str, **kw: Any) -> str:
        return template.format(chunk_index=self.chunk, file_index=self.file, **kw)


@dataclass
class _Features:
    cameras: list[str]
    image_size: int
    state_names: list[str]
    action_names: list[str]
    text: list[str] = field(default_factory=list)
    env_state_names: list[str] = field(default_factory=list)

    def video_key(self, camera: str) -> str:
        return f"observation.images.{camera}"


def partial_folder(root: Path) -> Path:
    """Where a dataset for `root` is written before it is renamed into place (left behind by a killed run)."""
    return root.parent / f".{root.name}.partial"


class DatasetWriter:
    """Write a LeRobotDataset v3.0 into a temporary folder; `finish()` renames it into place.

    Use as a context manager: on an exception the temporary folder is removed and nothing appears at `root`.
    """

    def __init__(self, root: str | Path, *, fps: int, cameras: list[str], image_size: int, state_names: list[str],
                 action_names: list[str], text_features: list[str] | None = None,
                 env_state_names: list[str] | None = None, robot_type: str = "sawyer",
                 codec: str = "libx264", crf: int = 18, chunks_size: int = 1000, data_file_mb: float = 100.0,
                 video_file_mb: float = 500.0):
        self.root = Path(root)
        self.tmp = partial_folder(self.root)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.fps, self.codec, self.crf, self.robot_type = fps, codec, crf, robot_type
        self.f = _Features(cameras, image_size, state_names, action_names, list(text_features or []),
                           list(env_state_names or []))
        self.data_file_mb, self.video_file_mb = data_file_mb, video_file_mb
        self.data_cursor = _FileCursor(chunks_size)
        self.video_cursors = {c: _FileCursor(chunks_size) for c in cameras}
        self.videos: dict[str, VideoWriter] = {}
        self.pending: list[dict[str, Any]] = []  # per-episode columns of the open data file
        self.pending_bytes = 0
        self.episodes: list[dict[str, Any]] = []  # rows of meta/episodes
        self.episode_stats: list[dict[str, dict]] = []
        self.vectors: dict[str, list[np.ndarray]] = {}  # state / action / env state of every episode: exact stats
        self.tasks: dict[str, int] = {}
        self.total_frames = 0

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        return False

    def add_episode(self, task: str, images: dict[str, np.ndarray], state: np.ndarray, action: np.ndarray,
                    text: dict[str, list[str]] | None = None, env_state: np.ndarray | None = None) -> int:
        """Append one episode: images camera -> (T, H, W, 3) uint8, state (T, S), action (T, A), and env_state
        (T, E) when the writer was given env_state_names."""
        n = len(state)
        if (env_state is None) != (not self.f.env_state_names):
            raise VlaforgeError(f"add_episode: {ENV_STATE} must be given exactly when the writer has "
                                "env_state_names")
        text = text or {}
        task_index = self.tasks.setdefault(task, len(self.tasks))
        ep = len(self.episodes)
        meta: dict[str, Any] = {"episode_index": ep, "tasks": [task], "length": n,
                                "data/chunk_index": self.data_cursor.chunk, "data/file_index": self.data_cursor.file,
                                "dataset_from_index": self.total_frames, "dataset_to_index": self.total_frames + n}
        vectors = {"observation.state": state, "action": action, **({ENV_STATE: env_state} if env_state is not None
                                                                    else {})}
        stats = {name: _stats(v) for name, v in vectors.items()}
        for name, v in vectors.items():
            self.vectors.setdefault(name, []).append(v)
        for cam in self.f.cameras:
            key = self.f.video_key(cam)
            video = self._video(cam)
            start, end = video.add(images[cam])
            cur = self.video_cursors[cam]
            meta |= {f"videos/{key}/chunk_index": cur.chunk, f"videos/{key}/file_index": cur.file,
                     f"videos/{key}/from_timestamp": start, f"videos/{key}/to_timestamp": end}
            stats[key] = _image_stats(images[cam])
            if video.size_mb() >= self.video_file_mb:
                video.close()
                del self.videos[cam]
                cur.advance()
        t = np.arange(n)
        stats |= {"timestamp": _stats((t / self.fps)[:, None]), "frame_index": _stats(t[:, None]),
                  "episode_index": _stats(np.full((n, 1), ep)), "task_index": _stats(np.full((n, 1), task_index)),
                  "index": _stats((self.total_frames + t)[:, None])}
        for name, s in stats.items():
            for k, v in s.items():
                meta[f"stats/{name}/{k}"] = v
        self.episodes.append(meta)
        self.episode_stats.append(stats)
        self.pending.append({"observation.state": state.astype(np.float32), "action": action.astype(np.float32),
                             "timestamp": (t / self.fps).astype(np.float32), "frame_index": t,
                             "episode_index": np.full(n, ep), "index": self.total_frames + t,
                             "task_index": np.full(n, task_index), **{k: list(v) for k, v in text.items()},
                             **({ENV_STATE: env_state.astype(np.float32)} if env_state is not None else {})})
        self.pending_bytes += n * 4 * (state.shape[1] + action.shape[1] + 8)
        self.total_frames += n
        if self.pending_bytes / 2**20 >= self.data_file_mb:
            self._flush_data()
            self.data_cursor.advance()
        return ep

    def _video(self, cam: str) -> VideoWriter:
        if cam not in self.videos:
            rel = self.video_cursors[cam].fmt(VIDEO_PATH, video_key=self.f.video_key(cam))
            self.videos[cam] = VideoWriter(self.tmp / rel, self.fps, (self.f.image_size,) * 2, self.codec, self.crf)
        return self.videos[cam]

    def _flush_data(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.pending:
            return
        cols: dict[str, Any] = {}
        for name in ("observation.state", "action", *([ENV_STATE] if self.f.env_state_names else [])):
            values = np.concatenate([p[name] for p in self.pending])
            cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float32()), values.shape[1])
        cols["timestamp"] = pa.array(np.concatenate([p["timestamp"] for p in self.pending]), pa.float32())
        for name in INDEX_COLUMNS[1:]:
            cols[name] = pa.array(np.concatenate([p[name] for p in self.pending]), pa.int64())
        for name in self.f.text:
            cols[name] = pa.array([s for p in self.pending for s in p[name]], pa.string())
        path = self.tmp / self.data_cursor.fmt(DATA_PATH)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), path)
        self.pending, self.pending_bytes = [], 0

    def _features(self) -> dict[str, Any]:
        s = self.f.image_size
        feats: dict[str, Any] = {}
        for cam in self.f.cameras:
            feats[self.f.video_key(cam)] = {
                "dtype": "video", "shape": [s, s, 3], "names": ["height", "width", "channels"],
                "info": {"video.height": s, "video.width": s, "video.codec": "h264" if self.codec == "libx264"
                         else self.codec, "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                         "video.fps": self.fps, "video.channels": 3, "has_audio": False}}
        feats["observation.state"] = {"dtype": "float32", "shape": [len(self.f.state_names)],
                                      "names": list(self.f.state_names)}
        feats["action"] = {"dtype": "float32", "shape": [len(self.f.action_names)], "names": list(self.f.action_names)}
        if self.f.env_state_names:
            feats[ENV_STATE] = {"dtype": "float32", "shape": [len(self.f.env_state_names)],
                                "names": list(self.f.env_state_names)}
        for name in self.f.text:
            feats[name] = {"dtype": "string", "shape": [1], "names": None}
        feats["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
        for name in INDEX_COLUMNS[1:]:
            feats[name] = {"dtype": "int64", "shape": [1], "names": None}
        return feats

    def finish(self, extra_info: dict[str, Any] | None = None) -> Path:
        """Close files, write meta/, and move the dataset to `root` (which must not exist)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.episodes:
            raise VlaforgeError("no episodes were recorded; nothing to write")
        self._flush_data()
        for video in self.videos.values():
            video.close()
        self.videos = {}
        meta = self.tmp / "meta"
        ep_path = meta / EPISODES_PATH.format(chunk_index=0, file_index=0)[len("meta/"):]
        ep_path.parent.mkdir(parents=True, exist_ok=True)
        for e in self.episodes:
            e["meta/episodes/chunk_index"], e["meta/episodes/file_index"] = 0, 0
        pq.write_table(pa.Table.from_pylist(self.episodes), ep_path)
        _write_tasks(meta / "tasks.parquet", list(self.tasks))
        stats = {n: merge_stats([s[n] for s in self.episode_stats]) for n in self.episode_stats[0]}
        # NOTE: the vectors' quantiles over all frames, not merge_stats' count-weighted mean of the episodes' (what
        # LeRobot's own aggregation approximates them by): the normalization LeRobot's QUANTILES modes apply
        stats |= {n: _stats(np.concatenate(v)) for n, v in self.vectors.items()}
        (meta / "stats.json").write_text(json.dumps(stats, indent=1))
        info = {"codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
                "total_episodes": len(self.episodes), "total_frames": self.total_frames,
                "total_tasks": len(self.tasks), "chunks_size": self.data_cursor.chunks_size,
                "data_files_size_in_mb": self.data_file_mb, "video_files_size_in_mb": self.video_file_mb,
                "fps": self.fps, "splits": {"train": f"0:{len(self.episodes)}"},
                "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": self._features()}
        info |= extra_info or {}
        (meta / "info.json").write_text(json.dumps(info, indent=2))
        # NOTE: callers check for a non-empty root (and --overwrite) beforehand. The old dataset is renamed aside,
        # not deleted, until the new one is in place: a kill in between leaves one of the two whole.
        old = self.root.parent / f".{self.root.name}.replaced"
        if self.root.exists():
            shutil.rmtree(old, ignore_errors=True)
            self.root.rename(old)
        self.tmp.rename(self.root)
        shutil.rmtree(old, ignore_errors=True)
        return self.root

    def abort(self) -> None:
        for video in self.videos.values():
            try:
                video.container.close()
            except Exception:  # noqa: BLE001 - best effort while unwinding another error
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_tasks(path: Path, tasks: list[str]) -> None:
    """tasks.parquet as LeRobot writes it: `task_index` with the task text as the pandas index."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      "__index_level_0__": pa.array(tasks, pa.string())})
    pandas_meta = {"index_columns": ["__index_level_0__"], "column_indexes": [],
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                                "numpy_type": "int64", "metadata": None},
                               {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": None}],
                   "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)
