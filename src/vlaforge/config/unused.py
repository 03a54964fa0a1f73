"""Settings the chosen configuration does not read are refused, in one line naming what would read them.

A value counts as set when it differs from the field's default, not when pydantic's `model_fields_set` holds it: a
run's saved config.toml holds every field, and `train --resume` reloads it. Each rule names the settings that decide
whether its fields are read (its selectors). When a later layer - the command line over the recipe, a recipe over
its `base` - switches a selector (`--data.source=lerobot` on recipes/tiny_synthetic.toml), the earlier layers'
settings of the option it left are dropped back to their defaults instead of refused, so the resolved and saved
config holds only what the run reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

from vlaforge import COMPONENTS
from vlaforge.config.components import BLOCKLESS
from vlaforge.config.lora import random_bases
from vlaforge.config.schema import VLAConfig
from vlaforge.errors import ConfigError

LOSS_SCALING = ("initial", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale")
DISTILL_TUNING = ("weights", "temperature", "action", "flow_target", "layers", "projections", "teacher_dtype", "cache",
                  "init")
MISSING = object()


@dataclass(frozen=True)
class Rule:
    """`fields` (a `<c>` stands for each component) are read only where `why_unread(cfg, c)` returns None; else it
    returns why not and the fix ("...; drop it or ...")."""

    fields: tuple[str, ...]
    selectors: tuple[str, ...]
    why_unread: Callable[[VLAConfig, str], str | None]


def _data_lerobot(cfg, _c):
    if cfg.data.source != "lerobot":
        return f"data.source = {cfg.data.source!r} does not read a dataset; drop it or set data.source = 'lerobot'"
    return None


def _lerobot_source(cfg, _c):
    if not cfg.model.lerobot.pretrained:
        return ("it applies to a LeRobot policy (model.lerobot.pretrained), and none is given; drop it or give the "
                "policy")
    return None


def _data_synthetic(cfg, _c):
    if cfg.data.source != "synthetic":
        return ("data.source = 'lerobot' reads the episodes of data.path, not generated samples; drop it or set "
                "data.source = 'synthetic'")
    return None


def _frame_stride(cfg, _c):
    if cfg.model.frames == 1:
        return "model.frames = 1 takes no history frames to space; drop it or set model.frames > 1"
    return None


def _max_cameras(cfg, _c):
    cams, most = cfg.model.cameras, cfg.model.max_cameras
    if cfg.data.source != "lerobot":
        return ("it limits model.cameras = 'auto' (a dataset's cameras) and data.source = 'synthetic' reads no "
                "dataset; drop it or set data.source = 'lerobot'")
    if cams != "auto" and len(cams) > most:  # (a resolved config's own list is never longer)
        return (f"it limits only model.cameras = 'auto' and model.cameras names {len(cams)} cameras; drop it or one "
                "of the cameras")
    return None


def _env_probe(cfg, _c):
    if cfg.loss.weights.get("env_state", 0.0) > 0:
        return None
    if cfg.data.source != "lerobot":
        return ("it sizes the action head's probe of a dataset's observation.environment_state, and data.source = "
                "'synthetic' has none; drop it or set data.source = 'lerobot' with loss.weights.env_state > 0")
    return ("it sizes the action head's environment-state probe, which only loss.weights.env_state > 0 trains; drop "
            "it or give loss.weights.env_state a weight")


def _flow_head(cfg, _c):
    kind = cfg.model.action_head.kind
    if kind != "flow_matching":
        return f"model.action_head.kind = {kind!r} has no flow network; drop it or set kind = 'flow_matching'"
    return None


def _fp8(cfg, c):
    p = getattr(cfg.components, c).precision
    return None if p == "fp8" else f"components.{c}.precision = {p!r} has no fp8 linears; drop it or set precision " \
                                   "= 'fp8'"


def _every_nth(cfg, c):
    s = getattr(cfg.components, c).checkpointing
    if s != "every_nth":
        return f"components.{c}.checkpointing = {s!r} does not pick every n-th block; drop it or set checkpointing = " \
               "'every_nth'"
    return None


def _blocks(cfg, c):
    if c in BLOCKLESS:
        return f"it picks transformer blocks and the {c} has none (it is handled whole); drop it"
    return None


def _nvme_files(cfg, c):
    where = getattr(cfg.components, c).offload
    if where != "nvme":
        return f"components.{c}.offload = {where!r} writes no files; drop it or set offload = 'nvme'"
    return None


def _qat(cfg, c):
    if getattr(cfg.components, c).qat == "none":
        return f"components.{c}.qat = 'none' fake-quantizes nothing; drop it or set qat = 'int4', 'int3' or 'int2'"
    return None


def _fp8_vision(cfg, _c):
    p = cfg.components.vision.precision
    if p != "fp8":
        return f"it permits components.vision.precision = 'fp8', which is {p!r}; drop it"
    return None


def _huber(cfg, _c):
    if cfg.loss.action != "huber":
        return f"loss.action = {cfg.loss.action!r} is not the Huber loss; drop it or set loss.action = 'huber'"
    return None


def _weighting(*kinds: str) -> Callable[[VLAConfig, str], str | None]:
    def why(cfg, _c):
        w = cfg.loss.weighting
        if w not in kinds:
            return f"loss.weighting = {w!r} does not read it; drop it or set loss.weighting = " + \
                " or ".join(map(repr, kinds))
        return None
    return why


def _deepspeed(cfg, _c):
    b = cfg.parallel.backend
    if b != "deepspeed":
        return f"parallel.backend = {b!r} does not run DeepSpeed ZeRO; drop it or set parallel.backend = 'deepspeed'"
    return None


def _ds_nvme(cfg, _c):
    p = cfg.parallel
    if "nvme" in (p.offload_optimizer, p.offload_param):
        return None
    if p.backend != "deepspeed":
        return (f"parallel.backend = {p.backend!r} never reads it (it is the folder of DeepSpeed's offload_optimizer / "
                "offload_param = 'nvme'; activations go to NVMe with components.<c>.offload = 'nvme' and its "
                "offload_path); drop it or set parallel.backend = 'deepspeed' with an 'nvme' offload")
    return ("neither parallel.offload_optimizer nor parallel.offload_param is 'nvme'; drop it or set one of them to "
            "'nvme'")


def _context(cfg, _c):
    return "parallel.cp = 1 splits no sequence; drop it or set parallel.cp > 1" if cfg.parallel.cp == 1 else None


def _cosine(cfg, _c):
    if cfg.train.lr_schedule == "constant":
        return "train.lr_schedule = 'constant' has no floor; drop it or set train.lr_schedule = 'cosine'"
    return None


def _decay_steps(cfg, _c):
    s = cfg.train.lr_schedule
    if s != "cosine_decay_with_warmup":
        return (f"train.lr_schedule = {s!r} does not read it (it is LeRobot's num_decay_steps); drop it or set "
                "train.lr_schedule = 'cosine_decay_with_warmup'")
    return None


def _master(cfg, _c):
    if all(p.precision == "fp32" for _, p in cfg.components.items()):
        return ("it is the weight dtype of components that compute below fp32, and every component computes in fp32; "
                "drop it or lower a component's precision")
    return None


def _bf16_weights(cfg, c):
    p, master = getattr(cfg.components, c).precision, cfg.train.precision_master
    if p == "fp32":
        return (f"components.{c}.precision = 'fp32' keeps fp32 weights, which need no rounding; drop it or set "
                f"components.{c}.precision = 'bf16' with train.precision_master = 'bf16'")
    if master != "bf16":
        return (f"train.precision_master = {master!r} keeps components.{c}'s weights in fp32, which need no rounding; "
                "drop it or set train.precision_master = 'bf16'")
    return None


def _own_optimizer(cfg, _c):
    if cfg.parallel.backend == "deepspeed":
        return ("parallel.backend = 'deepspeed' steps its own optimizer over the ZeRO partitions; drop it, or train "
                "in one process or with parallel.backend = 'ddp'")
    return None


def _random_base(cfg, _c):
    if not random_bases(cfg):
        return ("no LoRA component trains over a random base (each has train.init_from or its pretrained folder, or "
                "no component has lora); drop it")
    return None


def _eval_during(cfg, _c):
    if cfg.eval.every == 0:
        return "eval.every = 0 never evaluates during training (`vlaforge eval` takes eval.episodes); drop it or " \
               "set eval.every > 0"
    return None


def _fp16_trains(cfg) -> bool:
    return any(p.precision == "fp16" and (p.trainable or p.unfreeze_at_step is not None)
               for _, p in cfg.components.items())


def _scaling(cfg, _c):
    mode = cfg.loss_scale.mode
    if mode == "off":
        return "loss_scale.mode = 'off' never scales; drop it or set loss_scale.mode = 'auto' or 'always'"
    if mode == "auto" and not _fp16_trains(cfg):
        return ("loss_scale.mode = 'auto' scales only when a trainable component computes in fp16, and none does; "
                "drop it or set loss_scale.mode = 'always'")
    return None


def _underflow(cfg, _c):
    if cfg.numerics.every == 0:
        return "numerics.every = 0 measures no gradients; drop it or set numerics.every > 0"
    if not any(p.precision == "fp16" for _, p in cfg.components.items()):
        return "it tunes the fp16 underflow warning and no component computes in fp16; drop it"
    return None


def _unscaled(cfg, _c):
    if _scaling(cfg, _c) is None:
        return "dynamic loss scaling is on here and skips a non-finite step itself; drop it"
    return None


def _teacher(cfg, _c):
    if cfg.distill.teacher is None:
        return ("distill.teacher is not set, so nothing is distilled; drop it or set distill.teacher (`vlaforge "
                "distill TEACHER --student RECIPE`)")
    return None


def _distill_term(term: str) -> Callable[[VLAConfig, str], str | None]:
    def why(cfg, _c):
        if cfg.distill.weights[term] == 0:
            return f"distill.weights.{term} = 0 turns its term off; drop it or give the term a weight"
        return None
    return why


def _flow_target(cfg, _c):
    return _distill_term("action")(cfg, _c) or _flow_head(cfg, _c)


def _init_twice(cfg, _c):
    if cfg.train.init_from:
        return "train.init_from already gives the student its weights (the trainer then skips distill.init); drop it " \
               "or train.init_from"
    return None


PER_COMPONENT = tuple(f"components.{c}." for c in COMPONENTS)
PRECISIONS = tuple(f"{p}precision" for p in PER_COMPONENT) + tuple(f"{p}trainable" for p in PER_COMPONENT)
RULES = (
    Rule(("data.path", "data.root", "data.revision", "data.episodes", "data.text_column", "data.frame_stride",
          "data.augment_shift", "data.augment_color", "data.cache_mb"), ("data.source",), _data_lerobot),
    Rule(("data.num_samples", "data.num_tasks"), ("data.source",), _data_synthetic),
    Rule(("model.lerobot.vlm", "model.lerobot.tokenizer", "model.lerobot.config", "model.lerobot.sizes"),
         ("model.lerobot.pretrained",), _lerobot_source),
    Rule(("data.frame_stride",), ("model.frames",), _frame_stride),
    Rule(("model.max_cameras",), ("data.source", "model.cameras"), _max_cameras),
    Rule(("model.env_state_dim",), ("loss.weights.env_state", "data.source"), _env_probe),
    Rule(("model.action_head.flow_steps", "model.action_head.layers"), ("model.action_head.kind",), _flow_head),
    Rule(("components.<c>.fp8_recipe",), ("components.<c>.precision",), _fp8),
    Rule(("components.<c>.checkpoint_every_n",), ("components.<c>.checkpointing",), _every_nth),
    Rule(("components.<c>.offload_fraction", "components.<c>.unfreeze_last_blocks"), (), _blocks),
    Rule(("components.<c>.offload_path",), ("components.<c>.offload",), _nvme_files),
    Rule(("components.<c>.qat_group_size",), ("components.<c>.qat",), _qat),
    Rule(("components.<c>.stochastic_rounding",), ("components.<c>.precision", "train.precision_master"),
         _bf16_weights),
    Rule(("components.<c>.optim_state", "components.<c>.stochastic_rounding"), ("parallel.backend",),
         _own_optimizer),
    Rule(("components.allow_fp8_vision",), ("components.vision.precision",), _fp8_vision),
    Rule(("loss.huber_delta",), ("loss.action",), _huber),
    Rule(("loss.dwa_temperature",), ("loss.weighting",), _weighting("dwa")),
    Rule(("loss.gradnorm_alpha",), ("loss.weighting",), _weighting("gradnorm")),
    Rule(("loss.weighting_lr",), ("loss.weighting",), _weighting("uncertainty", "gradnorm")),
    Rule(("parallel.zero_stage", "parallel.zero_tuning"), ("parallel.backend",), _deepspeed),
    Rule(("parallel.nvme_path",), ("parallel.backend", "parallel.offload_optimizer", "parallel.offload_param"),
         _ds_nvme),
    Rule(("parallel.cp_method",), ("parallel.cp",), _context),
    Rule(("train.min_lr_ratio",), ("train.lr_schedule",), _cosine),
    Rule(("train.decay_steps",), ("train.lr_schedule",), _decay_steps),
    Rule(("train.precision_master",), PRECISIONS, _master),
    Rule(("train.lora_random_base",), ("train.init_from", "model.vision.pretrained", "model.llm.pretrained",
                                       "model.vlm.pretrained", *(f"{p}lora" for p in PER_COMPONENT)), _random_base),
    Rule(("eval.train_episodes",), ("eval.every",), _eval_during),
    Rule(tuple(f"loss_scale.{k}" for k in LOSS_SCALING), ("loss_scale.mode", *PRECISIONS), _scaling),
    Rule(("numerics.zero_jump", "numerics.norm_ratio"), ("numerics.every", *PRECISIONS), _underflow),
    Rule(("numerics.check_finite",), ("loss_scale.mode", *PRECISIONS), _unscaled),
    Rule(tuple(f"distill.{k}" for k in DISTILL_TUNING), ("distill.teacher",), _teacher),
    Rule(("distill.temperature",), ("distill.weights",), _distill_term("kl")),
    Rule(("distill.layers", "distill.projections"), ("distill.weights",), _distill_term("feature")),
    Rule(("distill.action",), ("distill.weights",), _distill_term("action")),
    Rule(("distill.flow_target",), ("distill.weights", "model.action_head.kind"), _flow_target),
    Rule(("distill.init",), ("train.init_from",), _init_twice),
)


@dataclass(frozen=True)
class Unread:
    """A set field nothing reads: its dotted path, the settings that decide that, and the one-line refusal."""

    field: str
    selectors: tuple[str, ...]
    message: str


def unread_settings(cfg: VLAConfig) -> list[Unread]:
    """Every field whose value differs from its default and that `cfg` does not read, with why (in RULES order)."""
    found: dict[str, Unread] = {}
    for rule in RULES:
        for c in COMPONENTS if any("<c>" in f for f in rule.fields) else ("",):
            for field in (f.replace("<c>", c) for f in rule.fields):
                value = lookup(cfg, field)
                if field in found or value == lookup(_defaults(), field):
                    continue
                why = rule.why_unread(cfg, c)
                if why is not None:
                    selectors = tuple(s.replace("<c>", c) for s in rule.selectors)
                    found[field] = Unread(field, selectors, f"{field} = {value!r} is set but {why}")
    return list(found.values())


def check_unread(cfg: VLAConfig, layers: list[dict[str, Any]], saved: int = 0) -> list[str]:
    """The settings to drop back to their defaults: those a later layer left behind by switching one of their
    selectors (`layers`: the recipe's base chain, base first, then the recipe, then the command line), and those
    only the first `saved` layers set (a run's saved config.toml: a record of what ran, which a run saved before a
    rule existed may hold; dropping an unread value changes nothing the run does).

    Raises:
        ConfigError: one line, for a set value nothing reads otherwise (a layer set it after, or with, its selectors).
    """
    refused, dropped = [], []
    for u in unread_settings(cfg):
        where = [i for i, layer in enumerate(layers) if lookup(layer, u.field) is not MISSING]
        switched = [i for i in range(len(layers)) if _switches(layers, i, u.selectors)]
        left = where and ((switched and max(switched) > max(where)) or max(where) < saved)
        (dropped if left else refused).append(u)
    if refused:
        more = f" (and {len(refused) - 1} more: {', '.join(u.field for u in refused[1:])})" if len(refused) > 1 else ""
        raise ConfigError(f"config: {refused[0].message}{more}")
    return [u.field for u in dropped]


def _switches(layers: list[dict[str, Any]], i: int, selectors: tuple[str, ...]) -> bool:
    """Whether layer `i` sets one of `selectors` to another value than the layers before it had."""
    for s in selectors:
        value = lookup(layers[i], s)
        before = next((v for layer in reversed(layers[:i]) if (v := lookup(layer, s)) is not MISSING), MISSING)
        if value is not MISSING and value != before:
            return True
    return False


def without(raw: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """A copy of `raw` with the dotted `fields` removed."""
    out = copy.deepcopy(raw)
    for field in fields:
        *parents, leaf = field.split(".")
        node = out
        for part in parents:
            node = node[part]
        node.pop(leaf)
    return out


def lookup(node: Any, path: str) -> Any:
    """The value at a dotted path of a config or a nested dict; MISSING where a dict lacks it."""
    for part in path.split("."):
        if isinstance(node, dict):
            if part not in node:
                return MISSING
            node = node[part]
        else:
            node = getattr(node, part)
    return node


@cache
def _defaults() -> VLAConfig:
    return VLAConfig()
