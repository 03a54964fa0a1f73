"""The policy families vlaforge reads from LeRobot folders, one row each (`POLICY_FAMILIES`): LeRobot's type names,
the composition facts, the key map from LeRobot's state-dict names onto the four components, what is dropped and why,
and the builder that sizes the modules from config.json. Adding a family is adding a row; `PolicyVLA` does not
branch on names.

Sizes: SmolVLA's VLM comes from `vlm_model_name`'s local folder (config.json), its expert from LeRobot's rule (the
text config at `expert_width_multiplier` times the width, an intermediate size rounded up to 256). pi0's come from
`paligemma_variant` / `action_expert_variant` as LeRobot defines them (`gemma_2b`, `gemma_300m`), PaliGemma-3B's
SigLIP-so400m tower and 257,152-token vocabulary; a `sizes` mapping (`model.lerobot.sizes`) declares other ones
(docs/lerobot_policies.md).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from vlaforge.config.base import MAX_TOKENS
from vlaforge.errors import VlaforgeError
from vlaforge.models.policies.checks import MAX_LAYERS, MAX_STEPS, Bound, check_policy_config, image_pair
from vlaforge.models.policies.inputs import empty_camera_keys
from vlaforge.models.policies.model import Composition, ExpertHead, PolicySpec, PolicyVLA
from vlaforge.registry import Registry

FIELD = "model.lerobot.pretrained"
OPENPI_MASK = -2.3819763e38  # openpi's attention mask value (LeRobot's pi0)


@dataclass(frozen=True)
class Overrides:
    """What a user declares beside the folder: a local copy of SmolVLA's VLM, other sizes for pi0's variants."""

    vlm: str | None = None
    sizes: dict | None = None
    vlm_config: dict | None = None  # SmolVLA's VLM config as a checkpoint saved it (no folder read)


@dataclass(frozen=True)
class PolicyFamily:
    name: str
    lerobot_types: tuple[str, ...]
    composition: Composition
    prefixes: tuple[tuple[str, str, str], ...]  # (LeRobot's prefix, component, the component's prefix), first wins
    dropped: tuple[tuple[str, str], ...]  # (LeRobot's prefix, why vlaforge does not keep it)
    build: Callable[[dict, Overrides, bool], tuple[dict[str, nn.Module], PolicySpec]]
    refused_layouts: dict[str, str]  # parallel layouts (sequence / pipeline / tensor) not built, and why
    steps_field: str = "num_steps"  # config.json's denoising steps per prediction
    bounds: tuple[Bound, ...] = ()  # config.json's family-specific numbers and their ranges (checks.COMMON_BOUNDS: all)
    image_field: str | None = None  # config.json's image size pair

    def check(self, cfg: dict, where: str, overridden: frozenset = frozenset()) -> None:
        """Every number of config.json in its range, before anything is built (`checks.check_policy_config`)."""
        check_policy_config(cfg, self.bounds, where, overridden)
        if self.image_field:
            image_pair(cfg, self.image_field, where)

    def key(self, name: str) -> tuple[str, str] | None:
        """A LeRobot state-dict name -> (component, its name there); None for a name no component takes."""
        for prefix, comp, inner in self.prefixes:
            if name.startswith(prefix):
                return comp, inner + name[len(prefix):]
        return None

    def lerobot_name(self, component: str, name: str) -> str | None:
        """The inverse of `key`: a component's parameter name -> LeRobot's state-dict name (the longest component
        prefix that matches, with the first LeRobot prefix listed for it); None where no row gives a name that maps
        back through `key`."""
        firsts: dict[str, str] = {}
        for prefix, comp, inner in self.prefixes:
            if comp == component and name.startswith(inner):
                firsts.setdefault(inner, prefix)
        for inner in sorted(firsts, key=len, reverse=True):
            full = firsts[inner] + name[len(inner):]
            if self.key(full) == (component, name):
                return full
        return None

    def why_dropped(self, name: str) -> str | None:
        return next((why for prefix, why in self.dropped if name.startswith(prefix)), None)


POLICY_FAMILIES: Registry[PolicyFamily] = Registry("LeRobot policy type")

_PREFIX_LM = ("context and pipeline parallelism split the sequence or the blocks, and these policies' prefix-LM "
              "masks span two widths (VLM and expert) in every joint layer; not built")
_REFUSED = {"sequence": _PREFIX_LM, "pipeline": _PREFIX_LM,
            "tensor": "tensor parallelism over the joint layers is not built yet"}


def _layer_classes(model_type: str) -> tuple[type, type]:
    """transformers' decoder block and RMS norm classes of a text family ('llama', 'gemma')."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = {"llama": "Llama", "gemma": "Gemma"}.get(model_type)
    if prefix is None:
        raise VlaforgeError(f"{FIELD}: an action expert of the '{model_type}' family is not built; llama and gemma "
                            "experts are")
    return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm")


def _expert(config, cross: set[int], kv_in: int, adaptive: bool = False) -> tuple[nn.ModuleList, nn.Module]:
    """The expert's decoder blocks and final norm from a text config; blocks in `cross` read the VLM's keys and
    values (`kv_in` wide) through their own key / value projections; `adaptive`: every norm is pi0.5's
    time-conditioned `AdaRMSNorm` (its condition as wide as the expert)."""
    from vlaforge.models.policies.joint import AdaRMSNorm

    layer_cls, norm_cls = _layer_classes(config.model_type)
    config._attn_implementation = "sdpa"
    blocks = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
    if adaptive:
        width, eps = config.hidden_size, config.rms_norm_eps
        for block in blocks:
            block.input_layernorm, block.post_attention_layernorm = AdaRMSNorm(width, width, eps), \
                AdaRMSNorm(width, width, eps)
        return blocks, AdaRMSNorm(width, width, eps)
    width = config.num_key_value_heads * config.head_dim
    for i in cross:
        attn = blocks[i].self_attn
        attn.k_proj = nn.Linear(kv_in, width, bias=config.attention_bias)
        attn.v_proj = nn.Linear(kv_in, width, bias=config.attention_bias)
    return blocks, norm_cls(config.hidden_size, eps=config.rms_norm_eps)


def _features(cfg: dict) -> tuple[tuple[str, ...], int, int]:
    """(camera keys, state size, action size) from config.json's input / output features; the cameras are those a
    batch holds, not the empty ones LeRobot declares for `empty_cameras` (`inputs.py`)."""
    inputs, outputs = cfg.get("input_features") or {}, cfg.get("output_features") or {}
    empty = set(empty_camera_keys(int(cfg.get("empty_cameras") or 0)))
    cameras = tuple(k for k, f in inputs.items() if f.get("type") == "VISUAL" and k not in empty)
    state, action = inputs.get("observation.state"), outputs.get("action")
    if not cameras or state is None or action is None:
        raise VlaforgeError(f"{FIELD}: config.json's input_features / output_features name no camera, no "
                            "observation.state or no action; give a folder LeRobot's save_pretrained wrote")
    return cameras, int(state["shape"][0]), int(action["shape"][0])


def _spec(family: str, cfg: dict, image_size: tuple[int, int], rope_base: float, layers: tuple, **kw) -> PolicySpec:
    cameras, state_dim, action_dim = _features(cfg)
    steps_key = POLICY_FAMILIES.get(family).steps_field
    return PolicySpec(family=family, cameras=cameras, state_dim=state_dim, action_dim=action_dim,
                      chunk=int(cfg["chunk_size"]), max_state_dim=int(cfg["max_state_dim"]),
                      max_action_dim=int(cfg["max_action_dim"]), image_size=image_size,
                      num_steps=int(cfg[steps_key]), min_period=float(cfg["min_period"]),
                      max_period=float(cfg["max_period"]), rope_base=rope_base, layers=layers,
                      empty_cameras=int(cfg.get("empty_cameras") or 0), extra=dict(cfg), **kw)


# ---- SmolVLA ------------------------------------------------------------------------------------------------------
def _smolvla_intermediate(width: int, multiplier: int = 4, multiple_of: int = 256) -> int:
    """LeRobot's expert MLP width: 2/3 of 4x the width, rounded up to a multiple of 256."""
    hidden = int(multiplier * int(2 * width / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _smolvla_layers(n_vlm: int, n_expert: int, mode: str, every: int) -> tuple[tuple[int, int | None, str], ...]:
    """Which expert block meets VLM block i (every (n_vlm / n_expert)-th VLM block has one) and how they attend
    (cross attention, except every `every`-th layer, which attends jointly)."""
    step = n_vlm // n_expert
    plan = []
    for i in range(n_vlm):
        expert = None if step > 0 and i > 0 and i % step else (i // step if step > 0 else i)
        joint = "cross" not in mode or (every > 0 and i % every == 0)
        plan.append((i, expert, "self" if joint else "cross"))
    return tuple(plan)


def _vlm_folder(given: str | None, named: str | None) -> str:
    """SmolVLA's VLM folder: model.lerobot.vlm, else config.json's vlm_model_name; a Hub id (the real folders'
    HuggingFaceTB/SmolVLM2-500M-Video-Instruct) resolves through the Hugging Face cache (its config and tokenizer:
    the weights are the policy's).

    Raises:
        VlaforgeError: neither is given, or it resolves to no folder with a config.json.
    """
    from vlaforge import hub

    field = "model.lerobot.vlm" if given else f"{FIELD}: config.json's vlm_model_name"
    if not (given or named):
        raise VlaforgeError(f"{FIELD}: config.json names no vlm_model_name; set model.lerobot.vlm to the VLM's "
                            "folder or Hub id")
    folder = hub.local_folder(given or named, field, hub.VLM_CONFIG,
                              instead="" if given else ", or set model.lerobot.vlm to a local copy of that VLM")
    if not (folder / "config.json").is_file():
        raise VlaforgeError(f"{field} {str(given or named)!r} is a folder without a config.json; give the VLM's "
                            "save_pretrained folder or its Hub id")
    return str(folder)


def _smolvla_build(cfg: dict, over: Overrides, fake: bool) -> tuple[dict[str, nn.Module], PolicySpec]:
    from transformers import AutoConfig
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

    from vlaforge.models.llm import text_lm_class

    if over.vlm_config is None:
        folder = _vlm_folder(over.vlm, cfg.get("vlm_model_name"))
    if cfg.get("add_image_special_tokens"):
        raise VlaforgeError(f"{FIELD}: add_image_special_tokens = true is not built; fine-tune a SmolVLA without it")
    vlm = AutoConfig.from_pretrained(folder, local_files_only=True) if over.vlm_config is None else \
        AutoConfig.for_model(**over.vlm_config)
    text = copy.deepcopy(vlm.text_config)
    n_vlm = int(cfg.get("num_vlm_layers", -1))
    # NOTE: LeRobot keeps the first num_vlm_layers blocks: a larger number keeps them all
    text.num_hidden_layers = min(n_vlm, text.num_hidden_layers) if n_vlm > 0 else text.num_hidden_layers
    text.tie_word_embeddings = bool(getattr(vlm, "tie_word_embeddings", False))
    expert = copy.deepcopy(text)
    expert.hidden_size = int(text.hidden_size * float(cfg.get("expert_width_multiplier", 0.75)))
    expert.intermediate_size = _smolvla_intermediate(expert.hidden_size)
    n_exp = int(cfg.get("num_expert_layers", -1))
    if n_exp > 0 and text.num_hidden_layers % n_exp:
        raise VlaforgeError(f"{FIELD}: num_expert_layers = {n_exp} does not divide the VLM's "
                            f"{text.num_hidden_layers} layers")
    expert.num_hidden_layers = n_exp if n_exp > 0 else text.num_hidden_layers
    mode, every = str(cfg.get("attention_mode", "cross_attn")), int(cfg.get("self_attn_every_n_layers", -1))
    # NOTE: LeRobot picks the expert blocks with cross projections by the expert's own index
    cross = {i for i in range(expert.num_hidden_layers) if "cross" in mode and not (every > 0 and i % every == 0)}
    vlm._attn_implementation = text._attn_implementation = "sdpa"
    vlm.vision_config._attn_implementation = "sdpa"
    blocks, norm = _expert(expert, cross, text.num_key_value_heads * text.head_dim)
    parts = {"vision": SmolVLMVisionTransformer(vlm.vision_config), "projector": SmolVLMConnector(vlm),
             "llm": text_lm_class()(text),
             "action_head": (blocks, norm, int(cfg["max_state_dim"]), text.hidden_size, expert.hidden_size)}
    layers = _smolvla_layers(text.num_hidden_layers, expert.num_hidden_layers, mode, every)
    clash = next(((i, e) for i, e, how in layers if e is not None and (e in cross) != (how == "cross")), None)
    if clash:
        raise VlaforgeError(f"{FIELD}: num_expert_layers = {n_exp} with self_attn_every_n_layers = {every} gives "
                            f"expert block {clash[1]} the wrong key / value projections for VLM layer {clash[0]} "
                            "(LeRobot 0.6.1 fails alike); choose settings whose expert blocks meet layers of "
                            "their kind")
    size = cfg.get("resize_imgs_with_padding")  # LeRobot's (width, height)
    image = (int(size[1]), int(size[0])) if size else (vlm.vision_config.image_size,) * 2
    spec = _spec("smolvla", cfg, image, 10_000.0, layers, prefix_length=int(cfg.get("prefix_length", -1)))
    parts["backbones"] = {"config": cfg, "vlm": vlm.to_dict()}
    return parts, spec


# ---- pi0 ----------------------------------------------------------------------------------------------------------
# LeRobot's (openpi's) Gemma variants, and PaliGemma-3B's tower and vocabulary as LeRobot builds them
GEMMA_VARIANTS = {
    "gemma_300m": {"width": 1024, "depth": 18, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
    "gemma_2b": {"width": 2048, "depth": 18, "mlp_dim": 16_384, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
}
PALIGEMMA_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "patch_size": 14, "vision_use_head": False}
PALIGEMMA_VOCAB = 257_152


def _gemma(variant: dict, vocab: int):
    from transformers import GemmaConfig

    return GemmaConfig(hidden_size=variant["width"], intermediate_size=variant["mlp_dim"],
                       num_attention_heads=variant["num_heads"], num_key_value_heads=variant["num_kv_heads"],
                       head_dim=variant["head_dim"], num_hidden_layers=variant["depth"], vocab_size=vocab,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def _variant(name: str, field: str, declared: dict) -> dict:
    variants = {**GEMMA_VARIANTS, **(declared.get("variants") or {})}
    if not isinstance(name, str) or name not in variants:
        raise VlaforgeError(f"{FIELD}: config.json's {field} = {name!r} is not a Gemma variant vlaforge knows "
                            f"({', '.join(variants)}); declare its sizes in model.lerobot.sizes")
    return variants[name]


def _pi0_build(cfg: dict, over: Overrides, fake: bool, family: str = "pi0") -> tuple[dict[str, nn.Module], PolicySpec]:
    """pi0, and pi0.5 (`family` 'pi05': the expert's norms time-conditioned, no state projection)."""
    from transformers import PaliGemmaConfig, SiglipVisionConfig, SiglipVisionModel
    from transformers.models.paligemma.modeling_paligemma import PaliGemmaMultiModalProjector

    from vlaforge.models.llm import text_lm_class

    declared = over.sizes or {}
    vocab = int(declared.get("vocab_size", PALIGEMMA_VOCAB))
    text = _gemma(_variant(cfg.get("paligemma_variant", "gemma_2b"), "paligemma_variant", declared), vocab)
    expert = _gemma(_variant(cfg.get("action_expert_variant", "gemma_300m"), "action_expert_variant", declared), vocab)
    resolution = tuple(int(v) for v in cfg.get("image_resolution", (224, 224)))
    vision = SiglipVisionConfig(**{**PALIGEMMA_VISION, **(declared.get("vision") or {}), "image_size": resolution[0]})
    vision._attn_implementation = text._attn_implementation = "sdpa"
    projection = int(declared.get("projection_dim", text.hidden_size))
    pali = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), projection_dim=projection)
    pali.vision_config.hidden_size = vision.hidden_size
    adaptive = family == "pi05"
    blocks, norm = _expert(expert, set(), 0, adaptive=adaptive)
    state_in = None if adaptive else int(cfg["max_state_dim"])  # pi0.5 writes the state into its prompt
    parts = {"vision": SiglipVisionModel(vision), "projector": PaliGemmaMultiModalProjector(pali),
             "llm": text_lm_class()(text),
             "action_head": (blocks, norm, state_in, expert.hidden_size, expert.hidden_size)}
    rope = (text.rope_parameters or {}).get("rope_theta", 10_000.0)
    n = text.num_hidden_layers
    if expert.num_hidden_layers != n:
        raise VlaforgeError(f"{FIELD}: the VLM has {n} layers and the expert {expert.num_hidden_layers}; pi0 pairs "
                            "them one to one")
    beta = tuple(float(cfg.get(k, d)) for k, d in (("time_sampling_beta_alpha", 1.5), ("time_sampling_beta_beta", 1.0),
                                                   ("time_sampling_scale", 0.999), ("time_sampling_offset", 0.001)))
    spec = _spec(family, cfg, resolution, float(rope),
                 tuple((i, i, "self") for i in range(n)), time_beta=beta)
    parts["backbones"] = {"config": cfg, "sizes": over.sizes}
    return parts, spec


# config.json's numbers each family reads beyond checks.COMMON_BOUNDS (-1: LeRobot's "none" / "all")
_SMOLVLA_BOUNDS = (
    Bound("num_steps", 1, MAX_STEPS, "denoising steps per prediction"),
    Bound("prefix_length", -1, MAX_TOKENS, "tokens the prefix is padded to", required=False),
    Bound("num_vlm_layers", -1, MAX_LAYERS, "VLM blocks kept", required=False),
    Bound("num_expert_layers", -1, MAX_LAYERS, "expert blocks", required=False),
    Bound("self_attn_every_n_layers", -1, MAX_LAYERS, "layers between joint-attention layers", required=False),
    Bound("expert_width_multiplier", 0, 8, "the expert's width over the VLM's", number=True, required=False,
          above=True))
_PI0_BOUNDS = (
    Bound("num_inference_steps", 1, MAX_STEPS, "denoising steps per prediction"),
    *(Bound(f"time_sampling_beta_{k}", 0, 1e3, "a Beta parameter of the training times", number=True,
            required=False, above=True) for k in ("alpha", "beta")),
    Bound("time_sampling_scale", 0, 1, "the training times' scale", number=True, required=False, above=True),
    Bound("time_sampling_offset", 0, 1, "the training times' offset", number=True, required=False))


POLICY_FAMILIES.add("smolvla", PolicyFamily(
    name="smolvla", lerobot_types=("smolvla",),
    composition=Composition(state_token="prefix", actions_causal=True, embed_scale=True, rope_style="divide",
                            resize="top_left", mask_value=float(torch.finfo(torch.float32).min)),
    prefixes=(("model.vlm_with_expert.vlm.model.vision_model.", "vision", ""),
              ("model.vlm_with_expert.vlm.model.connector.", "projector", ""),
              ("model.vlm_with_expert.vlm.model.text_model.", "llm", "model."),
              ("model.vlm_with_expert.vlm.lm_head.", "llm", "lm_head."),
              ("model.vlm_with_expert.lm_expert.layers.", "action_head", "blocks."),
              ("model.vlm_with_expert.lm_expert.norm.", "action_head", "norm."),
              ("model.", "action_head", "")),
    dropped=(), build=_smolvla_build, refused_layouts=_REFUSED, bounds=_SMOLVLA_BOUNDS,
    image_field="resize_imgs_with_padding"))

POLICY_FAMILIES.add("pi0", PolicyFamily(
    name="pi0", lerobot_types=("pi0",),
    composition=Composition(state_token="suffix", actions_causal=False, embed_scale=False, rope_style="multiply",
                            resize="centered", mask_value=OPENPI_MASK, masks_padded_actions=False),
    prefixes=(("model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.", "vision", ""),
              ("model.paligemma_with_expert.paligemma.model.vision_tower.", "vision", ""),
              ("model.paligemma_with_expert.paligemma.model.multi_modal_projector.", "projector", ""),
              ("model.paligemma_with_expert.paligemma.model.language_model.", "llm", "model."),
              ("model.paligemma_with_expert.paligemma.lm_head.", "llm", "lm_head."),
              ("model.paligemma_with_expert.gemma_expert.model.layers.", "action_head", "blocks."),
              ("model.paligemma_with_expert.gemma_expert.model.norm.", "action_head", "norm."),
              ("model.", "action_head", "")),
    dropped=(("model.paligemma_with_expert.gemma_expert.lm_head.",
              "the action expert's LM head, which pi0 never uses (263 M parameters at pi0's size)"),),
    build=_pi0_build, refused_layouts=_REFUSED, steps_field="num_inference_steps", bounds=_PI0_BOUNDS,
    image_field="image_resolution"))


# pi0.5: pi0's keys, drops and composition, but the state in the prompt and the flow time in every expert norm
POLICY_FAMILIES.add("pi05", dataclasses.replace(
    POLICY_FAMILIES.get("pi0"), name="pi05", lerobot_types=("pi05",),
    composition=dataclasses.replace(POLICY_FAMILIES.get("pi0").composition, state_token=None,
                                    time_conditioning="adarms"),
    build=lambda cfg, over, fake: _pi0_build(cfg, over, fake, "pi05")))


def family_of(kind: str | None, where: str) -> PolicyFamily:
    """The family whose LeRobot type is `kind`.

    Raises:
        VlaforgeError: a type no row reads.
    """
    for name in POLICY_FAMILIES:
        fam = POLICY_FAMILIES.get(name)
        if kind in fam.lerobot_types:
            return fam
    known = ", ".join(t for n in POLICY_FAMILIES for t in POLICY_FAMILIES.get(n).lerobot_types)
    raise VlaforgeError(f"{FIELD}: {where} is a LeRobot '{kind}' policy; vlaforge reads these types: {known}")


def build_policy(cfg: dict, over: Overrides, fake: bool = False) -> PolicyVLA:
    """The family's modules, sized from config.json, composed (weights random: the reader fills them)."""
    fam = family_of(cfg.get("type"), "config.json")
    fam.check(cfg, FIELD)  # NOTE: also a checkpoint's saved copy and the defaults, before allocating
    parts, spec = fam.build(cfg, over, fake)
    parts["llm"].tie_weights()  # NOTE: transformers' no_init_weights (a fake build) also skips the tying
    blocks, norm, state_in, state_out, width = parts.pop("action_head")
    head = ExpertHead(blocks, norm, state_in, state_out, width, spec.max_action_dim, spec.chunk, spec.action_dim,
                      fam.composition.time_conditioning)
    model = PolicyVLA(parts["vision"], parts["projector"], parts["llm"], head, spec, fam.composition)
    model.backbones = parts["backbones"]  # what rebuilds it without the folder (a checkpoint's backbones.json)
    return model
