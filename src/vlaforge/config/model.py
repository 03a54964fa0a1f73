"""`[model]`: the four components' sources (a flavor, pretrained folders, a whole VLM), the camera and action
shapes ("auto": from the dataset), and the action head."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from vlaforge.config.base import MAX_IMAGE_SIZE, MAX_TOKENS, Section
from vlaforge.registry import did_you_mean

Auto = Literal["auto"]
# The action heads `models/action_heads.py` registers, by name (a test keeps the two equal).
ACTION_HEAD_KINDS = ("regression", "flow_matching")
Dim = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
SYNTHETIC_SHAPES = {"cameras": ["corner"], "state_dim": 4, "action_dim": 4}  # what "auto" means without a dataset


class PretrainedSource(Section):
    pretrained: str | None = Field(None, description="a save_pretrained folder or a Hub id (org/name[@revision], "
                                                     "from the Hugging Face cache or downloaded there); None builds "
                                                     "from the flavor")


class VisionSource(PretrainedSource):
    fused: str | None = Field(None, description="a second tower's save_pretrained folder whose patch tokens are "
                              "concatenated per patch to model.vision.pretrained's (OpenVLA's Prismatic: DINOv2 + "
                              "SigLIP; each read at its penultimate block, before its final norm); same patch size")


class LeRobotSource(Section):
    pretrained: str | None = Field(
        None, description="a folder LeRobot 0.6.x wrote (save_pretrained / lerobot-train): config.json with type "
                          "smolvla, pi0 or pi05, model.safetensors, policy_preprocessor.json / "
                          "policy_postprocessor.json; or its Hub id (lerobot/smolvla_base[@revision]), read from "
                          "the Hugging Face cache or downloaded there. "
                          "The policy is the model (its VLM, expert and pipelines; docs/lerobot_policies.md); "
                          "excludes model.vlm / vision / llm .pretrained")
    vlm: str | None = Field(None, description="SmolVLA: the VLM folder or Hub id to use instead of the one its "
                                              "config.json's vlm_model_name names (that one resolves through the "
                                              "Hugging Face cache by itself)")
    tokenizer: str | None = Field(None, description="a tokenizer folder or Hub id to use instead of the one the "
                                                    "pipeline's tokenizer step names (pi0's "
                                                    "google/paligemma-3b-pt-224, resolved through the cache by "
                                                    "itself)")
    config: dict[str, Any] = Field(default_factory=dict, description="fields of the policy's config.json replaced "
                                   "for this run, as lerobot-train's --policy.FIELD=VALUE replaces them (e.g. "
                                   "{n_action_steps = 10}); each must be a field of the policy's type")
    sizes: str | None = Field(None, description="pi0: a JSON file declaring sizes other than LeRobot's variants: "
                                                "{\"variants\": {name: {width, depth, mlp_dim, num_heads, "
                                                "num_kv_heads, head_dim}}, \"vision\": {SigLIP config keys}, "
                                                "\"vocab_size\": N, \"projection_dim\": N}")


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
    lerobot: LeRobotSource = Field(default_factory=LeRobotSource)

    @field_validator("flavor")
    @classmethod
    def _known_flavor(cls, v: str) -> str:
        from vlaforge.config.flavors import FLAVORS

        if v not in FLAVORS:
            raise ValueError(FLAVORS.unknown_message(v))
        return v

    def _policy_chunk(self) -> None:
        """A LeRobot policy predicts its own chunk_size actions from one frame per camera: model.action_chunk
        follows it (a different value set explicitly is refused), model.frames stays 1."""
        import json
        from pathlib import Path

        from vlaforge import hub
        from vlaforge.errors import VlaforgeError

        try:  # a Hub id resolves to its cached snapshot (config.json only; the builder fetches the weights)
            folder = hub.local_folder(self.lerobot.pretrained, "model.lerobot.pretrained", hub.POLICY_CONFIG)
            chunk = {**json.loads((Path(folder) / "config.json").read_text()), **self.lerobot.config}.get("chunk_size")
        except (OSError, ValueError, VlaforgeError):
            return  # the reader says what is wrong with the folder, in one line, when it builds the model
        if not isinstance(chunk, int):
            return
        if "action_chunk" in self.model_fields_set and self.action_chunk != chunk:
            raise ValueError(f"model.action_chunk = {self.action_chunk}, but the LeRobot policy predicts "
                             f"chunk_size = {chunk} actions; drop model.action_chunk")
        self.__dict__["action_chunk"] = chunk  # NOTE: not through validate_assignment (it reruns this validator)
        if self.frames != 1:
            raise ValueError("model.frames: a LeRobot policy reads one frame per camera; drop model.frames")

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
        if self.lerobot.pretrained and (self.vlm.pretrained or self.vision.pretrained or self.llm.pretrained):
            raise ValueError("model.lerobot.pretrained is a whole policy (VLM, expert and pipelines); drop "
                             "model.vlm / vision / llm .pretrained, or model.lerobot.pretrained")
        if self.lerobot.pretrained:
            self._policy_chunk()
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

