"""Loading `transformers` models from local `save_pretrained` folders, with errors a user can act on.

Nothing is ever downloaded: a pretrained source must be a local folder holding `config.json` and weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlaforge.errors import VlaforgeError, first_line

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


HINT = "give a local folder written by save_pretrained (config.json + model.safetensors)"


def read_config(path: str | Path, field: str) -> dict[str, Any]:
    """The config.json of a pretrained folder, as a dict. The weights need not be there: planning, `model summary`
    and fake builds read the config alone.

    Raises:
        VlaforgeError: the folder or its config.json is missing, or config.json is not a JSON object.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise VlaforgeError(f"{field}: {folder} is not a folder; {HINT}")
    config = folder / "config.json"
    if not config.is_file():
        raise VlaforgeError(f"{field}: {folder} has no config.json; {HINT}")
    try:
        out = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VlaforgeError(f"{field}: {config} is not valid JSON ({exc}); {HINT}") from None
    if not isinstance(out, dict):
        raise VlaforgeError(f"{field}: {config} holds a JSON {type(out).__name__}, not an object; {HINT}")
    return out


def check_pretrained_folder(path: str | Path, field: str) -> Path:
    """Return the folder as a Path, or raise naming `field` and what is missing.

    Raises:
        VlaforgeError: the folder, its config.json or its weight files are missing or config.json is not JSON.
    """
    read_config(path, field)
    folder = Path(path).expanduser()
    if not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        raise VlaforgeError(f"{field}: {folder} has no weight files (*.safetensors); {HINT}")
    return folder


def _sdpa_or_eager(build: Any, notice: str | None = None, attn: str = "sdpa") -> Any:
    """`build(attn_implementation)` with `attn` ('sdpa' or 'eager'); SDPA falls back to eager for a family
    transformers runs without SDPA (Gemma2's soft-capped logits), printing `notice` when it does."""
    if attn == "eager":
        return build("eager")
    try:
        return build("sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        if notice:
            print(notice, flush=True)
        return build("eager")


def load_pretrained(model_cls: Any, path: str | Path, field: str, families: tuple[str, ...] = (),
                    attn: str = "sdpa") -> Any:
    """`model_cls.from_pretrained(path)` in fp32, local files only, with SDPA attention (eager, with a printed
    notice, for a family transformers runs without SDPA: Gemma2's soft-capped logits).

    Every weight of the built module must come from the folder: a folder of another family (a DINOv2 or a whole
    VLM given where a SigLIP tower is built) would otherwise train a randomly initialised module in its place,
    which transformers reports only in its load report. `families`: the config `model_type`s the module takes.

    Raises:
        VlaforgeError: the folder is malformed, of another family, or its weights do not all load.
    """
    import torch

    folder = check_pretrained_folder(path, field)
    kind = read_config(folder, field).get("model_type")
    if families and kind not in families:
        raise VlaforgeError(f"{field}: {folder} is a '{kind}' folder; this component is built as "
                            f"{' / '.join(families)} and would not load its weights; give a folder of that family")

    def load(attn: str):
        return model_cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32, attn_implementation=attn,
                                         output_loading_info=True)

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report and progress bars: what matters is checked below, in one line
    hf_logging.disable_progress_bar()
    try:
        model, info = _sdpa_or_eager(load, f"{field}: {kind} has no SDPA attention in transformers: using eager "
                                           "attention", attn)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        if "ignore_mismatched_sizes" in str(exc):
            raise VlaforgeError(f"{field}: the weights in {folder} do not match the shapes its config.json gives "
                                "(edited config or files from another model); give the folder save_pretrained "
                                "wrote") from None
        raise VlaforgeError(f"{field}: cannot load {folder}: {first_line(exc, None)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    mismatched = [k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys") or []]
    missing = list(info.get("missing_keys") or []) + mismatched
    if missing:
        total = sum(1 for _ in model.state_dict())
        shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
        raise VlaforgeError(f"{field}: {len(missing)} of the {total} weights of the {type(model).__name__} "
                            f"built from {folder} are not in its files ({shown}): it would train from random "
                            "values; give a folder written by save_pretrained for this model")
    return model



def from_config(model_cls: Any, config: dict[str, Any], field: str, attn: str = "sdpa") -> Any:
    """A module of `model_cls` built from a config dict alone, weights left to the caller (a checkpoint's saved
    backbone config, a planning build under fake tensors). `model_cls`: a model class, or `AutoModelForCausalLM`.
    SDPA attention, or eager for a family transformers runs without it, as `load_pretrained` chooses."""
    from transformers import AutoConfig

    config = dict(config)
    kind = config.pop("model_type", None)
    try:
        built = AutoConfig.for_model(kind, **config)
    except (ValueError, KeyError, TypeError) as exc:
        raise VlaforgeError(f"{field}: the saved config of a '{kind}' model does not build "
                            f"({first_line(exc, None)})") from None
    make = model_cls.from_config if hasattr(model_cls, "from_config") else model_cls._from_config
    try:
        return _sdpa_or_eager(lambda kind: make(built, attn_implementation=kind), attn=attn)
    except ValueError as exc:
        raise VlaforgeError(f"{field}: cannot build a '{kind}' model: {first_line(exc, None)}") from None
