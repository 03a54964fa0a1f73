"""A run's pieces, built once by `trainer.build_run` and read by the loop and by `saving.py`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vlaforge.config.schema import VLAConfig
from vlaforge.data.loader import Data
from vlaforge.distributed.parallel_dims import ParallelDims, World
from vlaforge.techniques.precision import PrecisionSetup
from vlaforge.training.step import Executor, StepGuards

# A saved checkpoint -> metrics (eval/success/<task>, eval/success). NOTE: evaluation sits on a floor above training
# (it loads what training writes), so the trainer is handed the evaluator instead of importing it.
Evaluator = Callable[[Path], dict[str, float]]


@dataclass
class Run:
    """Everything the loop touches, built once."""

    cfg: VLAConfig
    run_dir: Path
    device: torch.device
    world: World
    dims: ParallelDims
    model: nn.Module
    precision: PrecisionSetup
    guards: StepGuards
    executor: Executor
    weighting: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    start_step: int
    start_sample: int  # global samples consumed before start_step (the batch may have changed with the world size)
    tokens_per_sample: int
    data: Data
    evaluate: Evaluator | None
    lora_base: dict[str, Any] | None = None  # what names a LoRA run's frozen base (checkpoints/lora.py)


def global_batch(cfg: VLAConfig, dims: ParallelDims) -> int:
    """Samples per optimizer step over all ranks."""
    return cfg.train.batch_size * cfg.train.grad_accum * dims.dp


