"""Whole pretrained vision-language models as vlaforge's components (`model.vlm.pretrained = DIR`): one adapter per
family, here and nowhere else, maps the folder onto `vision` (its tower, read where the VLM reads it), `projector`
(its connector, weights and all) and `llm` (its language model and LM head); the action head is new. The token
layout stays vlaforge's (`[frames][instruction][action queries]`, fed as embeddings): the VLM's image tokens and
chat template are not used.

Every path goes through configs first: `component_configs` derives each component's config from the folder's
`config.json` (the tower truncated to the layer the VLM reads, the connector's shape), vlaforge builds the
components from them as it builds a checkpoint's saved backbones, and `load_weights` fills them from the folder's
safetensors by a per-family key map, refusing in one line when any weight is missing. Planning (`--fake`) stops
after the configs; a checkpoint carries the derived configs (`backbones.json`) and needs no folder.

LLaVA (`llava`): `vision_tower` (CLIP or SigLIP) read at `vision_feature_layer` (-2: the output of the penultimate
block, so the last block is not built and a SigLIP tower's post-norm is dropped) with the CLS token dropped
(`vision_feature_select_strategy = "default"`); `multi_modal_projector` (linear, GELU, linear) is vlaforge's
`Projector` with the VLM's weights; `language_model` + `lm_head` are the causal LM.

Idefics3 / SmolVLM (`idefics3`, `smolvlm`; SmolVLA's backbone): the SigLIP-shaped tower whole, the connector's pixel
shuffle (`scale_factor` x `scale_factor` patches per token) and bias-free linear as a one-layer merging `Projector`,
the Llama-shaped text model. One image per frame at the tower's size: the image processor's tiling into sub-images
is not done.

Qwen2-VL / Qwen2.5-VL (`qwen2_vl`, `qwen2_5_vl`; StarVLA's, Qwen-VLA's backbones): the tower to its last block (its
3-D patch embedding fed the frame as a still image), the patch merger (`ln_q` + linear, GELU, linear over each
`spatial_merge_size`^2 block of patches) as a merging two-layer `Projector` with its per-patch norm, the text model
with its LM head (`models/llm.py:TextLM`). Frames' tokens get multimodal-RoPE positions as transformers'
`get_rope_index` gives consecutive images (`models/vla.py:mrope_positions`); no vision-start / -end tokens are added.
Qwen3-VL is refused: its DeepStack feeds tower features into the language model's first blocks, which an
embeddings-in layout does not carry.

PaliGemma (`paligemma`, pi0's backbone): the whole SigLIP tower (its last hidden states, post-norm included), the
one-linear connector (a one-layer `Projector`), Gemma with its tied embeddings. Its 1-based positions are not
copied: rotary attention depends on position differences only. Its prefix-bidirectional mask is not either:
vlaforge's layout is causal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vlaforge.errors import VlaforgeError
from vlaforge.models.hf_loading import HINT, read_config

FIELD = "model.vlm.pretrained"


@dataclass(frozen=True)
class VLMFamily:
    """How one family of whole VLM folders maps onto vlaforge's components."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type
    configs: Callable[[dict], dict]  # the folder's config -> {"vision": dict, "llm": dict, "projector": dict}
    connector: dict[str, str]  # the connector's layer names -> vlaforge's Projector's (`mlp.0.`, `mlp.2.`)
    prefixes: tuple[tuple[str, str, str], ...] = ()  # (in the folder, component, in the component)

    def key(self, key: str) -> tuple[str, str] | None:
        """A weight's name in the folder -> (component, its name there), or None for what no component takes."""
        for prefix, comp, inner in self.prefixes:
            if key.startswith(prefix):
                rest = key[len(prefix):]
                if comp == "vision":
                    rest = rest.removeprefix("vision_model.")  # checkpoints before transformers 5 nest the tower
                if comp == "projector":
                    for theirs, ours in self.connector.items():
                        rest = rest.replace(theirs, ours)
                return comp, inner + rest
        return None


# (prefix in the folder, component, prefix in the component) of LLaVA and PaliGemma: transformers 5's names, then the
# older ones (which `save_pretrained` still writes for some families)
TOWER_CONNECTOR_LM = (("model.vision_tower.", "vision", ""), ("vision_tower.", "vision", ""),
                      ("model.multi_modal_projector.", "projector", ""), ("multi_modal_projector.", "projector", ""),
                      ("model.language_model.", "llm", "model."), ("language_model.model.", "llm", "model."),
                      ("language_model.lm_head.", "llm", "lm_head."), ("lm_head.", "llm", "lm_head."))


def _tower_layers(vision: dict, layer: Any) -> dict:
    """The tower's config cut to the blocks up to `layer` (a `hidden_states` index: -1 all, -2 all but the last)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise VlaforgeError(f"{FIELD}: vision_feature_layer = {layer!r} (several layers concatenated) is not read "
                            "by vlaforge; give a VLM that reads one layer")
    blocks = vision["num_hidden_layers"]
    kept = blocks + 1 + layer if layer < 0 else layer
    if not 1 <= kept <= blocks:
        raise VlaforgeError(f"{FIELD}: vision_feature_layer = {layer} is outside the tower's {blocks} blocks")
    out = {**vision, "num_hidden_layers": kept}
    if kept < blocks:  # hidden_states[kept] precedes the tower's final norm
        out["vlaforge_final_norm"] = False
    return out


def _sub_configs(config: dict) -> tuple[dict, dict]:
    """The folder config's (vision_config, text_config), copied.

    Raises:
        VlaforgeError: either is missing.
    """
    vision, text = config.get("vision_config"), config.get("text_config")
    if not isinstance(vision, dict) or not isinstance(text, dict):
        raise VlaforgeError(f"{FIELD}: the {config.get('model_type')} config has no vision_config / text_config; "
                            f"{HINT}")
    return dict(vision), dict(text)


def _llava_configs(config: dict) -> dict:
    vision, text = _sub_configs(config)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise VlaforgeError(f"{FIELD}: vision_feature_select_strategy = {strategy!r} keeps the CLS token, which "
                            "vlaforge drops (docs/families.md); give a VLM with the 'default' strategy")
    act, bias = config.get("projector_hidden_act", "gelu"), config.get("multimodal_projector_bias", True)
    if act != "gelu" or not bias:
        raise VlaforgeError(f"{FIELD}: the LLaVA connector uses {act} (bias {bias}); vlaforge's projector is "
                            "linear + GELU + linear with biases")
    return {"vision": _tower_layers(vision, config.get("vision_feature_layer", -2)), "llm": text,
            "projector": {"hidden": text["hidden_size"], "layers": 2}}


def _paligemma_configs(config: dict) -> dict:
    vision, text = _sub_configs(config)
    width = vision.get("projection_dim", text.get("hidden_size"))
    if width != text["hidden_size"]:
        raise VlaforgeError(f"{FIELD}: the PaliGemma connector projects to {width}, the language model is "
                            f"{text['hidden_size']} wide; give a folder save_pretrained wrote")
    return {"vision": vision, "llm": text, "projector": {"layers": 1}}


def _idefics3_configs(config: dict) -> dict:
    vision, text = _sub_configs(config)
    scale = config.get("scale_factor", 2)
    grid = vision["image_size"] // vision["patch_size"]
    if not isinstance(scale, int) or scale < 1 or grid % scale:
        raise VlaforgeError(f"{FIELD}: scale_factor = {scale} does not divide the tower's {grid} x {grid} patch grid")
    return {"vision": vision, "llm": text, "projector": {"layers": 1, "merge": scale, "bias": False}}


def _qwen_vl_configs(config: dict) -> dict:
    """Through transformers' config class, which also reads the pre-v5 layout (text keys at the top level)."""
    from transformers import AutoConfig

    kind = config.get("model_type")
    try:
        built = AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError) as exc:
        raise VlaforgeError(f"{FIELD}: the {kind} config does not build ({exc}); {HINT}") from None
    vision, text = built.vision_config.to_dict(), built.text_config.to_dict()
    text["tie_word_embeddings"] = bool(built.tie_word_embeddings)
    width = vision["embed_dim"] if kind == "qwen2_vl" else vision["hidden_size"]
    out = vision["hidden_size"] if kind == "qwen2_vl" else vision["out_hidden_size"]
    if out != text["hidden_size"]:
        raise VlaforgeError(f"{FIELD}: the {kind} patch merger projects to {out}, the language model is "
                            f"{text['hidden_size']} wide; give a folder save_pretrained wrote")
    merge = vision["spatial_merge_size"]
    return {"vision": vision, "llm": text,
            "projector": {"hidden": width * merge * merge, "layers": 2, "merge": merge,
                          "norm": "layer" if kind == "qwen2_vl" else "rms", "order": "units"}}


# Qwen-VL: the checkpoints' names (visual, model, lm_head), then transformers 5's module names
VISUAL_MERGER_MODEL = (("model.visual.merger.", "projector", ""), ("visual.merger.", "projector", ""),
                       ("model.visual.", "vision", ""), ("visual.", "vision", ""),
                       ("model.language_model.", "llm", "model."), ("model.", "llm", "model."),
                       ("lm_head.", "llm", "lm_head."))

# Idefics3 and SmolVLM: vision_model, connector.modality_projection.proj (after the pixel shuffle), text_model
VISION_CONNECTOR_TEXT = (("model.vision_model.", "vision", ""),
                         ("model.connector.modality_projection.", "projector", ""),
                         ("model.text_model.", "llm", "model."), ("lm_head.", "llm", "lm_head."))

VLM_FAMILIES = (
    VLMFamily("llava", ("llava",), _llava_configs, {"linear_1.": "mlp.0.", "linear_2.": "mlp.2."}, TOWER_CONNECTOR_LM),
    VLMFamily("paligemma", ("paligemma",), _paligemma_configs, {"linear.": "mlp.0."}, TOWER_CONNECTOR_LM),
    VLMFamily("idefics3", ("idefics3",), _idefics3_configs, {"proj.": "mlp.0."}, VISION_CONNECTOR_TEXT),
    VLMFamily("smolvlm", ("smolvlm",), _idefics3_configs, {"proj.": "mlp.0."}, VISION_CONNECTOR_TEXT),
    VLMFamily("qwen2_vl", ("qwen2_vl", "qwen2_5_vl"), _qwen_vl_configs, {"ln_q.": "norm."}, VISUAL_MERGER_MODEL),
)
# VLM families transformers has that no adapter maps, and why
REFUSED = {kind: "its DeepStack adds tower features from intermediate blocks to the language model's first blocks, "
                 "which vlaforge's embeddings-in token layout does not carry; Qwen2-VL and Qwen2.5-VL folders are "
                 "mapped" for kind in ("qwen3_vl", "qwen3_vl_moe")}


def vlm_family(folder: str | Path) -> tuple[VLMFamily, dict]:
    """The family of a VLM folder and its config.json.

    Raises:
        VlaforgeError: not a folder with a config, or a model type no adapter maps.
    """
    config = read_config(folder, FIELD)
    kind = config.get("model_type")
    for fam in VLM_FAMILIES:
        if kind in fam.model_types:
            return fam, config
    if kind in REFUSED:
        raise VlaforgeError(f"{FIELD}: {folder} is a '{kind}' folder, which vlaforge does not map: {REFUSED[kind]}")
    known = ", ".join(t for fam in VLM_FAMILIES for t in fam.model_types)
    raise VlaforgeError(f"{FIELD}: {folder} is a '{kind}' folder; vlaforge maps these VLM families: {known} "
                        "(a vision tower or an LLM alone goes in model.vision / model.llm .pretrained)")


def component_configs(folder: str | Path) -> dict:
    """{"vision": the tower's config (its image normalization from the folder's processor file), "llm": the
    language model's, "projector": the connector's shape ({"layers": 1 | 2, "hidden"})}, from config.json alone."""
    from vlaforge.models.vision import family_for_folder, read_pixel_stats

    fam, config = vlm_family(folder)
    out = fam.configs(config)
    tower = family_for_folder(out["vision"].get("model_type"), f"{folder} (its vision tower)")
    out["vision"]["image_mean"], out["vision"]["image_std"] = read_pixel_stats(tower, str(folder), FIELD)
    return out


def _expected(module: nn.Module) -> list[tuple[str, ...]]:
    """The names `module`'s state must be given: one of each group of names a tied tensor has."""
    groups: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    persistent = set(module.state_dict())
    return [tuple(g) for g in groups.values() if any(n in persistent for n in g)]


def load_weights(folder: str | Path, parts: dict[str, nn.Module], new: dict[str, set[str]] | None = None) -> None:
    """Fill `parts` ({"vision", "projector", "llm"} modules built from `component_configs`) from the folder's
    safetensors files. `new`: per component, the names vlaforge adds that no VLM has (the projector's contrastive
    temperature).

    Raises:
        VlaforgeError: no weight files, or a weight of a component is not in them (it would train from random
        values), or a file's tensor does not fit the component's shape.
    """
    from safetensors.torch import load_file

    fam, _ = vlm_family(folder)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise VlaforgeError(f"{FIELD}: {folder} has no weight files (*.safetensors); {HINT}")
    states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in parts}
    for file in files:
        for key, value in load_file(str(file)).items():
            target = fam.key(key)
            if target is not None and target[0] in states:
                states[target[0]][target[1]] = value
    for name, module in parts.items():
        given = states[name]
        ours = (new or {}).get(name, set())
        missing = [g[0] for g in _expected(module) if not any(n in given or n in ours for n in g)]
        if missing:
            shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
            raise VlaforgeError(f"{FIELD}: {len(missing)} weights of the {name} component are not in {folder}'s "
                                f"files ({shown}): it would train from random values; {HINT}")
        own = module.state_dict()
        kept = {k: v for k, v in given.items() if k in own}  # the tower's unread blocks and norms are left out
        for k, v in kept.items():
            if v.shape != own[k].shape:
                raise VlaforgeError(f"{FIELD}: {k} of the {name} component is {tuple(v.shape)} in the files and "
                                    f"{tuple(own[k].shape)} in its config; give the folder save_pretrained wrote")
        module.load_state_dict(kept, strict=False)
