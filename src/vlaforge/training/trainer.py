"""The training loop, built from `build_*` pieces; readable top to bottom."""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlaforge import hub
from vlaforge.checkpoints import lora as lora_checkpoint
from vlaforge.checkpoints.layout import resolve_checkpoint
from vlaforge.checkpoints.load import load_init_from
from vlaforge.checkpoints.run_folder import check_run_folder, stopped_before_first_checkpoint
from vlaforge.config.loading import dump_toml
from vlaforge.config.schema import VLAConfig
from vlaforge.config.shapes import describe as describe_shapes
from vlaforge.config.shapes import resolve_shapes, resolve_terms
from vlaforge.data.loader import build_data, build_loader
from vlaforge.distributed.apply import Applied, apply_techniques
from vlaforge.distributed.deepspeed_backend import build_engine
from vlaforge.distributed.parallel_dims import ParallelDims, check_layout, init_distributed, world_from_env
from vlaforge.distributed.parallelize import GradReducer
from vlaforge.distributed.pipeline import Pipeline
from vlaforge.errors import VlaforgeError
from vlaforge.models.build import build_vla, tokens_per_sample
from vlaforge.outputs import write_atomic
from vlaforge.progress import progress_bar
from vlaforge.seeding import seed_everything
from vlaforge.techniques.freezing import apply_freezing, ever_trains, schedule_changes
from vlaforge.techniques.lora import lora_components
from vlaforge.techniques.precision import PrecisionSetup
from vlaforge.techniques.step_in_backward import apply_step_in_backward
from vlaforge.training.distill import Distiller, Teacher, build_teacher, split_parameters
from vlaforge.training.loss_scale import LossScaler
from vlaforge.training.memory_check import check_memory, memory_errors
from vlaforge.training.metrics import MetricsLogger, to_floats
from vlaforge.training.numerics import NumericsMonitor
from vlaforge.training.optim import build_optimizer, build_param_groups, build_scheduler
from vlaforge.training.recorder import oom_snapshot, recorded_step
from vlaforge.training.run import Evaluator, Run, global_batch
from vlaforge.training.saving import restore, save
from vlaforge.training.step import (
    DeepSpeedExecutor,
    Executor,
    InBackwardExecutor,
    LocalExecutor,
    StepGuards,
    train_step,
)
from vlaforge.training.weighting import build_weighting

SOURCES_FILE = "sources.json"  # in a run folder: the Hub ids it read, each with the commit it resolved to


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise VlaforgeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(cfg: VLAConfig, device: torch.device) -> tuple[nn.Module, PrecisionSetup]:
    """The VLA with its one-process techniques applied (`apply_techniques` without a layout): for tools and
    benchmarks that run the model in this process."""
    model = build_bare(cfg, device)
    return model, apply_techniques(model, cfg, device).precision


def build_bare(cfg: VLAConfig, device: torch.device) -> nn.Module:
    """The VLA as `build_vla` makes it, on `device`, before any technique."""
    model = build_vla(cfg.model, cfg.loss)
    if next(model.parameters()).device != device:  # (built on CPU; also keeps fake-tensor builds off `.to`)
        model.to(device)
    return model


def build_guards(cfg: VLAConfig, precision: PrecisionSetup) -> StepGuards:
    """Loss scaler (dynamic when a component that ever trains computes in fp16) and numerics monitor."""
    ever_trained = [c for c, p in cfg.components.items() if ever_trains(p)]
    scaler = LossScaler.from_config(cfg.loss_scale, precision.used, ever_trained)
    if precision.computes_in("fp16") and not scaler.enabled:
        warnings.warn("components compute in fp16 with loss_scale.mode = 'off': small gradients (the vision "
                      "encoder's first) will underflow to zero", UserWarning, stacklevel=2)
    return StepGuards(scaler, NumericsMonitor(cfg.numerics, precision.used), sync_every=cfg.train.sync_every)


def build_loss_weighting(cfg: VLAConfig, model: nn.Module, device: torch.device,
                         teacher: Teacher | None = None) -> nn.Module:
    """The loss weighting of the data terms; with a distillation teacher, the `Distiller` around it."""
    terms = [t for t, w in cfg.loss.weights.items() if w > 0]
    if cfg.data.max_text_tokens == 0 and "language" in terms:
        terms.remove("language")
    shared = lambda: [model.projector.mlp[-1].weight]  # the last layer every loss term flows through
    weighting = build_weighting(cfg.loss.weighting, terms, cfg.loss, shared=shared)
    if teacher is not None:
        weighting = Distiller(cfg.distill, model, teacher, weighting)
    return weighting.to(device)


def build_run(cfg: VLAConfig, evaluate: Evaluator | None = None) -> Run:
    if cfg.eval.every and evaluate is None:
        raise VlaforgeError(f"eval.every = {cfg.eval.every} evaluates in the simulator during training, and no "
                            "evaluator was given: run it through `vlaforge train`, or set eval.every = 0")
    world = world_from_env()
    cfg, chosen = resolve_shapes(cfg)  # "auto" cameras / state / action sizes from the dataset
    cfg, term_lines = resolve_terms(cfg)  # the text column, and loss terms the dataset has no data for
    if world.is_main:
        for line in ([describe_shapes(chosen, cfg.data.path)] if chosen else []) + term_lines:
            print(line, flush=True)
    dims = check_layout(cfg, world)
    run_dir = Path(cfg.train.output_dir)
    resume_from = resolve_checkpoint(cfg.train.resume, run_dir) if cfg.train.resume else None
    check_run_folder(run_dir, resume_from)
    device = init_distributed(world, resolve_device(cfg.train.device), single=dims.backend == "deepspeed")
    if dims.distributed:
        torch.distributed.barrier()  # NOTE: every rank has checked the folder before rank 0 writes into it
    seed_everything(cfg.train.seed)  # the same on every rank: identical initial weights before sharding
    model = build_bare(cfg, device)
    lora = lora_components(dict(cfg.components.items()))
    if resume_from is None or lora:  # a LoRA checkpoint holds no base: rebuilt here
        load_init_from(cfg, model)
    lora_base = lora_checkpoint.base_record(cfg, model)
    if resume_from is not None and lora_base is not None and lora_checkpoint.is_lora(resume_from):
        lora_checkpoint.check_base(resume_from, lora_checkpoint.read_record(resume_from), lora_base["digest"])
    teacher = build_teacher(cfg, model, device, fresh=resume_from is None, verbose=world.is_main)
    tps = tokens_per_sample(model, cfg.data.max_instruction_tokens, cfg.data.max_text_tokens)
    check_memory(cfg, model, device, tps)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VlaforgeError(f"train.output_dir {run_dir} cannot be created ({exc.strerror or exc}); choose a "
                            "writable --train.output_dir") from None
    mesh = dims.build_mesh(device.type) if dims.distributed and dims.backend != "deepspeed" else None
    applied = apply_techniques(model, cfg, device, dims, mesh, tps)
    if world.is_main and cfg.train.progress:
        describe_layout(applied, dims)
    guards = build_guards(cfg, applied.precision)
    guards.reducer = GradReducer() if dims.backend == "deepspeed" else applied.reducer  # DeepSpeed: world sums
    weighting = build_loss_weighting(cfg, model, device, teacher)
    executor, optimizer, scheduler = build_executor(cfg, dims, model, weighting, applied, mesh, device)
    start = samples = 0
    if resume_from is not None:
        start, samples = restore(resume_from, model, weighting, optimizer, scheduler, guards.scaler,
                                 dims.distributed, global_batch(cfg, dims), getattr(executor, "engine", None))
        if start >= cfg.train.steps:
            raise VlaforgeError(f"checkpoint {resume_from} is at step {start} and train.steps = {cfg.train.steps}: "
                                f"nothing to train; set --train.steps above {start}")
    data = build_data(cfg, model)  # NOTE: before the run's first files: a dataset it refuses leaves nothing behind
    if world.is_main:
        for line in data.notices:
            print(line, flush=True)
        if resume_from is None and (stale := stopped_before_first_checkpoint(run_dir)):
            print(f"{run_dir}: replacing the files of a run that stopped before its first checkpoint", flush=True)
            for path in stale:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        write_atomic(run_dir / "config.toml", dump_toml(cfg))
        if hub.RESOLVED:  # what each Hub id resolved to (commit), so the run can be reproduced
            write_atomic(run_dir / SOURCES_FILE, json.dumps(hub.resolved_sources(), indent=1) + "\n")
        write_atomic(run_dir / "precision.json", json.dumps(applied.precision.to_json(), indent=2))
    if teacher is not None:  # the teacher against the student's data, and its output cache (rank 0 builds it)
        weighting.bind(cfg, data, world.is_main, torch.distributed.barrier if dims.distributed else lambda: None)
    return Run(cfg=cfg, run_dir=run_dir, device=device, world=world, dims=dims, model=model,
               precision=applied.precision, guards=guards, executor=executor, weighting=weighting, optimizer=optimizer,
               scheduler=scheduler, start_step=start, start_sample=samples, tokens_per_sample=tps, data=data,
               evaluate=evaluate, lora_base=lora_base)


def describe_layout(applied: Applied, dims: ParallelDims) -> None:
    """Rank 0's lines on what the layout chose: the pipeline's stage split, the context-parallel method."""
    if applied.stage_plan is not None:
        print(f"pipeline: {applied.stage_plan.summary()}", flush=True)
    if applied.qat:
        print("quantization-aware training: " + ", ".join(f"{c} {len(layers)} layers fake-quantized"
                                                          for c, layers in applied.qat.items()), flush=True)
    for name, report in (applied.lora or {}).items():
        print(f"lora: {report.summary(name)}", flush=True)
    if applied.sequence_parallel is not None:
        sp = applied.sequence_parallel
        print(f"context parallel: cp = {dims.cp}, {sp.method} ({sp.why})", flush=True)


def build_executor(cfg: VLAConfig, dims: ParallelDims, model: nn.Module, weighting: nn.Module, applied: Applied,
                   mesh, device: torch.device) -> tuple[Executor, torch.optim.Optimizer, Any]:
    """How each step runs - in this process, through the pipeline schedule, inside backward
    (`train.step_in_backward`), or through a DeepSpeed engine (the data-parallel step of that backend, built here
    because it wraps the optimizer) - with the optimizer (the per-component AdamW groups) and the schedule."""
    if dims.backend == "deepspeed":
        groups = build_param_groups(model, cfg.components, cfg.train.decay_all)
        engine, scheduler = build_engine(model, cfg, dims.dp, groups, lambda o: build_scheduler(o, cfg.train), device)
        return DeepSpeedExecutor(engine), scheduler.optimizer, scheduler  # ZeRO partitions our optimizer's state
    optimizer = build_optimizer(model, cfg, *split_parameters(weighting))
    if cfg.train.step_in_backward:  # (no pipeline: refused in the config)
        optimizer = apply_step_in_backward(optimizer)
        return InBackwardExecutor(), optimizer, build_scheduler(optimizer, cfg.train)
    pipeline = None
    if applied.stage is not None:
        pipeline = Pipeline(model, applied.stage, dims.pp, cfg.train.grad_accum, cfg.parallel.pp_schedule, mesh,
                            device)
    return LocalExecutor(pipeline), optimizer, build_scheduler(optimizer, cfg.train)


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Each component's learning rate (a float, or a 0-d tensor on the device for fused AdamW)."""
    return {f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups if not g["name"].endswith(".no_decay")}


def train(cfg: VLAConfig, evaluate: Evaluator | None = None) -> dict[str, float]:
    """Train as configured; returns the last logged metrics. `evaluate`: rank 0 scores every eval.every-th
    checkpoint with it (`evaluation.closed_loop.during_training`)."""
    with memory_errors():
        return _train(cfg, evaluate)


def window_metrics(run: Run, metrics: dict[str, torch.Tensor], steps: int, busy: dict[str, float],
                   elapsed: float) -> dict[str, float]:
    """The logged figures of a window of `steps` steps: the last step's metrics (averaged over ranks), learning
    rates, throughput, time per step in compute and data wait, stragglers, peak memory. One read per device."""
    if run.guards.reducer is not None:  # every rank's losses, averaged (a collective: all ranks)
        metrics = run.guards.reducer.mean_over_ranks(metrics)
    samples = steps * global_batch(run.cfg, run.dims)
    last = {**to_floats({**metrics, **group_lrs(run.optimizer)}),
            "perf/samples_per_s": samples / elapsed, "perf/tokens_per_s": samples * run.tokens_per_sample / elapsed,
            # per optimizer step: compute (`vlaforge plan --calibrate` reads it) and data wait
            "perf/step_s": busy["step"] / steps, "perf/data_s": busy["data"] / steps,
            "perf/world_size": float(run.world.size)}
    if run.guards.reducer is not None:  # stragglers: every rank's own step time (vlaforge diagnose)
        hi, lo, slowest = run.guards.reducer.spread(busy["step"] / steps, run.device)
        last |= {"perf/step_s_rank_max": hi, "perf/step_s_rank_min": lo, "perf/slowest_rank": slowest}
    if run.device.type == "cuda":  # this rank's peak, for `plan --calibrate`'s memory comparison
        last["perf/peak_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
    return last


def drain(device: torch.device) -> float:
    """Seconds spent waiting for the kernels queued so far (the steps between logging steps do not wait)."""
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _train(cfg: VLAConfig, evaluate: Evaluator | None) -> dict[str, float]:
    run = build_run(cfg, evaluate)
    run.guards.defer = True  # NOTE: a non-finite stop is raised at the next logging or checkpoint step
    cfg = run.cfg  # resolved
    t = cfg.train
    dp, main = run.dims.dp, run.world.is_main
    loader = build_loader(run.data.dataset, t.batch_size, t.seed,
                          start_sample=run.start_sample,
                          num_workers=cfg.data.num_workers, rank=run.dims.dp_rank(run.world.rank), dp=dp)
    batches = iter(loader)
    policies = dict(cfg.components.items())
    changes = schedule_changes(policies) | {run.start_step}
    logger = MetricsLogger(run.run_dir, t.tensorboard) if main else None
    show = t.progress and main
    if show:
        print(f"precision: {run.precision.summary()}", flush=True)
    last: dict[str, float] = {}
    window_start, window_steps = time.perf_counter(), 0
    busy = {"data": 0.0, "step": 0.0}  # seconds of the window waiting for batches / in train_step
    with oom_snapshot(cfg, run.device, run.run_dir):
        with progress_bar(show, "train", t.steps, run.start_step) as advance:
            for step in range(run.start_step, t.steps):
                if step in changes:
                    apply_freezing(run.model, policies, step)
                t0 = time.perf_counter()
                micro = [next(batches).to(run.device, non_blocking=True) for _ in range(t.grad_accum)]
                t1 = time.perf_counter()
                if step == run.start_step:
                    micro[0].validate()  # the data contract, checked once with a readable error
                run.guards.step = step
                with recorded_step(cfg, step + 1, run.model, run.optimizer, run.device, run.run_dir,
                                   run.world.rank) as recorded:
                    metrics = train_step(run.model, micro, run.optimizer, run.scheduler, run.weighting, t.grad_clip,
                                         run.guards, run.executor)
                busy["data"], busy["step"] = busy["data"] + t1 - t0, busy["step"] + time.perf_counter() - t1
                window_steps += 1
                done = step + 1
                if recorded and logger:
                    logger.log(done, recorded)
                logging = done % t.log_every == 0 or done == t.steps
                evaluate_now = cfg.eval.every and done % cfg.eval.every == 0
                saving = (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps or evaluate_now
                numerics = {k: v for k, v in metrics.items() if k.startswith("numerics/")}
                if numerics and logger and not logging:
                    logger.log(done, to_floats(numerics))
                if logging or saving:
                    busy["step"] += drain(run.device)  # the kernels the steps queued count as step time
                    run.guards.raise_pending(run.model)  # a stop the steps recorded (one read): nothing stopping
                    # is logged as a step or saved
                if logging:
                    last = window_metrics(run, metrics, window_steps, busy, time.perf_counter() - window_start)
                    if logger:
                        logger.log(done, last)
                    window_start, window_steps = time.perf_counter(), 0
                    busy = {"data": 0.0, "step": 0.0}
                if saving:
                    path = save(run, done)
                    if evaluate_now and main:
                        scores = run.evaluate(path)
                        logger.log(done, scores)
                        last |= scores
                    if evaluate_now and run.dims.distributed:
                        torch.distributed.barrier()  # the other ranks wait for rank 0's rollouts
                advance(f"loss {last['loss/total']:.4f}" if last else "")
    if logger:
        logger.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return last
