"""Config sections of what watches a run: loss scaling, the gradient numerics monitor, the diagnostics recorder."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from vlaforge.config.base import Section


class LossScaleConfig(Section):
    """Dynamic loss scaling (Megatron-style: growth window + hysteresis) for fp16 compute."""

    mode: Literal["auto", "always", "off"] = Field(
        "auto", description="auto: scale when a trainable component computes in fp16, else scale 1.0; always: "
                            "scale in bf16/fp32 too; off: never (fp16 gradients may underflow)")
    initial: float = Field(1024.0, gt=0, description="starting scale (2^10)")
    growth_factor: float = Field(2.0, gt=1)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: int = Field(1000, ge=1, description="finite steps in a row before the scale grows")
    hysteresis: int = Field(2, ge=1, description="overflowing steps tolerated before the scale backs off")
    min_scale: float = Field(1.0, gt=0, description="floor; overflowing at the floor is an error")


class NumericsConfig(Section):
    """Gradient numerics monitor (diagnostics/numerics.py)."""

    every: int = Field(50, ge=0, description="measure per-component gradient statistics every N steps (0: never)")
    zero_jump: float = Field(0.2, gt=0, le=1, description="warn when a component's exactly-zero gradient fraction "
                                                          "rises this much above its lowest value")
    norm_ratio: float = Field(1e-3, gt=0, description="warn when an fp16 component's gradient norm falls below "
                                                      "this fraction of the llm's")
    check_finite: bool = Field(True, description="without loss scaling: a step with a non-finite gradient is "
                                                 "skipped on the device (no host read), and training stops at "
                                                 "the next logging or checkpoint step, naming the components")


class DiagnosticsConfig(Section):
    """What the trainer records for `vlaforge diagnose` beyond its per-window metrics (training/recorder.py)."""

    memory_steps: list[int] = Field(default_factory=list, description="steps whose memory is logged per component "
                                                                      "and kind (params, grads, optimizer, "
                                                                      "activations; on CUDA the peak and the rest)")
    profile_steps: list[int] = Field(default_factory=list, description="steps traced with torch.profiler "
                                                                       "(RUN/traces/, Chrome format) and read for "
                                                                       "the communication share and overlap")
    oom_snapshot: bool = Field(False, description="CUDA: record the allocator's history (a little host time per "
                                                  "allocation) and dump RUN/oom_snapshot.pickle "
                                                  "(pytorch.org/memory_viz) when a step runs out of memory")

    @field_validator("memory_steps", "profile_steps")
    @classmethod
    def _positive_steps(cls, v: list[int]) -> list[int]:
        if any(s < 1 for s in v):
            raise ValueError("steps count from 1 (the step number metrics.jsonl logs)")
        return sorted(set(v))
