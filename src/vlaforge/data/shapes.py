"""Model shapes a recipe leaves to the dataset: `model.cameras`, `model.state_dim` and `model.action_dim` set to
"auto" (the default with `data.source = "lerobot"`) are read from the dataset's `meta/info.json`, which already
declares its cameras and its state and action sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlaforge.config.loading import deep_merge, to_dict, validate
from vlaforge.config.schema import VLAConfig
from vlaforge.data.lerobot_v3 import read_info
from vlaforge.errors import VlaforgeError

VIDEO_PREFIX = "observation.images."


def dataset_shapes(info: dict[str, Any], where: Path) -> dict[str, Any]:
    """Cameras (in the dataset's order), state and action sizes declared by a LeRobot `meta/info.json`.

    Raises:
        VlaforgeError: a feature is missing or has no size.
    """
    feats = info.get("features") or {}
    cameras = [k.removeprefix(VIDEO_PREFIX) for k, v in feats.items() if v.get("dtype") == "video"]
    if not cameras:
        raise VlaforgeError(f"{where / 'meta/info.json'} declares no video features (cameras); the dataset has no "
                            "images to train on")
    out: dict[str, Any] = {"cameras": cameras}
    for key, name in (("observation.state", "state_dim"), ("action", "action_dim")):
        shape = (feats.get(key) or {}).get("shape")
        if not shape or not isinstance(shape[0], int):
            raise VlaforgeError(f"{where / 'meta/info.json'} declares no size for {key!r}; regenerate the dataset")
        out[name] = shape[0]
    return out


def resolve_shapes(cfg: VLAConfig, required: bool = True) -> tuple[VLAConfig, dict[str, Any]]:
    """`cfg` with its "auto" model shapes taken from the dataset, and what was chosen ({} if nothing was auto).

    Args:
        required: False leaves them "auto" when the dataset folder does not exist (`config show` before
            `data generate`).

    Raises:
        VlaforgeError: the dataset cannot tell (no info.json, no cameras), or the result does not validate.
    """
    m = cfg.model
    auto = [k for k in ("cameras", "state_dim", "action_dim") if getattr(m, k) == "auto"]
    if not auto or cfg.data.source != "lerobot":
        return cfg, {}
    root = Path(cfg.data.path)
    if not required and not (root / "meta" / "info.json").is_file():
        return cfg, {}
    shapes = dataset_shapes(read_info(root), root)
    if m.max_cameras:
        shapes["cameras"] = shapes["cameras"][:m.max_cameras]
    chosen = {k: shapes[k] for k in auto}
    return validate(deep_merge(to_dict(cfg), {"model": chosen})), chosen


def describe(chosen: dict[str, Any], path: str) -> str:
    """One line saying which shapes came from which dataset."""
    parts = ", ".join(f"model.{k} = {v}" for k, v in chosen.items())
    return f"from dataset {path}: {parts}"
