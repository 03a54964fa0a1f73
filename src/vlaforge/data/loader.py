"""Datasets by `data.source` and a resumable, deterministic sample order."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vlaforge.data.batch import Batch
from vlaforge.data.lerobot_features import frame_size
from vlaforge.data.tokenizer import TextTokenizer
from vlaforge.data.transforms import ObservationSpec
from vlaforge.errors import VlaforgeError


class ResumableSampler(Sampler[int]):
    """An endless stream of indices: epoch e yields e * size + a permutation of range(size) seeded by (seed, e).
    Datasets take `index % len` as the sample and may seed per-draw randomness (augmentation) with the whole
    index. Starting at `start` (samples already consumed) continues the exact stream, which makes resumed runs
    bit-identical."""

    def __init__(self, size: int, seed: int, start: int = 0):
        self.size, self.seed, self.start = size, seed, start

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.size)
        while True:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            yield from (epoch * self.size + i for i in torch.randperm(self.size, generator=g)[offset:].tolist())
            epoch, offset = epoch + 1, 0


class RankSlice(Sampler[int]):
    """A rank's share of the global sample stream: of every global batch (batch_size x dp samples), the rank-th
    contiguous slice, so that the ranks together see exactly what one process with a dp-times larger batch sees."""

    def __init__(self, base: Sampler[int], batch_size: int, rank: int, dp: int):
        self.base, self.batch_size, self.rank, self.dp = base, batch_size, rank, dp

    def __iter__(self) -> Iterator[int]:
        stream, b = iter(self.base), self.batch_size
        while True:
            chunk = [next(stream) for _ in range(b * self.dp)]
            yield from chunk[self.rank * b:(self.rank + 1) * b]


@dataclass
class Data:
    """A training dataset and what a policy trained on it needs at inference (saved with every checkpoint)."""

    dataset: Dataset
    spec: ObservationSpec | None = None
    tokenizer: TextTokenizer | None = None
    notices: tuple[str, ...] = ()  # what the dataset holds that training leaves out, one line each

    def save_policy_files(self, folder: Path) -> None:
        if self.spec is not None:
            self.spec.save(folder)
        if self.tokenizer is not None:
            self.tokenizer.save(folder)


def build_data(cfg, model) -> Data:
    """The dataset named by `data.source`, shaped for `model` (frames, image size, vocabulary)."""
    if cfg.data.source == "lerobot":
        return _lerobot_data(cfg, model)
    from vlaforge.data.synthetic import SyntheticDataset

    m, d = cfg.model, cfg.data
    return Data(SyntheticDataset(
        num_samples=d.num_samples, num_tasks=d.num_tasks, frames=m.frames_per_sample,
        image_size=model.layout.image_size, state_dim=m.state_dim, action_dim=m.action_dim,
        chunk=m.action_chunk, vocab_size=model.llm.config.vocab_size, instruction_tokens=d.max_instruction_tokens,
        text_tokens=d.max_text_tokens, seed=cfg.train.seed))


def _lerobot_data(cfg, model) -> Data:
    from vlaforge.data.episodes import DemoDataset, resolve_cameras
    from vlaforge.data.lerobot_features import auto_text_column
    from vlaforge.data.lerobot_v3 import LeRobotDataset
    from vlaforge.data.tokenizer import build_tokenizer
    from vlaforge.data.transforms import normalization_from_stats

    m, d = cfg.model, cfg.data
    from vlaforge.data.hub_dataset import dataset_root

    reader = LeRobotDataset(dataset_root(d), d.episodes)
    for name, want in (("observation.state", m.state_dim), ("action", m.action_dim)):
        have = reader.columns[name].shape[1]
        if have != want:
            short = "state_dim" if name.startswith("obs") else "action_dim"
            raise VlaforgeError(f"dataset {d.path} has {name} of size {have} but model.{short} = {want}; "
                                f"set model.{short} = {have}")
    text_column = auto_text_column(reader.info["features"]) if d.text_column == "auto" else d.text_column
    texts = list(reader.tasks)
    text_columns = sorted(k for k, v in reader.columns.items() if v.dtype == object)
    if text_column in reader.columns and text_column not in text_columns:
        raise VlaforgeError(f"data.text_column = {text_column!r} is not a text column of dataset {d.path} (it holds "
                            f"numbers); set it to one of {text_columns or 'its text columns (it has none)'}, or turn "
                            "the language term off with --loss.weights.language=0")
    if text_column in reader.columns:
        texts += sorted(set(reader.columns[text_column].astype(str).tolist()))
    elif d.max_text_tokens > 0 and cfg.loss.weights.get("language", 0) > 0:
        what = "no per-frame text" if d.text_column == "auto" else f"no text column {d.text_column!r}"
        raise VlaforgeError(f"dataset {d.path} has {what} (data.text_column) for the language loss; set "
                            f"data.text_column to one of {text_columns or 'its text columns (it has none)'}, or turn "
                            "the term off with --loss.weights.language=0")
    vocab = model.llm.config.vocab_size
    instruction_tokens = d.max_instruction_tokens
    policy_text = getattr(model, "policy_tokenizer", None)  # a LeRobot policy's own tokenization
    if policy_text is not None:
        tokenizer, instruction_tokens = policy_text()
    else:
        tokenizer = build_tokenizer(texts, vocab, m.text_folder)
    if tokenizer.vocab_size > vocab:
        raise VlaforgeError(f"the tokenizer has {tokenizer.vocab_size} tokens but the LLM only {vocab}")
    cameras = resolve_cameras(reader, m.cameras)
    policy_norm, computed = policy_normalization(model, reader)
    spec = ObservationSpec(cameras=cameras, frames=m.frames, frame_stride=d.frame_stride,
                           image_size=model.layout.image_size,
                           render_size=frame_size(reader.info["features"][cameras[0]])[0],
                           instruction_tokens=instruction_tokens,
                           text_tokens=d.max_text_tokens, chunk=m.action_chunk,
                           **normalization_from_stats(reader.stats), **policy_norm)
    env_state = cfg.loss.weights.get("env_state", 0.0) > 0
    if env_state:
        check_env_state(reader, m.env_state_dim)
    dataset = DemoDataset(reader, spec, tokenizer, seed=cfg.train.seed, shift=d.augment_shift, color=d.augment_color,
                          cache_mb=d.cache_mb, text_column=text_column, threads=max(2, d.num_workers),
                          env_state=env_state, repeat_padding=repeats_padding(model))
    notices = (*reader.notices, *([dataset.store.notice] if dataset.store.notice else []),
               *([computed] if computed else []))
    return Data(dataset, spec, tokenizer, tuple(f"dataset {d.path}: {n}" for n in notices))


def repeats_padding(model) -> bool:
    """A LeRobot policy whose loss counts the chunk steps past the episode end (pi0, pi0.5: LeRobot's repeated last
    action) trains on them as LeRobot does; SmolVLA and vlaforge's heads mask them out."""
    composition = getattr(model, "composition", None)
    return composition is not None and not composition.masks_padded_actions


def policy_normalization(model, reader) -> tuple[dict, str | None]:
    """A LeRobot policy's own normalization of state and action (its normalization_mapping: pi0.5's QUANTILES) with
    the dataset's statistics (data/stats.py), as ObservationSpec fields ({} for vlaforge's VLA: MEAN_STD, std
    floored); and a line when statistics had to be computed."""
    mapping = getattr(model, "normalization_mapping", None)
    if mapping is None:
        return {}, None
    from vlaforge.data.stats import policy_stats

    norm_map = {k: v for k, v in mapping().items() if k in ("STATE", "ACTION")}
    stats, computed = policy_stats(reader, norm_map)
    return {"norm_map": norm_map, "stats": stats}, computed


def check_env_state(reader, dim: int) -> None:
    """The dataset must hold `observation.environment_state` of size `dim` for the env_state loss term.

    Raises:
        VlaforgeError: naming the column, its size and the fix.
    """
    from vlaforge.data.lerobot_writer import ENV_STATE

    col = reader.columns.get(ENV_STATE)
    if col is None:
        raise VlaforgeError(f"loss.weights.env_state needs the column {ENV_STATE!r}, which dataset {reader.root} does "
                            "not have (datasets from `vlaforge data generate` before 2026-12-02's evening lack it); "
                            "regenerate the dataset or set --loss.weights.env_state=0")
    if col.shape[1] != dim:
        raise VlaforgeError(f"dataset {reader.root} has {ENV_STATE} of size {col.shape[1]} but model.env_state_dim = "
                            f"{dim}; set model.env_state_dim = {col.shape[1]}")
    reader.check_finite(ENV_STATE)


def build_loader(dataset: Dataset, batch_size: int, seed: int, start_sample: int, num_workers: int,
                 rank: int = 0, dp: int = 1) -> DataLoader:
    """Batches of `batch_size` for data-parallel rank `rank` of `dp`; `start_sample` counts global samples."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_workers > cores:  # NOTE: more workers than cores only add memory; far more exhaust it and hang
        warnings.warn(f"data.num_workers = {num_workers} exceeds the {cores} cores of this machine; using {cores}",
                      UserWarning, stacklevel=2)
        num_workers = cores
    sampler: Sampler[int] = ResumableSampler(len(dataset), seed, start_sample)
    if dp > 1:
        sampler = RankSlice(sampler, batch_size, rank, dp)
    # NOTE: an explicit generator keeps the DataLoader from drawing on the global RNG, which resume restores.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      collate_fn=Batch.collate, num_workers=num_workers, generator=torch.Generator().manual_seed(seed),
                      persistent_workers=num_workers > 0)
