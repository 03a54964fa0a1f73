"""The `vision` component: a `transformers` vision tower, built from a flavor (SigLIP) or loaded from a pretrained
folder of one of the families in `VISION_FAMILIES` (SigLIP, SigLIP2, CLIP, DINOv2, DINOv2 with registers).

The rule every family follows: the VLA reads the tower's last hidden states at the patch positions only, one token
per patch of the `image_size // patch_size` grid, row-major. Tokens a family puts before the patches (CLIP's and
DINOv2's CLS token, DINOv2's registers) are dropped, and pooling heads (SigLIP's attention-pooling head) are
removed, so `patches_per_frame` is the same formula for every family and the planner counts what the model holds.
What differs per family (the transformers class, leading tokens, how position embeddings meet another image size,
SigLIP2's patch-sequence input, where the blocks are) is in its `VisionFamily` row, nowhere else.

A fused tower (`model.vision.fused`, OpenVLA's Prismatic: DINOv2 + SigLIP) runs two towers on the same frames and
concatenates their patch tokens per patch ([first, second]), each read as Prismatic's featurizer reads it: the output
of its penultimate block, before any final norm, its own leading tokens dropped and its own pixel normalization.

Qwen2-VL / Qwen2.5-VL towers (only as a whole VLM's, models/vlm.py) take the image as flattened 3-D patches (the
frame repeated over the `temporal_patch_size` of their Conv3d patch embedding, as their image processor does for a
still image) in merge-unit order: each `spatial_merge_size` x `spatial_merge_size` block of patches consecutive, the
blocks row-major. Their tokens keep that order (the projector merges consecutive groups, the merged grid is
row-major); their patch merger belongs to the projector, so the tower ends at its last block (Qwen2.5-VL's window
attention permutation undone by the tower's own forward).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlaforge.config.flavors import Flavor
from vlaforge.errors import VlaforgeError
from vlaforge.models.families import SELF_ATTN_MLP, Sublayers
from vlaforge.models.hf_loading import check_pretrained_folder, from_config, load_pretrained, read_config


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


@dataclass(frozen=True)
class VisionFamily:
    """How vlaforge builds and reads one family of `transformers` vision towers."""

    name: str
    folder_types: tuple[str, ...]  # config model_type of a folder of this family: the tower alone, or the whole model
    tower_type: str  # model_type of the tower's own config (a checkpoint rebuilds the tower from it)
    model_class: str  # the transformers class vlaforge builds
    leading_tokens: Any  # config -> tokens before the patch tokens in the output (CLS, registers), dropped
    resize_arg: bool = True  # forward takes interpolate_pos_encoding (DINOv2 interpolates always, SigLIP2 resizes)
    # the input: "pixels" (N, C, H, W); "naflex" (SigLIP2: (N, patches, p*p*C) with their grid shape and a mask);
    # "qwen" (flattened 3-D patches in merge-unit order with each frame's (t, h, w) grid)
    input: str = "pixels"
    # the image side its position embeddings were trained at (None: positions are computed for any size)
    native_size: Any = lambda config: config.image_size
    pixel_stats: str = "half"  # the per-channel mean / std its pretraining normalized pixels with (`PIXEL_STATS`)
    final_norm: str | None = "post_layernorm"  # the norm its last hidden states pass through (none: CLIP's)
    unused: tuple[str, ...] = ()  # modules the patch tokens never pass through (CLIP's pooled-token norm)
    frozen: tuple[str, ...] = ()  # parameters they never use: kept as buffers (same state-dict name), not trained
    blocks: str = "encoder.layers"  # where its transformer blocks are
    # its forward's shapes follow from the input's shape alone: fake tensors (planning) and graph export run it
    # (Qwen-VL's read their patch grid's values for windows and sequence bounds)
    static_shapes: bool = True
    # the planner's block formula that counts this tower exactly ("siglip": SigLIP's block, embeddings and
    # post-norm, also Idefics3's and SmolVLM's towers; "qwen_vit": Qwen2.5-VL's windowed block); None: not planned
    planned: str | None = None
    positions_per_image: bool = False  # position ids per image (Idefics3's, bucketed onto each image's grid)
    width: Any = lambda config: config.hidden_size  # the width of its tokens (Qwen2-VL's `embed_dim`)
    block: str | None = None  # the class of its blocks (None: a fused tower's blocks are its towers')
    sublayers: Sublayers = SELF_ATTN_MLP  # where its blocks keep their attention and feed-forward sub-layers
    # what its blocks take of the whole patch grid at every call, which a pass over some of a frame's patches
    # (the token cache's partial recomputation) cannot give them (None: nothing)
    whole_grid: str | None = None

    def cls(self):
        import importlib

        import transformers

        if hasattr(transformers, self.model_class):
            return getattr(transformers, self.model_class)
        # a tower transformers exports only from its VLM's modeling module (Qwen-VL's)
        vlm = self.tower_type.removesuffix("_vision")
        return getattr(importlib.import_module(f"transformers.models.{vlm}.modeling_{vlm}"), self.model_class)


FUSED = "vlaforge_fused"  # the model_type of a fused tower's saved config
# Qwen-VL's `whole_grid` (the sequence bounds: cu_seqlens)
QWEN_WHOLE_GRID = ("its blocks take the rotary positions and sequence bounds (Qwen2.5-VL: attention windows) of the "
                   "whole patch grid at every call")
VISION_FAMILIES = (
    VisionFamily("siglip", ("siglip_vision_model", "siglip"), "siglip_vision_model", "SiglipVisionModel",
                 lambda config: 0, planned="siglip", block="SiglipEncoderLayer"),
    VisionFamily("siglip2", ("siglip2_vision_model", "siglip2"), "siglip2_vision_model", "Siglip2VisionModel",
                 lambda config: 0, resize_arg=False, input="naflex",
                 native_size=lambda config: math.isqrt(config.num_patches) * config.patch_size,
                 block="Siglip2EncoderLayer"),
    VisionFamily("clip", ("clip_vision_model", "clip"), "clip_vision_model", "CLIPVisionModel", lambda config: 1,
                 pixel_stats="openai_clip", final_norm=None, unused=("post_layernorm",), block="CLIPEncoderLayer"),
    VisionFamily("dinov2", ("dinov2",), "dinov2", "Dinov2Model", lambda config: 1, resize_arg=False,
                 pixel_stats="imagenet", final_norm="layernorm", frozen=("embeddings.mask_token",),
                 blocks="encoder.layer", block="Dinov2Layer", sublayers=Sublayers("attention", "mlp")),
    # the towers of Idefics3 and SmolVLM (SigLIP-shaped; positions bucketed onto their grid, so any size reads)
    VisionFamily("idefics3", ("idefics3_vision",), "idefics3_vision", "Idefics3VisionTransformer", lambda config: 0,
                 resize_arg=False, planned="siglip", positions_per_image=True, block="Idefics3EncoderLayer"),
    VisionFamily("smolvlm", ("smolvlm_vision",), "smolvlm_vision", "SmolVLMVisionTransformer", lambda config: 0,
                 resize_arg=False, planned="siglip", positions_per_image=True, block="SmolVLMEncoderLayer"),
    VisionFamily("dinov2_with_registers", ("dinov2_with_registers",), "dinov2_with_registers",
                 "Dinov2WithRegistersModel", lambda config: 1 + config.num_register_tokens, resize_arg=False,
                 pixel_stats="imagenet", final_norm="layernorm", frozen=("embeddings.mask_token",),
                 blocks="encoder.layer", block="Dinov2WithRegistersLayer", sublayers=Sublayers("attention", "mlp")),
    # a fused tower: its towers' own rows do the work (`tower_features`); its default size, the smaller native one
    VisionFamily("fused", (), FUSED, "FusedTower", lambda config: 0, resize_arg=False, input="fused",
                 native_size=lambda config: min(family_for_folder(c.model_type).native_size(c) for c in config.towers),
                 final_norm=None, blocks="blocks"),
    # Qwen-VL's towers (2-D rotary positions: any multiple of patch x merge reads, no native size)
    VisionFamily("qwen2_vl", ("qwen2_vl_vision",), "qwen2_vl_vision", "Qwen2VisionTransformerPretrainedModel",
                 lambda config: 0, resize_arg=False, input="qwen", native_size=lambda config: None, static_shapes=False,
                 pixel_stats="openai_clip", final_norm=None, blocks="blocks", width=lambda config: config.embed_dim,
                 block="Qwen2VLVisionBlock", sublayers=Sublayers("attn", "mlp"), whole_grid=QWEN_WHOLE_GRID),
    VisionFamily("qwen2_5_vl", ("qwen2_5_vl_vision",), "qwen2_5_vl_vision", "Qwen2_5_VisionTransformerPretrainedModel",
                 lambda config: 0, resize_arg=False, input="qwen", native_size=lambda config: None, static_shapes=False,
                 pixel_stats="openai_clip", final_norm=None, blocks="blocks", planned="qwen_vit",
                 block="Qwen2_5_VLVisionBlock", sublayers=Sublayers("attn", "mlp"), whole_grid=QWEN_WHOLE_GRID),
)
# (mean, std) per channel of pixels in [0, 1], as the families' image processors normalize them (transformers'
# constants): SigLIP's 0.5 / 0.5 is vlaforge's own [-1, 1] input (data/transforms.py:to_model_images)
PIXEL_STATS = {"half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
               "openai_clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
               "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}


class FusedConfig:
    """A fused tower's config: its towers' configs (a checkpoint's backbones.json rebuilds it from `to_dict`)."""

    model_type = FUSED

    def __init__(self, towers: list):
        self.towers = towers

    @property
    def patch_size(self) -> int:
        return self.towers[0].patch_size

    @property
    def hidden_size(self) -> int:  # the width of the concatenated tokens
        return sum(family_for_folder(c.model_type).width(c) for c in self.towers)

    @property
    def num_hidden_layers(self) -> int:
        return sum(c.num_hidden_layers for c in self.towers)

    def to_dict(self) -> dict:
        # (DINOv2's backbone stages name the uncut tower's blocks; transformers derives them again)
        drop = ("out_features", "out_indices", "stage_names")
        return {"model_type": FUSED, "towers": [{k: v for k, v in c.to_dict().items()
                                                 if not k.startswith("_") and k not in drop} for c in self.towers]}


class FusedTower(nn.Module):
    """Two towers on the same frames, their patch tokens concatenated per patch (`tower_features`); `blocks` are
    both towers' blocks in order (FSDP2 units, checkpointing, freezing)."""

    def __init__(self, towers: list[nn.Module]):
        super().__init__()
        self.towers = nn.ModuleList(towers)
        self.config = FusedConfig([t.config for t in towers])

    @property
    def blocks(self) -> nn.ModuleList:
        return nn.ModuleList([b for t in self.towers for b in vision_blocks(t)])


def read_penultimate(tower: nn.Module) -> None:
    """Cut `tower` to read as Prismatic's featurizer reads it: the output of its penultimate block, no final norm
    (its last block removed, the config saying so, so a rebuild from the config is the same cut tower)."""
    fam = vision_family(tower)
    blocks = vision_blocks(tower)
    del blocks[len(blocks) - 1]
    tower.config.num_hidden_layers = len(blocks)
    tower.config.vlaforge_final_norm = False
    if fam.final_norm:
        setattr(tower, fam.final_norm, nn.Identity())


def fuse_towers(towers: list[nn.Module], cut: bool) -> FusedTower:
    """The fused tower of `towers` (`cut`: read each at its penultimate block first, `read_penultimate`).

    Raises:
        VlaforgeError: a tower whose patch grid is not computed from pixels like the others' (different patch
            sizes, a Qwen-VL or fused tower).
    """
    names = [vision_family(t).name for t in towers]
    patches = [t.config.patch_size for t in towers]
    if any(vision_family(t).input not in ("pixels", "naflex") for t in towers) or len(set(patches)) != 1:
        raise VlaforgeError(f"model.vision.fused: the towers ({' + '.join(names)}, patches {patches} px) do not "
                            "give one patch grid; fuse two towers of the same patch size (DINOv2 + SigLIP at 14 px)")
    if cut:
        for t in towers:
            read_penultimate(t)
    return FusedTower(towers)


def family_for_folder(kind: str | None, folder: str = "the folder", field: str = "model.vision.pretrained"
                      ) -> VisionFamily:
    """The family of a `folder` whose config.json says `model_type = kind`.

    Raises:
        VlaforgeError: no vision family vlaforge builds has that model type.
    """
    for fam in VISION_FAMILIES:
        if kind in fam.folder_types or kind == fam.tower_type:
            return fam
    known = ", ".join(t for fam in VISION_FAMILIES for t in fam.folder_types)
    raise VlaforgeError(f"{field}: {folder} is a '{kind}' folder, not a vision tower vlaforge "
                        f"builds ({known}); give a folder of one of those")


def vision_family(vision: nn.Module) -> VisionFamily:
    """The family of a built tower (by its class; FSDP2 subclasses it)."""
    names = {c.__name__ for c in type(vision).__mro__}
    for fam in VISION_FAMILIES:
        if fam.model_class in names:
            return fam
    raise VlaforgeError(f"the vision tower is a {type(vision).__name__}, which vlaforge does not read")


def tower_width(vision: nn.Module) -> int:
    """The width of the tower's tokens (what the projector reads per patch)."""
    return vision_family(vision).width(vision.config)


def native_size(vision: nn.Module) -> int | None:
    """The image side the tower's position embeddings were trained at (SigLIP2: its position grid x patch; None:
    any size, Qwen-VL's rotary positions)."""
    return vision_family(vision).native_size(vision.config)


def read_pixel_stats(fam: VisionFamily, folder: str | None, field: str = "model.vision.pretrained"
                     ) -> tuple[list[float], list[float]]:
    """The normalization a tower's pretraining used: the folder's `preprocessor_config.json` (image_mean /
    image_std) when it has one, else the family's (`PIXEL_STATS`).

    Raises:
        VlaforgeError: the processor file is not JSON or its mean / std are not three numbers each (std > 0).
    """
    mean, std = PIXEL_STATS[fam.pixel_stats]
    processor = Path(folder) / "preprocessor_config.json" if folder else None
    if processor is not None and processor.is_file():
        try:
            saved = json.loads(processor.read_text())
        except ValueError as exc:
            raise VlaforgeError(f"{field}: {processor} is not valid JSON ({exc}); fix or remove it") from None
        mean, std = saved.get("image_mean", mean), saved.get("image_std", std)
        if not (isinstance(mean, (list, tuple)) and isinstance(std, (list, tuple)) and len(mean) == len(std) == 3
                and all(isinstance(v, (int, float)) for v in (*mean, *std)) and min(std) > 0):
            raise VlaforgeError(f"{field}: {processor} gives image_mean {mean} / image_std {std}; give three "
                                "numbers each (std > 0) or remove the file")
    return [float(v) for v in mean], [float(v) for v in std]


def set_pixel_stats(vision: nn.Module, fam: VisionFamily, folder: str | None) -> None:
    """Record on the tower's config (`image_mean` / `image_std`, saved with it in a checkpoint's backbones.json)
    the normalization its pretraining used (`read_pixel_stats`). A config that already carries them (a
    checkpoint's rebuild, a VLM's tower) keeps its own."""
    config = vision.config
    if getattr(config, "image_mean", None) is not None and getattr(config, "image_std", None) is not None:
        return
    config.image_mean, config.image_std = read_pixel_stats(fam, folder)


def prune_tower(vision: nn.Module, fam: VisionFamily) -> None:
    """Drop what the patch-token rule never uses, so no parameter goes without a gradient (DDP) or memory: SigLIP's
    pooling head, the final norm of CLIP's pooled CLS token (`unused`; DINOv2's mask token becomes a buffer), and
    the final norm of a tower a VLM reads before its last blocks (its config's `vlaforge_final_norm = False`:
    LLaVA's `vision_feature_layer = -2`)."""
    if fam.input == "qwen":  # its patch merger is the projector's (models/vlm.py)
        vision.merger = MergeUnits(vision.config.spatial_merge_size ** 2)
    if getattr(vision, "use_head", False):
        del vision.head
        vision.use_head = False
        vision.config.vision_use_head = False
    drop = list(fam.unused)
    if getattr(vision.config, "vlaforge_final_norm", True) is False and fam.final_norm:
        drop.append(fam.final_norm)
    for name in drop:
        setattr(vision, name, nn.Identity())
    for name in fam.frozen:  # DINOv2's mask token (masked image modelling only); a buffer keeps its state-dict key
        owner_name, _, attr = name.rpartition(".")
        owner = vision.get_submodule(owner_name)
        value = owner._parameters.pop(attr).detach()
        owner.register_buffer(attr, value)


def normalize_pixels(vision: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """vlaforge's [-1, 1] pixels -> the tower's own normalization ((x01 - mean) / std per channel); unchanged for
    the 0.5 / 0.5 of SigLIP and the flavors' towers."""
    mean, std = getattr(vision.config, "image_mean", None), getattr(vision.config, "image_std", None)
    if mean is None or std is None or (list(mean) == [0.5] * 3 and list(std) == [0.5] * 3):
        return pixels
    m = torch.tensor(mean, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    return ((pixels + 1) * 0.5 - m) / s


class MergeUnits(nn.Module):
    """In a Qwen-VL tower, in place of its patch merger (which the projector holds): (S, D) tokens -> (S / unit,
    unit * D), each merge unit's tokens side by side, so the tower's forward returns them in processor order
    (Qwen2.5-VL un-permutes its windows on this output)."""

    def __init__(self, unit: int):
        super().__init__()
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.unit * x.shape[-1])


def qwen_patches(pixels: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C, H, W) -> (flattened patches (N*h*w, C*T*p*p), grid (N, 3)): a Qwen-VL tower's input as its image
    processor (`patchify`) lays a still image out - merge units consecutive, each patch's pixels (channel, time,
    row, column), the frame repeated over the T = `temporal_patch_size` steps of the patch embedding."""
    n, c, hgt, wid = pixels.shape
    p, m, t = config.patch_size, config.spatial_merge_size, config.temporal_patch_size
    h, w = hgt // p, wid // p
    x = pixels.reshape(n, c, h // m, m, p, w // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1).reshape(n * h * w, c * t * p * p)
    grid = torch.tensor([[1, h, w]], dtype=torch.long, device=pixels.device).expand(n, 3)
    return x, grid


def patch_sequence(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, h*w, p*p*C): SigLIP2's input, each patch's pixels in (row, column, channel) order, as its
    image processor (`convert_image_to_patches`) lays them out."""
    n, c, hgt, wid = pixels.shape
    h, w = hgt // patch, wid // patch
    x = pixels[:, :, :h * patch, :w * patch].reshape(n, c, h, patch, w, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(n, h * w, patch * patch * c)


def tower_features(vision: nn.Module, pixels: torch.Tensor, resize: bool) -> torch.Tensor:
    """(N, C, H, W) frames in [-1, 1] -> the tower's last hidden states at the patch positions (N, P, D), the module
    rule, the pixels first normalized as the tower was pretrained (`normalize_pixels`). `resize`: the frames are not
    the size the tower's position embeddings were trained at."""
    fam = vision_family(vision)
    if fam.input == "fused":  # each tower at its own normalization and position resizing
        return torch.cat([tower_features(t, pixels, pixels.shape[-1] != native_size(t)) for t in vision.towers], -1)
    pixels = normalize_pixels(vision, pixels)
    if not fam.static_shapes:
        from vlaforge.models.fake import fake_mode_active

        if fake_mode_active():
            raise VlaforgeError(f"the {fam.name} vision tower computes its attention windows and sequence bounds from "
                                "the values of its patch grid, which fake tensors do not hold: profile it without "
                                "--fake (vlaforge plan counts Qwen2.5-VL's from its shapes)")
    if fam.input == "qwen":
        flat, grid = qwen_patches(pixels, vision.config)
        units = vision(hidden_states=flat, grid_thw=grid).pooler_output  # (N*h*w / unit, unit * D): MergeUnits
        return units.reshape(len(pixels), -1, fam.width(vision.config))
    if fam.input == "naflex":
        patch = vision.config.patch_size
        grid = (pixels.shape[-2] // patch, pixels.shape[-1] // patch)
        seq = patch_sequence(pixels, patch)
        shapes = torch.tensor([grid], dtype=torch.long, device=pixels.device).expand(len(pixels), 2)
        mask = torch.ones(seq.shape[:2], dtype=torch.long, device=pixels.device)
        hidden = vision(pixel_values=seq, pixel_attention_mask=mask, spatial_shapes=shapes).last_hidden_state
    elif fam.resize_arg:
        hidden = vision(pixel_values=pixels, interpolate_pos_encoding=resize).last_hidden_state
    else:
        hidden = vision(pixel_values=pixels).last_hidden_state
    skip = fam.leading_tokens(vision.config)
    return hidden[:, skip:] if skip else hidden


def build_vision(flavor: Flavor, image_size: int | None, pretrained: str | None,
                 patch_size: int | None = None, stem: str = "patch", config: dict | None = None,
                 attn: str = "sdpa", fused: str | None = None, field: str = "model.vision.pretrained") -> nn.Module:
    """The vision tower without its pooling head (the VLA uses every patch token): a flavor's SigLIP, or the tower
    of the `pretrained` folder's family (`VISION_FAMILIES`); `stem` 'conv' swaps its patch embedding for a
    `ConvStem` (towers built from scratch only). `config`: a pretrained tower's config alone (weights to come from
    a checkpoint, or none under fake tensors). `attn`: `model.attn_implementation`. `fused`: a second tower's
    folder, fused with `pretrained`'s (`FusedTower`). `field`: the config field a folder's errors name."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    if fused or (config is not None and config.get("model_type") == FUSED):
        if config is not None:  # a saved fused config (its towers cut already), or the two folders' configs
            towers = [build_vision(flavor, None, None, config=c, attn=attn) for c in config["towers"]]
            return fuse_towers(towers, cut=any(c.get("vlaforge_final_norm", True) for c in config["towers"]))
        return fuse_towers([build_vision(flavor, None, f, attn=attn, field=name) for f, name in
                            ((pretrained, "model.vision.pretrained"), (fused, "model.vision.fused"))], cut=True)
    if pretrained or config is not None:
        if config is not None:
            fam = family_for_folder(config.get("model_type"))
            config = {**config.get("vision_config", config), "model_type": fam.tower_type}
            model = from_config(fam.cls(), config, "model.vision.pretrained", attn)
        else:  # a tower's folder, or a whole image + text model's (SigLIP, CLIP) whose vision tower is taken
            folder = check_pretrained_folder(pretrained, field)  # config and weights there
            fam = family_for_folder(read_config(folder, field).get("model_type"), pretrained, field)
            model = load_pretrained(fam.cls(), pretrained, field, families=fam.folder_types, attn=attn)
        set_pixel_stats(model, fam, pretrained if config is None else None)
        prune_tower(model, fam)  # NOTE: unused parameters would never get gradients (breaks DDP, wastes memory)
        return model
    kwargs = dict(flavor.vision)
    if image_size is not None:
        kwargs["image_size"] = image_size
    if patch_size is not None:
        kwargs["patch_size"] = patch_size
    config = SiglipVisionConfig(vision_use_head=False, attn_implementation=attn, **kwargs)
    model = SiglipVisionModel(config)
    if stem == "conv":
        model.embeddings.patch_embedding = ConvStem(config.num_channels, config.hidden_size, config.patch_size)
    return model


def vision_blocks(vision: nn.Module) -> nn.ModuleList:
    """The transformer blocks of the vision tower, in order (`encoder.layers`; DINOv2's `encoder.layer`, Qwen-VL's
    `blocks`)."""
    return vision.get_submodule(vision_family(vision).blocks)
