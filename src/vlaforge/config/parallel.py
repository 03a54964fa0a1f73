"""`[parallel]`: the layout under torchrun (data, tensor, sequence, context and pipeline parallel) and the
DeepSpeed backend's ZeRO settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from vlaforge.config.base import Section

# DeepSpeed zero_optimization tuning keys passed through unchanged (no vlaforge counterpart), and those whose
# "auto" is sized from the LLM's hidden width (`distributed/deepspeed_backend.py` holds the sizes).
ZERO_TUNING = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
               "allgather_partitions", "reduce_scatter", "round_robin_gradients", "sub_group_size",
               "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save")
ZERO_AUTO_FROM_HIDDEN = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


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
