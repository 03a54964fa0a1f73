"""The `vision` component: a `transformers` SigLIP vision tower, from a flavor or a pretrained folder."""

from __future__ import annotations

from torch import nn

from vlaforge.config.flavors import Flavor
from vlaforge.models.hf_loading import load_pretrained


def build_vision(flavor: Flavor, image_size: int | None, pretrained: str | None,
                 patch_size: int | None = None) -> nn.Module:
    """SigLIP vision tower without its pooling head (the VLA uses every patch token)."""
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
    return SiglipVisionModel(config)


def vision_blocks(vision: nn.Module) -> nn.ModuleList:
    """The transformer blocks of the vision tower, in order."""
    return vision.encoder.layers
