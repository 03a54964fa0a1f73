"""Checkpoints: model weights in safetensors, optimizer/scheduler/loss-weighting/RNG/data position in a torch
file, the resolved config beside them. Written to a temporary folder and renamed, so a crash never leaves a
half-written checkpoint; `latest` names the newest complete one.

Layout: RUN_DIR/checkpoints/step_00000010/{model.safetensors, trainer_state.pt, config.toml[, policy.json,
tokenizer.json]}, RUN_DIR/checkpoints/latest. A sharded checkpoint (`train.checkpoint_format = "sharded"`) has
`dcp/` (torch.distributed.checkpoint: every rank's shards of model and optimizer) instead of model.safetensors, and
no optimizer in trainer_state.pt; `vlaforge export` writes its model.safetensors.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from vlaforge.outputs import write_atomic
from vlaforge.errors import VlaforgeError, first_line, load_refusal

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
    _move_into_place(tmp, final)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def finish_interrupted_saves(root: Path, keep: Path | None = None) -> None:
    """What killed saves left in `root` (a run's checkpoints/), put right, keeping `latest` on a complete checkpoint
    at every instant. A save killed after `latest` moved to the aside copy .step_X.old (so its .step_X.tmp is
    complete) is finished: the new folder renamed into place, `latest` pointed at it, the aside copy removed. A
    .step_X.tmp saved no further is removed (but `keep`, the folder the current save's ranks are writing)."""
    latest = root / "latest"
    named = lambda: latest.read_text().strip() if latest.is_file() else ""  # noqa: E731
    for tmp in sorted(root.glob(".step_*.tmp")):
        name = tmp.name[1:-len(".tmp")]
        if tmp == keep or not tmp.is_dir():
            continue
        if named() == f".{name}.old":  # past the commit point: `latest` holds the old copy meanwhile
            shutil.rmtree(root / name, ignore_errors=True)
            tmp.rename(root / name)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for aside in sorted(root.glob(".step_*.old")):
        name, holds = aside.name[1:-len(".old")], named() == aside.name
        if holds and not (root / name).exists():
            aside.rename(root / name)  # the only copy left
        if holds:
            write_atomic(latest, name + "\n")
        shutil.rmtree(aside, ignore_errors=True)


def _pause(stage: str) -> None:
    """Between the steps of replacing a checkpoint; tests make it wait, to kill the process there."""


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete checkpoint `tmp` to `final` and point `latest` at it. `latest` names a complete
    checkpoint at every instant, also when `final` already exists (the same step saved again): the old one is first
    linked aside (hard links: no bytes copied) and `latest` moved there, before it is removed."""
    latest, aside = final.parent / "latest", final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        shutil.copytree(final, aside, copy_function=os.link)
        write_atomic(latest, aside.name + "\n")
        _pause("aside")
        shutil.rmtree(final)
        _pause("removed")
    tmp.rename(final)
    _pause("renamed")
    write_atomic(latest, final.name + "\n")
    for stale in final.parent.glob(".step_*.old"):  # this one, and any a killed save left
        shutil.rmtree(stale, ignore_errors=True)


EXPORT_MARK = {"format": "pt", "vlaforge": "export"}  # safetensors metadata of files `vlaforge export` wrote


def save_full_weights(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(path),  # clone: unties shared tensors
              metadata=metadata)


def resolve_checkpoint(resume: str, output_dir: str | Path, what: str = "train.resume") -> Path:
    """'latest' (in output_dir), a run folder or a checkpoint folder -> the checkpoint folder.

    Raises:
        VlaforgeError: nothing to resume from there.
    """
    path = Path(output_dir) if resume == "latest" else Path(resume)
    if has_weights(path):
        return path
    latest = path / "checkpoints" / "latest"
    if what == "train.resume" and os.environ.get("WORLD_SIZE", "1") == "1" and latest.is_file():
        finish_interrupted_saves(latest.parent)  # NOTE: one process only: ranks resolve at once (their next save
        # finishes it then)
    if latest.is_file():
        name = _read_latest(latest)
        ckpt = path / "checkpoints" / name
        if has_weights(ckpt):
            return ckpt
    fix = ", or drop --train.resume" if what == "train.resume" else ""
    raise VlaforgeError(f"{what}: no checkpoint at {path} (expected {MODEL_FILE}, {DCP_DIR}/ or checkpoints/latest); "
                        f"give a run folder or a checkpoints/step_* folder{fix}")


def _read_latest(latest: Path) -> str:
    """The checkpoint name in a `latest` file: one folder name, nothing else."""
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except (UnicodeDecodeError, OSError):
        name = ""
    if not name or "/" in name or "\\" in name or name in (".", "..") or len(name) > 255:
        raise VlaforgeError(f"{latest} does not name a checkpoint folder; write the name of a step_* folder "
                            "into it, or give the checkpoints/step_* folder itself")
    return name


def run_folder_of(ckpt: Path) -> Path:
    """The run a checkpoint belongs to: RUN for RUN/checkpoints/step_*, else the checkpoint's own parent."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


# what a run writes before its first checkpoint: a folder holding only these (and no checkpoint) is a run that
# stopped before it saved anything, which its retry may replace
BEFORE_FIRST_CHECKPOINT = frozenset({"config.toml", "precision.json", "metrics.jsonl", "tensorboard", "traces",
                                     "oom_snapshot.pickle", "checkpoints"})


def stopped_before_first_checkpoint(run_dir: Path) -> list[Path]:
    """The files of a run that stopped before its first checkpoint (a missing dataset, a crash at step 1), which a
    new run in the same folder replaces; empty when the folder holds anything else, or any checkpoint."""
    entries = list(run_dir.iterdir()) if run_dir.is_dir() else []
    if not entries or any(e.name not in BEFORE_FIRST_CHECKPOINT for e in entries):
        return []
    saved = run_dir / "checkpoints"
    if saved.exists() and (not saved.is_dir() or any(saved.iterdir())):
        return []
    return entries


def check_run_folder(run_dir: Path, resume_from: Path | None) -> None:
    """A new run needs an empty (or missing) folder it can write, or one where a run stopped before its first
    checkpoint (`stopped_before_first_checkpoint`); a resumed run writes into the run it resumes from (or an empty
    folder). Nothing of an earlier run that saved a checkpoint is ever overwritten.

    Raises:
        VlaforgeError: the folder is a file, holds another run, or cannot be written.
    """
    where = f"train.output_dir {run_dir}"
    if run_dir.exists() and not run_dir.is_dir():
        raise VlaforgeError(f"{where} is a file, not a folder; choose another --train.output_dir")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not (resume_from is None
                                                             and stopped_before_first_checkpoint(run_dir)):
        if resume_from is None:
            raise VlaforgeError(f"{where} is not empty (an earlier run's files would be overwritten); choose another "
                                f"--train.output_dir, or continue that run with --resume {run_dir}")
        if run_dir.resolve() not in resume_from.resolve().parents:
            raise VlaforgeError(f"{where} is not empty and is not the run of the resumed checkpoint {resume_from}; "
                                "resume into that run or into an empty --train.output_dir")
    existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise VlaforgeError(f"{where}: {existing} is {'not writable' if existing.is_dir() else 'a file'}; choose a "
                            "writable --train.output_dir")


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
        from vlaforge.training.lora_checkpoint import is_lora, optional_keys, read_record

        _upgrade_legacy(ckpt / MODEL_FILE)
        optional = optional_keys(model, read_record(ckpt)) if is_lora(ckpt) else set()
        load_full_model_state(model, load_file(str(ckpt / MODEL_FILE)), optional=optional)
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
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for damaged files (and refuses foreign objects)
        why = load_refusal(exc)
        what = "is refused" if why.startswith("it holds") else "is truncated or corrupt"
        raise VlaforgeError(f"checkpoint file {ckpt / STATE_FILE} {what} ({why}); resume from another checkpoint"
                            ) from None
    problem = _state_problem(state)
    if problem:
        raise VlaforgeError(f"checkpoint file {ckpt / STATE_FILE} is not a vlaforge trainer state ({problem}); "
                            "resume from another checkpoint")
    return state


# trainer_state.pt's keys and the types their values must have (optimizer: full checkpoints only)
STATE_TYPES = {"step": int, "scheduler": dict, "weighting": dict, "rng": dict}


def _state_problem(state: Any) -> str:
    """What is wrong with a loaded trainer state, or ''."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict"
    for key, kind in STATE_TYPES.items():
        if key not in state:
            return f"no {key!r}"
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            return f"{key!r} is a {type(state[key]).__name__}, not {kind.__name__}"
    if state["step"] < 0 or not isinstance(state.get("samples", 0), int):
        return "a negative step or a non-integer sample count"
    rng = state["rng"]
    if not isinstance(rng.get("torch"), torch.Tensor) or not isinstance(rng.get("python"), tuple):
        return "'rng' lacks the torch and python generator states"
    if not {"last_epoch", "_step_count"} <= state["scheduler"].keys():
        return "'scheduler' lacks its position"
    if "optimizer" in state and not (isinstance(state["optimizer"], dict)
                                     and {"state", "param_groups"} <= state["optimizer"].keys()):
        return "'optimizer' is not an optimizer state"
    return ""


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load model.safetensors (or a sharded checkpoint's model shards) into `model` (strict).

    Raises:
        VlaforgeError: the file is missing, truncated or does not match the model, or the checkpoint is quantized.
    """
    from vlaforge.techniques.quantized_format import is_quantized

    if is_quantized(ckpt):
        raise VlaforgeError(f"checkpoint {ckpt} is quantized (`vlaforge quantize`): it runs for inference only "
                            "(vlaforge eval / serve, PolicyRuntime); train or export from the float run it came from")
    if is_sharded(ckpt) and not (ckpt / MODEL_FILE).is_file():
        from vlaforge.distributed.state import load_sharded

        load_sharded(ckpt / DCP_DIR, model)
        return
    if not (ckpt / MODEL_FILE).is_file():
        raise VlaforgeError(f"checkpoint {ckpt} has no {MODEL_FILE}; give a checkpoints/step_* folder")
    from vlaforge.training.lora_checkpoint import is_lora, load_lora_weights, load_merged

    if is_lora(ckpt) and getattr(model, "lora", None):  # resuming: the same adapters over the rebuilt base
        load_lora_weights(ckpt, model, ckpt / MODEL_FILE)
        return
    if is_lora(ckpt):  # a plain model (init_from, a teacher): the adapters merged into their base
        from vlaforge.config.loading import load_config

        merged = load_merged(ckpt, load_config(ckpt / CONFIG_FILE)).state_dict()
        try:
            model.load_state_dict(merged)
        except RuntimeError as exc:
            raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({first_line(exc, 160)}); use the "
                                "config saved in that checkpoint") from None
        return
    try:
        _upgrade_legacy(ckpt / MODEL_FILE)
        missing, unexpected = load_model(model, str(ckpt / MODEL_FILE), strict=False)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        if mismatch := _shape_mismatch(ckpt / MODEL_FILE, model):
            raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({mismatch}); use the config saved in "
                                "that checkpoint") from None
        raise VlaforgeError(f"checkpoint file {ckpt / MODEL_FILE} is truncated or corrupt ({first_line(exc)}); "
                            "use another checkpoint") from None
    if missing or unexpected:
        raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({len(missing)} missing, "
                            f"{len(unexpected)} unexpected tensors, e.g. {(missing or unexpected)[0]}); "
                            "use the config saved in that checkpoint")


def _shape_mismatch(path: Path, model: torch.nn.Module) -> str:
    """The first tensor whose shape in the safetensors file differs from the model's, or '' (also when the file's
    header cannot be read: then the file is damaged, not mismatched)."""
    from safetensors import safe_open

    want = model.state_dict()
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                got = tuple(f.get_slice(key).get_shape())
                if key in want and got != tuple(want[key].shape):
                    return f"{key} is {list(got)} in the file, {list(want[key].shape)} in the model"
    except Exception:  # noqa: BLE001 - a header that does not parse: damage, reported by the caller
        return ""
    return ""


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


def export_weights(ckpt: Path, out: Path | None = None) -> Path:
    """Consolidate a checkpoint's weights into one safetensors file for inference (default: CKPT/model.safetensors,
    which `vlaforge eval` and the policy server read); written to a temporary name and renamed.

    Raises:
        VlaforgeError: the checkpoint is not sharded and `out` is not given (nothing to do), it cannot be read, or
            `out` would replace something export did not write (see `_check_export_target`).
    """
    from vlaforge.techniques.quantized_format import is_quantized

    default = ckpt / MODEL_FILE
    out = out or default
    if is_quantized(ckpt):
        raise VlaforgeError(f"{ckpt} is a `vlaforge quantize` folder: its weights are torchao's quantized tensors, "
                            "not float weights to export; export the float run, or serve / eval the folder itself")
    from vlaforge.training.lora_checkpoint import is_lora

    if is_lora(ckpt):  # the adapters merged into their base: the full weights a plain VLA loads
        if out.resolve() == default.resolve():
            raise VlaforgeError(f"checkpoint {ckpt} is a LoRA run (its {MODEL_FILE} holds the adapters); give --out "
                                "for the merged weights")
        _check_export_target(out)
        state = load_policy_model(ckpt)[0].state_dict()
    elif not is_sharded(ckpt):
        if out.resolve() == default.resolve():
            raise VlaforgeError(f"checkpoint {ckpt} already holds {MODEL_FILE} (it is not sharded); give --out to "
                                "copy it elsewhere")
        _check_export_target(out)
        from safetensors.torch import load_file

        try:
            state = load_file(str(default))
        except (SafetensorError, OSError, ValueError) as exc:
            raise VlaforgeError(f"checkpoint file {default} is truncated or corrupt ({first_line(exc)}); use "
                                "another checkpoint") from None
    else:
        if out.resolve() != default.resolve():
            _check_export_target(out)
        from vlaforge.distributed.state import consolidate_sharded

        state = consolidate_sharded(ckpt / DCP_DIR)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_full_weights(state, tmp, metadata=EXPORT_MARK)
        tmp.replace(out)
    except (OSError, SafetensorError) as exc:  # safetensors reports its own I/O errors (a full or special device)
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        why = getattr(exc, "strerror", None) or first_line(exc, 120)
        raise VlaforgeError(f"--out {out}: cannot write there ({why}); choose a writable path") from None
    return out


def _check_export_target(out: Path) -> None:
    """Refuse an --out that is a folder, lies inside a checkpoint, or is an existing file export did not write.

    Raises:
        VlaforgeError: naming the problem.
    """
    if out.is_dir():
        raise VlaforgeError(f"--out {out} is a folder; give a file path such as {out / MODEL_FILE}")
    for parent in out.resolve().parents:
        if (parent / STATE_FILE).is_file() or (parent / DCP_DIR).is_dir():
            raise VlaforgeError(f"--out {out} lies inside checkpoint {parent}, whose files export never replaces; "
                                "write it outside the checkpoint")
    if out.exists() and not _made_by_export(out):
        raise VlaforgeError(f"--out {out} exists and was not written by vlaforge export; remove it or choose "
                            "another path")


def _made_by_export(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("vlaforge") == EXPORT_MARK["vlaforge"]
    except Exception:  # noqa: BLE001 - not a safetensors file at all
        return False


def load_policy_model(checkpoint: str | Path, device: torch.device | str = "cpu", what: str = "CHECKPOINT"):
    """The trained VLA of a run folder, a checkpoints/step_* folder (full or sharded) or a `vlaforge quantize`
    folder, with its saved config: (model, config, checkpoint folder). What `PolicyRuntime` and a distillation
    teacher load; `what` names the option in errors."""
    from vlaforge.config.loading import load_config
    from vlaforge.models.build import build_vla
    from vlaforge.techniques.quantized_format import is_quantized, load_quantized
    from vlaforge.training.lora_checkpoint import is_lora, load_merged

    ckpt = resolve_checkpoint(str(checkpoint), ".", what=what)
    cfg = load_config(ckpt / CONFIG_FILE)
    if is_lora(ckpt) and not is_quantized(ckpt):
        return load_merged(ckpt, cfg), cfg, ckpt
    model = build_vla(cfg.model, cfg.loss, backbones=saved_backbones(ckpt))
    if is_quantized(ckpt):
        load_quantized(ckpt, model, torch.device(device))
    else:
        load_weights(ckpt, model)
    return model, cfg, ckpt


def saved_backbones(ckpt: Path) -> dict[str, dict] | None:
    """The pretrained components' configs a checkpoint carries (backbones.json), so it loads without the folders
    it was trained from; None for a checkpoint without pretrained components (or from before the file)."""
    from vlaforge.models.build import BACKBONES_FILE

    path = Path(ckpt) / BACKBONES_FILE
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VlaforgeError(f"{path} is not readable JSON ({exc}); the checkpoint is damaged: use another "
                            "checkpoint of the run") from None
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise VlaforgeError(f"{path} does not hold component configs; the checkpoint is damaged: use another "
                            "checkpoint of the run")
    return found


def weights_digest(ckpt: Path) -> str:
    """sha256 over a checkpoint's weight files (safetensors, DCP shards) and its config: changes with any weight."""
    import hashlib

    h = hashlib.sha256()
    files = sorted(p for p in Path(ckpt).rglob("*") if p.is_file() and (p.suffix in (".safetensors", ".distcp")
                                                                          or p.name in (CONFIG_FILE, ".metadata")))
    for path in files:
        h.update(str(path.relative_to(ckpt)).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
