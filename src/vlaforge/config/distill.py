"""`[distill]`: teacher -> student distillation as an objective of the normal `vlaforge train` (training/distill.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from vlaforge.config.base import Section

DISTILL_TERMS = ("action", "kl", "feature")
DEFAULT_WEIGHTS = {"action": 1.0, "kl": 1.0, "feature": 0.1}


class DistillConfig(Section):
    """A frozen teacher VLA supervises the student next to the data loss: its action chunk (or velocity field), its
    language logits at a temperature, and its hidden states at the action queries through learned projections."""

    teacher: str | None = Field(None, description="the teacher: a run folder, a checkpoints/step_* folder or a "
                                                   "`vlaforge quantize` folder; None: no distillation")
    weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="weight of each distillation term (action: matching the teacher's actions; kl: temperature-"
                    "scaled KL on the language logits x T^2; feature: hidden-state MSE through projections); 0 turns "
                    "a term off (a term left out keeps its default); the data terms keep "
                    "loss.weights")
    temperature: float = Field(2.0, gt=0, le=100, description="T of the KL term: both distributions softened by T, "
                                                              "the KL scaled by T^2 (Hinton et al. 2015)")
    action: Literal["mse", "huber"] = Field("mse", description="distance to the teacher's actions (or velocities)")
    flow_target: Literal["velocity", "chunk"] = Field(
        "velocity", description="flow-matching heads: velocity matches the teacher's velocity field at the "
                                "student's own noisy points (online teacher only); chunk trains the student's flow "
                                "towards the teacher's sampled chunk (works from the cache)")
    layers: Literal["uniform"] | list[tuple[int, int]] = Field(
        "uniform", description="student -> teacher LLM layers for the feature term (1-based block outputs): "
                               "uniform pairs student block i with teacher block round(i * Lt / Ls); or explicit "
                               "[[s, t], ...] pairs")
    projections: bool = Field(True, description="learned linear maps from student to teacher width per layer pair "
                                                "(trained with the student, not saved in its checkpoint weights); "
                                                "off: the widths must be equal")
    teacher_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="the teacher's compute dtype (auto: bf16 on CUDA, fp32 on CPU); a quantized teacher "
                            "keeps its quantized components")
    cache: str | None = Field(None, description="a file of the teacher's outputs on every dataset sample (no "
                                                "augmentation), built when missing and rebuilt when the teacher, "
                                                "the dataset or the objective changed; later epochs then do not run "
                                                "the teacher. None: the teacher runs on every batch")
    init: Literal["scratch", "teacher"] = Field(
        "scratch", description="teacher: start the student from the teacher where shapes allow (the vision tower, "
                               "projector, action head, embeddings and every k-th LLM block); scratch: random")

    @field_validator("weights")
    @classmethod
    def _known_terms(cls, v: dict[str, float]) -> dict[str, float]:
        from vlaforge.registry import did_you_mean

        for k, w in v.items():
            if k not in DISTILL_TERMS:
                raise ValueError(f"unknown distillation term {k!r}{did_you_mean(k, DISTILL_TERMS)}; choose from "
                                 f"{', '.join(DISTILL_TERMS)}")
            if not (w >= 0):
                raise ValueError(f"distill.weights.{k} = {w} must be >= 0 (0 turns the term off)")
        return {k: float(v.get(k, DEFAULT_WEIGHTS[k])) for k in DISTILL_TERMS}

    @field_validator("layers")
    @classmethod
    def _pairs_positive(cls, v):
        if v != "uniform":
            if not v:
                raise ValueError("distill.layers needs at least one [student, teacher] pair, or 'uniform'")
            if any(s < 1 or t < 1 for s, t in v):
                raise ValueError("distill.layers pairs count block outputs from 1, e.g. [[1, 2], [2, 4]]")
        return v

    def active(self, term: str) -> bool:
        return self.teacher is not None and self.weights.get(term, 0.0) > 0

    def check(self, cfg) -> None:
        """Combinations with the rest of the run that cannot work (raises ValueError with the fix)."""
        if self.teacher is None:
            return
        if not any(self.weights[t] > 0 for t in DISTILL_TERMS):
            raise ValueError("distill.teacher is set but every distill.weights term is 0; give one a weight")
        p = cfg.parallel
        for name, value in (("pp", p.pp), ("tp", p.tp), ("cp", p.cp)):
            if value > 1:
                raise ValueError(f"distillation runs with data parallel only; parallel.{name} = {value} splits the "
                                 f"student's layers or sequence: set parallel.{name} = 1")
        if p.backend == "deepspeed":
            raise ValueError("distillation runs on the fsdp2 / ddp backends; set parallel.backend = 'fsdp2'")
        if self.active("kl") and (cfg.loss.weights.get("language", 0) <= 0 or cfg.data.max_text_tokens == 0):
            raise ValueError("distill.weights.kl distils the language logits at the text targets, which the student "
                             "computes only with loss.weights.language > 0 and data.max_text_tokens > 0; set them, or "
                             "distill.weights.kl = 0")
        flow = cfg.model.action_head.kind == "flow_matching"
        if self.cache and flow and self.flow_target == "velocity" and self.active("action"):
            raise ValueError("distill.cache holds the teacher's sampled chunk; matching its velocity needs the teacher "
                             "at the student's own noisy points: set distill.flow_target = 'chunk' or drop "
                             "distill.cache")
