"""The image / vector helpers LeRobot 0.6.1's policies apply inside the model (`prepare_images`, `prepare_state`,
`prepare_action`), not in their processor pipelines: SmolVLA's resize padded at the top left, pi0's (openpi's) centred
one, and a vector zero-padded to max_state_dim / max_action_dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def resize_with_pad(img: Tensor, height: int, width: int, pad_value: float) -> Tensor:
    """SmolVLA's resize: (B, C, H, W) scaled bilinearly to fit (height, width) keeping its aspect ratio, then padded
    with `pad_value` on the LEFT and TOP (LeRobot's `vla_utils.resize_with_pad`); returned as is at the target size."""
    if img.ndim != 4:
        raise ValueError(f"resize_with_pad expects (B, C, H, W), got {tuple(img.shape)}")
    cur_h, cur_w = img.shape[2:]
    if cur_h == height and cur_w == width:
        return img
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    resized = F.interpolate(img, size=(new_h, new_w), mode="bilinear", align_corners=False)
    return F.pad(resized, (max(0, width - new_w), 0, max(0, height - new_h), 0), value=pad_value)


def resize_with_pad_centered(images: Tensor, height: int, width: int, mode: str = "bilinear") -> Tensor:
    """pi0's (openpi's `resize_with_pad_torch`) resize: [*b, H, W, C] (last dim <= 4) or [*b, C, H, W], a 3-D input
    gaining a batch dim it keeps; float32 is clamped to [0, 1] after the resize (uint8 rounded to [0, 255]), then
    padded with 0 centred (the odd pixel at the bottom / right). Same layout out as in."""
    channels_last = images.shape[-1] <= 4
    images = images.unsqueeze(0) if images.dim() == 3 else images
    images = images.permute(0, 3, 1, 2) if channels_last else images  # (B, H, W, C) -> (B, C, H, W)
    cur_h, cur_w = images.shape[2:]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    resized = F.interpolate(images, size=(new_h, new_w), mode=mode,
                            align_corners=False if mode == "bilinear" else None)
    if images.dtype == torch.uint8:
        resized = torch.round(resized).clamp(0, 255).to(torch.uint8)
    elif images.dtype == torch.float32:
        resized = resized.clamp(0.0, 1.0)
    else:
        raise ValueError(f"resize_with_pad_centered takes uint8 or float32 images, got {images.dtype}")
    (top, odd_h), (left, odd_w) = divmod(height - new_h, 2), divmod(width - new_w, 2)
    padded = F.pad(resized, (left, left + odd_w, top, top + odd_h), value=0 if images.dtype == torch.uint8 else 0.0)
    return padded.permute(0, 2, 3, 1) if channels_last else padded


def pad_vector(x: Tensor, dim: int) -> Tensor:
    """The last dim of `x` zero-padded to `dim`; a vector already that long or longer is returned unchanged (openpi's
    `pad_vector`, LeRobot's with truncate=False)."""
    return x if x.shape[-1] >= dim else F.pad(x, (0, dim - x.shape[-1]))
