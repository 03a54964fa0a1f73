"""Metrics sinks: JSONL (one object per logged step) and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def to_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """One host sync for all tensor metrics."""
    keys = list(metrics)
    tensors = [torch.as_tensor(metrics[k]).detach().float().reshape(()).cpu() for k in keys]
    return dict(zip(keys, torch.stack(tensors).tolist())) if keys else {}


def add_mean(sums: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], n: int) -> None:
    """Accumulate one of `n` micro-batches' metrics into their mean, in place."""
    for k, v in metrics.items():
        sums[k] = sums[k] + v / n if k in sums else v / n
