"""What a recipe leaves to the dataset (`data.source = "lerobot"`), read from its `meta/info.json`:

- model shapes: `model.cameras`, `model.state_dim` and `model.action_dim` set to "auto" (the default with a
  dataset), which info.json declares;
- loss terms that need a column: the language term trains on a per-frame text column (`data.text_column`, "auto":
  vlaforge's `annotation.phase`, else LeRobot 0.6's `language_persistent.subtask`), the env_state term on
  `observation.environment_state`. A term whose column the dataset lacks is turned off with one line saying why,
  unless it is in `loss.required` (a weight set on the command line is): then the dataset is refused in one line
  when the data is built (docs/lerobot.md)."""

from __future__ import annotations

from typing import Any

from vlaforge.config.loading import deep_merge, to_dict, validate
from vlaforge.config.schema import VLAConfig
from vlaforge.data.hub_dataset import dataset_root
from vlaforge.data.lerobot_features import auto_text_column
from vlaforge.data.lerobot_v3 import read_info
from vlaforge.data.lerobot_writer import ENV_STATE
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
    root = dataset_root(cfg.data, fetch=required)
    if not required and not (root / "meta" / "info.json").is_file():
        return cfg, {}
    shapes = dataset_shapes(read_info(root), root)
    if m.max_cameras:
        shapes["cameras"] = shapes["cameras"][:m.max_cameras]
    chosen = {k: shapes[k] for k in auto}
    return validate(deep_merge(to_dict(cfg), {"model": chosen})), chosen


def resolve_terms(cfg: VLAConfig, required: bool = True) -> tuple[VLAConfig, list[str]]:
    """`cfg` with data.text_column = "auto" resolved and the loss terms whose column the dataset lacks turned off
    (unless `loss.required` names them), and one line per change.

    Args:
        required: False leaves `cfg` as it is when the dataset folder does not exist.
    """
    if cfg.data.source != "lerobot":
        return cfg, []
    root = dataset_root(cfg.data, fetch=required)
    if not required and not (root / "meta" / "info.json").is_file():
        return cfg, []
    feats = read_info(root).get("features") or {}
    weights, d, lines, update = cfg.loss.weights, cfg.data, [], {}
    text = d.text_column
    if text == "auto":
        text = auto_text_column(feats)
        if text is not None:
            update["data"] = {"text_column": text}
            lines.append(f"from dataset {root}: data.text_column = {text!r} (the language target)")
    keep = set(cfg.loss.required)
    off = {}
    if weights.get("language", 0) > 0 and d.max_text_tokens > 0 and text is None and "language" not in keep:
        off["language"] = ("the dataset has no per-frame text (annotation.phase, or LeRobot 0.6's "
                           "language_persistent); name one with data.text_column")
    if weights.get("env_state", 0) > 0 and ENV_STATE not in feats and "env_state" not in keep:
        off["env_state"] = f"the dataset has no {ENV_STATE}"
        update["model"] = {"env_state_dim": 0}
    for term, why in off.items():
        lines.append(f"loss.weights.{term} = {weights[term]:g} -> 0: {why} (a weight set on the command line, or "
                     f"loss.required, makes it required)")
    if off:
        update["loss"] = {"weights": {**weights, **{t: 0.0 for t in off}}}
    if not update:
        return cfg, lines
    return validate(deep_merge(to_dict(cfg), update)), lines


def describe(chosen: dict[str, Any], path: str) -> str:
    """One line saying which shapes came from which dataset."""
    parts = ", ".join(f"model.{k} = {v}" for k, v in chosen.items())
    return f"from dataset {path}: {parts}"
