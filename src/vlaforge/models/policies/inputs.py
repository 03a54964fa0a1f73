"""What a policy's model reads (`PolicyInputs`), made from each of its three sources: a batch of LeRobot's keys (the
preprocessor's output: LeRobot's own `prepare_images` / `prepare_state` / `prepare_action`), vlaforge's `Batch`
(training), and the images' tokens of a prediction (the runtime's frame-feature cache, exported packages).

Every source ends with the policy's empty cameras (config.json's `empty_cameras`, e.g. LeRobot's pi0.5 LIBERO
fine-tune's `--policy.empty_cameras=1`): LeRobot 0.6.1 declares them as image features
`observation.images.empty_camera_{i}` that no batch holds, and appends for each one, after the real cameras, an image
of -1 (black after the [-1, 1] mapping) at the last real image's size with a mask of all False. The slot's tokens are
in the prefix, but no token attends to them and positions skip them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlaforge.errors import VlaforgeError
from vlaforge.models.policies.images import pad_vector, resize_with_pad, resize_with_pad_centered

EMPTY_CAMERA = "observation.images.empty_camera_{}"  # LeRobot's key of empty camera i (`validate_features`)


@dataclass
class PolicyInputs:
    """A batch as the policy's model reads it (LeRobot's `prepare_images` / `prepare_state` / `prepare_action` done):
    images (list of (B, 3, H, W) in [-1, 1]; None for a real camera given as tokens instead), their masks (B,) bool,
    tokens and their mask (B, L), the padded state (B, max_state_dim), the padded actions (B, T, max_action_dim) and
    `action_is_pad` (B, T) when training."""

    images: list[torch.Tensor | None]
    image_masks: list[torch.Tensor]
    tokens: torch.Tensor
    token_mask: torch.Tensor
    state: torch.Tensor
    actions: torch.Tensor | None = None
    action_is_pad: torch.Tensor | None = None


def empty_camera_keys(count: int) -> tuple[str, ...]:
    """The feature keys LeRobot gives `count` empty cameras."""
    return tuple(EMPTY_CAMERA.format(i) for i in range(count))


def with_empty_cameras(images: list, masks: list[torch.Tensor], count: int, like: torch.Tensor
                       ) -> tuple[list, list[torch.Tensor]]:
    """`images` and `masks` with `count` empty cameras appended: -1 everywhere, shaped and typed as `like` (LeRobot's
    `torch.ones_like(img) * -1` of its last real image), masked out for every sample."""
    if count == 0:
        return images, masks
    empty = torch.full_like(like, -1.0)
    off = torch.zeros(like.shape[0], dtype=torch.bool, device=like.device)
    return images + [empty] * count, masks + [off] * count


def lerobot_inputs(spec, resize: str, batch: dict, with_actions: bool = True) -> PolicyInputs:
    """A preprocessed batch (LeRobot's keys) -> the model's inputs, as LeRobot's `prepare_images` / `prepare_state` /
    `prepare_action` make them: each real camera resized with padding (`resize`: 'top_left' or 'centered') to the
    policy's size and mapped to [-1, 1], then the empty cameras; state and actions zero-padded.

    Raises:
        VlaforgeError: a real camera of the policy is not in the batch."""
    images, masks = [], []
    for key in spec.cameras:
        if key not in batch:
            raise VlaforgeError(f"the batch has no {key}; the policy reads cameras {', '.join(spec.cameras)}")
        img = batch[key]
        img = (img[:, -1] if img.ndim == 5 else img).to(torch.float32)
        if tuple(img.shape[-2:]) != spec.image_size:
            img = resize_with_pad(img, *spec.image_size, pad_value=0) if resize == "top_left" \
                else resize_with_pad_centered(img, *spec.image_size)
        images.append(img * 2.0 - 1.0)
        masks.append(torch.ones(img.shape[0], dtype=torch.bool, device=img.device))
    images, masks = with_empty_cameras(images, masks, spec.empty_cameras, images[-1])
    state = batch["observation.state"]
    state = state[:, -1] if state.ndim > 2 else state
    actions = pad_vector(batch["action"], spec.max_action_dim) if with_actions and "action" in batch else None
    return PolicyInputs(images, masks, batch["observation.language.tokens"],
                        batch["observation.language.attention_mask"].bool(), pad_vector(state, spec.max_state_dim),
                        actions, batch.get("action_is_pad") if actions is not None else None)


def batch_inputs(spec, batch) -> PolicyInputs:
    """vlaforge's `Batch` (one image per real camera in [-1, 1] at the policy's size, normalized vectors) -> the
    model's inputs, the empty cameras after the real ones."""
    b, f = batch.images.shape[:2]
    ones = torch.ones(b, dtype=torch.bool, device=batch.images.device)
    images, masks = with_empty_cameras([batch.images[:, i] for i in range(f)], [ones] * f, spec.empty_cameras,
                                       batch.images[:, -1])
    actions = None if batch.actions is None else pad_vector(batch.actions, spec.max_action_dim)
    return PolicyInputs(images, masks, batch.instruction_ids, batch.instruction_mask.bool(),
                        pad_vector(batch.state, spec.max_state_dim), actions,
                        None if batch.action_mask is None else ~batch.action_mask.bool())


def token_inputs(spec, vision_tokens: torch.Tensor, instruction_ids: torch.Tensor,
                 instruction_mask: torch.Tensor | None, state: torch.Tensor) -> PolicyInputs:
    """The inputs of a prediction whose real cameras are given as tokens (B, F*P, Dv) (`PolicyVLA.embed_prefix` takes
    them in the slots left None); the empty cameras are images of -1 at the policy's size, embedded with the rest."""
    b, f = vision_tokens.shape[0], len(spec.cameras)
    mask = torch.ones_like(instruction_ids, dtype=torch.bool) if instruction_mask is None else instruction_mask
    ones = torch.ones(b, dtype=torch.bool, device=vision_tokens.device)
    like = torch.empty(b, 3, *spec.image_size, device=vision_tokens.device)
    images, masks = with_empty_cameras([None] * f, [ones] * f, spec.empty_cameras, like)
    return PolicyInputs(images, masks, instruction_ids, mask.bool(), pad_vector(state, spec.max_state_dim))
