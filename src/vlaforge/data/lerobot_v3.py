"""LeRobotDataset reader for v3.0 and v2.1, on pyarrow + PyAV (no `lerobot` import); the writer is
`lerobot_writer.py`, the layout docs/lerobot_format.md. In short (v3.0):

    meta/info.json                                   codebase_version, fps, features, path templates
    meta/stats.json                                  per-feature min/max/mean/std/count (+ q01/q99)
    meta/tasks.parquet                               task_index + task text (as the pandas index)
    meta/episodes/chunk-XXX/file-YYY.parquet         one row per episode: length, tasks, file indices,
                                                     dataset_from/to_index, videos/{key}/from/to_timestamp, stats
    data/chunk-XXX/file-YYY.parquet                  one row per frame, many episodes per file
    videos/{key}/chunk-XXX/file-YYY.mp4              many episodes per file; a frame is at from_timestamp + timestamp

A camera of dtype "image" (the openpi / LeRobot LIBERO datasets) is a data-file column of {bytes, path} structs
(PNG or JPEG); it is read from its file per episode when frames are asked for, not held in memory.

Every error about a damaged or missing file is a `VlaforgeError` naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlaforge.data.lerobot_features import (
    LANGUAGE_COLUMNS,
    LANGUAGE_PERSISTENT,
    READ_DTYPES,
    feature_notices,
    frame_size,
    persistent_columns,
    rgb_cameras,
)
from vlaforge.data.lerobot_writer import ENV_STATE
from vlaforge.data.video import decode_frames
from vlaforge.errors import VlaforgeError

VECTOR_COLUMNS = ("observation.state", "action", ENV_STATE)  # per-frame vectors training reads as float32


@dataclass
class Episode:
    index: int
    task: str
    length: int
    start: int  # dataset_from_index (with data.episodes: its first row among the selected episodes' rows)
    videos: dict[str, tuple[Path, float]]  # video key -> (file, from_timestamp)
    data_file: Path | None = None  # the data/ parquet file holding its frames


class LeRobotDataset:
    """Reads meta, all frame rows (into memory) and decodes camera frames per episode on demand.

    Attributes:
        version: "v3.0" or "v2.1". fps. cameras: the RGB cameras' video keys (depth maps are not cameras to
            vlaforge, data/lerobot_features.py). tasks: task texts by task_index.
        columns: name -> np.ndarray over all frames, ordered by global `index`; LeRobot 0.6's
            `language_persistent` becomes one text column per style (`language_persistent.subtask`, ...).
        stats: meta/stats.json.
        notices: one line per thing training leaves out (a depth camera, event annotations, an unread dtype).
    """

    def __init__(self, root: str | Path, episodes: list[int] | None = None):
        self.root = Path(root)
        self.selected = None if episodes is None else sorted(set(int(e) for e in episodes))
        self.info = read_info(self.root)
        self.version = str(self.info.get("codebase_version", ""))
        if self.version not in ("v3.0", "v2.1", "v2.0"):
            raise VlaforgeError(f"{self.root / 'meta/info.json'}: codebase_version {self.version!r} is not supported;"
                                " vlaforge reads v3.0 and v2.1 LeRobot datasets")
        self.fps = _number(self.info, "fps", self.root)
        if not self.fps > 0:
            raise VlaforgeError(f"{self.root / 'meta/info.json'}: fps is {self.info['fps']!r}; it must be the "
                                "recording rate (> 0) - fix info.json or regenerate the dataset")
        feats = self.info.get("features")
        if not isinstance(feats, dict) or not all(isinstance(v, dict) for v in feats.values()):
            raise VlaforgeError(f"{self.root / 'meta/info.json'}: features is not a table of feature specs; fix "
                                "info.json or regenerate the dataset")
        self.cameras = rgb_cameras(feats)
        self.videos = [k for k, v in feats.items() if v.get("dtype") == "video"]  # RGB and depth
        self.images = [k for k, v in feats.items() if v.get("dtype") == "image"]  # frames in the data files
        self.notices = feature_notices(feats)
        self.stats = _read_json(self.root / "meta" / "stats.json")
        if self.version == "v3.0":
            self.tasks = _read_tasks_v3(self.root / "meta" / "tasks.parquet")
            self.episodes = self._select(self._episodes_v3())
            named = {e.data_file for e in self.episodes}
            data_files = sorted(named) if self.selected is not None and None not in named else \
                sorted(self.root.glob("data/*/*.parquet"))
        else:
            self.tasks = _read_tasks_v21(self.root / "meta" / "tasks.jsonl")
            self.episodes = self._select(self._episodes_v21())
            data_files = [e.data_file for e in self.episodes]
        if not data_files:
            raise VlaforgeError(f"dataset {self.root} has no data/ parquet files; regenerate it")
        self.columns = self._read_columns(data_files)
        if self.selected is not None:
            self._keep_selected()
        self._check_episodes()
        self._check_task_indices()
        self._check_declared_shapes()
        self._check_values()
        self._check_stats()

    # --- metadata ---

    def _select(self, episodes: list[Episode]) -> list[Episode]:
        """The episodes `data.episodes` asks for (all without it); one the dataset lacks is refused."""
        if self.selected is None:
            return episodes
        have = {e.index for e in episodes}
        absent = [i for i in self.selected if i not in have]
        if absent:
            raise VlaforgeError(f"data.episodes asks for episode {absent[0]}, which dataset {self.root} does not have "
                                f"(it has {len(have)} episodes, {min(have)}-{max(have)}); drop it from data.episodes")
        return [e for e in episodes if e.index in self.selected]

    def _keep_selected(self) -> None:
        """The rows of the selected episodes only (a data file holds others too), each episode's start re-based to
        its first row among them."""
        keep = np.isin(self.columns["episode_index"], self.selected)
        self.columns = {k: v[keep] for k, v in self.columns.items()}
        self._image_rows = tuple(a[keep] for a in self._image_rows)
        for e in self.episodes:
            e.start = int(np.argmax(self.columns["episode_index"] == e.index))  # (each has rows: checked after)

    def _episodes_v3(self) -> list[Episode]:
        files = sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))
        if not files:
            raise VlaforgeError(f"dataset {self.root} has no meta/episodes/*/*.parquet; regenerate it")
        rows = [r for f in files for r in _read_parquet(f).to_pylist()]
        if not rows:
            raise VlaforgeError(f"dataset {self.root}: meta/episodes/ holds no episode rows; the dataset is empty or "
                                "incomplete - regenerate it")
        rows.sort(key=lambda r: r["episode_index"])
        out = []
        for r in rows:
            videos = {}
            for key in self.videos:
                rel = self.info["video_path"].format(video_key=key, chunk_index=r[f"videos/{key}/chunk_index"],
                                                     file_index=r[f"videos/{key}/file_index"])
                videos[key] = (self.root / rel, float(r[f"videos/{key}/from_timestamp"]))
            data = r.get("data/chunk_index"), r.get("data/file_index")
            data_file = None if None in data else self.root / self.info["data_path"].format(
                chunk_index=data[0], file_index=data[1])
            out.append(Episode(int(r["episode_index"]), r["tasks"][0], int(r["length"]),
                               int(r["dataset_from_index"]), videos, data_file))
        return out

    def _episodes_v21(self) -> list[Episode]:
        rows = _read_jsonl(self.root / "meta" / "episodes.jsonl")
        rows.sort(key=lambda r: r["episode_index"])
        chunks = int(self.info.get("chunks_size", 1000))
        out, start = [], 0
        for r in rows:
            ep = int(r["episode_index"])
            videos = {key: (self.root / self.info["video_path"].format(episode_chunk=ep // chunks, video_key=key,
                                                                       episode_index=ep), 0.0)
                      for key in self.videos}
            data_file = self.root / self.info["data_path"].format(episode_chunk=ep // chunks, episode_index=ep)
            out.append(Episode(ep, r["tasks"][0], int(r["length"]), start, videos, data_file))
            start += int(r["length"])
        return out

    def _read_columns(self, files: list[Path]) -> dict[str, np.ndarray]:
        import pyarrow as pa

        tables = []
        for f in files:  # each file's schema read once: the image check, then every column but the images
            names = _schema_names(f)
            self._check_images_stored(f, names)
            tables.append(_read_parquet(f, only=[c for c in names if c not in self.images]))
        # where each row's image cells are: (data file, row in it), reordered with the rows below
        self._files = files
        self._image_rows = (np.repeat(np.arange(len(files)), [len(t) for t in tables]),
                            np.concatenate([np.arange(len(t)) for t in tables]))
        try:
            table = pa.concat_tables(tables, promote_options="default")
        except pa.ArrowInvalid as exc:
            raise VlaforgeError(f"dataset {self.root}: data files disagree on their columns ({exc}); "
                                "regenerate the dataset") from None
        if table.num_rows == 0:
            raise VlaforgeError(f"dataset {self.root} holds no frames: its data files have 0 rows (the episode "
                                f"metadata lists {len(self.episodes)} episodes); regenerate the dataset")
        cols, language = {}, {}
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            nested = pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or \
                pa.types.is_large_list(col.type)
            if name in LANGUAGE_COLUMNS:  # LeRobot 0.6: lists of message structs (data/lerobot_features.py)
                if name == LANGUAGE_PERSISTENT:
                    language[name] = col.to_pylist()
            elif nested and _numeric(col.type.value_type):  # fixed_size_list (v3) or plain list (older writers)
                flat = col.flatten().to_numpy(zero_copy_only=False)
                if len(col) and flat.size % len(col):
                    raise VlaforgeError(f"dataset {self.root}: column {name!r} has rows of different lengths; "
                                        "regenerate the dataset")
                cols[name] = flat.reshape(len(col), -1).astype(np.float32, copy=False)
            elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                cols[name] = np.asarray(col.to_pylist(), dtype=object)
            elif _numeric(col.type):
                cols[name] = col.to_numpy(zero_copy_only=False)
            elif (self.info["features"].get(name) or {}).get("dtype", "float32") in READ_DTYPES:
                # (a feature of a dtype vlaforge does not read is named by feature_notices already)
                self.notices.append(f"column {name!r} holds {col.type}, which vlaforge does not read; it is "
                                    "left out")
        for name in VECTOR_COLUMNS:
            if name in table.column_names:
                cols[name] = self._vector(name, cols.get(name), table.schema.field(name).type)
        for need in ("observation.state", "action", "episode_index", "frame_index", "index"):
            if need not in cols:
                raise VlaforgeError(f"dataset {self.root}: data files have no column {need!r}; regenerate it")
        if self.version == "v3.0":
            order = np.argsort(cols["index"], kind="stable")
        else:  # v2.x: per-episode files may restart `index`; order by episode, then frame
            order = np.lexsort((cols["frame_index"], cols["episode_index"]))
        cols = {k: v[order] for k, v in cols.items()}
        self._image_rows = tuple(a[order] for a in self._image_rows)
        if LANGUAGE_PERSISTENT in language:
            rows = [language[LANGUAGE_PERSISTENT][i] for i in order]
            times = cols["timestamp"] if "timestamp" in cols else cols["frame_index"] / self.fps
            cols.update(persistent_columns(rows, np.asarray(times, np.float64), cols["episode_index"]))
        return cols

    def _check_images_stored(self, f: Path, names: list[str]) -> None:
        """An `image` feature's frames are a column of every data file (`f`, whose columns are `names`); one stored
        as video is info.json's error."""
        missing = [k for k in self.images if k not in names]
        if missing:
            key = missing[0]
            video = any(key in v.parts for v in self.root.glob("videos/**/*.mp4"))
            where = " - its frames are video files under videos/ (declare it 'video')" if video else ""
            raise VlaforgeError(f"{self.root / 'meta/info.json'} declares {key!r} as dtype 'image' (frames in the "
                                f"data files), but data file {f} has no such column{where}; fix its dtype in "
                                "info.json or regenerate the dataset")

    def _vector(self, name: str, col: np.ndarray | None, stored) -> np.ndarray:
        """A state / action column as (N, width) float32: numbers as info.json declares them (LeRobot stores a
        1-wide feature as plain scalars: a column of width 1). `col`: as read (None: not numbers)."""
        import pyarrow as pa

        if col is None or col.dtype == object:
            raise VlaforgeError(f"dataset {self.root}: column {name!r} holds {stored} values, not numbers (LeRobot "
                                "stores one list of numbers per frame); rewrite the column or regenerate the dataset")
        declared = (self.info["features"].get(name) or {}).get("dtype")
        value = stored.value_type if hasattr(stored, "value_type") else stored
        if declared in READ_DTYPES and declared not in ("video", "image", "string", "language") and \
                value != pa.from_numpy_dtype(np.dtype(declared)):
            raise VlaforgeError(f"{self.root / 'meta/info.json'} declares {name!r} as {declared} but the data files "
                                f"store {value}; fix the dtype in info.json or write the column as {declared} "
                                "(regenerate the dataset)")
        return col.reshape(len(col), -1).astype(np.float32, copy=False)

    def _check_episodes(self) -> None:
        declared = self.info.get("total_episodes")
        if declared is not None and declared != len(self.episodes) and self.selected is None:
            raise VlaforgeError(f"dataset {self.root}: meta/info.json says total_episodes = {declared} but the "
                                f"episode metadata lists {len(self.episodes)}; the dataset is incomplete - "
                                "regenerate it")
        index = self.columns["episode_index"]
        present, counts = np.unique(index, return_counts=True)
        rows_of = dict(zip(present.tolist(), counts.tolist()))
        where = "meta/episodes/" if self.version == "v3.0" else "meta/episodes.jsonl"
        for e in self.episodes:
            have = rows_of.pop(e.index, 0)
            rows = slice(e.start, e.start + e.length)
            if have != e.length:
                raise VlaforgeError(f"dataset {self.root}: {where} gives episode {e.index} a length of {e.length} but "
                                    f"the data files hold {have} rows of it; fix its length there or regenerate the "
                                    "dataset")
            if e.start + e.length > len(index) or not np.all(index[rows] == e.index):
                raise VlaforgeError(f"dataset {self.root}: episode {e.index} ({e.length} frames from row {e.start}) "
                                    "does not match the data files; the dataset is incomplete - regenerate it")
        if rows_of:
            ep, n = next(iter(rows_of.items()))
            raise VlaforgeError(f"dataset {self.root}: the data files hold {n} rows of episode {ep}, which {where} "
                                "does not list; the dataset is incomplete - regenerate it")

    def _check_task_indices(self) -> None:
        """Every row's task_index names a task of the task table."""
        col = self.columns.get("task_index")
        bad = np.flatnonzero((col < 0) | (col >= len(self.tasks))) if col is not None else []
        if len(bad):
            row = int(bad[0])
            table = "meta/tasks.parquet" if self.version == "v3.0" else "meta/tasks.jsonl"
            raise VlaforgeError(f"dataset {self.root}: episode {int(self.columns['episode_index'][row])} has "
                                f"task_index {int(col[row])} but {table} lists {len(self.tasks)} tasks (0-"
                                f"{len(self.tasks) - 1}); fix the task_index column or the task table")

    def _check_declared_shapes(self) -> None:
        """A vector feature's declared shape must be its rows' width: a mismatch is a wrong info.json, not damage."""
        for name, spec in self.info["features"].items():
            col = self.columns.get(name)
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if col is None or col.ndim != 2 or not isinstance(shape, list) or \
                    not all(type(d) is int for d in shape):
                continue
            if int(np.prod(shape)) != col.shape[1]:
                raise VlaforgeError(f"{self.root / 'meta/info.json'} declares {name!r} with shape {shape} but the "
                                    f"data rows hold {col.shape[1]} values; fix the shape in info.json or regenerate "
                                    "the dataset")

    def _check_stats(self) -> None:
        """meta/stats.json must give state and action a finite mean and a finite, non-negative std of the columns'
        width: they normalize every sample (a bad value would surface only as non-finite losses)."""
        where = self.root / "meta" / "stats.json"
        for name in ("observation.state", "action"):
            entry = self.stats.get(name)
            if not isinstance(entry, dict):
                raise VlaforgeError(f"{where} has no {name!r} statistics; regenerate the dataset")
            width = self.columns[name].shape[1]
            for key in ("mean", "std"):
                try:
                    values = np.asarray(entry.get(key), dtype=np.float64).reshape(-1)
                except (TypeError, ValueError):
                    values = None
                ok = values is not None and values.size == width and np.isfinite(values).all() and \
                    (key == "mean" or (values >= 0).all())
                if not ok:
                    raise VlaforgeError(f"{where}: {name} {key} is {str(entry.get(key))[:80]}, not {width} finite "
                                        f"numbers{' >= 0' if key == 'std' else ''}; recompute the statistics "
                                        "(regenerate the dataset)")

    def check_thoroughly(self) -> None:
        """What training may meet later, checked now (`vlaforge data info`): every numeric vector column finite,
        and the first frame of every video file decodes at its declared size.

        Raises:
            VlaforgeError: one line naming the column or the video file.
        """
        for name, col in self.columns.items():
            if col.ndim == 2 and np.issubdtype(col.dtype, np.floating):
                self.check_finite(name)
        seen = set()
        for e in self.episodes:
            for key, (path, start) in e.videos.items():
                if path not in seen:
                    seen.add(path)
                    self._check_frame_size(key, path, decode_frames(path, start, 1, self.fps))

    def _check_values(self) -> None:
        """State and action rows must be finite numbers: one NaN would poison the statistics and the loss."""
        for name in ("observation.state", "action"):
            self.check_finite(name)

    def check_finite(self, name: str) -> None:
        """Every row of the vector column `name` must be finite.

        Raises:
            VlaforgeError: naming the column, how many rows and the first one's episode and frame.
        """
        bad = ~np.isfinite(self.columns[name]).all(axis=1)
        if bad.any():
            row = int(np.argmax(bad))
            raise VlaforgeError(f"dataset {self.root}: column {name!r} holds NaN or inf in {int(bad.sum())} rows "
                                f"(first: episode {int(self.columns['episode_index'][row])}, frame "
                                f"{int(self.columns['frame_index'][row])}); fix or drop those episodes")

    @property
    def num_frames(self) -> int:
        return len(self.columns["index"])

    # --- video ---

    def decode(self, key: str, episode: Episode) -> np.ndarray:
        """All frames of `episode` from camera `key`: (T, H, W, 3) uint8."""
        if key in self.images:
            return self._decode_images(key, episode)
        path, start = episode.videos[key]
        return self._check_frame_size(key, path, decode_frames(path, start, episode.length, self.fps))

    def _decode_images(self, key: str, episode: Episode) -> np.ndarray:
        """An image camera's frames of `episode`: its cells read from the data files, PNG / JPEG decoded."""
        import io

        from PIL import Image, UnidentifiedImageError

        rows = slice(episode.start, episode.start + episode.length)
        files, within = self._image_rows[0][rows], self._image_rows[1][rows]
        frames = []
        for f in np.unique(files):
            path = self._files[int(f)]
            column = _read_parquet(path, only=[key]).column(key).combine_chunks()
            cells = column.field("bytes") if hasattr(column.type, "get_field_index") else column
            for r in within[files == f]:
                data = cells[int(r)].as_py()
                try:
                    frames.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
                except (UnidentifiedImageError, OSError, TypeError):
                    raise VlaforgeError(f"data file {path}: row {int(r)} of {key!r} is not a PNG / JPEG image; the "
                                        "file is damaged - regenerate the dataset") from None
        return self._check_frame_size(key, self._files[int(files[0])], np.stack(frames))

    def _check_frame_size(self, key: str, path: Path, frames: np.ndarray) -> np.ndarray:
        declared = frame_size(self.info["features"][key]) if self.info["features"][key].get("shape") else ()
        if declared and frames.shape[1:3] != declared:
            raise VlaforgeError(f"video file {path} is {frames.shape[1]}x{frames.shape[2]} px but meta/info.json "
                                f"declares {key} as {declared[0]}x{declared[1]}; fix info.json or regenerate the "
                                "dataset")
        return frames


def _numeric(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _number(info: dict[str, Any], key: str, root: Path) -> float:
    try:
        return float(info[key])
    except (KeyError, TypeError, ValueError):
        raise VlaforgeError(f"{root / 'meta/info.json'}: {key} is missing or not a number; fix info.json or "
                            "regenerate the dataset") from None


def read_info(root: Path) -> dict[str, Any]:
    """meta/info.json of a dataset folder."""
    if not Path(root).is_dir():
        raise VlaforgeError(f"dataset folder {root} does not exist; generate one with `vlaforge data generate --out "
                            "DIR` or fix data.path")
    return _read_json(Path(root) / "meta" / "info.json")


def _read_parquet(path: Path, only: list[str] | None = None):
    """A parquet table: all columns, or `only` these."""
    import pyarrow.parquet as pq

    return _parquet(path, lambda: pq.read_table(path, columns=only))


def _schema_names(path: Path) -> list[str]:
    """The column names of a parquet file (its footer only)."""
    import pyarrow.parquet as pq

    return _parquet(path, lambda: pq.read_schema(path).names)


def _parquet(path: Path, read):
    """`read()` of parquet file `path`, a damaged file named in one line."""
    import pyarrow as pa

    try:
        return read()
    except (pa.ArrowInvalid, OSError) as exc:
        raise VlaforgeError(f"parquet file {path} cannot be read ({str(exc).splitlines()[0][:120]}); it is "
                            "corrupt or truncated - regenerate the dataset") from None


def _require(path: Path) -> Path:
    if not path.is_file():
        raise VlaforgeError(f"dataset file {path} is missing; the folder is not a complete LeRobot dataset")
    return path


def _read_text(path: Path) -> str:
    try:
        return _require(path).read_text()
    except UnicodeDecodeError:
        raise VlaforgeError(f"dataset file {path} is not text (UTF-8); regenerate the dataset") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in _read_text(path).splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise VlaforgeError(f"dataset file {path} is not valid JSON lines ({exc}); regenerate the dataset") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise VlaforgeError(f"dataset file {path} is not valid JSON ({exc}); regenerate the dataset") from None
    if not isinstance(data, dict):
        raise VlaforgeError(f"dataset file {path} holds a JSON {type(data).__name__}, not an object; regenerate the "
                            "dataset")
    return data


def _read_tasks_v3(path: Path) -> list[str]:
    rows = _read_parquet(_require(path)).to_pylist()
    text_key = "task" if rows and "task" in rows[0] else "__index_level_0__"
    return _task_list({int(r["task_index"]): r[text_key] for r in rows}, path)


def _read_tasks_v21(path: Path) -> list[str]:
    rows = _read_jsonl(path)
    return _task_list({int(r["task_index"]): r["task"] for r in rows}, path)


def _task_list(tasks: dict[int, str], path: Path) -> list[str]:
    """Task texts by task_index, which must count 0, 1, ... without gaps."""
    if sorted(tasks) != list(range(len(tasks))):
        raise VlaforgeError(f"task table {path} numbers its tasks {sorted(tasks)[:8]}, not 0-{len(tasks) - 1}; "
                            "renumber task_index there (and in the data files) or regenerate the dataset")
    return [tasks[i] for i in range(len(tasks))]
