"""What a run reads and does: `[data]` (synthetic or a LeRobot dataset), `[loss]`, `[train]` and `[eval]`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from vlaforge.config.base import MAX_BATCH, MAX_ENV_SEED, MAX_SEED, MAX_TOKENS, Section

LossTerm = Literal["contrastive", "language", "action", "env_state"]


class LossConfig(Section):
    weighting: Literal["static", "uncertainty", "dwa", "gradnorm"] = "static"
    weights: dict[LossTerm, float] = Field(
        default_factory=lambda: {"contrastive": 0.3, "language": 0.4, "action": 0.3},
        description="static weights; a term with weight 0 is not computed (also under dynamic weighting)")
    required: list[Literal["language", "env_state"]] = Field(
        default_factory=list, description="terms that need a dataset column (language: data.text_column, env_state: "
        "observation.environment_state) and must find it; the others are turned off with one line when the dataset "
        "lacks it. A weight set on the command line adds its term")
    action: Literal["l1", "mse", "huber"] = "huber"
    huber_delta: float = Field(1.0, gt=0)
    smoothness: float = Field(0.0, ge=0, description="weight of the consecutive-action smoothness term")
    dwa_temperature: float = Field(2.0, gt=0)
    gradnorm_alpha: float = Field(1.5, ge=0)
    weighting_lr: float = Field(0.025, gt=0, description="lr of learned loss weights (uncertainty, gradnorm)")

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in v.values()):
            raise ValueError("loss weights must be >= 0")
        if v.get("action", 0.0) <= 0:
            raise ValueError("the action term needs a weight > 0 (it is what the policy is for)")
        return v

class DataConfig(Section):
    source: Literal["synthetic", "lerobot"] = "synthetic"
    path: str | None = Field(None, description="LeRobotDataset v3.0 or v2.1 folder (source = 'lerobot'), or a Hub "
                                                "dataset id (lerobot/libero[@revision]) found in data.root, else "
                                                "HF_LEROBOT_HOME/<id> (LeRobot's rule), downloaded there when "
                                                "missing unless HF_HUB_OFFLINE is set")
    root: str | None = Field(None, description="the local folder of the Hub dataset data.path names, instead of "
                                               "HF_LEROBOT_HOME/<id> (LeRobot's --dataset.root)")
    revision: str | None = Field(None, description="the Hub dataset's branch, tag or commit (default: LeRobot's "
                                                   "v3.0 tag, else the default branch)")
    episodes: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = Field(
        None, description="train on these episode indices only (LeRobot's --dataset.episodes); a Hub dataset "
                          "downloads only their files")
    num_samples: int = Field(1024, ge=1, description="synthetic: samples per epoch")
    num_tasks: int = Field(4, ge=1, description="synthetic: distinct tasks (instruction + goal)")
    max_instruction_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    max_text_tokens: int = Field(8, ge=0, le=MAX_TOKENS, description="length of language-loss targets; 0 disables "
                                                                    "them")
    text_column: str = Field("auto", description="lerobot: per-frame text used as language target; 'auto': "
                                                 "annotation.phase, else LeRobot 0.6's language_persistent.subtask "
                                                 "(the active subtask), else none (the language term is turned off "
                                                 "with a line unless loss.required names it)")
    frame_stride: int = Field(1, ge=1, description="lerobot: steps between the frames of the history "
                                                   "(model.frames)")
    augment_shift: int = Field(4, ge=0, description="lerobot: random image shift in pixels (pad + crop)")
    augment_color: float = Field(0.1, ge=0, le=0.5, description="lerobot: brightness/contrast/saturation jitter")
    cache_mb: float = Field(2048, ge=0, description="lerobot: decoded frames kept in memory; a dataset that fits "
                                                    "is decoded once up front and shared by the workers")
    num_workers: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _path_for_lerobot(self) -> "DataConfig":
        if self.source == "lerobot" and not self.path:
            raise ValueError("data.source = 'lerobot' needs data.path (a dataset folder from "
                             "`vlaforge data generate`, or a Hub dataset id)")
        if self.episodes is not None and len(set(self.episodes)) != len(self.episodes):
            dup = next(e for e in self.episodes if self.episodes.count(e) > 1)
            raise ValueError(f"data.episodes lists episode {dup} twice; list each episode once")
        if (self.root or self.revision) and self.path:
            from vlaforge.data.hub_dataset import dataset_id

            if dataset_id(self.path) is None:
                which = "data.root" if self.root else "data.revision"
                raise ValueError(f"{which} applies to a Hub dataset id in data.path (org/name), and "
                                 f"{self.path!r} is not one; drop {which} or give the id")
        return self


class EvalConfig(Section):
    """Closed-loop evaluation in Meta-World (`vlaforge eval`, and during training when `every` > 0)."""

    tasks: list[str] | None = Field(None, description="Meta-World tasks; None: the tasks the dataset was made of")
    episodes: int = Field(50, ge=1, description="held-out episodes per task")
    execute: int = Field(1, ge=1, description="actions executed from each predicted chunk before re-planning "
                                              "(receding horizon; at most model.action_chunk)")
    max_steps: int = Field(200, ge=1, description="steps before an episode counts as failed")
    workers: int = Field(2, ge=1, description="rollout processes")
    seed: int = Field(0, ge=0, le=MAX_ENV_SEED, description="base seed of the held-out initial positions")
    video: bool = Field(True, description="write one MP4 rollout per task")
    every: int = Field(0, ge=0, description="during training: evaluate every N steps (0: never)")
    train_episodes: int = Field(10, ge=1, description="during training: episodes per task")

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            from vlaforge.data.metaworld import TASKS

            for name in v:
                if name not in TASKS:
                    raise ValueError(TASKS.unknown_message(name))
        return v


class TrainConfig(Section):
    @model_validator(mode="after")
    def _sync_keeps_the_math(self) -> "TrainConfig":
        if self.sync_every > self.grad_accum:
            raise ValueError(f"sync_every = {self.sync_every} > grad_accum = {self.grad_accum} would step the "
                             "optimizer with gradients never reduced across ranks (local SGD), which changes the "
                             f"math; use 1..{self.grad_accum} (0: reduce once, on the last micro-batch)")
        return self

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each AdamW beta must be in [0, 1), e.g. [0.9, 0.95]")
        return v

    steps: int = Field(100, ge=1, le=1 << 40, description="optimizer steps")
    compile: bool = Field(False, description="torch.compile each transformer block of the vision tower and the LLM "
                                             "(after checkpointing / offload wrapping, before FSDP2), torchtitan's "
                                             "per-block unit: repeated blocks compile once")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="micro-batch per rank per forward")
    grad_accum: int = Field(1, ge=1, le=MAX_BATCH, description="micro-batches per optimizer step")
    sync_every: int = Field(0, ge=0, description="data parallel: reduce gradients every N micro-batches (0: once, "
                                                 "on the last; smaller N sends more but FSDP2 then keeps sharded "
                                                 "instead of full gradients between micro-batches)")
    precision_master: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of weights, gradients and optimizer state of components not in fp32 "
                            "(bf16: half the memory, updates lose low-order bits)")
    lr_schedule: Literal["cosine", "constant", "cosine_decay_with_warmup"] = Field(
        "cosine", description="cosine: linear warmup from lr / warmup_steps, then cosine over the remaining steps to "
                              "the floor; constant: the same warmup, then each group's lr; cosine_decay_with_warmup: "
                              "LeRobot 0.6.1's scheduler of that name (pi0, pi0.5, SmolVLA): warmup from lr / "
                              "(warmup_steps + 1), cosine over steps 0..decay_steps (warmup included) to the floor, "
                              "then the floor; a run shorter than decay_steps scales warmup to int(warmup_steps x "
                              "steps / decay_steps) and decays over its steps, as LeRobot does")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup (LeRobot's num_warmup_steps)")
    decay_steps: int | None = Field(None, ge=1, le=1 << 40, description=(
        "cosine_decay_with_warmup: steps of the cosine (LeRobot's num_decay_steps, e.g. pi0's 30000); unset: "
        "train.steps"))
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of each group's lr "
                                                             "(LeRobot's decay_lr / peak_lr)")
    decay_all: bool = Field(False, description="weight decay on every parameter, norms, biases and scalars too, as "
                                               "LeRobot's AdamW over the policy's parameters; off: parameters with "
                                               "fewer than 2 dimensions are not decayed")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    step_in_backward: bool = Field(False, description="step each parameter and free its gradient during backward, "
                                   "as soon as its gradient is complete (the last micro-batch's): the whole "
                                   "gradient is never held at once (with grad_accum = 1). Exact; needs grad_clip = "
                                   "0 and no fp16 loss scaling, one process or FSDP2 (docs/precision.md)")
    lr_ratio_warning: float = Field(50.0, gt=1, description="warn when max/min component lr exceeds this")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "runs/default"
    resume: str | None = Field(None, description="'latest' (in output_dir), a run folder or a checkpoint folder")
    init_from: str | None = Field(None, description="start from the model weights of a run folder or checkpoint "
                                                    "folder with the same model config (fine-tuning, e.g. "
                                                    "quantization-aware from a float policy); optimizer, schedule "
                                                    "and step start fresh; ignored when resuming")
    lora_random_base: bool = Field(False, description="let LoRA components train over a randomly initialised base "
                                   "(tests and benchmarks of the technique itself); off, training refuses a LoRA "
                                   "component without train.init_from or its pretrained folder")
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="0: only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    checkpoint_format: Literal["full", "sharded"] = Field(
        "full", description="full: model.safetensors + optimizer gathered on rank 0 (loads anywhere as is); "
                            "sharded: torch.distributed.checkpoint shards written by every rank (no gather; for "
                            "large models), resumable at any layout, `vlaforge export` consolidates it")
    tensorboard: bool = True
    progress: bool = True
