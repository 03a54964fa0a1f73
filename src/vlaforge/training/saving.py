"""Saving a run and resuming it, whatever runs its steps: rank 0's files, a sharded model's gathered state or every
rank's own shards (`checkpoint_format = "sharded"`), a DeepSpeed engine's partitions, a LoRA run's adapters; and
the reverse, every piece of the run put back as the checkpoint left it (`checkpoints/` reads and writes the files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from vlaforge.checkpoints import lora as lora_checkpoint
from vlaforge.checkpoints.layout import DCP_DIR, is_sharded, temporary_folder
from vlaforge.checkpoints.load import load_checkpoint, load_trainer_state
from vlaforge.checkpoints.save import save_checkpoint
from vlaforge.config.loading import dump_toml
from vlaforge.distributed.deepspeed_backend import full_weights, load_engine, save_engine
from vlaforge.distributed.state import (
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
    load_sharded,
    save_sharded,
)
from vlaforge.errors import VlaforgeError
from vlaforge.models.build import BACKBONES_FILE, backbone_configs
from vlaforge.outputs import write_atomic
from vlaforge.seeding import rng_state, set_rng_state
from vlaforge.training.loss_scale import LossScaler
from vlaforge.training.run import Run, global_batch


def trainer_state(run: Run, step: int, optimizer: bool = True) -> dict[str, Any]:
    """Optimizer (full, keyed by parameter name; left out for sharded checkpoints, which hold it in their shards),
    schedule, loss weighting, scaler, RNG."""
    samples = run.start_sample + (step - run.start_step) * global_batch(run.cfg, run.dims)
    state = {"step": step, "samples": samples, "scheduler": run.scheduler.state_dict(),
             "weighting": run.weighting.state_dict(), "loss_scale": run.guards.scaler.state_dict(),
             "rng": rng_state(), "world_size": run.dims.world_size}
    if optimizer:  # by name: loads at any layout
        state["optimizer"] = full_optimizer_state(run.model, run.weighting, run.optimizer, run.dims.pp)
    return state


def restore(path: Path, model, weighting, optimizer, scheduler, scaler: LossScaler, distributed: bool,
            step_samples: int, engine=None) -> tuple[int, int]:
    """Load a checkpoint into the run's pieces; returns (step, global samples consumed). `step_samples`: this
    run's samples per step, for checkpoints written before the count was kept (all single-process). `engine`: a
    DeepSpeed run's engine, which restores its own partitions."""
    if engine is not None:
        state = load_trainer_state(path)
        load_engine(engine, path, state.get("world_size"), torch.distributed.get_world_size())
    elif is_sharded(path):
        state = load_trainer_state(path)
        load_sharded(path / DCP_DIR, model, weighting, optimizer)  # resharded to this run's layout
    else:
        state = load_checkpoint(path, model, sharded=distributed)
        if "optimizer" not in state:
            raise VlaforgeError(f"checkpoint {path} holds DeepSpeed's optimizer partitions; resume it with "
                                "parallel.backend = 'deepspeed' at the world size that wrote it")
        if isinstance(state["optimizer"]["param_groups"][0]["params"][0], int):
            optimizer.load_state_dict(state["optimizer"])  # written before optimizer state was keyed by name
        else:
            load_full_optimizer_state(model, weighting, optimizer, state["optimizer"])
    # the position only: base learning rates come from the config, one per parameter group of this run (a
    # pipeline stage has fewer groups than the run that saved)
    position = {k: state["scheduler"][k] for k in ("last_epoch", "_step_count")}
    scheduler.load_state_dict({**scheduler.state_dict(), **position})
    weighting.load_state_dict(state["weighting"])
    if "loss_scale" in state:
        scaler.load_state_dict(state["loss_scale"])
    set_rng_state(state["rng"])
    step = int(state["step"])
    return step, int(state.get("samples", step * step_samples))


def save(run: Run, step: int) -> Path | None:
    """Write a checkpoint. Rank 0 writes the files; with a sharded model every rank takes part: gathering the full
    state, or writing its own shards (`checkpoint_format = "sharded"`, and DeepSpeed's optimizer partitions)."""
    t, distributed, engine = run.cfg.train, run.dims.distributed, getattr(run.executor, "engine", None)
    sharded = t.checkpoint_format == "sharded"
    prepared = sharded or engine is not None  # every rank writes into the temporary folder first
    if prepared:
        tmp = temporary_folder(run.run_dir, step)
        if run.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if distributed:
            torch.distributed.barrier()  # the folder exists before any rank writes into it
    weights = None
    if engine is not None:
        weights = full_weights(engine)
        save_engine(engine, tmp)
    elif sharded:
        save_sharded(tmp / DCP_DIR, run.model, run.weighting, run.optimizer)
    elif distributed:
        weights = full_model_state(run.model, run.dims.pp)
    if run.lora_base is not None:  # the adapters (and the components trained in full), not the frozen base
        weights = lora_checkpoint.checkpoint_weights(run.lora_base, run.model.state_dict() if weights is None
                                                     else weights)
    state = trainer_state(run, step, optimizer=not prepared)
    path = None
    if run.world.is_main:
        path = save_checkpoint(run.run_dir, step, run.model, state, dump_toml(run.cfg), t.keep_checkpoints,
                                    extra=lambda folder: save_policy_files(run, folder, weights), weights=weights,
                                    prepared=prepared)
        if run.cfg.lerobot.layout:  # `vlaforge lerobot-train`: LeRobot's layout beside (OUT/checkpoints/<step>/)
            from vlaforge.checkpoints.lerobot_folder import write_lerobot_checkpoint

            write_lerobot_checkpoint(path, run.run_dir, step, t.steps, lerobot_record(run.cfg))
    if distributed:
        torch.distributed.barrier()  # no rank runs ahead of a checkpoint it may need to resume from
    return path


def lerobot_record(cfg) -> dict[str, Any]:
    """pretrained_model/train_config.json of a lerobot-train run: the command it was started with, the vlaforge
    run it became, and what LeRobot's own loaders need to know is not there (LeRobot cannot resume it)."""
    return {"lerobot_train": cfg.lerobot.command, "job_name": cfg.lerobot.job_name, "repo_id": cfg.lerobot.repo_id,
            "output_dir": cfg.train.output_dir, "steps": cfg.train.steps, "batch_size": cfg.train.batch_size,
            "seed": cfg.train.seed, "written_by": "vlaforge lerobot-train (resume it with vlaforge lerobot-train "
                                                   "--resume=true --config_path=THIS_FILE)"}


def save_policy_files(run: Run, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """What a checkpoint needs beyond its weights to load and predict on its own: the observation spec and the
    tokenizer (training's, or the pretrained LLM's), and the pretrained components' configs (backbones.json), so
    it loads after the pretrained folders it started from are gone."""
    if run.data.tokenizer is None and run.cfg.model.text_folder:  # synthetic data: the LLM's own tokenizer,
        from vlaforge.data.tokenizer import pretrained_tokenizer  # read at the first save and held after it

        run.data.tokenizer = pretrained_tokenizer(run.cfg.model.text_folder)
    run.data.save_policy_files(folder)
    if run.lora_base is not None:
        lora_checkpoint.write_record(folder, run.lora_base, weights)
    backbones = backbone_configs(run.model, run.cfg.model)
    if backbones:
        write_atomic(folder / BACKBONES_FILE, json.dumps(backbones, indent=1, default=str))


