"""Markdown reference of every config field, generated from the schema (docs/configuration.md).

    python -m vlaforge.config.reference > docs/configuration.md
"""

from __future__ import annotations

import types
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from vlaforge.config.schema import ComponentConfig, VLAConfig

HEADER = """# Configuration reference

Generated from the config classes (`src/vlaforge/config/`, `VLAConfig` in `schema.py`) by `python -m
vlaforge.config.reference`; a test keeps it in sync. Recipes are TOML; every field can be overridden on the command
line as `--section.key=value`. Unknown keys and bad values stop the run before any model is built, with the field
path and the allowed values. A recipe's top-level `base = "other.toml"` (a path relative to the recipe) reads that
recipe first and merges this one's keys over it, table by table, so a variant holds only what it changes
(`recipes/tiny_metaworld_long.toml`).

Nothing set is silently ignored (`config/unused.py`): a value that differs from its default and that the chosen
configuration does not read stops the run too, in one line naming what would read it (`data.path` with
`data.source = "synthetic"`, `parallel.nvme_path` under fsdp2, `flow_steps` on a regression head, an offload setting
of a component that offloads nothing, ...). Where a later layer switches an option - the command line over the
recipe (`--data.source=lerobot` on `recipes/tiny_synthetic.toml`), a recipe over its `base` - the earlier layers'
settings of the option it left return to their defaults, so the resolved config (`vlaforge config show`, a run's
`config.toml`) holds what the run reads. LoRA components train over a pretrained base (`train.init_from`, or the
component's `model.*.pretrained` folder); `train.lora_random_base = true` allows a random one on purpose.
"""


def _rows(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    for name, field in model.model_fields.items():
        ann = field.annotation
        path = f"{prefix}{name}"
        default = field.get_default(call_default_factory=True)
        if path == "components":
            for comp, sub in ann.model_fields.items():
                if sub.annotation is ComponentConfig:
                    out.append(f"| `components.{comp}.*` | policy (below) | {_describe(getattr(default, comp))} | |")
                else:
                    _rows_one(f"components.{comp}", sub, out)
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            _rows(ann, f"{path}.", out)
        elif (sub := _optional_section(ann)) is not None:  # e.g. components.<name>.lora: off unless given
            _rows_one(path, field, out)
            _rows(sub, f"{path}.", out)
        else:
            _rows_one(path, field, out)


def _optional_section(ann) -> type[BaseModel] | None:
    """The section of a `Section | None` field, else None."""
    if get_origin(ann) not in (Union, types.UnionType):
        return None
    found = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
    return found[0] if len(found) == 1 else None


def _type_name(ann) -> str:
    """`int | Literal['auto']` for a field's annotation (constraints inside `Annotated` left out)."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if ann is type(None) else getattr(ann, "__name__", str(ann))


def _rows_one(path: str, field, out: list[str]) -> None:
    type_name = _type_name(field.annotation)
    default = field.get_default(call_default_factory=True)
    out.append(f"| `{path}` | `{_cell(type_name)}` | `{_cell(repr(default))}` | {_cell(field.description or '')} |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _describe(policy: BaseModel) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in policy.model_dump().items() if k in ("lr", "weight_decay"))


def markdown_reference() -> str:
    rows: list[str] = []
    _rows(VLAConfig, "", rows)
    comp: list[str] = []
    _rows(ComponentConfig, "components.<name>.", comp)
    table = "| key | type | default | meaning |\n|---|---|---|---|\n"
    return (f"{HEADER}\n## Sections\n\n{table}" + "\n".join(rows) +
            "\n\n## Per-component policy (`components.vision|projector|llm|action_head`)\n\n" + table +
            "\n".join(comp) + "\n")


if __name__ == "__main__":
    print(markdown_reference(), end="")
