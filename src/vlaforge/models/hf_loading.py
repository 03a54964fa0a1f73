"""Loading `transformers` models from local `save_pretrained` folders, with errors a user can act on.

Nothing is ever downloaded: a pretrained source must be a local folder holding `config.json` and weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlaforge.errors import VlaforgeError, first_line

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def check_pretrained_folder(path: str | Path, field: str) -> Path:
    """Return the folder as a Path, or raise naming `field` and what is missing.

    Raises:
        VlaforgeError: the folder, its config.json or its weight files are missing or config.json is not JSON.
    """
    folder = Path(path).expanduser()
    hint = "give a local folder written by save_pretrained (config.json + model.safetensors)"
    if not folder.is_dir():
        raise VlaforgeError(f"{field}: {folder} is not a folder; {hint}")
    config = folder / "config.json"
    if not config.is_file():
        raise VlaforgeError(f"{field}: {folder} has no config.json; {hint}")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VlaforgeError(f"{field}: {config} is not valid JSON ({exc}); {hint}") from None
    if not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        raise VlaforgeError(f"{field}: {folder} has no weight files (*.safetensors); {hint}")
    return folder


def load_pretrained(model_cls: Any, path: str | Path, field: str) -> Any:
    """`model_cls.from_pretrained(path)` in fp32 with SDPA attention, local files only.

    Raises:
        VlaforgeError: the folder is malformed or its weights do not load.
    """
    import torch

    folder = check_pretrained_folder(path, field)
    try:
        return model_cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                         attn_implementation="sdpa")
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise VlaforgeError(f"{field}: cannot load {folder}: {first_line(exc, None)}") from None
