"""LeRobot 0.6.1's policy processor pipelines, read natively: `policy_preprocessor.json` / `policy_postprocessor.json`
and the `<pipeline>_step_<i>_<registry_name>.safetensors` state files they name, run in the JSON's step order with
LeRobot's arithmetic (a step or behaviour-changing option vlaforge lacks is refused in one line at load, never
skipped). The image / vector helpers the policies apply inside the model are in `images.py`."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vlaforge.data.tokenizer import state_prompt
from vlaforge.data.transforms import MODE_STATS, MODES, normalize
from vlaforge.errors import VlaforgeError, first_line
from vlaforge.models.policies import checks
from vlaforge.models.policies.checks import FEATURE_TYPES, feature_shapes, json_file

PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"
ACTION = "action"
OBS_STATE, OBS_ENV_STATE = "observation.state", "observation.environment_state"
OBS_IMAGE, OBS_IMAGES = "observation.image", "observation.images"
LANG_TOKENS, LANG_MASK = "observation.language.tokens", "observation.language.attention_mask"
# Raw keys carried beside `observation.*` and `action` (and every `*_is_pad`), LeRobot's complementary data; NOTE:
# its chat fields (messages, language_events...) are left out, as other keys are: SmolVLA and pi0 never read them.
COMPLEMENTARY_KEYS = ("task", "index", "task_index", "episode_index", "timestamp")
FLOAT_DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
                "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64}
TOKENIZER_SETTING = "model.lerobot.tokenizer"


class DegenerateStatsWarning(UserWarning):
    """A normalized feature's range is zero in some dims (std 0, max == min, q99 == q01): LeRobot divides by eps."""


def _observed(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k.startswith("observation.")}


@dataclass
class _Normalizer:
    inverse: bool
    features: dict[str, tuple[str, tuple[int, ...]]]  # key -> (feature type, shape)
    norm_map: dict[str, str]  # feature type -> mode
    stats: dict[str, dict[str, Tensor]]  # key -> statistic -> float32 tensor
    eps: float
    keys: set[str] | None  # normalize_observation_keys

    def __call__(self, b: dict[str, Any]) -> dict[str, Any]:
        b, observed = dict(b), _observed(b)
        for key, (ftype, _) in self.features.items():
            if (self.keys is None or key in self.keys) and ftype != "ACTION" and key in observed:
                b[key] = self._apply(torch.as_tensor(b[key]), key, ftype)
        if b.get(ACTION) is not None:  # always under the key "action", whatever `features` lists (as LeRobot)
            b[ACTION] = self._apply(b[ACTION], ACTION, "ACTION")
        return b

    def _apply(self, x: Tensor, key: str, ftype: str) -> Tensor:
        mode = self.norm_map.get(ftype, "IDENTITY")
        return x if key not in self.stats else normalize(x, self.stats[key], mode, self.eps, inverse=self.inverse)


def _rename(renames: dict[str, str]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """`rename_observations_processor`: observation keys renamed in place (their order kept)."""
    return lambda b: {renames.get(k, k) if k.startswith("observation.") else k: v for k, v in b.items()}


def _unbatched(key: str, value: Any) -> bool:
    """Whether `to_batch_processor` adds a batch dim: a 1-D action or (environment) state, a 3-D image."""
    image = key == OBS_IMAGE or key.startswith(OBS_IMAGES + ".")
    one_d = key in (ACTION, OBS_STATE, OBS_ENV_STATE)
    return isinstance(value, Tensor) and value.dim() == (1 if one_d else 3 if image else -1)


def _add_batch_dim(b: dict[str, Any]) -> dict[str, Any]:
    """LeRobot's `to_batch_processor`: a 1-D action, 1-D state and 3-D images gain a leading batch dim, a str task
    becomes [task], a 0-D index / task_index gains one."""
    b = {k: v.unsqueeze(0) if _unbatched(k, v) else v for k, v in b.items()}
    if isinstance(b.get("task"), str):
        b["task"] = [b["task"]]
    for key in ("index", "task_index"):
        if isinstance(b.get(key), Tensor) and b[key].dim() == 0:
            b[key] = b[key].unsqueeze(0)
    return b


def _new_line(b: dict[str, Any]) -> dict[str, Any]:
    """`smolvla_new_line_processor` / `pi0_new_line_processor`: the task (str or list of str) ends with a newline."""
    task = b.get("task")
    if isinstance(task, str) and not task.endswith("\n"):
        return {**b, "task": task + "\n"}
    if isinstance(task, list) and all(isinstance(x, str) for x in task):
        return {**b, "task": [x if x.endswith("\n") else x + "\n" for x in task]}
    return b


@dataclass
class _StatePrompt:
    r"""`pi05_prepare_state_tokenizer_processor_step`: each task becomes "Task: {task}, State: {bins};\nAction: ", the
    task stripped, '_' and newlines made spaces, the (already normalized) state row's bins joined by spaces
    (`data.tokenizer.state_prompt`, which vlaforge's data pipeline writes too)."""
    task_key: str

    def __call__(self, b: dict[str, Any]) -> dict[str, Any]:
        state, tasks, name = b.get(OBS_STATE), b.get(self.task_key), "pi05_prepare_state_tokenizer_processor_step"
        if not isinstance(state, Tensor) or state.ndim != 2:
            got = f"shape {tuple(state.shape)}" if isinstance(state, Tensor) else type(state).__name__
            raise VlaforgeError(f"the pre-processor's {name} reads a (B, state_dim) {OBS_STATE} and got {got}; pass "
                                "the robot state there, normalized by the steps before it (pi0.5 prompts with it)")
        if not (isinstance(tasks, list | tuple) and all(isinstance(x, str) for x in tasks)
                and len(tasks) == state.shape[0]):
            got = type(tasks).__name__ + (f" of {len(tasks)}" if isinstance(tasks, list | tuple) else "")
            raise VlaforgeError(f"the pre-processor's {name} reads raw[{self.task_key!r}], one str per state row "
                                f"({state.shape[0]}), and got {got}; pass the task instruction there")
        return {**b, self.task_key: [state_prompt(t, r) for t, r in zip(tasks, state, strict=True)]}


@dataclass
class _Tokenize:
    tokenizer: Any
    max_length: int
    task_key: str
    padding_side: str
    padding: str | bool
    truncation: bool | str

    def __call__(self, b: dict[str, Any]) -> dict[str, Any]:
        task = [b[self.task_key]] if isinstance(b.get(self.task_key), str) else b.get(self.task_key)
        if not (isinstance(task, list | tuple) and all(isinstance(x, str) for x in task)):
            raise VlaforgeError(f"the pre-processor's tokenizer step reads raw[{self.task_key!r}], a str or a list of "
                                f"str, and got {type(task).__name__}; pass the task instruction there")
        enc = self.tokenizer(list(task), max_length=self.max_length, truncation=self.truncation,
                             padding=self.padding, padding_side=self.padding_side, return_tensors="pt")
        tensors = [*_observed(b).values(), b.get(ACTION)]
        device = next((v.device for v in tensors if isinstance(v, Tensor)), torch.device("cpu"))
        return {**b, LANG_TOKENS: enc["input_ids"].to(device),  # (B, L) int64; mask (B, L) bool, True on tokens
                LANG_MASK: enc["attention_mask"].to(device).to(dtype=torch.bool)}


@dataclass
class _ToDevice:
    device: torch.device
    dtype: torch.dtype | None

    def _move(self, v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        # NOTE: a tensor already on some GPU stays there when the target is a GPU (LeRobot's multi-GPU rule)
        target = v.device if (v.is_cuda and self.device.type == "cuda") else self.device
        v = v.to(target, non_blocking=target.type == "cuda")  # the same tensor where it already is
        return v.to(dtype=self.dtype) if self.dtype is not None and v.is_floating_point() else v

    def __call__(self, b: dict[str, Any]) -> dict[str, Any]:
        return {k: self._move(v) for k, v in b.items()}


def _shift(actions: Tensor, state: Tensor, mask: list[bool], sign: int) -> Tensor:
    """actions[..., :len(mask)] -/+= state[..., :len(mask)] * mask, broadcast over time for (B, T, A) actions."""
    mask_t = torch.tensor(mask, dtype=actions.dtype, device=actions.device)
    dims = mask_t.shape[0]
    offset = state.to(device=actions.device, dtype=actions.dtype)[..., :dims] * mask_t  # (B, dims)
    if actions.ndim == 3:
        offset = offset.unsqueeze(-2)  # (B, 1, dims)
    actions = actions.clone()
    actions[..., :dims] += sign * offset  # NOTE: negation is exact: a + (-b) is a - b bit for bit
    return actions


@dataclass
class _Relative:
    """`relative_actions_processor`: caches the state it sees (always), and when enabled makes the action relative."""
    enabled: bool
    exclude_joints: list[str]
    action_names: list[str] | None
    last_state: Tensor | None = None

    def mask(self, action_dim: int) -> list[bool]:
        tokens = [str(n).lower() for n in self.exclude_joints if n]
        if not tokens or self.action_names is None:
            return [True] * action_dim
        mask = [not any(tok in str(name).lower() for tok in tokens) for name in self.action_names[:action_dim]]
        return mask + [True] * (action_dim - len(mask))

    def __call__(self, b: dict[str, Any]) -> dict[str, Any]:
        state, action = b.get(OBS_STATE), b.get(ACTION)
        if state is not None:
            self.last_state = state
        if self.enabled and action is not None and state is not None:
            b = {**b, ACTION: _shift(action, state, self.mask(action.shape[-1]), -1)}
        return b


@dataclass
class _Absolute:
    enabled: bool
    relative: _Relative | None

    def __call__(self, b: dict[str, Any]) -> dict[str, Any]:
        if not self.enabled or b.get(ACTION) is None:
            return b
        if self.relative.last_state is None:
            raise VlaforgeError("the post-processor's absolute_actions_processor adds the state the pre-processor "
                                "last saw, and it has seen none; run the pre-processor on an observation first")
        action = b[ACTION]
        return {**b, ACTION: _shift(action, self.relative.last_state, self.relative.mask(action.shape[-1]), +1)}


class _Pipeline:
    def __init__(self, steps: list[tuple[str, Callable]]):
        self.steps = steps
        self.step_names = [name for name, _ in steps]
        norm = next((s for _, s in steps if isinstance(s, _Normalizer)), None)
        self.features: dict[str, tuple[str, tuple[int, ...]]] = dict(norm.features) if norm else {}
        self.stats: dict[str, dict[str, Tensor]] = norm.stats if norm else {}

    def _run(self, b: dict[str, Any]) -> dict[str, Any]:
        for _, step in self.steps:
            b = step(b)
        return b


class Preprocessor(_Pipeline):
    """A loaded `policy_preprocessor.json`: raw LeRobot batch dict in, the policy's input dict out. `.features` and
    `.stats` are its normalizer's (key -> (type, shape); key -> statistic -> tensor)."""

    def __init__(self, steps: list[tuple[str, Callable]]):
        super().__init__(steps)
        tok = next((s for _, s in steps if isinstance(s, _Tokenize)), None)
        self.tokenizer = tok.tokenizer if tok else None
        self.max_length: int | None = tok.max_length if tok else None

    def __call__(self, raw: dict[str, Any]) -> dict[str, Tensor | list]:
        """Run the steps in the JSON's order over `raw` (LeRobot's keys: `observation.*`, optional `action`, `task`
        and the other complementary keys; others are dropped, as LeRobot drops them); `raw` is left unchanged."""
        if not _observed(raw):
            raise VlaforgeError(f"the pre-processor got no observation.* key (got {sorted(raw)}); pass "
                                "observation.images.<camera> and observation.state as LeRobot names them")
        if raw.get(ACTION) is not None and not isinstance(raw[ACTION], Tensor):
            raise TypeError(f"raw['action'] must be a tensor, got {type(raw[ACTION]).__name__}")
        keep = lambda k: k.startswith("observation.") or k in COMPLEMENTARY_KEYS or "_is_pad" in k
        return self._run({k: v for k, v in raw.items() if keep(k) or (k == ACTION and v is not None)})


class Postprocessor(_Pipeline):
    """A loaded `policy_postprocessor.json`: the policy's action chunk in, the robot's action out."""

    def __call__(self, action: Tensor) -> Tensor:
        if not isinstance(action, Tensor):
            raise TypeError(f"the post-processor takes an action tensor, got {type(action).__name__}")
        return self._run({ACTION: action})[ACTION]


@dataclass
class _Load:
    """What building one pipeline's steps needs: where it is (for messages) and what the caller chose."""
    folder: Path
    file: Path
    tokenizer_override: str | None
    device: torch.device | None
    warned: set[tuple[str, str]]
    relative: _Relative | None = None
    where: str = ""  # "<file>: step <i> (<name>)", set per step


def _read_state(ld: _Load, filename: str) -> dict[str, dict[str, Tensor]]:
    """A normalizer's state file, flat `<feature>.<stat>` tensors, as {feature: {stat: float32 tensor}}."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path, stats = ld.folder / filename, {}
    try:
        for name, tensor in load_file(path).items():
            if "." not in name:
                raise ValueError(f"it holds {name!r}, not a '<feature>.<stat>' tensor")
            key, stat = name.rsplit(".", 1)
            stats.setdefault(key, {})[stat] = tensor.to(torch.float32)
    except (SafetensorError, OSError, ValueError) as exc:
        raise VlaforgeError(f"{ld.where}: cannot read its state file {path} ({first_line(exc, 120)}); restore it from "
                            "the checkpoint or re-save the pipeline with LeRobot's save_pretrained") from None
    return stats


def _check_stats(ld: _Load, key: str, mode: str, stats: dict[str, Tensor], eps: float,
                 shape: tuple[int, ...] | None) -> None:
    """Refuse a mode whose statistics are missing, not finite or not of the feature's `shape`; warn (once per feature
    and statistic) where their range is 0."""
    low, high = MODE_STATS[mode]
    missing = [s for s in (low, high) if s not in stats]
    if missing:
        raise VlaforgeError(f"{ld.where}: feature {key!r} is normalized with {mode} but its stats lack "
                            f"{', '.join(missing)} (it has {', '.join(sorted(stats)) or 'none'}); re-save the "
                            "pipeline with dataset stats that hold them")
    checks.check_statistics(ld.where, key, stats, (low, high), shape)
    flat = stats[high] == 0 if mode == "MEAN_STD" else stats[high] == stats[low]
    what = f"{high} == 0" if mode == "MEAN_STD" else f"{high} == {low}"
    if bool(flat.any()) and (key, what) not in ld.warned:
        ld.warned.add((key, what))
        warnings.warn(f"{ld.file}: feature {key!r} has {what} in {int(flat.sum())} of {flat.numel()} entries: {mode} "
                      f"divides by eps = {eps:g} there (as LeRobot does), so any value off {low} normalizes far "
                      "outside [-1, 1]; check the dataset statistics", DegenerateStatsWarning, stacklevel=2)


def _build_normalizer(ld: _Load, opts: dict[str, Any], entry: dict[str, Any], inverse: bool) -> _Normalizer:
    features = feature_shapes(ld.where, opts["features"] or {})
    norm_map = dict(opts["norm_map"] or {})
    bad = [t for t, _ in features.values() if t not in FEATURE_TYPES] + [
        f"{k}: {v}" for k, v in norm_map.items() if k not in FEATURE_TYPES or v not in MODES]
    if bad:
        raise VlaforgeError(f"{ld.where}: feature type or norm_map entry {bad[0]!r} is not supported; feature types: "
                            f"{', '.join(FEATURE_TYPES)}; modes: {', '.join(MODES)}")
    stats = _read_state(ld, entry["state_file"]) if "state_file" in entry else {}
    for key, (ftype, _) in features.items():  # (C,) image stats broadcast over (C, H, W) as (C, 1, 1)
        if ftype == "VISUAL" and key in stats:
            stats[key] = {s: v.reshape(-1, 1, 1) if v.ndim == 1 else v for s, v in stats[key].items()}
    eps = checks.normalizer_eps(ld.where, opts["eps"])
    used = {k: t for k, (t, _) in features.items() if t != "ACTION"} | {ACTION: "ACTION"}
    for key, ftype in used.items():
        mode = norm_map.get(ftype, "IDENTITY")
        if mode != "IDENTITY" and key in stats:
            _check_stats(ld, key, mode, stats[key], eps, features[key][1] if key in features else None)
    keys = opts["normalize_observation_keys"]
    return _Normalizer(inverse, features, norm_map, stats, eps, set(keys) if keys is not None else None)


def _build_tokenizer(ld: _Load, opts: dict[str, Any], entry: dict[str, Any]) -> _Tokenize:
    name = ld.tokenizer_override or opts["tokenizer_name"]
    if name is None:
        raise VlaforgeError(f"{ld.where}: the step names no tokenizer_name; set {TOKENIZER_SETTING} to the policy's "
                            "tokenizer folder")
    from vlaforge import hub

    # a Hub id (pi0's google/paligemma-3b-pt-224) resolves through the Hugging Face cache: tokenizer files only
    field = TOKENIZER_SETTING if ld.tokenizer_override else f"{ld.where}: its tokenizer_name"
    name = hub.local_folder(name, field, hub.TOKENIZER, instead="" if ld.tokenizer_override else
                            f", or set {TOKENIZER_SETTING} to a local copy")
    if not name.is_dir():
        raise VlaforgeError(f"{field} {str(name)!r} is a file, not a tokenizer folder; give the folder or its Hub "
                            "id")
    checks.tokenizer_length(ld.where, opts["max_length"])
    if opts["padding"] not in ("max_length", "longest", "do_not_pad", True, False) or (
            opts["padding_side"] not in ("left", "right")):
        raise VlaforgeError(f"{ld.where}: padding {opts['padding']!r} / padding_side {opts['padding_side']!r} is not "
                            "supported; padding: max_length, longest, do_not_pad, true, false; side: left, right")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... for a bad folder
        raise VlaforgeError(f"{ld.where}: the tokenizer folder {name} does not load ({first_line(exc, 120)}); point "
                            f"{TOKENIZER_SETTING} at a folder holding the policy's tokenizer files") from None
    return _Tokenize(tokenizer, *(opts[k] for k in ("max_length", "task_key", "padding_side", "padding", "truncation")))


def _build_device(ld: _Load, opts: dict[str, Any], entry: dict[str, Any]) -> _ToDevice:
    if opts["float_dtype"] is not None and opts["float_dtype"] not in FLOAT_DTYPES:
        raise VlaforgeError(f"{ld.where}: float_dtype {opts['float_dtype']!r} is not supported; supported: "
                            f"{', '.join(FLOAT_DTYPES)} or null")
    try:
        device = ld.device or torch.device(opts["device"])
    except RuntimeError:
        raise VlaforgeError(f"{ld.where}: device {opts['device']!r} is not a torch device; give cpu, cuda, cuda:N "
                            "or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")  # NOTE: moving is all this step does; values are the same on the CPU
    return _ToDevice(device, FLOAT_DTYPES.get(opts["float_dtype"]))


def _build_absolute(ld: _Load, opts: dict[str, Any], entry: dict[str, Any]) -> _Absolute:
    if opts["enabled"] and ld.relative is None:
        raise VlaforgeError(f"{ld.where}: the step is enabled but {PREPROCESSOR_FILE} has no "
                            "relative_actions_processor whose state it adds back; re-save the pipeline pair together")
    return _Absolute(bool(opts["enabled"]), ld.relative)


_ANY = object()  # an inert option accepted with any value
_NORM_OPTIONS = {"features": {}, "norm_map": {}, "eps": 1e-8, "normalize_observation_keys": None}
# NOTE: the normalizer's `device` / `dtype` only place the statistics, which follow the input tensor at every call
_NORM_INERT = {"stats": (None, {}), "device": _ANY, "dtype": (None,)}


# registry name -> (its options with LeRobot's defaults, known options accepted only with a no-op value, builder)
STEPS: dict[str, tuple[dict[str, Any], dict[str, Any], Callable[[_Load, dict, dict], Callable]]] = {
    "rename_observations_processor": ({"rename_map": {}}, {}, lambda ld, o, e: _rename(dict(o["rename_map"]))),
    "to_batch_processor": ({}, {}, lambda ld, o, e: _add_batch_dim),
    "smolvla_new_line_processor": ({}, {}, lambda ld, o, e: _new_line),
    "pi0_new_line_processor": ({}, {}, lambda ld, o, e: _new_line),
    # NOTE: LeRobot 0.6.1 saves this step's config as {} and never reads max_state_dim: any value is inert
    "pi05_prepare_state_tokenizer_processor_step": ({"task_key": "task"}, {"max_state_dim": _ANY},
                                                    lambda ld, o, e: _StatePrompt(o["task_key"])),
    "tokenizer_processor": ({"tokenizer_name": None, "max_length": 512, "task_key": "task", "padding_side": "right",
                             "padding": "max_length", "truncation": True}, {"tokenizer": (None,)}, _build_tokenizer),
    "device_processor": ({"device": "cpu", "float_dtype": None}, {}, _build_device),
    "normalizer_processor": (_NORM_OPTIONS, _NORM_INERT, lambda ld, o, e: _build_normalizer(ld, o, e, False)),
    "unnormalizer_processor": (_NORM_OPTIONS, _NORM_INERT, lambda ld, o, e: _build_normalizer(ld, o, e, True)),
    "relative_actions_processor": ({"enabled": False, "exclude_joints": [], "action_names": None}, {},
                                   lambda ld, o, e: _Relative(bool(o["enabled"]), list(o["exclude_joints"] or []),
                                                              o["action_names"])),
    "absolute_actions_processor": ({"enabled": False}, {"relative_step": (None,)}, _build_absolute),
}


def _read_pipeline(ld: _Load) -> list[dict[str, Any]]:
    """The JSON's step entries, refused in one line when the file is missing or is not a processor pipeline."""
    if not ld.file.is_file():
        raise VlaforgeError(f"{ld.file} not found: point at the folder LeRobot's save_pretrained wrote (it holds "
                            f"{PREPROCESSOR_FILE} and {POSTPROCESSOR_FILE}), or migrate an older checkpoint with "
                            "LeRobot's migrate_policy_normalization.py")
    data = json_file(ld.file)
    try:
        steps = data["steps"]
        if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
            raise ValueError("its 'steps' is not a list of objects")
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "no 'steps'" if isinstance(exc, KeyError) else first_line(exc, 120)
        raise VlaforgeError(f"{ld.file} is not a LeRobot processor pipeline ({why}); restore it "
                            "from the checkpoint or re-save it with LeRobot's save_pretrained") from None
    return steps


def _build_step(ld: _Load, index: int, entry: dict[str, Any]) -> tuple[str, Callable]:
    name = str(entry.get("registry_name") or entry.get("class") or "<unnamed>")
    ld.where = f"{ld.file}: step {index} ({name})"
    if name not in STEPS:
        raise VlaforgeError(f"{ld.where} is not a step vlaforge runs; supported steps: {', '.join(STEPS)} (run this "
                            "policy with LeRobot, or re-save its pipeline without the step)")
    options, inert, build = STEPS[name]
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise VlaforgeError(f"{ld.where}: its config is a JSON {type(config).__name__}, not an object; re-save the "
                            "pipeline with LeRobot's save_pretrained")
    for key, value in config.items():
        accepted = inert.get(key)
        if key not in options and not (accepted is _ANY or (accepted is not None and value in accepted)):
            raise VlaforgeError(f"{ld.where} sets option {key!r} = {json.dumps(value)[:60]}, which vlaforge does not "
                                f"implement; supported options of {name}: {', '.join(options) or 'none'} (run "
                                "this policy with LeRobot, or re-save the pipeline without the option)")
    checks.check_options(ld.where, {k: v for k, v in config.items() if k in options})  # (inert ones are never read)
    state = entry.get("state_file")
    if state is not None:
        checks.check_state_file(ld.where, state)
    if state is not None and not (ld.folder / state).is_file():
        raise VlaforgeError(f"{ld.where} names state file {state}, which is not in {ld.folder}; copy it from the "
                            "checkpoint it came from (LeRobot writes it beside the JSON) or re-save the pipeline")
    step = build(ld, {**options, **config}, entry)
    if isinstance(step, _Relative):
        ld.relative = step  # the post-processor's absolute_actions_processor adds back the state it caches
    return name, step


def load_pipelines(folder: Path, tokenizer_override: str | None = None, *,
                   device: str | torch.device | None = None) -> tuple[Preprocessor, Postprocessor]:
    """The pre- and post-processor of a LeRobot 0.6.1 policy folder (its two processor JSONs and their state files),
    steps in the JSONs' order.

    Args:
        tokenizer_override: a local tokenizer folder (`model.lerobot.tokenizer`) used instead of the tokenizer
            step's `tokenizer_name`; needed when that name is a Hub name.
        device: where the pre-processor's device steps move tensors (LeRobot's eval overrides them with the policy's
            device); None keeps each step's JSON device, the CPU where that one is absent here.

    Raises:
        VlaforgeError: one line, for a missing or unreadable file, a step or option vlaforge does not implement,
            statistics a mode needs but lacks, or a tokenizer that is not a local folder.
    Warns:
        DegenerateStatsWarning: a normalized feature with std 0 (max == min, q99 == q01, q90 == q10) somewhere.
    """
    folder = Path(folder)
    pre = _Load(folder, folder / PREPROCESSOR_FILE, tokenizer_override, torch.device(device) if device else None, set())
    pre_steps = [_build_step(pre, i, e) for i, e in enumerate(_read_pipeline(pre))]
    post = _Load(folder, folder / POSTPROCESSOR_FILE, None, None, pre.warned, relative=pre.relative)
    post_steps = [_build_step(post, i, e) for i, e in enumerate(_read_pipeline(post))]
    return Preprocessor(pre_steps), Postprocessor(post_steps)
