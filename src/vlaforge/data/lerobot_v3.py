"""LeRobotDataset v3.0 writer, and a reader for v3.0 and v2.1, on pyarrow + PyAV (no `lerobot` import).

The layout is documented in docs/lerobot_format.md. In short (v3.0):

    meta/info.json                                   codebase_version, fps, features, path templates
    meta/stats.json                                  per-feature min/max/mean/std/count (+ q01/q99)
    meta/tasks.parquet                               task_index + task text (as the pandas index)
    meta/episodes/chunk-XXX/file-YYY.parquet         one row per episode: length, tasks, file indices,
                                                     dataset_from/to_index, videos/{key}/from/to_timestamp, stats
    data/chunk-XXX/file-YYY.parquet                  one row per frame, many episodes per file
    videos/{key}/chunk-XXX/file-YYY.mp4              many episodes per file; a frame is at from_timestamp + timestamp

Every error about a damaged or missing file is a `VlaforgeError` naming the file.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.errors import VlaforgeError

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
QUANTILES = (0.01, 0.99)


# ----------------------------------------------------------------------------------------------------- writing


def _stats(values: np.ndarray, axis: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """min/max/mean/std/count (+ q01/q99 for vectors) over `axis`, as lists for JSON."""
    v = values.astype(np.float64)
    out = {"min": v.min(axis), "max": v.max(axis), "mean": v.mean(axis), "std": v.std(axis),
           "count": np.array([values.shape[0]])}
    if axis == (0,):
        for q in QUANTILES:
            out[f"q{round(q * 100):02d}"] = np.quantile(v, q, axis=0)
    return {k: np.asarray(x).tolist() for k, x in out.items()}


def _image_stats(frames: np.ndarray) -> dict[str, Any]:
    """Per-channel stats in [0, 1], shaped (3, 1, 1) as LeRobot stores them; every 4th frame is enough."""
    v = frames[::4].astype(np.float32) / 255.0  # (T, H, W, C)
    out = {"min": v.min((0, 1, 2)), "max": v.max((0, 1, 2)), "mean": v.mean((0, 1, 2)), "std": v.std((0, 1, 2))}
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


class VideoWriter:
    """One mp4 that many episodes are appended to; each episode starts on a keyframe (cheap seeks)."""

    def __init__(self, path: Path, fps: int, size: tuple[int, int], codec: str = "libx264", crf: int = 18):
        """size: (height, width), both even."""
        import av

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.frames, self.bytes = path, 0, 0
        self.container = av.open(str(path), "w", format="mp4")
        self.stream = self.container.add_stream(codec, rate=fps)
        self.stream.height, self.stream.width = size
        self.stream.pix_fmt = "yuv420p"
        # NOTE: zerolatency: no lookahead or B-frames, so each episode's packets are written when it ends
        # (its size is known for file roll-over) and frames decode in presentation order.
        self.stream.options = ({"crf": str(crf), "preset": "veryfast", "tune": "zerolatency"} if codec == "libx264"
                               else {"crf": str(crf)})
        self.fps = fps

    def add(self, frames: np.ndarray) -> tuple[float, float]:
        """Encode (T, H, W, 3) uint8; returns the episode's (from_timestamp, to_timestamp)."""
        import av

        start = self.frames
        for i, img in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = start + i
            if i == 0:
                frame.pict_type = av.video.frame.PictureType.I
            for packet in self.stream.encode(frame):
                self.bytes += packet.size
                self.container.mux(packet)
        self.frames += len(frames)
        return start / self.fps, self.frames / self.fps

    def size_mb(self) -> float:
        return self.bytes / 2**20

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


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

    def video_key(self, camera: str) -> str:
        return f"observation.images.{camera}"


class DatasetWriter:
    """Write a LeRobotDataset v3.0 into a temporary folder; `finish()` renames it into place.

    Use as a context manager: on an exception the temporary folder is removed and nothing appears at `root`.
    """

    def __init__(self, root: str | Path, *, fps: int, cameras: list[str], image_size: int, state_names: list[str],
                 action_names: list[str], text_features: list[str] | None = None, robot_type: str = "sawyer",
                 codec: str = "libx264", crf: int = 18, chunks_size: int = 1000, data_file_mb: float = 100.0,
                 video_file_mb: float = 500.0):
        self.root = Path(root)
        self.tmp = self.root.parent / f".{self.root.name}.partial"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.fps, self.codec, self.crf, self.robot_type = fps, codec, crf, robot_type
        self.f = _Features(cameras, image_size, state_names, action_names, list(text_features or []))
        self.data_file_mb, self.video_file_mb = data_file_mb, video_file_mb
        self.data_cursor = _FileCursor(chunks_size)
        self.video_cursors = {c: _FileCursor(chunks_size) for c in cameras}
        self.videos: dict[str, VideoWriter] = {}
        self.rows: list[dict[str, Any]] = []  # frames of the open data file
        self.rows_bytes = 0
        self.episodes: list[dict[str, Any]] = []
        self.tasks: dict[str, int] = {}
        self.total_frames = 0

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        return False

    def add_episode(self, task: str, images: dict[str, np.ndarray], state: np.ndarray, action: np.ndarray,
                    text: dict[str, list[str]] | None = None) -> int:
        """Append one episode: images camera -> (T, H, W, 3) uint8, state (T, S), action (T, A)."""
        n = len(state)
        text = text or {}
        task_index = self.tasks.setdefault(task, len(self.tasks))
        ep = len(self.episodes)
        meta: dict[str, Any] = {"episode_index": ep, "tasks": [task], "length": n,
                                "data/chunk_index": self.data_cursor.chunk, "data/file_index": self.data_cursor.file,
                                "dataset_from_index": self.total_frames, "dataset_to_index": self.total_frames + n}
        stats = {"observation.state": _stats(state), "action": _stats(action)}
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
        for i in range(n):
            row = {"observation.state": state[i].astype(np.float32), "action": action[i].astype(np.float32),
                   "timestamp": np.float32(i / self.fps), "frame_index": i, "episode_index": ep,
                   "index": self.total_frames + i, "task_index": task_index}
            row |= {name: values[i] for name, values in text.items()}
            self.rows.append(row)
        self.rows_bytes += n * 4 * (state.shape[1] + action.shape[1] + 8)
        self.total_frames += n
        if self.rows_bytes / 2**20 >= self.data_file_mb:
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

        if not self.rows:
            return
        cols: dict[str, Any] = {}
        for name, dim in (("observation.state", len(self.f.state_names)), ("action", len(self.f.action_names))):
            flat = pa.array(np.stack([r[name] for r in self.rows]).reshape(-1), pa.float32())
            cols[name] = pa.FixedSizeListArray.from_arrays(flat, dim)
        cols["timestamp"] = pa.array([r["timestamp"] for r in self.rows], pa.float32())
        for name in INDEX_COLUMNS[1:]:
            cols[name] = pa.array([r[name] for r in self.rows], pa.int64())
        for name in self.f.text:
            cols[name] = pa.array([r[name] for r in self.rows], pa.string())
        path = self.tmp / self.data_cursor.fmt(DATA_PATH)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), path)
        self.rows, self.rows_bytes = [], 0

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
        names = [k[len("stats/"):-len("/mean")] for k in self.episodes[0] if k.startswith("stats/") and
                 k.endswith("/mean")]
        stats = {n: merge_stats([{k.split("/")[-1]: e[k] for k in e if k.startswith(f"stats/{n}/")}
                                 for e in self.episodes]) for n in names}
        (meta / "stats.json").write_text(json.dumps(stats, indent=1))
        info = {"codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
                "total_episodes": len(self.episodes), "total_frames": self.total_frames,
                "total_tasks": len(self.tasks), "chunks_size": self.data_cursor.chunks_size,
                "data_files_size_in_mb": self.data_file_mb, "video_files_size_in_mb": self.video_file_mb,
                "fps": self.fps, "splits": {"train": f"0:{len(self.episodes)}"},
                "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": self._features()}
        info |= extra_info or {}
        (meta / "info.json").write_text(json.dumps(info, indent=2))
        if self.root.exists():
            shutil.rmtree(self.root)  # NOTE: callers check for a non-empty root (and --overwrite) beforehand
        self.tmp.rename(self.root)
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


# ----------------------------------------------------------------------------------------------------- reading


@dataclass
class Episode:
    index: int
    task: str
    length: int
    start: int  # dataset_from_index
    videos: dict[str, tuple[Path, float]]  # video key -> (file, from_timestamp)


class LeRobotDataset:
    """Reads meta, all frame rows (into memory) and decodes camera frames per episode on demand.

    Attributes:
        version: "v3.0" or "v2.1". fps. cameras: video keys. tasks: task texts by task_index.
        columns: name -> np.ndarray over all frames, ordered by global `index`.
        stats: meta/stats.json.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise VlaforgeError(f"dataset folder {self.root} does not exist; generate one with "
                                "`vlaforge data generate --out DIR` or fix data.path")
        self.info = read_info(self.root)
        self.version = str(self.info.get("codebase_version", ""))
        if self.version not in ("v3.0", "v2.1", "v2.0"):
            raise VlaforgeError(f"{self.root / 'meta/info.json'}: codebase_version {self.version!r} is not supported;"
                                " vlaforge reads v3.0 and v2.1 LeRobot datasets")
        self.fps = float(self.info["fps"])
        feats = self.info["features"]
        self.cameras = [k for k, v in feats.items() if v.get("dtype") == "video"]
        self.text_columns = [k for k, v in feats.items() if v.get("dtype") == "string"]
        self.stats = _read_json(self.root / "meta" / "stats.json")
        if self.version == "v3.0":
            self.tasks = _read_tasks_v3(self.root / "meta" / "tasks.parquet")
            self.episodes = self._episodes_v3()
            data_files = sorted(self.root.glob("data/*/*.parquet"))
        else:
            self.tasks = _read_tasks_v21(self.root / "meta" / "tasks.jsonl")
            self.episodes = self._episodes_v21()
            data_files = [self.root / self.info["data_path"].format(
                episode_chunk=e.index // int(self.info.get("chunks_size", 1000)), episode_index=e.index)
                for e in self.episodes]
        if not data_files:
            raise VlaforgeError(f"dataset {self.root} has no data/ parquet files; regenerate it")
        self.columns = self._read_columns(data_files)
        self._check_episodes()

    # --- metadata ---

    def _episodes_v3(self) -> list[Episode]:
        files = sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))
        if not files:
            raise VlaforgeError(f"dataset {self.root} has no meta/episodes/*/*.parquet; regenerate it")
        rows = [r for f in files for r in _read_parquet(f).to_pylist()]
        rows.sort(key=lambda r: r["episode_index"])
        out = []
        for r in rows:
            videos = {}
            for key in self.cameras:
                rel = self.info["video_path"].format(video_key=key, chunk_index=r[f"videos/{key}/chunk_index"],
                                                     file_index=r[f"videos/{key}/file_index"])
                videos[key] = (self.root / rel, float(r[f"videos/{key}/from_timestamp"]))
            out.append(Episode(int(r["episode_index"]), r["tasks"][0], int(r["length"]),
                               int(r["dataset_from_index"]), videos))
        return out

    def _episodes_v21(self) -> list[Episode]:
        path = self.root / "meta" / "episodes.jsonl"
        rows = [json.loads(line) for line in _read_text(path).splitlines() if line.strip()]
        rows.sort(key=lambda r: r["episode_index"])
        chunks = int(self.info.get("chunks_size", 1000))
        out, start = [], 0
        for r in rows:
            ep = int(r["episode_index"])
            videos = {key: (self.root / self.info["video_path"].format(episode_chunk=ep // chunks, video_key=key,
                                                                       episode_index=ep), 0.0)
                      for key in self.cameras}
            out.append(Episode(ep, r["tasks"][0], int(r["length"]), start, videos))
            start += int(r["length"])
        return out

    def _read_columns(self, files: list[Path]) -> dict[str, np.ndarray]:
        import pyarrow as pa

        tables = [_read_parquet(f) for f in files]
        try:
            table = pa.concat_tables(tables, promote_options="default")
        except pa.ArrowInvalid as exc:
            raise VlaforgeError(f"dataset {self.root}: data files disagree on their columns ({exc}); "
                                "regenerate the dataset") from None
        cols = {}
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or \
                    pa.types.is_large_list(col.type):  # fixed_size_list (v3) or plain list (older writers)
                flat = col.flatten().to_numpy(zero_copy_only=False)
                if len(col) and flat.size % len(col):
                    raise VlaforgeError(f"dataset {self.root}: column {name!r} has rows of different lengths; "
                                        "regenerate the dataset")
                cols[name] = flat.reshape(len(col), -1).astype(np.float32, copy=False)
            elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                cols[name] = np.asarray(col.to_pylist(), dtype=object)
            else:
                cols[name] = col.to_numpy()
        for need in ("observation.state", "action", "episode_index", "frame_index", "index"):
            if need not in cols:
                raise VlaforgeError(f"dataset {self.root}: data files have no column {need!r}; regenerate it")
        order = np.argsort(cols["index"], kind="stable")
        if self.version != "v3.0":  # v2.x: per-episode files may restart `index`; order by episode, then frame
            order = np.lexsort((cols["frame_index"], cols["episode_index"]))
        return {k: v[order] for k, v in cols.items()}

    def _check_episodes(self) -> None:
        n = len(self.columns["index"])
        for e in self.episodes:
            rows = slice(e.start, e.start + e.length)
            if e.start + e.length > n or not np.all(self.columns["episode_index"][rows] == e.index):
                raise VlaforgeError(f"dataset {self.root}: episode {e.index} ({e.length} frames from row {e.start}) "
                                    "does not match the data files; the dataset is incomplete - regenerate it")

    @property
    def num_frames(self) -> int:
        return len(self.columns["index"])

    # --- video ---

    def decode(self, key: str, episode: Episode) -> np.ndarray:
        """All frames of `episode` from camera `key`: (T, H, W, 3) uint8."""
        path, start = episode.videos[key]
        return decode_frames(path, start, episode.length, self.fps)


def decode_frames(path: Path, from_timestamp: float, count: int, fps: float) -> np.ndarray:
    """Decode `count` frames starting at `from_timestamp` (seconds) from an mp4.

    Raises:
        VlaforgeError: the file is missing, unreadable, or ends before `count` frames.
    """
    import av

    if not path.is_file():
        raise VlaforgeError(f"video file {path} is missing; the dataset is incomplete - regenerate it")
    frames = []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            tb = stream.time_base
            if from_timestamp > 0:
                container.seek(int(Fraction(from_timestamp).limit_denominator(1_000_000) / tb), stream=stream,
                               backward=True)
            first = round(from_timestamp * fps)
            for frame in container.decode(stream):
                idx = round(float(frame.pts * tb) * fps)
                if idx < first:
                    continue
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) == count:
                    break
    except av.error.FFmpegError as exc:
        raise VlaforgeError(f"video file {path} cannot be decoded ({exc}); it is truncated or corrupt - "
                            "regenerate the dataset") from None
    if len(frames) < count:
        raise VlaforgeError(f"video file {path} ends after {len(frames)} of {count} frames of an episode starting at "
                            f"{from_timestamp:.3f}s; it is truncated - regenerate the dataset")
    return np.stack(frames)


def read_info(root: Path) -> dict[str, Any]:
    """meta/info.json of a dataset folder."""
    return _read_json(root / "meta" / "info.json")


def _read_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise VlaforgeError(f"parquet file {path} cannot be read ({str(exc).splitlines()[0][:120]}); it is "
                            "corrupt or truncated - regenerate the dataset") from None


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise VlaforgeError(f"dataset file {path} is missing; the folder is not a complete LeRobot dataset")
    return path.read_text()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise VlaforgeError(f"dataset file {path} is not valid JSON ({exc}); regenerate the dataset") from None


def _read_tasks_v3(path: Path) -> list[str]:
    if not path.is_file():
        raise VlaforgeError(f"dataset file {path} is missing; the folder is not a complete LeRobot dataset")
    rows = _read_parquet(path).to_pylist()
    text_key = "task" if rows and "task" in rows[0] else "__index_level_0__"
    tasks = {int(r["task_index"]): r[text_key] for r in rows}
    return [tasks[i] for i in range(len(tasks))]


def _read_tasks_v21(path: Path) -> list[str]:
    rows = [json.loads(line) for line in _read_text(path).splitlines() if line.strip()]
    tasks = {int(r["task_index"]): r["task"] for r in rows}
    return [tasks[i] for i in range(len(tasks))]
