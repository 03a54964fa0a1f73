"""Writing a checkpoint: model weights in safetensors, optimizer / scheduler / loss-weighting / RNG / data position
in a torch file, the resolved config beside them; written to a temporary folder and renamed (`layout.py`), so a crash
never leaves a half-written checkpoint and `latest` names the newest complete one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file, save_model

from vlaforge.checkpoints.layout import (
    CONFIG_FILE,
    MODEL_FILE,
    STATE_FILE,
    finish_interrupted_saves,
    move_into_place,
    temporary_folder,
)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any], config_toml: str,
                    keep: int, extra: Callable[[Path], None] | None = None,
                    weights: dict[str, torch.Tensor] | None = None, prepared: bool = False) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep` checkpoints.

    `extra(folder)` writes further files (the policy's observation spec, tokenizer) into the checkpoint.
    `weights`: the full state dict to write instead of `model`'s own (a sharded model's, gathered).
    `prepared`: every rank has already written its part (DCP's `dcp/`, DeepSpeed's `deepspeed/`) into
    `temporary_folder(run_dir, step)`; add the rest (model.safetensors only when `weights` is given).
    """
    root = run_dir / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = temporary_folder(run_dir, step)
    finish_interrupted_saves(root, keep=tmp)
    if not prepared:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if weights is not None:
        save_full_weights(weights, tmp / MODEL_FILE)
    elif not prepared:
        save_model(model, str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    (tmp / CONFIG_FILE).write_text(config_toml)
    if extra is not None:
        extra(tmp)
    move_into_place(tmp, final)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def save_full_weights(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(path),  # clone: unties shared tensors
              metadata=metadata)


