"""Tiny random-init `save_pretrained` folders of each LLM family, built with `transformers` the way a user's real
folder is written (config.json, model.safetensors, a tokenizer): the family matrix's inputs. Each family is built once
per test session (`family_folder`), in a folder shared by the tests that use it. Each config is its family's plain
`transformers` config class given only the fields that class declares (`family_config`), so a folder holds what a
user's does: GPT-NeoX's, for one, no `num_key_value_heads` and no `head_dim`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# NOTE: the tokenizer is trained in the test process, which later forks CLI runs and ranks: tokenizers' Rust thread
# pool, once started, deadlocks a forked child (a lock held by a pool thread at the fork)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# hidden 64, 4 heads of 16, 2 kv heads: tp = 2 and cp = 2 divide everything; windows of 8 tokens are shorter than
# tiny_synthetic's sequence, so a sliding window binds. Each family takes the ones its config class declares
# (`own_fields`): a multi-head family (GPT-NeoX) no kv heads, and head_dim only where the family has the field
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=320, max_position_embeddings=256, head_dim=16, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},  # per-head q/k norms
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": {},  # tied embeddings, scaled embeddings
    "gemma2": dict(sliding_window=8),  # soft-capped attention logits (eager attention)
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),  # 4 norms per block
    "mistral": dict(sliding_window=8),
    "phi3": {},  # fused qkv_proj / gate_up_proj
    "phi": {},  # final_layernorm, parallel attention + MLP, partial rotary
    "olmo2": {},  # full-width q/k norms, post-norms only
    "gpt_neox": {},  # gpt_neox.layers, fused query_key_value
}
_BUILT: dict[str, Path] = {}

# vision towers: width 32, 2 heads, patch 8 on 32-pixel images (a 4 x 4 grid); each family's own extras
VISION_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=8)
VISION_FAMILIES = {
    "siglip": ("SiglipVisionModel", dict(intermediate_size=64, image_size=32, vision_use_head=True)),  # head dropped
    "siglip2": ("Siglip2VisionModel", dict(intermediate_size=64, num_patches=16)),  # NaFlex: a 4 x 4 position grid
    "clip": ("CLIPVisionModel", dict(intermediate_size=64, image_size=32)),  # CLS token, pre-LayerNorm
    "dinov2": ("Dinov2Model", dict(mlp_ratio=2, image_size=32)),  # CLS token, layer scale, always interpolates
    "dinov2_with_registers": ("Dinov2WithRegistersModel", dict(mlp_ratio=2, image_size=32, num_register_tokens=2)),
}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "open close the door drawer press button reach goal pick place put move push pull left right".split()
    tok.train_from_iterator([" ".join(words)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def own_fields(cls, values: dict) -> dict:
    """The entries of `values` that config class `cls` declares (its dataclass fields and `attribute_map` aliases):
    what a folder of that family states, nothing added for vlaforge's convenience."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "attribute_map", {}))
    return {k: v for k, v in values.items() if k in names}


def family_config(name: str, **overrides):
    """Family `name`'s plain `transformers` config: COMMON's values for the fields its class declares, then the
    family's own extras and `overrides` (e.g. more layers), each of which must be one of its fields."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[name]
    extra = {**FAMILIES[name], **overrides}
    unknown = sorted(set(extra) - set(own_fields(cls, extra)))
    if unknown:  # a field the family does not have would only sit in its config.json, unread by its model
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return cls(**{**own_fields(cls, COMMON), **extra})


def save_causal_lm(model, out: Path) -> Path:
    """`model` and the test tokenizer saved into `out`, as a user's folder is."""
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out


def build_family(name: str, out: Path, **overrides) -> Path:
    """A tiny random-init causal LM of family `name` saved with its tokenizer into `out` (`overrides`: config
    fields of the family on top of its own, e.g. more layers)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config(name, **overrides)
    attn = "eager" if name == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():  # norms start at ones (zeros for Gemma's 1 + w): random ones catch a misplaced norm
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return save_causal_lm(model, out)


def _cached(key: str, build, out: Path) -> Path:
    """The session's folder `key`, built by `build(out)` on first use (again if it was deleted)."""
    if key not in _BUILT or not _BUILT[key].is_dir():
        _BUILT[key] = build(out)
    return _BUILT[key]


def family_folder(name: str, root: Path) -> Path:
    """The session's folder of family `name` (built on first use under `root`)."""
    return _cached(name, lambda out: build_family(name, out), Path(root) / name)


def build_tower(name: str, out: Path, **overrides) -> Path:
    """A tiny random-init vision tower of family `name` saved into `out` (`overrides`: config fields)."""
    import transformers

    torch.manual_seed(0)
    cls_name, extra = VISION_FAMILIES[name]
    cls = getattr(transformers, cls_name)
    model = cls(cls.config_class(**{**VISION_COMMON, **extra, **overrides}))
    with torch.no_grad():  # norms and layer scales off their init values: a misplaced one shows
        for n, p in model.named_parameters():
            if "norm" in n or "layer_scale" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def tower_folder(name: str, root: Path) -> Path:
    """The session's folder of vision family `name` (built on first use under `root`)."""
    return _cached(f"vision:{name}", lambda out: build_tower(name, out), Path(root) / f"vision_{name}")


VLM_STATS = ([0.45, 0.42, 0.4], [0.27, 0.26, 0.28])  # the tiny VLMs' processor normalization (not a default)


def build_vlm(name: str, out: Path) -> Path:
    """A tiny random-init whole VLM of family `name` (LLaVA: a 3-block CLIP tower read at layer -2, a 2-layer GELU
    connector, a Llama LM; PaliGemma: a SigLIP tower, a one-linear connector, a tied-embedding Gemma; Idefics3 and
    SmolVLM: their SigLIP-shaped tower, a 2 x 2 pixel shuffle and a bias-free linear, a Llama LM; Qwen2-VL and
    Qwen2.5-VL: their 3-D-patch towers (2.5: windowed blocks), a 2 x 2 patch merger, an M-RoPE text model) saved with
    its tokenizer and a processor file of its own mean / std into `out`."""
    import json

    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    if name == "llava":
        vision = CLIPVisionConfig(**{**VISION_COMMON, "num_hidden_layers": 3}, intermediate_size=64, image_size=32)
        text = LlamaConfig(**COMMON)
        model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                                          image_token_index=COMMON["vocab_size"] - 1))
    elif name in ("idefics3", "smolvlm"):
        import transformers

        prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[name]
        vision = getattr(transformers, f"{prefix}VisionConfig")(**VISION_COMMON, intermediate_size=64, image_size=32)
        config = getattr(transformers, f"{prefix}Config")(vision_config=vision.to_dict(),
                                                          text_config=LlamaConfig(**COMMON).to_dict(), scale_factor=2,
                                                          image_token_id=COMMON["vocab_size"] - 1)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    elif name in ("qwen2_vl", "qwen2_5_vl"):
        import transformers

        # M-RoPE over head_dim 16 (hidden / heads: the text configs have no head_dim field): (temporal, height,
        # width) = 2 + 3 + 3 frequency pairs
        text_cls = {"qwen2_vl": transformers.Qwen2VLTextConfig, "qwen2_5_vl": transformers.Qwen2_5_VLTextConfig}[name]
        text = dict(own_fields(text_cls, COMMON), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 3, 3]})
        tokens = dict(image_token_id=319, video_token_id=318, vision_start_token_id=317)
        if name == "qwen2_vl":  # embed_dim is the tower's width, hidden_size the merger's output
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8, mlp_ratio=2)
            model = transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
                vision_config=vision, text_config=text, **tokens))
        else:  # patch 4: 32 px is 4 x 4 merge units, 16-px windows are 2 x 2 of them (4 windows: a real permutation)
            vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                          patch_size=4, window_size=16, fullatt_block_indexes=[1])
            model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
                vision_config=vision, text_config=text, **tokens))
    else:
        from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

        assert name == "paligemma", name
        vision = SiglipVisionConfig(**VISION_COMMON, intermediate_size=64, image_size=32)
        text = GemmaConfig(**COMMON)  # tied embeddings
        model = PaliGemmaForConditionalGeneration(PaliGemmaConfig(
            vision_config=vision.to_dict(), text_config=text.to_dict(), projection_dim=COMMON["hidden_size"],
            hidden_size=COMMON["hidden_size"], image_token_index=COMMON["vocab_size"] - 1))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "ln_q" in n:  # Qwen-VL merger's norm too
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({"image_mean": VLM_STATS[0],
                                                               "image_std": VLM_STATS[1]}))
    return out


def vlm_folder(name: str, root: Path) -> Path:
    """The session's folder of VLM family `name` (built on first use under `root`)."""
    return _cached(f"vlm:{name}", lambda out: build_vlm(name, out), Path(root) / f"vlm_{name}")


def all_folders(root: Path) -> dict[str, Path]:
    return {name: family_folder(name, root) for name in FAMILIES}


if __name__ == "__main__":  # python tests/families.py OUT: build every family into OUT
    import sys

    for n, p in all_folders(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd())).items():
        print(n, p)
