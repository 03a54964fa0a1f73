"""Every value of a LeRobot policy folder checked before anything is allocated or run: config.json's sizes, step
counts and features (after `model.lerobot.config`'s overrides), the processor steps' options, the normalizers'
statistics. A value out of bounds is refused in one line naming the field, the value and the accepted range, where
it would otherwise be an allocator error of many GB, a prediction that never returns, a tokenizer that aborts the
process or actions that are all NaN. The bounds are generous: LeRobot's own policies sit far below them
(docs/lerobot_policies.md, "What a folder is checked for")."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from vlaforge.config.base import MAX_IMAGE_SIZE, MAX_TOKENS
from vlaforge.data.transforms import MODES
from vlaforge.errors import VlaforgeError

MAX_CHUNK = 4096  # chunk_size, n_action_steps: actions per chunk (LeRobot's policies: 50)
MAX_VECTOR_DIM = 4096  # max_state_dim / max_action_dim and a vector feature's size (LeRobot's policies: 32)
MAX_STEPS = 1000  # num_steps / num_inference_steps: denoising steps per prediction (LeRobot's policies: 10)
MAX_LAYERS = 1024  # num_vlm_layers, num_expert_layers, self_attn_every_n_layers
MAX_CHANNELS = 4  # an image feature's channels (RGB: 3)
MAX_EMPTY_CAMERAS = 64  # empty_cameras: masked image slots, each a whole image's tokens (LeRobot's LIBERO pi0.5: 1)
FEATURE_TYPES = ("STATE", "VISUAL", "ENV", "ACTION", "REWARD", "LANGUAGE")
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# a processor option -> the JSON types it may hold (LeRobot writes these; another type fails deep in a step)
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "rename_map": (dict,), "features": (dict,), "norm_map": (dict,), "eps": (int, float),
    "normalize_observation_keys": (list, type(None)), "max_length": (int,), "task_key": (str,),
    "padding_side": (str,), "truncation": (bool, str), "tokenizer_name": (str, type(None)), "device": (str,),
    "float_dtype": (str, type(None)), "enabled": (bool,), "exclude_joints": (list, type(None)),
    "action_names": (list, type(None)), "padding": (str, bool)}


@dataclass(frozen=True)
class Bound:
    """A config.json number and its accepted range (inclusive; `above` excludes `low` itself)."""

    field: str
    low: float
    high: float
    what: str  # what the number is, said in the refusal
    number: bool = False  # a real number (else an integer)
    required: bool = True
    above: bool = False

    def range(self) -> str:
        kind = "a number" if self.number else "an integer"
        return f"{kind} {'above' if self.above else 'from'} {self.low:g} {'and at most' if self.above else 'to'} " \
               f"{self.high:g}"


# every family's config.json; a family's row (families.py) adds its own
COMMON_BOUNDS = (
    Bound("chunk_size", 1, MAX_CHUNK, "actions predicted per chunk"),
    Bound("n_action_steps", 1, MAX_CHUNK, "actions executed per chunk", required=False),
    Bound("max_state_dim", 1, MAX_VECTOR_DIM, "the size the state is zero-padded to"),
    Bound("max_action_dim", 1, MAX_VECTOR_DIM, "the size actions are zero-padded to"),
    Bound("tokenizer_max_length", 1, MAX_TOKENS, "instruction tokens", required=False),
    Bound("empty_cameras", 0, MAX_EMPTY_CAMERAS, "image slots of no camera, masked out", required=False),
    Bound("min_period", 0, 1e6, "the time embedding's shortest period", number=True, above=True),
    Bound("max_period", 0, 1e6, "the time embedding's longest period", number=True, above=True),
)


def shown(value: Any, limit: int = 60) -> str:
    """A JSON value as a refusal quotes it (cut at `limit` characters)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def in_range(value: Any, bound: Bound, where: str, source: str, fix: str = "set it within that range"
             ) -> int | float:
    """`value` of `bound.field` (named as `source` says) as a number in its range; `fix`: the message's end.

    Raises:
        VlaforgeError: not a number of the kind, not finite, or out of the range.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (bound.number or isinstance(value, int))
    if ok and math.isfinite(value) and (value > bound.low if bound.above else value >= bound.low) \
            and value <= bound.high:
        return value
    raise VlaforgeError(f"{where}: {source} = {shown(value)} is not {bound.range()} ({bound.what}); {fix}")


def json_file(path: Path, what: str | None = None) -> Any:
    """The parsed JSON of `path`; one line naming the file (after `what`, the setting), line and column where it
    does not parse.

    Raises:
        VlaforgeError: unreadable, not UTF-8 or not JSON.
    """
    what = f"{what}: " if what else ""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise VlaforgeError(f"{what}{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}; "
                            "fix that line or copy the file again from where the folder came from") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise VlaforgeError(f"{what}{path} cannot be read as UTF-8 JSON ({str(exc)[:120]}); copy the file again "
                            "from where the folder came from") from None


def pickles_in(folder: Path) -> list[str]:
    """The pickled weight files of a folder (pytorch_model.bin, *.pt, *.pth, *.ckpt, *.pkl), by name."""
    return sorted({p.name for pattern in PICKLES for p in folder.glob(pattern) if p.is_file()})


def refuse_pickles(folder: Path, what: str, weights: str) -> None:
    """One line saying that vlaforge never unpickles and how to convert, where `folder` holds pickles only.

    Raises:
        VlaforgeError: the folder holds a pickled weight file and no `weights`.
    """
    found = pickles_in(folder)
    if found and not (folder / weights).is_file():
        raise VlaforgeError(f"{what}: {folder} holds its weights only as a pickle ({', '.join(found[:3])}), which "
                            "vlaforge never unpickles (loading one can run any code it holds); convert it where you "
                            "trust the file: torch.load it (weights_only=True) and write the state dict with "
                            f"safetensors.torch.save_file as {weights}, or load the policy with LeRobot and "
                            "save_pretrained it")


def check_policy_config(cfg: dict, bounds: tuple[Bound, ...], where: str, overridden: frozenset = frozenset()
                        ) -> None:
    """config.json's numbers in their ranges (`COMMON_BOUNDS` and the family's `bounds`), n_action_steps within
    chunk_size, min_period <= max_period, its features and normalization mapping well formed.

    Args:
        where: the message's start (the setting and the file); `overridden`: fields `model.lerobot.config` set.
    Raises:
        VlaforgeError: the first value out of its range or of the wrong form.
    """
    source = lambda f: f"model.lerobot.config.{f}" if f in overridden else f"config.json's {f}"
    for bound in (*COMMON_BOUNDS, *bounds):
        if bound.field in cfg or bound.required:
            in_range(cfg.get(bound.field), bound, where, source(bound.field), f"set it within that range (in "
                     f"config.json, or for a run with model.lerobot.config.{bound.field})")
    steps, chunk = cfg.get("n_action_steps"), cfg["chunk_size"]
    if steps is not None and steps > chunk:
        raise VlaforgeError(f"{where}: {source('n_action_steps')} = {steps} is over chunk_size = {chunk} (a chunk "
                            "cannot execute more actions than it predicts; LeRobot refuses it too); set "
                            f"n_action_steps to at most {chunk}")
    if cfg["min_period"] > cfg["max_period"]:
        raise VlaforgeError(f"{where}: min_period = {cfg['min_period']:g} is over max_period = "
                            f"{cfg['max_period']:g}; the time embedding's periods run from the first to the second")
    _check_features(cfg, where)
    _check_empty_cameras(cfg, where, source("empty_cameras"))
    mapping = cfg.get("normalization_mapping")
    if mapping is not None and not (isinstance(mapping, dict) and all(
            k in FEATURE_TYPES and v in MODES for k, v in mapping.items())):
        raise VlaforgeError(f"{where}: config.json's normalization_mapping = {shown(mapping)} is not a mapping of "
                            f"feature types ({', '.join(FEATURE_TYPES)}) to modes ({', '.join(MODES)})")


def image_pair(cfg: dict, field: str, where: str) -> None:
    """A (width, height) or (height, width) pair of config.json (`resize_imgs_with_padding`, `image_resolution`),
    when given: two integers from 1 to MAX_IMAGE_SIZE.

    Raises:
        VlaforgeError: another form, or a side out of range.
    """
    value = cfg.get(field)
    if value is None:
        return
    if not (isinstance(value, list | tuple) and len(value) == 2):
        raise VlaforgeError(f"{where}: config.json's {field} = {shown(value)} is not a pair of pixel sizes; give "
                            "two integers, e.g. [224, 224]")
    for side in value:
        in_range(side, Bound(field, 1, MAX_IMAGE_SIZE, "pixels per side"), where, f"config.json's {field}")


def _feature_shape(key: str, feature: Any, where: str, origin: str) -> tuple[str, list[int]]:
    """(type, shape) of one feature entry, each dim an integer from 1 to the kind's bound."""
    if not (isinstance(feature, dict) and feature.get("type") in FEATURE_TYPES
            and isinstance(feature.get("shape"), list | tuple) and feature["shape"]):
        raise VlaforgeError(f"{where}: {origin} {key!r} = {shown(feature)} is not a feature: give "
                            f"{{\"type\": one of {', '.join(FEATURE_TYPES)}, \"shape\": [sizes]}}")
    kind, shape = feature["type"], list(feature["shape"])
    visual = kind == "VISUAL"
    if visual and len(shape) != 3:
        raise VlaforgeError(f"{where}: {origin} {key!r} has shape {shown(shape)}; an image feature is (channels, "
                            "height, width)")
    highs = (MAX_CHANNELS, MAX_IMAGE_SIZE, MAX_IMAGE_SIZE) if visual else (MAX_VECTOR_DIM,) * len(shape)
    for dim, high in zip(shape, highs, strict=True):
        in_range(dim, Bound("shape", 1, high, f"a size of {key}"), where, f"{origin} {key!r}'s shape entry")
    return kind, shape


def _check_features(cfg: dict, where: str) -> None:
    """input_features / output_features: well-formed entries; the state and action no larger than their pads."""
    for side in ("input_features", "output_features"):
        features = cfg.get(side)
        if not isinstance(features, dict):
            raise VlaforgeError(f"{where}: config.json's {side} = {shown(features)} is not a mapping of features; "
                                "give a folder LeRobot's save_pretrained wrote")
        for key, feature in features.items():
            _, shape = _feature_shape(key, feature, where, f"config.json's {side}")
            pad = {"observation.state": "max_state_dim", "action": "max_action_dim"}.get(key)
            if pad and (len(shape) != 1 or shape[0] > cfg[pad]):
                raise VlaforgeError(f"{where}: config.json's {key} has shape {shown(shape)}, over {pad} = "
                                    f"{cfg[pad]}; the policy zero-pads it to {pad} and cannot take more: raise "
                                    f"{pad} (model.lerobot.config.{pad}) or give a smaller {key}")


def _check_empty_cameras(cfg: dict, where: str, source: str) -> None:
    """Every `observation.images.empty_camera_{i}` feature within the `empty_cameras` LeRobot added it for: one past
    them would be read as a real camera that no batch holds (LeRobot's pi0 fills any missing camera, its SmolVLA only
    `empty_cameras` of them).

    Raises:
        VlaforgeError: such a feature with i >= empty_cameras."""
    count = int(cfg.get("empty_cameras") or 0)
    for key in cfg["input_features"]:
        found = re.fullmatch(r"observation\.images\.empty_camera_(\d+)", key)
        if found and int(found.group(1)) >= count:
            raise VlaforgeError(f"{where}: config.json's input_features names {key}, an image LeRobot adds for "
                                f"empty_cameras above {found.group(1)}, and {source} = {count}; set empty_cameras to "
                                f"at least {int(found.group(1)) + 1} (model.lerobot.config.empty_cameras) or remove "
                                "the feature")


# ---- processor pipelines ------------------------------------------------------------------------------------------
def check_options(where: str, options: dict[str, Any]) -> None:
    """A processor step's options of the JSON types LeRobot writes (`OPTION_TYPES`).

    Raises:
        VlaforgeError: the first option of another type.
    """
    for key, value in options.items():
        kinds = OPTION_TYPES.get(key)
        if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise VlaforgeError(f"{where}: option {key!r} = {shown(value)} is not a {names}; re-save the pipeline "
                                "with LeRobot's save_pretrained")


def check_state_file(where: str, name: Any) -> None:
    """A step's state file names a file inside the folder (a relative path without '..'), as LeRobot writes it.

    Raises:
        VlaforgeError: another name.
    """
    path = PurePosixPath(str(name).replace("\\", "/"))
    if not isinstance(name, str) or not name or path.is_absolute() or ".." in path.parts or ":" in name:
        raise VlaforgeError(f"{where} names state file {shown(name)}, which is not a file inside the folder; LeRobot "
                            "writes it beside the JSON: name it so, or re-save the pipeline")


def tokenizer_length(where: str, value: Any) -> int:
    """The tokenizer step's max_length, from 1 to MAX_TOKENS.

    Raises:
        VlaforgeError: out of that range. NOTE: with padding = "max_length" every instruction is padded to it, and
            the tokenizer library aborts the process (it does not raise) for a length near 1e9.
    """
    return int(in_range(value, Bound("max_length", 1, MAX_TOKENS, "tokens per instruction"), where,
                        "option 'max_length'", "set it within that range (LeRobot's policies use 48 to 200)"))


def normalizer_eps(where: str, value: Any) -> float:
    """A normalizer's eps, above 0 and at most 1: it is added to std and stands in for a zero range, so 0 or NaN
    would make NaN or infinite values.

    Raises:
        VlaforgeError: out of that range.
    """
    return float(in_range(value, Bound("eps", 0, 1, "what a zero range divides by", number=True, above=True),
                          where, "option 'eps'", "LeRobot writes 1e-8: re-save the pipeline"))


def feature_shapes(where: str, features: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A normalizer's `features` option as key -> (type, shape), each checked (`_feature_shape`)."""
    return {k: (t, tuple(s)) for k, (t, s) in ((k, _feature_shape(k, f, where, "feature")) for k, f in
                                               features.items())}


def check_statistics(where: str, key: str, stats: dict[str, torch.Tensor], names: tuple[str, ...],
                     shape: tuple[int, ...] | None) -> None:
    """The statistics a mode reads (`names`) of feature `key`: finite, and of `shape` (the feature's, from the
    normalizer's `features`) or broadcast to it (an image's per-channel (C, 1, 1)).

    Raises:
        VlaforgeError: a NaN or infinite entry, or another shape.
    """
    for name in names:
        value = stats[name]
        if shape is not None and (value.ndim > len(shape) or _broadcast(value.shape, shape) != shape):
            raise VlaforgeError(f"{where}: feature {key!r}'s {name} has shape {tuple(value.shape)} and the feature "
                                f"{shape}; the statistics belong to another dataset or policy: re-save the pipeline "
                                "with this feature's statistics")
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            raise VlaforgeError(f"{where}: feature {key!r}'s {name} holds {int(bad.sum())} NaN or infinite values of "
                                f"{value.numel()}; every normalized value would be NaN: recompute the dataset "
                                "statistics and re-save the pipeline")


def _broadcast(a: torch.Size, b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None
