"""Config classes (pydantic v2). Unknown keys, wrong types and bad values fail before any model is built.

Every value is checked before any model is built: types, ranges (no inf / nan anywhere), sizes against the flavor's
positions, and combinations. Each section lives next to its concern (`model.py`, `components.py`, `parallel.py`,
`run.py`: data / loss / train / eval; `monitors.py`, `distill.py`, `lora.py`); `VLAConfig` here holds them and the
checks across sections. The serializable description lives here; runtime objects are built elsewhere.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from vlaforge.config.base import MAX_ENV_SEED, Section
from vlaforge.config.components import ComponentConfig, ComponentsConfig
from vlaforge.config.distill import DistillConfig
from vlaforge.config.lerobot_run import LeRobotRunConfig
from vlaforge.config.model import ACTION_HEAD_KINDS, SYNTHETIC_SHAPES, ActionHeadConfig, ModelConfig
from vlaforge.config.monitors import DiagnosticsConfig, LossScaleConfig, NumericsConfig
from vlaforge.config.parallel import ZERO_AUTO_FROM_HIDDEN, ZERO_TUNING, ParallelConfig
from vlaforge.config.run import DataConfig, EvalConfig, LossConfig, TrainConfig

# what other modules import from here (the sections moved to their own modules)
__all__ = ["ACTION_HEAD_KINDS", "MAX_ENV_SEED", "ZERO_AUTO_FROM_HIDDEN", "ZERO_TUNING", "ActionHeadConfig",
           "ComponentConfig", "ComponentsConfig", "DataConfig", "EvalConfig", "LossConfig", "ModelConfig",
           "ParallelConfig", "TrainConfig", "VLAConfig"]


class VLAConfig(Section):
    """A whole run: `[model]`, `[components.*]`, `[loss]`, `[parallel]`, `[data]`, `[train]`, `[loss_scale]`,
    `[numerics]`, `[eval]`, `[diagnostics]`, `[distill]`, `[lerobot]`."""

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
    lerobot: LeRobotRunConfig = Field(default_factory=LeRobotRunConfig)

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
        if self.model.lerobot.pretrained:
            self._policy_techniques()
        elif self.lerobot.layout:
            raise ValueError("lerobot.layout writes LeRobot's checkpoint layout of a LeRobot policy fine-tune, and "
                             "model.lerobot.pretrained names no policy; drop lerobot.layout or give the policy")
        self._lora_composes()
        if self.train.step_in_backward:
            self._steps_in_backward()
        self.distill.check(self)
        if self.model.shapes_known():  # else checked again once the dataset has resolved them
            self._tokens_fit()
        return self

    def _policy_techniques(self) -> None:
        """A LeRobot policy (`model.lerobot.pretrained`) trains with the techniques verified on its joint layers;
        the others are refused here, before anything is built. Its one loss term weighs 1 unless set."""
        if "weights" not in self.loss.model_fields_set:
            self.loss.__dict__["weights"] = {"action": 1.0}  # NOTE: not through validate_assignment
        why = "is not built for LeRobot policies yet (their joint layers call both blocks' sub-layers directly)"
        defaults = ComponentConfig()
        for c, comp in self.components.items():
            for name in ("offload", "qat"):
                if getattr(comp, name) != getattr(defaults, name):
                    raise ValueError(f"components.{c}.{name} = {getattr(comp, name)!r} {why}; drop it (no offload "
                                     "or QAT)")
            if comp.precision == "fp8":
                raise ValueError(f"components.{c}.precision = 'fp8' is not built for LeRobot policies (not measured "
                                 "on a GPU yet); use 'bf16' or 'fp16'")
        # precision: the joint layer's one attention spans the VLM's and the expert's queries, so the expert's blocks
        # compute in the LLM's precision (models/policies/model.py:precision_regions)
        llm_p, head_p = self.components.llm.precision, self.components.action_head.precision
        if llm_p != head_p:
            raise ValueError(f"components.llm.precision = {llm_p!r} and components.action_head.precision = "
                             f"{head_p!r}: a LeRobot policy's joint layers run the VLM's and the expert's blocks in "
                             "one attention, so the two compute in one precision; set both to the same")
        # checkpointing: the tower's blocks as any tower's; the LLM's unit is the joint layer (VLM block i and the
        # expert block it meets, recomputed together), whole or every n-th; the expert's blocks have no unit of
        # their own, and the selective strategies' sub-layers are one block's, not a joint layer's two
        llm, head = self.components.llm.checkpointing, self.components.action_head.checkpointing
        if llm.startswith("selective"):
            raise ValueError(f"components.llm.checkpointing = '{llm}' is not built for LeRobot policies: their unit "
                             "is the joint layer (a VLM block and an expert block), which 'full' and 'every_nth' "
                             "recompute whole; use one of those")
        if head != "none":
            raise ValueError(f"components.action_head.checkpointing = '{head}': a LeRobot policy's expert blocks run "
                             "inside the joint layers, which components.llm.checkpointing recomputes; set that "
                             "instead")
        p, extra = self.parallel, {k: v for k, v in self.loss.weights.items() if k != "action" and v > 0}
        for what, hit in {"parallel.tp > 1": p.tp > 1, "parallel.pp > 1": p.pp > 1, "parallel.cp > 1": p.cp > 1,
                          "distill.teacher": self.distill.teacher is not None,
                          f"loss.weights.{next(iter(extra), '')}": bool(extra)}.items():
            if hit:
                raise ValueError(f"{what} {why}; drop {what.split(' ')[0]}")

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

    def _steps_in_backward(self) -> None:
        """What `train.step_in_backward` cannot do exactly (techniques/step_in_backward.py): every rule the plain
        step applies to all gradients at once, after the last one, and layouts whose gradients are complete only
        after backward."""
        t, p, why = self.train, self.parallel, "train.step_in_backward steps each parameter during backward"
        if t.grad_clip > 0:
            raise ValueError(f"{why}, before the global gradient norm that train.grad_clip = {t.grad_clip:g} clips "
                             "by is known; set train.grad_clip = 0 (lerobot-train: --policy.optimizer_grad_clip_norm"
                             "=0), or drop step_in_backward")
        fp16 = [c for c, comp in self.components.items() if comp.precision == "fp16"
                and (comp.trainable or comp.unfreeze_at_step is not None)]
        if self.loss_scale.mode == "always" or (self.loss_scale.mode == "auto" and fp16):
            what = f"components.{fp16[0]}.precision = 'fp16'" if fp16 else "loss_scale.mode = 'always'"
            raise ValueError(f"{what} scales the loss and skips a step whose gradients overflow, and {why} (a "
                             "parameter that stepped cannot be taken back); use 'bf16', or loss_scale.mode = 'off'")
        layouts = {"parallel.backend = 'deepspeed'": (p.backend == "deepspeed", "its engine reduces, clips and "
                                                      "steps after backward"),
                   "parallel.pp > 1": (p.pp > 1, "the tied embeddings' gradients are summed across stages after the "
                                                 "schedule's backward"),
                   "parallel.tp > 1": (p.tp > 1, "the q/k norms' partial gradients are summed over the TP group "
                                                 "after backward"),
                   "parallel.cp > 1": (p.cp > 1, "it is not verified with context parallel yet")}
        for what, (hit, because) in layouts.items():
            if hit:
                raise ValueError(f"{what} with train.step_in_backward is refused: {because}; drop "
                                 f"{what.split(' ')[0]} or step_in_backward (one process and FSDP2 run it)")

    def _tokens_fit(self) -> None:
        """The LLM sequence of one sample within the flavor's positions (a pretrained LLM is checked on load)."""
        from vlaforge.config.flavors import FLAVORS

        m, d = self.model, self.data
        if m.pretrained_tower or m.text_folder or m.lerobot.pretrained:
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
