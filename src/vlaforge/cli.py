"""The `vlaforge` command: verbs only; each verb calls one function elsewhere.

Errors a user can act on end with one line on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from vlaforge.errors import VlaforgeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train Vision-Language-Action models efficiently, from one GPU to many nodes.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configurations.")
model_app = typer.Typer(no_args_is_help=True, help="Inspect model flavors.")
app.add_typer(config_app, name="config")
app.add_typer(model_app, name="model")

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def _load(config: Optional[Path], ctx: typer.Context, resume: Optional[str] = None):
    from vlaforge.config import load_config
    from vlaforge.training.checkpoint import CONFIG_FILE, resolve_checkpoint

    overrides = list(ctx.args)
    if config is not None and str(config).startswith("--"):  # an override, not a recipe path
        overrides.insert(0, str(config))
        config = None
    if resume is not None:
        overrides.append(f"--train.resume={json.dumps(resume)}")
        if config is None:  # resume a run with the config saved in its checkpoint
            config = resolve_checkpoint(resume, ".") / CONFIG_FILE
    return load_config(config, overrides)


@app.command(context_settings=OVERRIDES)
def train(ctx: typer.Context,
          config: Optional[Path] = typer.Argument(None, help="TOML recipe, e.g. recipes/tiny_metaworld.toml"),
          resume: Optional[str] = typer.Option(None, help="'latest', a run folder or a checkpoint folder; "
                                                          "without CONFIG, the checkpoint's saved config is used")):
    """Train a VLA. Overrides: --section.key=value (e.g. --train.steps=10)."""
    from vlaforge.training.trainer import train as run_training

    cfg = _load(config, ctx, resume)
    last = run_training(cfg)
    shown = {k: round(v, 5) for k, v in last.items() if k.startswith(("loss/", "perf/"))}
    typer.echo(f"done: {cfg.train.steps} steps -> {cfg.train.output_dir}  {json.dumps(shown)}")


@config_app.command("show", context_settings=OVERRIDES)
def config_show(ctx: typer.Context, config: Optional[Path] = typer.Argument(None, help="TOML recipe")):
    """Print the resolved configuration (recipe + overrides + defaults) as TOML."""
    from vlaforge.config import dump_toml

    typer.echo(dump_toml(_load(config, ctx)), nl=False)


@model_app.command("summary")
def model_summary(flavor: str = typer.Argument(..., help="tiny | small | vla-7b | vla-30b | vla-70b"),
                  as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Parameters and bytes per component, built on fake tensors (no weights allocated)."""
    from vlaforge.models.summary import render_summary, summarize

    summary = summarize(flavor)
    typer.echo(json.dumps(summary, indent=2) if as_json else render_summary(summary))


def main() -> None:
    try:
        app()
    except VlaforgeError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
