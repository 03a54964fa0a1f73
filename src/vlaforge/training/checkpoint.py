"""Checkpoints: model weights in safetensors, optimizer/scheduler/loss-weighting/RNG/data position in a torch
file, the resolved config beside them. Written to a temporary folder and renamed, so a crash never leaves a
half-written checkpoint; `latest` names the newest complete one.

Layout: RUN_DIR/checkpoints/step_00000010/{model.safetensors, trainer_state.pt, config.toml[, policy.json,
tokenizer.json]}, RUN_DIR/checkpoints/latest. A sharded checkpoint (`train.checkpoint_format = "sharded"`) has
`dcp/` (torch.distributed.checkpoint: every rank's shards of model and optimizer) instead of model.safetensors, and
no optimizer in trainer_state.pt; `vlaforge export` writes its model.safetensors.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from vlaforge.config.loading import write_atomic
from vlaforge.errors import VlaforgeError

MODEL_FILE, STATE_FILE, CONFIG_FILE, DCP_DIR = "model.safetensors", "trainer_state.pt", "config.toml", "dcp"


def is_sharded(ckpt: Path) -> bool:
    """A sharded (DCP) checkpoint: training resumes from its shards (model.safetensors, once exported, is for
    inference)."""
    return (ckpt / DCP_DIR / ".metadata").is_file()


def has_weights(ckpt: Path) -> bool:
    return (ckpt / MODEL_FILE).is_file() or is_sharded(ckpt)


def temporary_folder(run_dir: Path, step: int) -> Path:
    """Where checkpoint `step` is written before the rename (the same path on every rank)."""
    return run_dir / "checkpoints" / f".step_{step:08d}.tmp"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    write_atomic(root / "latest", final.name + "\n")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def save_full_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(path))  # clone: unties shared tensors


def resolve_checkpoint(resume: str, output_dir: str | Path, what: str = "train.resume") -> Path:
    """'latest' (in output_dir), a run folder or a checkpoint folder -> the checkpoint folder.

    Raises:
        VlaforgeError: nothing to resume from there.
    """
    path = Path(output_dir) if resume == "latest" else Path(resume)
    if has_weights(path):
        return path
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        ckpt = path / "checkpoints" / latest.read_text().strip()
        if has_weights(ckpt):
            return ckpt
    fix = ", or drop --train.resume" if what == "train.resume" else ""
    raise VlaforgeError(f"{what}: no checkpoint at {path} (expected {MODEL_FILE}, {DCP_DIR}/ or checkpoints/latest); "
                        f"give a run folder or a checkpoints/step_* folder{fix}")


def load_checkpoint(ckpt: Path, model: torch.nn.Module, sharded: bool = False) -> dict[str, Any]:
    """Load weights into `model` (strict; `sharded`: a parallelized model, loaded from the full state on every
    rank) and return the trainer state.

    Raises:
        VlaforgeError: a file is missing, truncated or does not match the model.
    """
    for name in (MODEL_FILE, STATE_FILE):
        if not (ckpt / name).is_file():
            raise VlaforgeError(f"checkpoint {ckpt} has no {name}; resume from another checkpoint")
    if sharded:
        from safetensors.torch import load_file

        from vlaforge.distributed.state import load_full_model_state

        _upgrade_legacy(ckpt / MODEL_FILE)
        load_full_model_state(model, load_file(str(ckpt / MODEL_FILE)))
    else:
        load_weights(ckpt, model)
    return load_trainer_state(ckpt)


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    """trainer_state.pt of a checkpoint.

    Raises:
        VlaforgeError: the file is missing, truncated or corrupt.
    """
    if not (ckpt / STATE_FILE).is_file():
        raise VlaforgeError(f"checkpoint {ckpt} has no {STATE_FILE}; resume from another checkpoint")
    try:
        return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for damaged files
        raise VlaforgeError(f"checkpoint file {ckpt / STATE_FILE} is truncated or corrupt ({_first_line(exc)}); "
                            "resume from another checkpoint") from None


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load model.safetensors (or a sharded checkpoint's model shards) into `model` (strict).

    Raises:
        VlaforgeError: the file is missing, truncated or does not match the model.
    """
    if is_sharded(ckpt) and not (ckpt / MODEL_FILE).is_file():
        from vlaforge.distributed.state import load_sharded

        load_sharded(ckpt / DCP_DIR, model)
        return
    if not (ckpt / MODEL_FILE).is_file():
        raise VlaforgeError(f"checkpoint {ckpt} has no {MODEL_FILE}; give a checkpoints/step_* folder")
    try:
        _upgrade_legacy(ckpt / MODEL_FILE)
        missing, unexpected = load_model(model, str(ckpt / MODEL_FILE), strict=False)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise VlaforgeError(f"checkpoint file {ckpt / MODEL_FILE} is truncated or corrupt ({_first_line(exc)}); "
                            "use another checkpoint") from None
    if missing or unexpected:
        raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({len(missing)} missing, "
                            f"{len(unexpected)} unexpected tensors, e.g. {(missing or unexpected)[0]}); "
                            "use the config saved in that checkpoint")


def _upgrade_legacy(path: Path) -> None:
    """Checkpoints written before `projector.logit_scale` became shape (1,) (FSDP2 cannot shard 0-d parameters)
    store it as a scalar: rewrite the file once, atomically, with the new shape."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        if "projector.logit_scale" not in f.keys() or f.get_slice("projector.logit_scale").get_shape() != []:
            return
        metadata = f.metadata()
    state = load_file(str(path))
    state["projector.logit_scale"] = state["projector.logit_scale"].reshape(1)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp), metadata=metadata)
    tmp.replace(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def export_weights(ckpt: Path, out: Path | None = None) -> Path:
    """Consolidate a checkpoint's weights into one safetensors file for inference (default: CKPT/model.safetensors,
    which `vlaforge eval` and the policy server read); written to a temporary name and renamed.

    Raises:
        VlaforgeError: the checkpoint is not sharded and `out` is not given (nothing to do), or it cannot be read.
    """
    out = out or ckpt / MODEL_FILE
    if not is_sharded(ckpt):
        if out == ckpt / MODEL_FILE:
            raise VlaforgeError(f"checkpoint {ckpt} already holds {MODEL_FILE} (it is not sharded); give --out to "
                                "copy it elsewhere")
        from safetensors.torch import load_file

        state = load_file(str(ckpt / MODEL_FILE))
    else:
        from vlaforge.distributed.state import consolidate_sharded

        state = consolidate_sharded(ckpt / DCP_DIR)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_full_weights(state, tmp)
    tmp.replace(out)
    return out
