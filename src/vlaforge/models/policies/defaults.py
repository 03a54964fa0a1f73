"""LeRobot's pi0, pi0.5 and SmolVLA at their published sizes, with no folder: the config.json `lerobot-train` writes
for a policy left at LeRobot 0.6.1's defaults, and the config of the VLM SmolVLA builds from. The `pi0`, `pi05` and
`smolvla` flavors (config/flavors.py) are these policies (`build_default_policy`; `vlaforge model summary pi0`).

Where the numbers come from:
- `PI0_CONFIG`, `PI05_CONFIG`, `SMOLVLA_CONFIG`: `draccus.encode(PI0Config(...), PreTrainedConfig)` - what
  LeRobot's `save_pretrained` writes - of LeRobot 0.6.1's `policies/pi0/configuration_pi0.py`,
  `policies/pi05/configuration_pi05.py` and `policies/smolvla/configuration_smolvla.py` with every field at its
  default, given one camera `observation.images.base` at the policy's image size (pi0's and pi0.5's
  `image_resolution` (224, 224), SmolVLA's `resize_imgs_with_padding` (512, 512)) and `observation.state` / `action`
  of max_state_dim / max_action_dim (32). `device` is what LeRobot resolves its default (None) to on a GPU machine.
- `SMOLVLM2_500M`: HuggingFaceTB/SmolVLM2-500M-Video-Instruct's config.json (the `vlm_model_name` SmolVLA defaults
  to), its sizes only: the SigLIP-B/16 tower at 512 px (SmolVLMVisionConfig's defaults for intermediate_size 3072
  and 12 layers, which the file leaves out), the 4 x 4 pixel shuffle, SmolLM2-360M's 32-layer text model (SmolVLA
  keeps the first `num_vlm_layers` = 16) with its 49,280-token vocabulary. `tie_word_embeddings` is false: the VLM
  has its own LM head (SmolVLM2-500M's 507.5 M parameters count it; tied, it would be 460 M), and so does SmolVLA.
- pi0's and pi0.5's sizes are not here: LeRobot builds them from `paligemma_variant` / `action_expert_variant`
  (`gemma_2b`, `gemma_300m`), which `families.py` holds (`GEMMA_VARIANTS`, `PALIGEMMA_VISION`, `PALIGEMMA_VOCAB`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from vlaforge.errors import VlaforgeError
from vlaforge.models.policies.families import GEMMA_VARIANTS, PALIGEMMA_VOCAB, Overrides, build_policy
from vlaforge.models.policies.model import PolicyVLA


def _features(side: int) -> dict:
    """input_features / output_features: one camera at `side` px, state and action of 32 (max_*_dim)."""
    return {"input_features": {"observation.images.base": {"type": "VISUAL", "shape": [3, side, side]},
                               "observation.state": {"type": "STATE", "shape": [32]}},
            "output_features": {"action": {"type": "ACTION", "shape": [32]}}}


# PreTrainedConfig's fields (lerobot/configs/policies.py), first in every config.json
_BASE = {"n_obs_steps": 1, "device": "cuda", "use_amp": False, "use_peft": False, "push_to_hub": True,
         "repo_id": None, "private": None, "tags": None, "license": None, "pretrained_path": None,
         "pretrained_revision": None}
_NORMALIZATION = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}

# LeRobot 0.6.1, policies/pi0/configuration_pi0.py: PI0Config's defaults
PI0_CONFIG = {
    "type": "pi0", **_BASE, **_features(224),
    "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "dtype": "float32",
    "chunk_size": 50, "n_action_steps": 50, "max_state_dim": 32, "max_action_dim": 32,
    "num_inference_steps": 10, "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0,
    "time_sampling_scale": 0.999, "time_sampling_offset": 0.001, "min_period": 4e-3, "max_period": 4.0,
    "use_relative_actions": False, "relative_exclude_joints": ["gripper"], "action_feature_names": None,
    "rtc_config": None, "image_resolution": [224, 224], "empty_cameras": 0, "normalization_mapping": _NORMALIZATION,
    "gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
    "freeze_vision_encoder": False, "train_expert_only": False,
    "optimizer_lr": 2.5e-5, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-8, "optimizer_weight_decay": 0.01,
    "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30_000,
    "scheduler_decay_lr": 2.5e-6, "tokenizer_max_length": 48,
}

# LeRobot 0.6.1, policies/pi05/configuration_pi05.py: PI05Config's defaults. pi0's fields but QUANTILES for state and
# action, and a 200-token prompt (it carries the discretized state); PI05Config declares `tokenizer_max_length` twice,
# so draccus writes it where the first declaration stands (after `empty_cameras`)
PI05_CONFIG = {
    "type": "pi05", **_BASE, **_features(224),
    "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "dtype": "float32",
    "chunk_size": 50, "n_action_steps": 50, "max_state_dim": 32, "max_action_dim": 32,
    "num_inference_steps": 10, "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0,
    "time_sampling_scale": 0.999, "time_sampling_offset": 0.001, "min_period": 4e-3, "max_period": 4.0,
    "use_relative_actions": False, "relative_exclude_joints": ["gripper"], "action_feature_names": None,
    "rtc_config": None, "image_resolution": [224, 224], "empty_cameras": 0, "tokenizer_max_length": 200,
    "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
    "gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
    "freeze_vision_encoder": False, "train_expert_only": False,
    "optimizer_lr": 2.5e-5, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-8, "optimizer_weight_decay": 0.01,
    "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30_000,
    "scheduler_decay_lr": 2.5e-6,
}

# LeRobot 0.6.1, policies/smolvla/configuration_smolvla.py: SmolVLAConfig's defaults
SMOLVLA_CONFIG = {
    "type": "smolvla", **_BASE, **_features(512),
    "chunk_size": 50, "n_action_steps": 50, "normalization_mapping": _NORMALIZATION,
    "max_state_dim": 32, "max_action_dim": 32, "resize_imgs_with_padding": [512, 512], "empty_cameras": 0,
    "adapt_to_pi_aloha": False, "use_delta_joint_actions_aloha": False, "tokenizer_max_length": 48, "num_steps": 10,
    "use_cache": True, "freeze_vision_encoder": True, "train_expert_only": True, "train_state_proj": True,
    "optimizer_lr": 1e-4, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-8, "optimizer_weight_decay": 1e-10,
    "optimizer_grad_clip_norm": 10, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30_000,
    "scheduler_decay_lr": 2.5e-6, "vlm_model_name": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct",
    "load_vlm_weights": False, "add_image_special_tokens": False, "attention_mode": "cross_attn",
    "prefix_length": -1, "pad_language_to": "longest", "num_expert_layers": -1, "num_vlm_layers": 16,
    "self_attn_every_n_layers": 2, "expert_width_multiplier": 0.75, "min_period": 4e-3, "max_period": 4.0,
    "rtc_config": None, "compile_model": False, "compile_mode": "max-autotune",
}

# HuggingFaceTB/SmolVLM2-500M-Video-Instruct's config.json (sizes): a `transformers.SmolVLMConfig`
SMOLVLM2_500M = {
    "model_type": "smolvlm", "scale_factor": 4, "image_token_id": 49190, "vocab_size": 49280,
    "tie_word_embeddings": False,
    "vision_config": {"model_type": "smolvlm_vision", "hidden_size": 768, "intermediate_size": 3072,
                      "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 512, "patch_size": 16},
    "text_config": {"model_type": "llama", "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                    "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64, "vocab_size": 49280,
                    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100_000.0,
                    "tie_word_embeddings": False, "pad_token_id": 2},
}


@dataclass(frozen=True)
class DefaultPolicy:
    """A LeRobot policy at its defaults: its config.json, its VLM's config where it builds from one (SmolVLA), what
    it is in words, and the parameters LeRobot's module holds that vlaforge does not build (name -> count)."""

    config: dict
    architecture: str
    vlm_config: dict | None = None
    dropped: dict[str, int] = field(default_factory=dict)


def _expert_head(config: dict) -> dict[str, int]:
    """pi0's / pi0.5's unused expert LM head: LeRobot's gemma_expert is a GemmaForCausalLM of PaliGemma's vocabulary
    (modeling_pi0.py, modeling_pi05.py), whose embeddings it deletes and whose head (vocabulary x expert width, no
    bias) it never calls."""
    return {"the action expert's LM head": PALIGEMMA_VOCAB * GEMMA_VARIANTS[config["action_expert_variant"]]["width"]}


DEFAULT_POLICIES = {
    "pi0": DefaultPolicy(
        config=PI0_CONFIG,
        architecture="LeRobot's pi0: PaliGemma-3B (SigLIP-so400m/14 at 224 px + Gemma-2B) beside a Gemma-300M "
                     "action expert (18 joint layers, width 1024)",
        dropped=_expert_head(PI0_CONFIG)),
    "pi05": DefaultPolicy(
        config=PI05_CONFIG,
        architecture="LeRobot's pi0.5: PaliGemma-3B (SigLIP-so400m/14 at 224 px + Gemma-2B) beside a Gemma-300M "
                     "action expert whose norms the flow time conditions (adaRMS; 18 joint layers, width 1024)",
        dropped=_expert_head(PI05_CONFIG)),
    "smolvla": DefaultPolicy(
        config=SMOLVLA_CONFIG, vlm_config=SMOLVLM2_500M,
        architecture="LeRobot's SmolVLA: SmolVLM2-500M's SigLIP-B/16 at 512 px + pixel shuffle and the first 16 of "
                     "SmolLM2-360M's layers, beside a 0.75-wide action expert (16 layers, cross attention every "
                     "other layer)"),
}


def default_policy(kind: str) -> DefaultPolicy:
    """The defaults of LeRobot policy type `kind`.

    Raises:
        VlaforgeError: a type with no defaults here.
    """
    if kind not in DEFAULT_POLICIES:
        raise VlaforgeError(f"no LeRobot defaults for a '{kind}' policy; known: {', '.join(DEFAULT_POLICIES)}")
    return DEFAULT_POLICIES[kind]


def build_default_policy(kind: str, fake: bool = False) -> PolicyVLA:
    """The policy of LeRobot type `kind` at its default sizes (weights random; `fake`: none allocated, under
    `models.fake.fake_build`)."""
    spec = default_policy(kind)
    over = Overrides(vlm_config=copy.deepcopy(spec.vlm_config))
    return build_policy(copy.deepcopy(spec.config), over, fake=fake)

