"""TOML recipes, dotted CLI overrides (`--train.steps=10`), and one-line validation errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from vlaforge.config.schema import VLAConfig
from vlaforge.config.unused import check_unread, without
from vlaforge.errors import ConfigError
from vlaforge.registry import did_you_mean


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--train.steps=10', '--model.cameras=["a","b"]'] -> nested dict. Values parse as TOML, else as strings."""
    nested: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"override {arg!r} is not of the form --section.key=value (e.g. --train.steps=10)")
        key, raw = arg[2:].split("=", 1)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r} sets a key below a plain value")
        node[leaf] = _parse_value(raw)
    return nested


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; give a TOML recipe such as recipes/tiny_metaworld.toml")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


MAX_BASE_DEPTH = 16  # recipes in one base chain (a deeper one is a mistake, and would exhaust Python's stack)


def recipe_layers(path: str | Path, _chain: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """The TOML of a recipe and of its `base = "other.toml"` chain (a path next to the recipe), the deepest base
    first; `load_config` merges them in order, so a recipe can be another recipe plus the keys it changes and the two
    cannot drift apart."""
    p = Path(path)
    raw = read_toml(p)
    base = raw.pop("base", None)
    if base is None:
        return [raw]
    if not isinstance(base, str):
        raise ConfigError(f"{p}: base must be the path of another recipe as a string, e.g. base = "
                          f"\"tiny_metaworld.toml\"; got {base!r}")
    target = (p.parent / base).resolve()
    chain = (*_chain, p.resolve())
    if len(chain) >= MAX_BASE_DEPTH:
        raise ConfigError(f"{p}: base chain deeper than {MAX_BASE_DEPTH} recipes ({chain[0].name} -> ... -> "
                          f"{p.name} -> {Path(base).name}); merge some of them into one recipe")
    if target in chain:
        raise ConfigError(f"{p}: base = {base!r} makes a cycle ({' -> '.join(c.name for c in (*chain, target))}); "
                          "a recipe cannot be its own base")
    if not target.is_file():
        raise ConfigError(f"{p}: base = {base!r} does not exist ({target}); the path is relative to {p.parent}")
    return [*recipe_layers(target, chain), raw]


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
                saved: bool = False) -> VLAConfig:
    """Recipe file (optional) + overrides -> validated VLAConfig, in which nothing set goes unread
    (`config/unused.py`: a setting the chosen configuration does not read is refused, or dropped where a later
    layer switched away from the option that reads it). `saved`: `path` is a run's saved config.toml, whose unread
    values (a run saved before a rule existed) are dropped, not refused; the overrides are checked all the same.

    Raises:
        ConfigError: one line naming the field path, the problem and the allowed values.
    """
    layers = recipe_layers(path) if path is not None else []
    if overrides:
        layers.append(parse_overrides(overrides) if isinstance(overrides, list) else overrides)
    raw: dict[str, Any] = {}
    for layer in layers:
        raw = deep_merge(raw, layer)
    if overrides:
        raw = _require_explicit_terms(raw, layers[-1])
    cfg = validate(raw)
    left = check_unread(cfg, layers, saved=len(layers) - bool(overrides) if saved else 0)
    return validate(without(raw, left)) if left else cfg


def _require_explicit_terms(raw: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """A data-dependent loss weight set by an override (the command line) is an explicit ask: its term goes into
    loss.required, so a dataset without its column is refused instead of the term being turned off."""
    weights = (update.get("loss") or {}).get("weights") if isinstance(update.get("loss"), dict) else None
    if not isinstance(weights, dict):
        return raw
    asked = [t for t in ("language", "env_state") if isinstance(weights.get(t), (int, float)) and weights[t] > 0]
    if not asked:
        return raw
    loss = raw.get("loss") if isinstance(raw.get("loss"), dict) else {}
    have = loss.get("required") if isinstance(loss.get("required"), list) else []
    return deep_merge(raw, {"loss": {"required": [*have, *(t for t in asked if t not in have)]}})


def validate(raw: dict[str, Any]) -> VLAConfig:
    try:
        return VLAConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    """The first problem of a pydantic error as 'config: a.b.c: message', with a suggestion for unknown keys."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] == "extra_forbidden":
        siblings = _field_names(VLAConfig, loc[:-1])
        hint = did_you_mean(loc[-1], siblings)
        return f"config: unknown key {path}{hint}; allowed keys here: {', '.join(siblings)}"
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {len(exc.errors()) - 1} more problem(s))" if len(exc.errors()) > 1 else ""
    got = "" if isinstance(err.get("input"), dict) else f" (got {err.get('input')!r})"  # a section: the message says
    return f"config: {path + ': ' if path else ''}{msg}{got}{more}"


def _field_names(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def to_dict(cfg: VLAConfig) -> dict[str, Any]:
    """Plain-data form of the config (None values dropped: TOML has no null)."""
    return cfg.model_dump(mode="json", exclude_none=True)


def dump_toml(cfg: VLAConfig) -> str:
    return tomli_w.dumps(to_dict(cfg))
