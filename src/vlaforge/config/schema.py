"""Config classes (pydantic v2). Unknown keys, wrong types and bad values fail before any model is built.

Every value is checked here, before any model is built: types, ranges (no inf / nan anywhere), sizes against the
flavor's positions, and combinations. The serializable description lives here; runtime objects are built
elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from vlaforge import COMPONENTS
from vlaforge.config.base import Section
from vlaforge.config.distill import DistillConfig
from vlaforge.config.lora import LoraConfig
from vlaforge.config.monitors import DiagnosticsConfig, LossScaleConfig, NumericsConfig
from vlaforge.registry import did_you_mean

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Auto = Literal["auto"]
Checkpointing = Literal["none", "full", "selective", "selective_attn", "selective_ffn", "every_nth"]
Offload = Literal["none", "cpu", "nvme"]


# Upper bounds on sizes that no run means literally; larger values are typos that would otherwise fail as
# allocation errors deep inside the model. The memory a given size needs is checked again when the run is built.
MAX_IMAGE_SIZE, MAX_TOKENS, MAX_BATCH = 4096, 65536, 1 << 20
MAX_SEED = (1 << 32) - 1  # numpy's and Meta-World's seeds are 32-bit
MAX_ENV_SEED = 40_000  # eval / generation: base seed x 100,000 + offsets stays a 32-bit environment seed


# The action heads `models/action_heads.py` registers, by name (a test keeps the two equal).
ACTION_HEAD_KINDS = ("regression", "flow_matching")
# DeepSpeed zero_optimization tuning keys passed through unchanged (no vlaforge counterpart), and those whose
# "auto" is sized from the LLM's hidden width (`distributed/deepspeed_backend.py` holds the sizes).
ZERO_TUNING = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
               "allgather_partitions", "reduce_scatter", "round_robin_gradients", "sub_group_size",
               "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save")
ZERO_AUTO_FROM_HIDDEN = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
Dim = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
SYNTHETIC_SHAPES = {"cameras": ["corner"], "state_dim": 4, "action_dim": 4}  # what "auto" means without a dataset


class PretrainedSource(Section):
    pretrained: str | None = Field(None, description="local save_pretrained folder; None builds from the flavor")


class VisionSource(PretrainedSource):
    fused: str | None = Field(None, description="a second tower's save_pretrained folder whose patch tokens are "
                              "concatenated per patch to model.vision.pretrained's (OpenVLA's Prismatic: DINOv2 + "
                              "SigLIP; each read at its penultimate block, before its final norm); same patch size")


class ActionHeadConfig(Section):
    kind: str = Field("regression", description="action head from the registry: regression | flow_matching")
    hidden: int | None = Field(None, ge=8, description="head width; None takes the flavor's")
    flow_steps: int = Field(10, ge=1, description="Euler integration steps of the flow matching head")
    layers: int = Field(2, ge=1, description="transformer layers of the flow matching velocity network")
    state_dropout: float = Field(0.0, ge=0.0, le=1.0, description="probability that a training sample's robot state "
                                 "is zeroed (its dataset mean); 1: the head never reads the state, at inference too")

    @field_validator("kind")
    @classmethod
    def _known_head(cls, v: str) -> str:
        if v not in ACTION_HEAD_KINDS:
            raise ValueError(f"unknown action head {v!r}{did_you_mean(v, ACTION_HEAD_KINDS)}; choose one of: "
                             f"{', '.join(ACTION_HEAD_KINDS)}")
        return v


class ModelConfig(Section):
    flavor: str = "tiny"
    frames: int = Field(1, ge=1, le=MAX_TOKENS, description="time steps of images per sample")
    cameras: Annotated[list[str], Field(min_length=1)] | Auto = Field(
        default_factory=lambda: list(SYNTHETIC_SHAPES["cameras"]),
        description="camera names (dataset video keys, with or without 'observation.images.'); 'auto' (the default "
                    "with data.source = 'lerobot'): every camera of the dataset in its order, at most max_cameras; "
                    "['corner'] for synthetic data")
    max_cameras: int | None = Field(None, ge=1, description="cameras = 'auto': take at most this many")
    image_size: int | None = Field(None, ge=8, le=MAX_IMAGE_SIZE, description="pixels per side; None takes the "
                                                                               "flavor's")
    patch_size: int | None = Field(None, ge=2, description="vision patch size of a tower built from the flavor "
                                                           "(smaller: finer localization, more tokens); None "
                                                           "takes the flavor's")
    vision_stem: Literal["patch", "conv"] = Field(
        "patch", description="a vision tower built from the flavor embeds patches with one strided convolution "
                             "(patch) or with a stack of stride-2 3x3 convolutions ending on the same patch grid "
                             "(conv: 'early convolutions', Xiao et al. 2021; needs a power-of-2 patch size)")
    action_chunk: int = Field(8, ge=1, le=MAX_TOKENS, description="T: actions predicted per step")
    action_dim: Dim | Auto = Field(4, description="'auto' (the default with data.source = 'lerobot'): the "
                                                  "dataset's action size")
    state_dim: Dim | Auto = Field(4, description="'auto' (the default with data.source = 'lerobot'): the dataset's "
                                                 "state size")
    env_state_dim: int = Field(0, ge=0, le=MAX_TOKENS, description="size of the dataset's "
                               "observation.environment_state (the goal position: 3) that a linear probe in the action "
                               "head predicts for the auxiliary loss term env_state (training only); 0: no probe")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="attention kernel of the vision tower and the LLM: sdpa (torch's scaled_dot_product_"
                            "attention), or eager (transformers' matmul-softmax path, for debugging or a family "
                            "that needs it); a family transformers runs only eagerly (Gemma2) gets eager with a "
                            "notice either way; context parallel replaces the LLM's with its own kernels")
    vision: VisionSource = Field(default_factory=VisionSource)
    llm: PretrainedSource = Field(default_factory=PretrainedSource)
    vlm: PretrainedSource = Field(
        default_factory=PretrainedSource,
        description="a whole pretrained vision-language model's save_pretrained folder (models/vlm.py: LLaVA) "
                    "mapped onto vision (its tower), projector (its connector), llm (its language model and LM "
                    "head), with its tokenizer and image normalization; excludes vision / llm .pretrained")
    action_head: ActionHeadConfig = Field(default_factory=ActionHeadConfig)

    @field_validator("flavor")
    @classmethod
    def _known_flavor(cls, v: str) -> str:
        from vlaforge.config.flavors import FLAVORS

        if v not in FLAVORS:
            raise ValueError(FLAVORS.unknown_message(v))
        return v

    @property
    def pretrained_tower(self) -> str | None:
        """The folder the vision tower comes from (its own, or a whole VLM's)."""
        return self.vision.pretrained or self.vlm.pretrained

    @property
    def text_folder(self) -> str | None:
        """The folder whose tokenizer and language model the LLM comes from (its own, or a whole VLM's)."""
        return self.llm.pretrained or self.vlm.pretrained

    @model_validator(mode="after")
    def _patch_fits(self) -> "ModelConfig":
        if self.vlm.pretrained and (self.vision.pretrained or self.llm.pretrained):
            raise ValueError("model.vlm.pretrained gives the vision tower and the LLM both; drop "
                             "model.vision.pretrained / model.llm.pretrained, or model.vlm.pretrained")
        if self.vision.fused and not self.vision.pretrained:
            raise ValueError("model.vision.fused is the second tower of a fused pair; give the first as "
                             "model.vision.pretrained (Prismatic: DINOv2 there, SigLIP here)")
        if self.patch_size is not None and self.pretrained_tower:
            raise ValueError("model.patch_size cannot change a pretrained vision tower; drop it or "
                             "model.vision.pretrained")
        if self.vision_stem == "conv" and self.pretrained_tower:
            raise ValueError("model.vision_stem = 'conv' replaces the patch embedding of a tower trained from "
                             "scratch; a pretrained tower keeps its own: drop one of the two")
        if not self.pretrained_tower:  # a pretrained tower's patch size is checked when it is loaded
            from vlaforge.config.flavors import FLAVORS

            vision = FLAVORS.get(self.flavor).vision
            size, patch = self.image_size or vision["image_size"], self.patch_size or vision["patch_size"]
            if size % patch and self.patch_size:
                raise ValueError(f"model.patch_size = {patch} does not divide the image size {size}; pick a divisor")
            if size % patch:
                raise ValueError(f"the image size {size} is not a multiple of the patch size {patch}; set "
                                 f"model.image_size to a multiple such as {max(patch, size - size % patch)}")
            if self.vision_stem == "conv" and patch & (patch - 1):
                raise ValueError(f"model.vision_stem = 'conv' halves the image per convolution down to the patch "
                                 f"grid, so the patch size must be a power of 2, not {patch}; set model.patch_size")
        return self

    @property
    def frames_per_sample(self) -> int:
        """F: images per sample (time steps x cameras).

        Raises:
            ConfigError: the cameras are still 'auto' (they come from the dataset when training starts).
        """
        if self.cameras == "auto":
            from vlaforge.errors import ConfigError

            raise ConfigError("model.cameras = 'auto' takes the dataset's cameras, and no dataset was read here; set "
                              "model.cameras (e.g. [\"corner\"]) or point data.path at the dataset")
        return self.frames * len(self.cameras)

    def shapes_known(self) -> bool:
        return "auto" not in (self.cameras, self.state_dim, self.action_dim)


class ComponentConfig(Section):
    """Per-component policy: precision, memory techniques, optimizer settings, freezing."""

    precision: Precision = Field("fp32", description="compute dtype: fp32 | bf16 | fp16 (with loss scaling) | fp8 "
                                                     "(torchao float8 linears, bf16 elsewhere)")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field("rowwise", description="torchao float8 scaling "
                                                         "(precision = 'fp8')")
    checkpointing: Checkpointing = Field("none", description="activation checkpointing per block: none | full | "
                                         "selective (keep attention, recompute FFN) | selective_attn | "
                                         "selective_ffn | every_nth")
    checkpoint_every_n: int = Field(2, ge=1, description="every_nth: checkpoint blocks 0, N, 2N, ...")
    offload: Offload = Field("none", description="move tensors saved for backward to cpu (pinned) or nvme files")
    offload_min_bytes: int = Field(1 << 20, ge=0, description="offload only saved tensors at least this large")
    offload_fraction: float = Field(1.0, gt=0, le=1, description="share of blocks offloaded, earliest first "
                                                                 "(non-block parts only at 1.0)")
    offload_path: str | None = Field(None, description="nvme: folder for the files (None: the system temp dir)")
    qat: Literal["none", "int4", "int3", "int2"] = Field(
        "none", description="quantization-aware training: torchao fake quantization of the component's linears (and "
                            "the LLM's token embedding) at this width; `vlaforge quantize` converts the trained "
                            "weights to exactly that forward")
    qat_group_size: int = Field(32, ge=2, description="qat: weights per scale (a power of two)")
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    trainable: bool = True
    unfreeze_at_step: int | None = Field(None, ge=0, description="a frozen component starts training here")
    unfreeze_last_blocks: int | None = Field(None, ge=1, description="at unfreeze_at_step, train only the last K "
                                                                      "blocks (and what follows them)")
    lora: LoraConfig | None = Field(None, description="low-rank adapters over the frozen base (techniques/lora.py): "
                                                      "the adapters are the component's trainable parameters")

    @model_validator(mode="after")
    def _qat_fits(self) -> "ComponentConfig":
        if self.qat_group_size & (self.qat_group_size - 1):
            raise ValueError(f"qat_group_size = {self.qat_group_size} must be a power of two (e.g. 32)")
        if self.qat != "none" and self.precision == "fp8":
            raise ValueError(f"qat = {self.qat!r} with precision = 'fp8': both replace the linears; train with "
                             "precision = 'bf16' and qat")
        if self.lora is not None and self.precision == "fp8":
            raise ValueError("lora with precision = 'fp8': fp8 linears and adapters both replace the linears; train "
                             "the adapters with precision = 'bf16' (lora.base = 'nf4' shrinks the base further)")
        if self.lora is not None and self.qat != "none":
            raise ValueError(f"lora with qat = {self.qat!r}: fake quantization and adapters both replace the "
                             "linears; train the adapters over a quantized base instead (lora.base = 'int8' | 'nf4')")
        if self.lora is not None and self.lora.base == "bf16" and self.precision == "fp32":
            raise ValueError("lora.base = 'bf16' on a component with precision = 'fp32': its linears would mix bf16 "
                             "weights with fp32 inputs; set precision = 'bf16' (or lora.base = 'nf4' / 'int8', which "
                             "dequantize to the input's dtype)")
        return self

    @model_validator(mode="after")
    def _freeze_schedule(self) -> "ComponentConfig":
        if self.unfreeze_at_step is not None and self.trainable:
            raise ValueError("unfreeze_at_step needs trainable = false (the component is frozen until then)")
        if self.unfreeze_last_blocks is not None and self.unfreeze_at_step is None:
            raise ValueError("unfreeze_last_blocks needs unfreeze_at_step")
        if self.lora is not None and not self.trainable and self.unfreeze_at_step is None:
            raise ValueError("lora on a component with trainable = false: its adapters would never train; drop "
                             "lora, or set unfreeze_at_step for when the adapters start training")
        return self


class ComponentsConfig(Section):
    vision: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=1e-5))
    projector: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=1e-4))
    llm: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=1e-4, weight_decay=0.1))
    action_head: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=5e-4, weight_decay=0.01))
    allow_fp8_vision: bool = Field(False, description="permit vision.precision = 'fp8' (off: its small gradients "
                                                      "and patch-embedding statistics lose accuracy in fp8)")

    @model_validator(mode="after")
    def _fp8_placement(self) -> "ComponentsConfig":
        if self.vision.precision == "fp8" and not self.allow_fp8_vision:
            raise ValueError("vision.precision = 'fp8' is refused: vision gradients are 10-100x smaller than the "
                             "LLM's and fp8 (e5m2 gradients, 2-3 mantissa bits) loses them; use 'bf16', or set "
                             "components.allow_fp8_vision = true to accept it")
        for name in ("projector", "action_head"):
            strategy = getattr(self, name).checkpointing
            if strategy not in ("none", "full"):
                raise ValueError(f"{name}.checkpointing = {strategy!r}: the {name} has no transformer blocks to "
                                 "checkpoint selectively; use 'none' or 'full'")
        if self.action_head.precision == "fp8":
            raise ValueError("action_head.precision = 'fp8' is refused: the head regresses continuous actions "
                             "from small layers where fp8 costs accuracy and saves nothing; use 'bf16' or 'fp32'")
        return self

    def items(self) -> list[tuple[str, ComponentConfig]]:
        return [(name, getattr(self, name)) for name in COMPONENTS]


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


class ParallelConfig(Section):
    """The layout under torchrun: data parallel (FSDP2 / HSDP / DDP / DeepSpeed ZeRO), LLM tensor parallel (with
    Megatron-style sequence parallel), context parallel and pipeline parallel."""

    dp_replicate: int = Field(1, ge=1, description="replicas (HSDP's outer dimension; DDP: all ranks)")
    dp_shard: int = Field(-1, ge=-1, description="-1: the rest of the world size")
    tp: int = Field(1, ge=1, description="tensor-parallel degree of the LLM's blocks (must divide heads and "
                                         "kv-heads)")
    pp: int = Field(1, ge=1, description="pipeline stages: stage 0 holds vision + projector + the first LLM blocks, "
                                         "the last the last blocks + LM head + action head; train.grad_accum "
                                         "micro-batches go through the pipeline (at least pp of them)")
    pp_schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="pipeline schedule (same bubble; 1f1b holds "
                                                                       "at most pp micro-batches' activations)")
    sequence_parallel: bool = Field(False, description="with tp > 1: Megatron-style sequence parallel - the "
                                    "norms and residual stream hold 1/tp of the tokens (all-gather / "
                                    "reduce-scatter at the TP boundaries instead of all-reduce)")
    cp: int = Field(1, ge=1, description="context-parallel degree: the LLM's sequence split over cp ranks")
    cp_method: Literal["ring", "ulysses", "allgather", "auto"] = "ring"
    backend: Literal["fsdp2", "ddp", "deepspeed"] = Field("fsdp2", description="deepspeed: the optional extra "
                                                                             "(pip install vlaforge[deepspeed])")
    zero_stage: int = Field(2, ge=1, le=3, description="deepspeed: ZeRO stage (1 optimizer state, 2 + gradients, "
                                                       "3 + parameters partitioned)")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field("none", description="deepspeed: optimizer state and "
                                                                                  "step on the CPU or NVMe")
    offload_param: Literal["none", "cpu", "nvme"] = Field("none", description="deepspeed ZeRO-3: parameters on the "
                                                                              "CPU or NVMe between uses")
    nvme_path: str | None = Field(None, description="deepspeed: folder on the NVMe drive for *_offload = 'nvme'")
    zero_tuning: dict[str, int | float | bool | Literal["auto"]] = Field(
        default_factory=dict, description="deepspeed: zero_optimization tuning keys passed through (bucket sizes, "
                                          "overlap_comm, stage3_* ...); 'auto' sizes reduce_bucket_size, "
                                          "stage3_prefetch_bucket_size and stage3_param_persistence_threshold from "
                                          "the LLM's hidden size, as transformers does")

    @field_validator("dp_shard")
    @classmethod
    def _shard_valid(cls, v: int) -> int:
        if v == 0:
            raise ValueError("dp_shard must be -1 (the rest of the world) or >= 1")
        return v

    @field_validator("zero_tuning")
    @classmethod
    def _known_tuning(cls, v: dict) -> dict:
        unknown = sorted(set(v) - set(ZERO_TUNING))
        if unknown:
            raise ValueError(f"unknown zero_optimization keys {unknown}; known: {', '.join(ZERO_TUNING)}")
        auto = sorted(k for k, x in v.items() if x == "auto" and k not in ZERO_AUTO_FROM_HIDDEN)
        if auto:
            raise ValueError(f"zero_optimization {auto[0]} = 'auto' has no vlaforge value; give a number (only "
                             f"{', '.join(ZERO_AUTO_FROM_HIDDEN)} take 'auto')")
        return v

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> "ParallelConfig":
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the tokens inside the tensor-parallel group; set tp > 1 (or "
                             "use cp for context parallel)")
        return self

    @model_validator(mode="after")
    def _deepspeed_fields(self) -> "ParallelConfig":
        offloads = self.offload_optimizer != "none" or self.offload_param != "none"
        if self.backend != "deepspeed" and offloads:
            raise ValueError("offload_optimizer / offload_param need backend = 'deepspeed'")
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError(f"offload_param needs zero_stage = 3 (only ZeRO-3 partitions parameters), not "
                             f"{self.zero_stage}")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path (a folder on the NVMe drive)")
        return self


class DataConfig(Section):
    source: Literal["synthetic", "lerobot"] = "synthetic"
    path: str | None = Field(None, description="LeRobotDataset v3.0 or v2.1 folder (source = 'lerobot')")
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
                             "`vlaforge data generate`)")
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
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of each group's lr")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    lr_ratio_warning: float = Field(50.0, gt=1, description="warn when max/min component lr exceeds this")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "runs/default"
    resume: str | None = Field(None, description="'latest' (in output_dir), a run folder or a checkpoint folder")
    init_from: str | None = Field(None, description="start from the model weights of a run folder or checkpoint "
                                                    "folder with the same model config (fine-tuning, e.g. "
                                                    "quantization-aware from a float policy); optimizer, schedule "
                                                    "and step start fresh; ignored when resuming")
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="0: only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    checkpoint_format: Literal["full", "sharded"] = Field(
        "full", description="full: model.safetensors + optimizer gathered on rank 0 (loads anywhere as is); "
                            "sharded: torch.distributed.checkpoint shards written by every rank (no gather; for "
                            "large models), resumable at any layout, `vlaforge export` consolidates it")
    tensorboard: bool = True
    progress: bool = True


class VLAConfig(Section):
    """A whole run: `[model]`, `[components.*]`, `[loss]`, `[parallel]`, `[data]`, `[train]`, `[loss_scale]`,
    `[numerics]`, `[eval]`, `[diagnostics]`, `[distill]`."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    components: ComponentsConfig = Field(default_factory=ComponentsConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)
    numerics: NumericsConfig = Field(default_factory=NumericsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "VLAConfig":
        if self.eval.execute > self.model.action_chunk:
            raise ValueError(f"eval.execute = {self.eval.execute} exceeds model.action_chunk = "
                             f"{self.model.action_chunk}; execute at most the predicted actions")
        if self.loss.weights.get("env_state", 0.0) > 0:
            if not self.model.env_state_dim:
                raise ValueError("loss.weights.env_state > 0 trains the action head's environment-state probe; set "
                                 "model.env_state_dim to the size of the dataset's observation.environment_state (3)")
            if self.data.source != "lerobot":
                raise ValueError("loss.weights.env_state needs data.source = 'lerobot' (a dataset with "
                                 "observation.environment_state)")
        if self.eval.every and self.data.source != "lerobot":
            raise ValueError("eval.every needs data.source = 'lerobot' (evaluation runs the policy in Meta-World)")
        for key, value in SYNTHETIC_SHAPES.items():
            if self.data.source == "lerobot" and key not in self.model.model_fields_set:
                setattr(self.model, key, "auto")  # unset: taken from the dataset (data/shapes.py)
            elif self.data.source != "lerobot" and getattr(self.model, key) == "auto":
                setattr(self.model, key, list(value) if isinstance(value, list) else value)  # no dataset to ask
        self._lora_composes()
        self.distill.check(self)
        if self.model.shapes_known():  # else checked again once the dataset has resolved them
            self._tokens_fit()
        return self

    def _lora_composes(self) -> None:
        """The layouts LoRA is not yet carried through are refused here, before anything is built (docs/lora.md)."""
        lora = [c for c, p in self.components.items() if p.lora is not None]
        if not lora:
            return
        p, t = self.parallel, self.train
        refused = {"parallel.tp > 1": p.tp > 1, "parallel.pp > 1": p.pp > 1,
                   "parallel.backend = 'deepspeed'": p.backend == "deepspeed",
                   "train.checkpoint_format = 'sharded'": t.checkpoint_format == "sharded",
                   "train.compile": t.compile}
        for what, hit in refused.items():
            if hit:
                raise ValueError(f"components.{lora[0]}.lora with {what} is not supported yet (the adapters are "
                                 "carried through FSDP2 / HSDP / DDP, checkpointing, offload and accumulation); drop "
                                 f"{what.split(' ')[0]} or the lora")

    def _tokens_fit(self) -> None:
        """The LLM sequence of one sample within the flavor's positions (a pretrained LLM is checked on load)."""
        from vlaforge.config.flavors import FLAVORS

        m, d = self.model, self.data
        if m.pretrained_tower or m.text_folder:
            return
        flavor = FLAVORS.get(m.flavor)
        size = m.image_size or flavor.vision["image_size"]
        patches = flavor.tokens_per_frame(size, m.patch_size or flavor.vision["patch_size"])
        tokens = m.frames_per_sample * patches + d.max_instruction_tokens + m.action_chunk + d.max_text_tokens
        limit = flavor.llm["max_position_embeddings"]
        if tokens > limit:
            raise ValueError(f"one sample is {tokens} LLM tokens ({m.frames_per_sample} images x {patches} patches "
                             f"+ {d.max_instruction_tokens} instruction + {m.action_chunk} action + "
                             f"{d.max_text_tokens} text) but the {m.flavor} flavor has {limit} positions; lower "
                             "model.image_size, model.frames, model.action_chunk or data.max_*_tokens")
