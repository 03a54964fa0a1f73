"""The `vision` component: a `transformers` SigLIP vision tower, from a flavor or a pretrained folder."""

from __future__ import annotations

from torch import nn

from vlaforge.config.flavors import Flavor
from vlaforge.errors import VlaforgeError
from vlaforge.models.hf_loading import from_config, load_pretrained


class ConvStem(nn.Module):
    """Early convolutions (Xiao et al. 2021, "Early convolutions help transformers see better"): stride-2 3x3
    convolutions, each with GroupNorm and GELU, channels doubling up to the tower's width, then a 1x1 projection -
    in place of a SigLIP tower's patch embedding, ending on the same patch grid, so the tower stays a `transformers`
    SigLIP (names, loading, FSDP units and checkpointing unchanged)."""

    def __init__(self, in_channels: int, width: int, patch: int):
        super().__init__()
        stages = patch.bit_length() - 1  # patch = 2 ** stages
        chans = [max(8, width >> (stages - i)) for i in range(1, stages + 1)]
        layers, prev = [], in_channels
        for c in chans:
            layers += [nn.Conv2d(prev, c, 3, stride=2, padding=1, bias=False), nn.GroupNorm(min(8, c), c), nn.GELU()]
            prev = c
        self.stages = nn.Sequential(*layers)
        self.proj = nn.Conv2d(prev, width, 1)

    @property
    def weight(self):  # SigLIP casts the pixels to its patch embedding's weight dtype
        return self.proj.weight

    def forward(self, pixels):
        return self.proj(self.stages(pixels))


SIGLIP = ("siglip_vision_model", "siglip")  # a SigLIP vision folder, or a whole SigLIP (image + text) one


def build_vision(flavor: Flavor, image_size: int | None, pretrained: str | None,
                 patch_size: int | None = None, stem: str = "patch", config: dict | None = None) -> nn.Module:
    """SigLIP vision tower without its pooling head (the VLA uses every patch token); `stem` 'conv' swaps its patch
    embedding for a `ConvStem` (towers built from scratch only). `config`: a pretrained tower's config alone
    (weights to come from a checkpoint, or none under fake tensors)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    if pretrained or config is not None:
        if config is not None:
            kind = config.get("model_type")
            if kind not in SIGLIP:
                raise VlaforgeError(f"model.vision.pretrained is a '{kind}' model; the vision tower is built as "
                                    f"{' / '.join(SIGLIP)}; give a folder of that family")
            config = {**config.get("vision_config", config), "model_type": "siglip_vision_model"}
            model = from_config(SiglipVisionModel, config, "model.vision.pretrained")
        else:  # a SigLIP vision folder, or a whole SigLIP (image + text) folder whose vision tower is taken
            model = load_pretrained(SiglipVisionModel, pretrained, "model.vision.pretrained",
                                    families=SIGLIP)
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
        model.embeddings.patch_embedding = ConvStem(config.num_channels, config.hidden_size, config.patch_size)
    return model


def vision_blocks(vision: nn.Module) -> nn.ModuleList:
    """The transformer blocks of the vision tower, in order."""
    return vision.encoder.layers
