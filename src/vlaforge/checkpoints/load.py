"""Loading every checkpoint kind vlaforge writes - full, sharded (DCP), LoRA (adapters over a rebuilt base),
quantized (`vlaforge quantize`) - into a model, for resuming, `train.init_from`, a distillation teacher and the
policy runtime; the trainer state beside the weights, checked before use."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model
from torch import nn

from vlaforge.checkpoints.layout import (
    CONFIG_FILE,
    DCP_DIR,
    MODEL_FILE,
    STATE_FILE,
    is_sharded,
    resolve_checkpoint,
    resolve_run,
    saved_config,
)
from vlaforge.checkpoints.lora import (
    check_adapters_described,
    check_base,
    is_lora,
    load_lora_weights,
    optional_keys,
    read_record,
)
from vlaforge.errors import VlaforgeError, first_line, load_refusal
from vlaforge.seeding import seed_everything
from vlaforge.techniques.lora import apply_lora, base_digest, lora_components, merge_lora
from vlaforge.techniques.optimizer_state import packed_problem
from vlaforge.techniques.precision import master_dtype


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
        check_adapters_described(ckpt, ckpt / MODEL_FILE)
        optional = optional_keys(model, read_record(ckpt)) if is_lora(ckpt) else set()
        state = load_file(str(ckpt / MODEL_FILE))
        check_finite(ckpt, state)  # NOTE: the file, the same on every rank (the loaded model is sharded)
        load_full_model_state(model, state, optional=optional)
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
        with _torch_globals_only():
            state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for damaged files (and refuses foreign objects)
        why = load_refusal(exc)
        what = "is refused" if why.startswith("it holds") else "is truncated or corrupt"
        raise VlaforgeError(f"checkpoint file {ckpt / STATE_FILE} {what} ({why}); resume from another checkpoint"
                            ) from None
    problem = _state_problem(state)
    if problem:
        raise VlaforgeError(f"checkpoint file {ckpt / STATE_FILE} is not a vlaforge trainer state ({problem}); "
                            "resume from another checkpoint")
    return state


@contextlib.contextmanager
def _torch_globals_only():
    """`weights_only` loads admit torch's own allowlist only: what a library adds with `add_safe_globals` (torchao
    adds its 8-bit optimizer state class) never lets a trainer state unpickle a class. A trainer state holds
    8-bit moments as plain tensors (techniques/optimizer_state.py:pack_moments)."""
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(added)


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
    if "optimizer" in state:
        optimizer = state["optimizer"]
        if not (isinstance(optimizer, dict) and {"state", "param_groups"} <= optimizer.keys()
                and isinstance(optimizer["state"], dict)):
            return "'optimizer' is not an optimizer state"
        for entry in optimizer["state"].values():
            for value in entry.values() if isinstance(entry, dict) else ():
                if isinstance(value, dict) and (why := packed_problem(value)):
                    return f"'optimizer': {why}"
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
    if is_lora(ckpt) and getattr(model, "lora", None):  # resuming: the same adapters over the rebuilt base
        load_lora_weights(ckpt, model, ckpt / MODEL_FILE)
        check_finite(ckpt, model.state_dict())
        return
    if is_lora(ckpt):  # a plain model (init_from, a teacher): the adapters merged into their base
        merged = load_merged(ckpt, resolve_run(ckpt)[1]).state_dict()
        check_finite(ckpt, merged)
        try:
            model.load_state_dict(merged)
        except RuntimeError as exc:
            raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({first_line(exc, 160)}); use the "
                                "config saved in that checkpoint") from None
        return
    check_adapters_described(ckpt, ckpt / MODEL_FILE)
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
    check_finite(ckpt, model.state_dict())


def check_finite(ckpt: Path, state: dict[str, torch.Tensor]) -> None:
    """Refuse weights with NaN or infinite values at load, named, rather than as "non-finite gradients" at the first
    step (or as NaN actions). Plain tensors only: a sharded (DTensor) or quantized tensor subclass is checked where
    it is still a plain file tensor.

    Raises:
        VlaforgeError: naming the tensors and how many of their values are not finite.
    """
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in state.items()
           if type(v) is torch.Tensor and v.is_floating_point() and not bool(torch.isfinite(v).all())}
    if bad:
        name, count = next(iter(bad.items()))
        raise VlaforgeError(f"checkpoint {ckpt} holds non-finite weights ({len(bad)} tensors, e.g. {name}: {count} "
                            "NaN / inf values): the run diverged before this save or the file was altered; use an "
                            "earlier checkpoint of the run")


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


def load_policy_model(checkpoint: str | Path, device: torch.device | str = "cpu", what: str = "CHECKPOINT",
                      lerobot: dict | None = None):
    """The trained VLA of a run folder, a checkpoints/step_* folder (full or sharded), a `vlaforge quantize`
    folder or a LeRobot policy folder (SmolVLA, pi0: `lerobot` gives its `model.lerobot` settings), with its config:
    (model, config, checkpoint folder). What `PolicyRuntime` and a distillation teacher load; `what` names the
    option in errors."""
    from vlaforge.models.build import build_vla
    from vlaforge.models.policies.reader import is_lerobot_folder
    from vlaforge.techniques.quantized_format import is_quantized, load_quantized

    if is_lerobot_folder(checkpoint):
        cfg = saved_config(Path(checkpoint), what, lerobot)
        return build_vla(cfg.model), cfg, Path(checkpoint)
    ckpt, cfg = resolve_run(checkpoint, what)
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


def rebuild_base(cfg) -> nn.Module:
    """The bare model a run started from: built under the run's seed as the trainer seeds it (a randomly
    initialised base comes out the same), the pretrained folders read, `train.init_from` loaded; the caller's
    random state is left as it was."""
    import random

    from vlaforge.models.build import build_vla

    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        seed_everything(cfg.train.seed)
        model = build_vla(cfg.model, cfg.loss)
    random.setstate(state)
    load_init_from(cfg, model)
    return model


def load_init_from(cfg, model: nn.Module) -> None:
    """Load `train.init_from`'s weights into the bare `model`, when the run names one."""
    if cfg.train.init_from:
        load_weights(resolve_checkpoint(cfg.train.init_from, ".", what="train.init_from"), model)


def load_merged(ckpt: Path, cfg) -> nn.Module:
    """A LoRA checkpoint as a plain VLA for inference: the base rebuilt and checked against the digest, stored as in
    training (master dtype, quantized base), the adapters loaded and merged into fp32 linears."""
    record = read_record(ckpt)
    model = rebuild_base(cfg)
    policies = dict(cfg.components.items())
    components = lora_components(policies)
    check_base(ckpt, record, base_digest(model, components))
    for c in components:  # the dtype apply_precision gave the base before the adapters were injected
        getattr(model, c).to(master_dtype(policies[c].precision, cfg.train.precision_master))
    apply_lora(model, policies)
    load_lora_weights(ckpt, model, ckpt / MODEL_FILE)
    merge_lora(model)
    return model.float()
