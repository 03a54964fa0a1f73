"""The map-style training dataset over a LeRobot dataset: one sample per frame, producing `Batch` fields.

Sample at frame t of an episode: the F-frame history (stride s) of every camera, the normalized state at t,
the instruction tokens, the next T normalized actions (padded and masked past the episode end - chunks never
cross episodes) and the phase text as language target.

Video decoding must not be the bottleneck: when all decoded frames fit in `cache_mb` they are decoded once,
up front and in parallel threads, into uint8 tensors that DataLoader workers share (fork, copy-on-write);
otherwise each process decodes episodes on demand into an LRU cache of `cache_mb`.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import Dataset

from vlaforge.data.batch import Batch
from vlaforge.data.lerobot_features import frame_size
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.lerobot_writer import ENV_STATE
from vlaforge.data.tokenizer import TextTokenizer
from vlaforge.data.transforms import STD_FLOOR, ObservationSpec, augment, to_model_images
from vlaforge.errors import VlaforgeError


def resolve_cameras(reader: LeRobotDataset, names: list[str]) -> list[str]:
    """Model camera names ('corner' or 'observation.images.corner') -> the dataset's video keys."""
    keys = []
    for name in names:
        key = name if name in reader.cameras else f"observation.images.{name}"
        if key in reader.videos and key not in reader.cameras:
            raise VlaforgeError(f"model.cameras asks for {name!r}, a depth map in dataset {reader.root}: vlaforge's "
                                "vision towers take RGB cameras only; drop it from model.cameras")
        if key not in reader.cameras:
            have = ", ".join(k.removeprefix("observation.images.") for k in reader.cameras)
            raise VlaforgeError(f"model.cameras asks for {name!r} but dataset {reader.root} has only: {have}; "
                                "set model.cameras to those")
        keys.append(key)
    return keys


class FrameStore:
    """uint8 frames (T, H, W, 3) per (camera, episode position)."""

    def __init__(self, reader: LeRobotDataset, cameras: list[str], cache_mb: float, threads: int = 2):
        self.reader, self.cameras = reader, cameras
        h, w = frame_size(reader.info["features"][cameras[0]])
        total_mb = reader.num_frames * len(cameras) * h * w * 3 / 2**20
        self.preloaded = total_mb <= cache_mb
        # said when training starts: past the cache, every batch decodes video (data-bound on a few cores)
        self.notice = None if self.preloaded else (
            f"its decoded frames ({total_mb:,.0f} MB) exceed data.cache_mb = {cache_mb:g}: frames are decoded per "
            f"batch into an LRU cache; set data.cache_mb above {total_mb:.0f} to decode them once, shared by the "
            "workers")
        self.cache_bytes, self.cache, self.cached = int(cache_mb * 2**20), OrderedDict(), 0
        self.frames: dict[str, torch.Tensor] = {}
        if self.preloaded:
            self._decode_all(threads)

    def _decode_all(self, threads: int) -> None:
        eps = self.reader.episodes
        jobs = [(cam, i) for cam in self.cameras for i in range(len(eps))]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            decoded = list(pool.map(lambda job: self.reader.decode(job[0], eps[job[1]]), jobs))
        for cam in self.cameras:
            parts = [decoded[k] for k, (c, _) in enumerate(jobs) if c == cam]
            self.frames[cam] = torch.from_numpy(np.concatenate(parts))  # rows follow episode order

    def get(self, cam: str, ep: int, rows: list[int]) -> torch.Tensor:
        """Frames `rows` (episode-relative) of episode position `ep`: (len(rows), H, W, 3) uint8."""
        e = self.reader.episodes[ep]
        if self.preloaded:
            return self.frames[cam][[e.start + r for r in rows]]
        key = (cam, ep)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
        else:  # NOTE: per process (each DataLoader worker has its own cache), so no lock is needed
            hit = self.cache[key] = torch.from_numpy(self.reader.decode(cam, e))
            self.cached += hit.numel()
            while self.cached > self.cache_bytes and len(self.cache) > 1:
                self.cached -= self.cache.popitem(last=False)[1].numel()
        return hit[rows]


class DemoDataset(Dataset):
    """One sample per frame. Indices past len() encode the epoch (see ResumableSampler): index % len picks the
    frame and the whole index seeds the augmentation, so every draw is a pure function of (seed, index).

    env_state: samples carry the dataset's `observation.environment_state`, standardized within each task (a target
    of the auxiliary env_state term; the caller checks that the column exists). Per task, because the goals of
    different tasks lie far apart: over the whole dataset, reach's goal box would span a fraction of one std.
    repeat_padding: a chunk step past the episode end holds the episode's last action and counts in the loss (LeRobot's
    padding, which pi0 and pi0.5 train on: their loss ignores action_is_pad); else it is zero and masked out."""

    def __init__(self, reader: LeRobotDataset, spec: ObservationSpec, tokenizer: TextTokenizer, *, seed: int,
                 shift: int, color: float, cache_mb: float, text_column: str | None, threads: int = 2,
                 env_state: bool = False, repeat_padding: bool = False):
        self.reader, self.spec, self.seed, self.shift, self.color = reader, spec, seed, shift, color
        self.repeat_padding = repeat_padding
        cols = reader.columns
        # normalized once here, not per sample
        self.state = spec.normalize_state(np.ascontiguousarray(cols["observation.state"], dtype=np.float32))
        self.action = spec.normalize_action(np.ascontiguousarray(cols["action"], dtype=np.float32))
        self.starts = np.array([e.start for e in reader.episodes])
        self.lengths = np.array([e.length for e in reader.episodes])
        task_idx = cols.get("task_index")
        self.task_of_row = task_idx if task_idx is not None else np.zeros(reader.num_frames, dtype=np.int64)
        self.instr_ids, self.instr_mask = tokenizer.encode(reader.tasks, spec.instruction_tokens)
        # pi0.5 prompts with the sample's state: its instruction is encoded per sample (`TextTokenizer.state_prompt`)
        self.prompts = tokenizer if getattr(tokenizer, "state_prompt", False) else None
        self.text = None
        if text_column and spec.text_tokens > 0 and text_column in cols:
            phases, self.text_of_row = np.unique(cols[text_column].astype(str), return_inverse=True)
            self.text = tokenizer.encode(list(phases), spec.text_tokens)
        self.env_state = standardized(cols[ENV_STATE], scene_tasks(reader)[0]) if env_state else None
        self.store = FrameStore(reader, spec.cameras, cache_mb, threads)

    def __len__(self) -> int:
        return self.reader.num_frames

    def without_augmentation(self) -> "DemoDataset":
        """The same samples with no shift or colour augmentation (shares the decoded frames)."""
        plain = copy.copy(self)
        plain.shift = plain.color = 0
        return plain

    def locate(self, row: int) -> tuple[int, int]:
        """Global frame row -> (episode position, frame in episode)."""
        ep = int(np.searchsorted(self.starts, row, side="right") - 1)
        return ep, row - int(self.starts[ep])

    def __getitem__(self, index: int) -> Batch:
        row = index % len(self)
        ep, t = self.locate(row)
        spec, length, start = self.spec, int(self.lengths[ep]), int(self.starts[ep])
        hist = spec.history(t)
        views = torch.stack([to_model_images(self.store.get(cam, ep, hist), spec.image_size)
                             for cam in spec.cameras])  # (V, F, 3, S, S)
        if self.shift or self.color:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            views = augment(views, g, self.shift, self.color)
        images = views.transpose(0, 1).flatten(0, 1)  # (F*V, 3, S, S): time-major, cameras within a time step
        steps = torch.arange(t, t + spec.chunk)
        valid = steps < length
        actions = self.action[start + steps.clamp(max=length - 1)]
        if self.repeat_padding:
            valid = torch.ones_like(valid)
        else:
            actions = actions * valid[:, None]
        task = int(self.task_of_row[row])
        text_ids = text_mask = None
        if self.text is not None:
            k = int(self.text_of_row[row])
            text_ids, text_mask = self.text[0][k], self.text[1][k]
        ids, mask = self.instr_ids[task], self.instr_mask[task]
        if self.prompts is not None:
            ids, mask = (x[0] for x in self.prompts.encode_with_states(
                [self.reader.tasks[task]], self.state[row][None], spec.instruction_tokens))
        return Batch(images=images, state=self.state[row], instruction_ids=ids, instruction_mask=mask,
                     actions=actions, action_mask=valid, text_ids=text_ids, text_mask=text_mask,
                     index=torch.tensor(row), env_state=None if self.env_state is None else self.env_state[row])


def scene_tasks(reader: LeRobotDataset) -> tuple[np.ndarray, list[str]]:
    """Each row's task index (N,) and the task names: the tasks the generator recorded (meta/info.json's
    vlaforge.episode_tasks, one per episode: the Meta-World task, whatever its instruction's wording), else the
    dataset's own tasks (its instructions)."""
    names = reader.info.get("vlaforge", {}).get("episode_tasks")
    if not isinstance(names, list) or len(names) != len(reader.episodes):
        task_idx = reader.columns.get("task_index")
        rows = task_idx if task_idx is not None else np.zeros(reader.num_frames, dtype=np.int64)
        return np.asarray(rows), list(reader.tasks)
    order = list(dict.fromkeys(names))
    return np.repeat([order.index(n) for n in names], [e.length for e in reader.episodes]), order


def group_moments(values: np.ndarray, groups: np.ndarray) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per group of rows (N,): the mean (E,) and the std (E,) (floored at STD_FLOOR) of float32 `values` (N, E)."""
    v = torch.as_tensor(np.ascontiguousarray(values, dtype=np.float32))
    return {int(g): (v[rows].mean(0), v[rows].std(0, correction=0).clamp_min(STD_FLOOR))
            for g in np.unique(groups) for rows in [torch.as_tensor(groups == g)]}


def standardized(values: np.ndarray, groups: np.ndarray) -> torch.Tensor:
    """(N, E) -> float32 (N, E) with zero mean and unit std per column within each group of rows (N,)."""
    v = torch.as_tensor(np.ascontiguousarray(values, dtype=np.float32))
    out = torch.empty_like(v)
    for g, (mean, std) in group_moments(values, groups).items():
        rows = torch.as_tensor(groups == g)
        out[rows] = (v[rows] - mean) / std
    return out
