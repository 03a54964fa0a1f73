"""`vlaforge export RUN` (no --format): a checkpoint's weights as one float safetensors file for inference - a
sharded checkpoint consolidated, a LoRA run's adapters merged into their base - written to a temporary name and
renamed; a file export did not write is never replaced."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError

from vlaforge.checkpoints.layout import DCP_DIR, MODEL_FILE, STATE_FILE, is_sharded
from vlaforge.checkpoints.load import check_finite, load_policy_model
from vlaforge.checkpoints.lora import check_adapters_described, is_lora
from vlaforge.checkpoints.save import save_full_weights
from vlaforge.errors import VlaforgeError, first_line

EXPORT_MARK = {"format": "pt", "vlaforge": "export"}  # safetensors metadata of files `vlaforge export` wrote


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
        check_adapters_described(ckpt, default)
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
    check_finite(ckpt, state)
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


