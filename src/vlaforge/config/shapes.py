"""Model shapes a recipe leaves to the dataset: `model.cameras`, `model.state_dim` and `model.action_dim` set to
"auto" (the default with `data.source = "lerobot"`) are read from the dataset's `meta/info.json`, which already
declares its cameras and its state and action sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlaforge.config.loading import deep_merge, to_dict, validate
from vlaforge.config.schema import VLAConfig
from vlaforge.data.lerobot_v3 import read_info
from vlaforge.data.summary import dataset_shapes


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
