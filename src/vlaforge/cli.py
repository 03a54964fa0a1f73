"""The `vlaforge` command: verbs only; each verb calls one function elsewhere. The deployment verbs (eval, serve,
export, quantize) live in `cli_deploy.py`.

Errors a user can act on end with one line on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from vlaforge import cli_deploy
from vlaforge.config.flavors import FLAVORS
from vlaforge.config.schema import MAX_ENV_SEED
from vlaforge.errors import VlaforgeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train Vision-Language-Action models efficiently, from one GPU to many nodes.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configurations.")
model_app = typer.Typer(no_args_is_help=True, help="Inspect model flavors.")
data_app = typer.Typer(no_args_is_help=True, help="Make and inspect datasets.")
app.add_typer(config_app, name="config")
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")
app.add_typer(cli_deploy.app)  # eval, serve, export, quantize: top-level verbs of the same command

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def _load(config: Optional[Path], ctx: typer.Context, resume: Optional[str] = None, first: list[str] = ()):
    """The config from a recipe (or a resumed checkpoint's), then `first` overrides, then the command line's."""
    from vlaforge.checkpoints.layout import CONFIG_FILE, resolve_checkpoint, run_folder_of
    from vlaforge.config import load_config

    overrides, ckpt = [*first, *ctx.args], None
    if config is not None and str(config).startswith("--"):  # an override, not a recipe path
        overrides.insert(0, str(config))
        config = None
    if resume is not None:
        ckpt = None if resume == "latest" else resolve_checkpoint(resume, ".")  # "latest": the output_dir's, below
        # NOTE: the resolved folder, so the trainer resumes what was resolved here (its own resolution is then a no-op)
        overrides.append(f"--train.resume={json.dumps(resume if ckpt is None else str(ckpt))}")
        if ckpt is not None:
            if config is None:  # resume a run with the config saved in its checkpoint
                config = ckpt / CONFIG_FILE
            if not any(a.startswith("--train.output_dir=") for a in overrides):  # NOTE: not the saved output_dir,
                # which may be another run (the one this folder was copied from)
                overrides.append(f"--train.output_dir={json.dumps(str(run_folder_of(ckpt)))}")
    saved = ckpt is not None and config == ckpt / CONFIG_FILE  # a run's record, not a recipe
    return load_config(config, overrides, saved=saved)


@app.command(context_settings=OVERRIDES)
def train(ctx: typer.Context,
          config: Optional[Path] = typer.Argument(None, help="TOML recipe, e.g. recipes/tiny_metaworld.toml"),
          resume: Optional[str] = typer.Option(None, help="'latest', a run folder or a checkpoint folder; "
                                                          "without CONFIG, the checkpoint's saved config is used"),
          deepspeed: Optional[Path] = typer.Option(None, help="a DeepSpeed JSON/YAML config, mapped onto [parallel] "
                                                              "(backend = deepspeed, ZeRO stage, offload) and [train] "
                                                              "(batch sizes, clipping); 'auto' values (the "
                                                              "transformers Trainer's files) take vlaforge's; "
                                                              "unhonoured or contradicting fields are refused")):
    """Train a VLA. Overrides: --section.key=value (e.g. --train.steps=10), applied after --deepspeed. Under
    torchrun: data parallel (--parallel.dp_shard / dp_replicate, --parallel.backend=fsdp2|ddp|deepspeed), tensor
    parallel (--parallel.tp) and pipeline parallel (--parallel.pp)."""
    from vlaforge.distributed.parallel_dims import world_from_env

    first: list[str] = []
    if deepspeed is not None:
        from vlaforge.distributed.deepspeed_backend import check_resolved, config_overrides, read_config_file

        ds, where = read_config_file(deepspeed), f"--deepspeed {deepspeed}"
        first = config_overrides(ds, world_from_env().size, where)
    cfg = _load(config, ctx, resume, first)
    if deepspeed is not None:
        check_resolved(cfg, ds, world_from_env().size, where)
    _train_and_report(cfg)


@app.command("lerobot-train", context_settings=OVERRIDES)
def lerobot_train(ctx: typer.Context):
    """LeRobot 0.6.1's `lerobot-train` command line, unchanged: `vlaforge lerobot-train
    --policy.path=lerobot/smolvla_base --dataset.repo_id=lerobot/libero --batch_size=64 --steps=20000
    --output_dir=outputs/train/my_smolvla`. Each flag
    becomes a vlaforge setting with LeRobot's semantics, or is refused in one line; vlaforge's own --section.key=value
    flags may follow. Prints the `vlaforge train` command it became; writes LeRobot's checkpoint layout
    (OUT/checkpoints/<step>/pretrained_model, checkpoints/last) beside vlaforge's; --resume=true --config_path=...
    continues it (docs/lerobot_policies.md)."""
    from types import SimpleNamespace

    from vlaforge.lerobot_train import translate

    t = translate(list(ctx.args))
    typer.echo(f"lerobot-train -> {t.command()}", err=True)
    for note in t.notes:
        typer.echo(f"note: {note}", err=True)
    args = SimpleNamespace(args=t.overrides)
    cfg = _load(None, args, resume=str(t.resume)) if t.resume else _load(Path(t.recipe), args)
    _train_and_report(cfg)
    from vlaforge.distributed.parallel_dims import world_from_env

    last = Path(cfg.train.output_dir) / "checkpoints" / "last" / "pretrained_model"
    if world_from_env().is_main:
        typer.echo(f"LeRobot policy folder: {last} (lerobot-eval --policy.path={last})")
        if cfg.lerobot.repo_id:
            typer.echo(f"not pushed (vlaforge does not upload): hf upload {cfg.lerobot.repo_id} {last}")


@app.command(context_settings=OVERRIDES)
def distill(ctx: typer.Context,
            teacher: str = typer.Argument(..., help="the teacher: a run folder, a checkpoints/step_* folder or a "
                                                    "`vlaforge quantize` folder"),
            student: Path = typer.Option(..., help="the student's TOML recipe, e.g. "
                                                   "recipes/distill_student.toml")):
    """Distil TEACHER into the student of --student: `vlaforge train STUDENT --distill.teacher=TEACHER`, with the
    recipe's distill section and the overrides (e.g. --distill.weights.kl=0 --distill.cache=F), so precision,
    checkpointing, data parallel (torchrun), resume and logging are the normal ones."""
    _train_and_report(_load(student, ctx, first=[f"--distill.teacher={json.dumps(teacher)}"]))


def _train_and_report(cfg) -> None:
    """Train as `cfg` says (evaluating during training when eval.every is set); rank 0 prints one summary line."""
    from vlaforge.config.lora import check_pretrained_base
    from vlaforge.distributed.parallel_dims import world_from_env
    from vlaforge.training.trainer import train as run_training

    check_pretrained_base(cfg)  # LoRA over a random base is refused before anything is built
    evaluate = None
    if cfg.eval.every:
        from vlaforge.evaluation.closed_loop import during_training

        evaluate = during_training(cfg)
    last = run_training(cfg, evaluate)
    if world_from_env().is_main:  # under torchrun, one summary line
        shown = {k: round(v, 5) for k, v in last.items() if k.startswith(("loss/", "perf/"))}
        typer.echo(f"done: {cfg.train.steps} steps -> {cfg.train.output_dir}  {json.dumps(shown)}")


@app.command(context_settings=OVERRIDES)
def profile(ctx: typer.Context,
            config: Optional[Path] = typer.Argument(None, help="TOML recipe, e.g. recipes/vla_7b.toml"),
            fake: bool = typer.Option(False, "--fake", help="fake tensors: memory only, no times; large flavors in "
                                                            "seconds"),
            budget_gb: Optional[float] = typer.Option(None, min=0, help="recommend the fastest strategy whose "
                                                                        "peak fits this many GB per device"),
            seq_len: Optional[int] = typer.Option(None, min=1, help="LLM tokens per sample (instruction padded "
                                                                    "to reach it); default: the config's"),
            batch_size: int = typer.Option(1, min=1, help="samples in the profiled batch"),
            offload: bool = typer.Option(False, help="also run each strategy with CPU offload of the components "
                                                     "with blocks (vision, llm)"),
            repeats: int = typer.Option(3, min=1, help="timed steps per strategy, in rounds over the strategies "
                                                       "(each round the reverse of the one before) after one "
                                                       "untimed warm-up step of each; the table shows "
                                                       "their min and median, and ranks by the min"),
            gpu: str = typer.Option("h100-80", help="with --fake: the catalog GPU whose step times the planner "
                                                    "predicts (see vlaforge plan --gpu)"),
            calibration: Optional[Path] = typer.Option(None, help="with --fake: a `vlaforge plan --calibrate` TOML; "
                                                                  "its entry for --gpu calibrates the prediction"),
            catalog: Optional[Path] = typer.Option(None, help="with --fake: TOML with [gpu.<name>] entries"),
            as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Activation memory and step time of every checkpointing strategy on the config's model (measured; with --fake
    predicted by the planner). Says when the measured differences are within the spread of the timed steps."""
    from vlaforge.config.shapes import resolve_shapes
    from vlaforge.diagnostics.profile import profile as run_profile
    from vlaforge.diagnostics.profile import render

    report = run_profile(resolve_shapes(_load(config, ctx))[0], fake=fake, budget_gb=budget_gb, seq_len=seq_len,
                         batch_size=batch_size, offload=offload, repeats=repeats, gpu=gpu,
                         calibration=str(calibration) if calibration else None,
                         catalog=str(catalog) if catalog else None)
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))


@app.command()
def diagnose(run: Path = typer.Argument(..., help="a run folder (its metrics.jsonl and config.toml)"),
             compare: Optional[Path] = typer.Option(None, help="a second run to set side by side (drawn dashed)"),
             html: Optional[Path] = typer.Option(None, help="the HTML report to write (default RUN/report.html)"),
             gpu: Optional[str] = typer.Option(None, help="the catalog GPU the run ran on, for the planner's step "
                                                          "time and memory (default: cpu for a CPU run)"),
             calibration: Optional[Path] = typer.Option(None, help="a `vlaforge plan --calibrate` TOML: with an entry "
                                                                   "for the GPU, a >30% step-time gap is a finding"),
             as_json: bool = typer.Option(False, "--json", help="print the JSON instead of the summary")):
    """What went wrong in a run and what to try: loss spikes, divergence, a loss that does not move, oscillation,
    learning rates far apart, a dominating loss term, fp16 underflow / overflow, loss-scale trouble, data stalls,
    straggler ranks, step time and memory against the planner. Writes RUN/diagnose.json and the HTML report."""
    from vlaforge.diagnostics.diagnose import diagnose as run_diagnose
    from vlaforge.diagnostics.diagnose import render
    from vlaforge.diagnostics.report import write_reports

    report, signals = run_diagnose(run, compare, gpu, str(calibration) if calibration else None)
    write_reports(report, signals, run, html)
    typer.echo(json.dumps(report, indent=1) if as_json else render(report) + f"\nreport: {report['html']}")


@app.command()
def plan(model: str = typer.Option("vla-7b", help=f"a flavor ({' | '.join(FLAVORS.names())}) or a TOML "
                                                   "recipe whose model, data and components sections are the base"),
         gpu: str = typer.Option("h100-80", help="catalog GPU: a100-40 | a100-80 | h100-80 | h100-pcie | h200-141 | "
                                                 "b200 | l40s | rtx-4090 | cpu (or one from --catalog)"),
         gpus_per_node: int = typer.Option(8, min=1, help="GPUs per node"),
         nodes: int = typer.Option(1, min=1, help="nodes"),
         cpu_mem_gb: float = typer.Option(1024.0, min=0, help="host memory per node for offload, GB"),
         nvme_gb: float = typer.Option(0.0, min=0, help="NVMe per node for offload, GB"),
         nvme_gbps: float = typer.Option(6.0, min=0.1, help="NVMe bandwidth per node, GB/s"),
         catalog: Optional[Path] = typer.Option(None, help="TOML with [gpu.<name>] entries overriding or adding GPUs"),
         frames: Optional[int] = typer.Option(None, min=1, help="time steps of images per sample"),
         cameras: Optional[int] = typer.Option(None, min=1, help="cameras per time step"),
         image_size: Optional[int] = typer.Option(None, min=8, help="pixels per side"),
         text_tokens: Optional[int] = typer.Option(None, min=1, help="instruction tokens per sample"),
         seq: Optional[int] = typer.Option(None, "--seq-len", "--seq", min=1, help="LLM tokens per sample (instruction "
                                                                                "padded to reach it)"),
         micro_batch: Optional[int] = typer.Option(None, min=1, help="pin the micro-batch (train.batch_size)"),
         global_batch: int = typer.Option(256, min=1, help="samples per optimizer step, all GPUs together"),
         fix: list[str] = typer.Option([], help="KEY=VALUE pins a config field (repeatable), e.g. --fix "
                                                "parallel.tp=1 --fix components.llm.checkpointing=none"),
         top: int = typer.Option(5, min=1, help="candidates shown / in --json"),
         lora: Optional[int] = typer.Option(None, min=1, max=1024, help="also consider LoRA of this rank on the "
                                                                        "vision tower and the LLM (bf16 base) and "
                                                                        "QLoRA (NF4 base); the explanation says "
                                                                        "what it trains and what full fine-tuning "
                                                                        "would need (docs/lora.md)"),
         matmul_efficiency: Optional[float] = typer.Option(None, min=0.01, max=1, help="share of the dense peak "
                                                                                       "matmuls reach (default 0.6, "
                                                                                       "or the calibrated one)"),
         calibrate: list[Path] = typer.Option([], help="a run folder (repeatable): fit the step-time efficiencies of "
                                                       "--gpu to these measured runs, write them to --calibration, "
                                                       "report predicted vs measured, and exit"),
         held_out: list[Path] = typer.Option([], help="with --calibrate: a run folder (repeatable) reported, not "
                                                      "fitted"),
         calibration: Optional[Path] = typer.Option(None, help="TOML of fitted efficiencies per GPU: --calibrate "
                                                               "writes it (default calibration.toml), a plan reads "
                                                               "it"),
         as_json: bool = typer.Option(False, "--json", help="print JSON"),
         measure: bool = typer.Option(False, help="also run the best (or the fixed) configuration's model under fake "
                                                  "tensors and print analytic vs measured activation bytes"),
         write_config: Optional[Path] = typer.Option(None, help="write the best candidate as a vlaforge train recipe; "
                                                                "an existing file is replaced only if plan wrote it "
                                                                "(its '# vlaforge plan:' first line), else refused"),
         plot: Optional[Path] = typer.Option(None, help="save the best candidate's per-GPU memory chart (PNG); an "
                                                        "existing file is replaced only if plan wrote it"),
         whitepaper: Optional[Path] = typer.Option(None, help="generate the configuration white paper (SmolVLA's "
                                                              "and pi0's VLM shapes, Qwen2.5-VL-3B, OpenVLA-7B, "
                                                              "7B/30B/70B x 1/8 frames x 8xA100-80, 8xH100, "
                                                              "4x8xH100) to this Markdown file and exit")):
    """Plan memory and throughput per GPU for a VLA on a cluster, and recommend the fastest configuration that fits:
    layout (FSDP2 / HSDP / DDP, tp, pp, cp), precision, checkpointing, offload, micro-batch and accumulation (and,
    with --lora R, LoRA / QLoRA of rank R)."""
    from vlaforge.planner import calibrate as calib
    from vlaforge.planner import cli as planner_cli

    if calibrate:
        report = calib.calibrate(calibrate, gpu, calibration or Path("calibration.toml"), catalog,
                                 held_out=held_out)
        typer.echo(json.dumps(report, indent=2) if as_json else calib.render(report))
        return
    cluster = planner_cli.cluster(gpu, gpus_per_node, nodes, cpu_mem_gb, nvme_gb, nvme_gbps, catalog)
    assume, source = calib.calibrated(calibration, cluster.gpu.name, planner_cli.assumptions(None))
    if matmul_efficiency is not None:
        assume = replace(assume, matmul_efficiency=matmul_efficiency)
    if whitepaper is not None:
        typer.echo(f"wrote {planner_cli.write_whitepaper(whitepaper, global_batch, assume, catalog)}")
        return
    base = planner_cli.base_config(model, frames, cameras, image_size, text_tokens, seq)
    result = planner_cli.run(base, cluster, global_batch, fix, micro_batch, assume, top, measure, write_config, plot,
                             lora_rank=lora)
    result["json"]["calibration"] = source
    note = source or calib.uncalibrated_note(assume)
    typer.echo(json.dumps(result["json"], indent=2) if as_json else f"{result['text']}\n{note}")


@config_app.command("show", context_settings=OVERRIDES)
def config_show(ctx: typer.Context, config: Optional[Path] = typer.Argument(None, help="TOML recipe")):
    """Print the resolved configuration (recipe + overrides + defaults; 'auto' model shapes from the dataset when
    it exists) as TOML, then, as comments, the tokens of one sample and of each context-parallel rank."""
    from vlaforge.config import dump_toml
    from vlaforge.config.shapes import resolve_shapes, resolve_terms
    from vlaforge.distributed.sequence_parallel import token_summary

    cfg, _ = resolve_shapes(_load(config, ctx), required=False)  # "auto" shapes, when the dataset is there
    cfg, _ = resolve_terms(cfg, required=False)
    typer.echo(dump_toml(cfg), nl=False)
    typer.echo(token_summary(cfg), nl=False)


@model_app.command("summary")
def model_summary(flavor: str = typer.Argument("tiny", help=f"{' | '.join(FLAVORS.names())} (with --vlm: "
                                                               "the flavor of the action head's width)"),
                  vision_stem: str = typer.Option("patch", help="model.vision_stem: patch or conv"),
                  vlm: str = typer.Option(None, "--vlm", help="a whole VLM's save_pretrained folder "
                                                              "(model.vlm.pretrained): its four components, from "
                                                              "its config.json alone"),
                  as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Parameters and bytes per component, built on fake tensors (no weights allocated or read)."""
    from vlaforge.models.summary import render_summary, summarize

    summary = summarize(flavor, vision_stem, vlm)
    typer.echo(json.dumps(summary, indent=2) if as_json else render_summary(summary))


@data_app.command("generate")
def data_generate(
        out: Path = typer.Option(..., help="new dataset folder (LeRobotDataset v3)"),
        tasks: Optional[str] = typer.Option(None, help="comma-separated tasks; task:N records N episodes of that task. "
                                                       "Meta-World's (default: the demo's four tasks), or with --suite "
                                                       "the suite's by LIBERO's names, e.g. pick_up_the_milk_and_place_"
                                                       "it_in_the_basket (default: all ten)"),
        suite: Optional[str] = typer.Option(None, help="libero_object: LIBERO-Object's tasks, recorded by its "
                                                       "scripted expert from LIBERO's placement sampler in the "
                                                       "LeRobot / openpi LIBERO layout (docs/libero.md)"),
        episodes: int = typer.Option(20, min=1, help="successful episodes per task without its own :N"),
        image_size: Optional[int] = typer.Option(None, min=16, help="pixels per side (even); default 96, with "
                                                                    "--suite 256 (the LIBERO datasets')"),
        cameras: Optional[str] = typer.Option(None, help="comma-separated cameras: Meta-World's own, or side (ours: "
                                                         "the goal box seen from beside the table); a wrong name lists "
                                                         "them all; default corner,behindGripper, with --suite "
                                                         "image,wrist_image"),
        seed: int = typer.Option(0, min=0, max=MAX_ENV_SEED, help="base seed of the initial positions"),
        workers: int = typer.Option(2, min=1, help="recording processes"),
        max_steps: Optional[int] = typer.Option(None, min=1, help="steps before an expert attempt counts as failed, "
                                                                  "at most the simulator's episode limit (Meta-World: "
                                                                  "500; libero_object: 280); default 200, with "
                                                                  "--suite the suite's limit"),
        hide_distractors: bool = typer.Option(False, help="Meta-World: render the tasks' distractor bodies (reach's "
                                                          "puck) invisible; recorded, and `vlaforge eval` renders "
                                                          "alike"),
        steer_tcp: bool = typer.Option(False, help="Meta-World: reach's expert steers the fingertips (what its "
                                                   "success test measures) to the goal instead of the hand body; "
                                                   "recorded"),
        overwrite: bool = typer.Option(False, help="replace a non-empty --out"),
        progress: bool = typer.Option(True, help="show a progress bar")):
    """Record scripted-expert demonstrations in Meta-World or LIBERO-Object (successful episodes only). A cut
    recording resumes: the same command records only the attempts still missing (kept in .OUT.episodes/ beside
    --out until the dataset is written)."""
    from vlaforge.data.generate import generate
    from vlaforge.data.metaworld import DEMO_TASKS, parse_cameras, parse_task_counts

    if suite is not None:
        from vlaforge.data import libero

        if suite != "libero_object":
            raise VlaforgeError(f"--suite {suite!r}: vlaforge has a scripted expert for libero_object only")
        meta_only = [name for name, given in (("--hide-distractors", hide_distractors), ("--steer-tcp", steer_tcp))
                     if given]
        if meta_only:
            raise VlaforgeError(f"{' and '.join(meta_only)} apply to Meta-World's tasks, not to --suite {suite}; "
                                "drop them")
        names = tasks or ",".join(t.name for t in libero.suite_tasks(suite))
        counts = libero.parse_task_counts(suite, names, episodes)
        cams = libero.parse_cameras(cameras or list(libero.CAMERAS))
        size = libero.RENDER_SIZE if image_size is None else image_size
        max_steps = libero.MAX_STEPS[suite] if max_steps is None else max_steps
    else:
        counts = parse_task_counts(tasks or ",".join(DEMO_TASKS), episodes)
        cams, size = parse_cameras(cameras or "corner,behindGripper"), 96 if image_size is None else image_size
        max_steps = 200 if max_steps is None else max_steps
    if size % 2:
        raise VlaforgeError(f"--image-size {size} must be even (the videos use yuv420p)")
    summary = generate(counts, episodes, out, cameras=cams, image_size=size, seed=seed, workers=workers,
                       max_steps=max_steps, overwrite=overwrite, progress=progress, hide_distractors=hide_distractors,
                       steer_tcp=steer_tcp)
    typer.echo(json.dumps(summary))


@data_app.command("info")
def data_info(path: Path = typer.Argument(..., help="a LeRobot dataset folder (v3.0 or v2.1)"),
              as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Features, episodes, frames, tasks and fps of a dataset, and the model shapes 'auto' would take from it. The
    dataset is checked as training checks it, and more (every vector column finite, the first frame of every video
    file decoded): a damaged one is one line (exit 2). Later frames of each video are decoded only by training."""
    from vlaforge.data.summary import dataset_summary, render_dataset_summary

    summary = dataset_summary(path)
    typer.echo(json.dumps(summary, indent=2) if as_json else render_dataset_summary(summary))


def one_line(exc: BaseException) -> str:
    """A user error's message as one line. An error raised in a DataLoader worker arrives wrapped with the worker's
    traceback ('Caught VlaforgeError in DataLoader worker process 0. Original Traceback ...'): its last line is the
    message."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and "Traceback" in str(exc):
        return re.sub(r"^[\w.]+: ", "", lines[-1].strip())
    return " ".join(line.strip() for line in lines) or type(exc).__name__


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # NOTE: SIGTERM unwinds like Ctrl-C: writers remove their unfinished temporary folders


def main() -> None:
    """Run the CLI: user errors (ours and bad command-line usage) end with one line on stderr and exit code 2; a
    SIGTERM or Ctrl-C ends with "interrupted" and exit code 130 after the commands have cleaned up."""
    import os
    import signal

    if os.environ.get("WORLD_SIZE", "1") == "1":  # NOTE: not under torchrun: a rank blocked in a collective must
        # die at the launcher's SIGTERM, and a Python handler would wait for the collective to return
        signal.signal(signal.SIGTERM, _terminated)  # `vlaforge serve` installs its own graceful stop over this
    try:
        code = app(standalone_mode=False)
    except VlaforgeError as exc:
        typer.echo(f"error: {one_line(exc)}", err=True)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.TyperException as exc:  # click's usage errors: a bad option value, a missing argument
        if type(exc).__name__ == "NoArgsIsHelpError":  # `vlaforge` or `vlaforge data` alone: show the help
            typer.echo(exc.ctx.get_help())
        else:
            where = exc.ctx.command_path if getattr(exc, "ctx", None) else "vlaforge"
            typer.echo(f"error: {exc.format_message()} (see {where} --help)", err=True)
        sys.exit(2)
    if code == 130:  # typer turns a KeyboardInterrupt inside a command into exit code 130, silently
        typer.echo("interrupted", err=True)
    sys.exit(code if isinstance(code, int) else 0)
