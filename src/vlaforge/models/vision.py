"""The `vision` component: a `transformers` SigLIP vision tower, from a flavor or a pretrained folder."""

from __future__ import annotations

import torch
from torch import nn

from vlaforge.config.flavors import Flavor
from vlaforge.models.hf_loading import load_pretrained


class SpatialSoftmax(nn.Module):
    """K keypoints of a feature map (Levine et al. 2016, "End-to-end training of deep visuomotor policies"): a 1x1
    convolution scores every position for each keypoint, a softmax over the positions (learned temperature) weighs
    them, and the keypoint is the expected (x, y) in [-1, 1]. A small bright target anywhere in the image becomes two
    numbers that move linearly with it - what a from-scratch tower needs to place a goal it saw at few positions."""

    def __init__(self, channels: int, keypoints: int):
        super().__init__()
        self.score = nn.Conv2d(channels, keypoints, 1)
        self.log_temperature = nn.Parameter(torch.zeros(1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, K, 2) expected (x, y) per keypoint."""
        n, _, h, w = features.shape
        scores = self.score(features).flatten(2) * self.log_temperature.exp()  # (N, K, H*W)
        weights = scores.softmax(-1)
        ys = torch.linspace(-1.0, 1.0, h, device=features.device, dtype=weights.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=features.device, dtype=weights.dtype)
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1).reshape(h * w, 2)  # (H*W, 2): (x, y)
        return weights @ grid


class ConvStem(nn.Module):
    """Early convolutions (Xiao et al. 2021, "Early convolutions help transformers see better"): stride-2 3x3
    convolutions, each with GroupNorm and GELU, channels doubling up to the tower's width, then a 1x1 projection -
    in place of a SigLIP tower's patch embedding, ending on the same patch grid, so the tower stays a `transformers`
    SigLIP (names, loading, FSDP units and checkpointing unchanged).

    `keypoints` K > 0: a `SpatialSoftmax` over the stage whose grid is 4x finer than the patch grid (or the first
    stage) gives K (x, y) keypoints per frame; a linear map of them is added to every patch token of that frame, so
    each token carries where the image's salient points are (model.vision_keypoints)."""

    def __init__(self, in_channels: int, width: int, patch: int, keypoints: int = 0):
        super().__init__()
        stages = patch.bit_length() - 1  # patch = 2 ** stages
        chans = [max(8, width >> (stages - i)) for i in range(1, stages + 1)]
        layers, prev = [], in_channels
        for c in chans:
            layers += [nn.Conv2d(prev, c, 3, stride=2, padding=1, bias=False), nn.GroupNorm(min(8, c), c), nn.GELU()]
            prev = c
        self.stages = nn.Sequential(*layers)
        self.proj = nn.Conv2d(prev, width, 1)
        self.keypoint_stage = max(1, stages - 2) if keypoints else 0  # stages run before the keypoints are read
        if keypoints:
            self.keypoints = SpatialSoftmax(chans[self.keypoint_stage - 1], keypoints)
            self.keypoint_proj = nn.Linear(2 * keypoints, width)

    @property
    def weight(self):  # SigLIP casts the pixels to its patch embedding's weight dtype
        return self.proj.weight

    def forward(self, pixels):
        if not self.keypoint_stage:
            return self.proj(self.stages(pixels))
        cut = 3 * self.keypoint_stage  # each stage is conv, norm, GELU
        early = self.stages[:cut](pixels)
        points = self.keypoints(early).flatten(1)  # (N, 2K)
        out = self.proj(self.stages[cut:](early))  # (N, width, grid, grid)
        return out + self.keypoint_proj(points)[:, :, None, None]


def build_vision(flavor: Flavor, image_size: int | None, pretrained: str | None,
                 patch_size: int | None = None, stem: str = "patch", keypoints: int = 0) -> nn.Module:
    """SigLIP vision tower without its pooling head (the VLA uses every patch token); `stem` 'conv' swaps its patch
    embedding for a `ConvStem` with `keypoints` spatial-softmax keypoints (towers built from scratch only)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    if pretrained:
        model = load_pretrained(SiglipVisionModel, pretrained, "model.vision.pretrained")
        if getattr(model, "use_head", False):
            # NOTE: an unused head would hold parameters that never get gradients (breaks DDP, wastes memory).
            del model.head
            model.use_head = False
            model.config.vision_use_head = False
        return model
    kwargs = dict(flavor.vision)
    if image_size is not None:
        kwargs["image_size"] = image_size
    if patch_size is not None:
        kwargs["patch_size"] = patch_size
    config = SiglipVisionConfig(vision_use_head=False, attn_implementation="sdpa", **kwargs)
    model = SiglipVisionModel(config)
    if stem == "conv":
        model.embeddings.patch_embedding = ConvStem(config.num_channels, config.hidden_size, config.patch_size,
                                                      keypoints)
    return model


def vision_blocks(vision: nn.Module) -> nn.ModuleList:
    """The transformer blocks of the vision tower, in order."""
    return vision.encoder.layers
