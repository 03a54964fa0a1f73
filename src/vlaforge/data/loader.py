"""Datasets by `data.source` and a resumable, deterministic sample order."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vlaforge.data.batch import Batch


class ResumableSampler(Sampler[int]):
    """An endless stream of indices: epoch e is a permutation seeded by (seed, e). Starting at `start`
    (samples already consumed) continues the exact stream, which makes resumed runs bit-identical."""

    def __init__(self, size: int, seed: int, start: int = 0):
        self.size, self.seed, self.start = size, seed, start

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.size)
        while True:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            yield from torch.randperm(self.size, generator=g)[offset:].tolist()
            epoch, offset = epoch + 1, 0


def build_dataset(cfg, model) -> Dataset:
    """The dataset named by `data.source`, shaped for `model` (frames, image size, vocabulary)."""
    from vlaforge.data.synthetic import SyntheticDataset

    m, d = cfg.model, cfg.data
    return SyntheticDataset(
        num_samples=d.num_samples, num_tasks=d.num_tasks, frames=m.frames_per_sample,
        image_size=model.layout.image_size, state_dim=m.state_dim, action_dim=m.action_dim,
        chunk=m.action_chunk, vocab_size=model.llm.config.vocab_size, instruction_tokens=d.max_instruction_tokens,
        text_tokens=d.max_text_tokens, seed=cfg.train.seed)


def build_loader(dataset: Dataset, batch_size: int, seed: int, start_sample: int, num_workers: int) -> DataLoader:
    # NOTE: an explicit generator keeps the DataLoader from drawing on the global RNG, which resume restores.
    return DataLoader(dataset, batch_size=batch_size, sampler=ResumableSampler(len(dataset), seed, start_sample),
                      collate_fn=Batch.collate, num_workers=num_workers, generator=torch.Generator().manual_seed(seed),
                      persistent_workers=num_workers > 0)
