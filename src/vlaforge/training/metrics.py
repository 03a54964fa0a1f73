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
    """The metrics as floats: one host read per device for all its tensors (stacked there first: a `.cpu()` per
    metric would wait for the device once each). Metrics stay on their device until a logging step calls this."""
    by_device: dict[torch.device, list[str]] = {}
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
        else:
            out[k] = float(v)
    for keys in by_device.values():
        stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
        out.update(zip(keys, stacked.tolist()))
    return {k: out[k] for k in metrics}


def add_mean(sums: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], n: int) -> None:
    """Accumulate one of `n` micro-batches' metrics into their mean, in place."""
    for k, v in metrics.items():
        sums[k] = sums[k] + v / n if k in sums else v / n
