"""A tiny pi0 / pi0.5 from LeRobot 0.6.1's own code: the test-side patch that make_policy.py and reference.py both
apply (never the site's files). LeRobot builds pi0 and pi0.5 only at full size: `PI0Config` / `PI05Config` accept the
variants `gemma_2b` / `gemma_300m` only, `get_gemma_config` maps them to PaliGemma-3B's widths, and
`PaliGemmaWithExpertModel.__init__` hard-codes the vocabulary (257152), SigLIP-so400m and `projection_dim` 2048 into
the configs it builds. pi0.5 (`policies/pi05/modeling_pi05.py`) has its own copy of `get_gemma_config` and
`PaliGemmaWithExpertModel` (the expert with adaRMS norms), so both modules are patched the same way. The patch keeps
the variant names (config.json stays LeRobot's) and builds them at SIZES: it replaces `get_gemma_config` and wraps
the two model classes `PaliGemmaWithExpertModel` instantiates, shrinking their configs just before the models are
built. 8 heads everywhere: `compute_layer_complete` reshapes the attention output with 8 heads.
"""

from __future__ import annotations

import copy

# the exact sizes (written to OUT/sizes.json by make_policy.py; reference.py reads them back from there)
SIZES = {
    "variants": {
        "gemma_2b": dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
        "gemma_300m": dict(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
    },
    "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
                   image_size=32),
    "vocab_size": None,  # the tiny tokenizer's size, set by make_policy.py
    "projection_dim": 64,
}


def sizes(vocab_size: int, image_size: int = 32, patch_size: int = 8) -> dict:
    """SIZES for a tokenizer of `vocab_size` and SigLIP at `image_size` (the config's image_resolution, which LeRobot
    sets the tower's size from) in patches of `patch_size`."""
    out = copy.deepcopy(SIZES)
    out["vocab_size"] = int(vocab_size)
    out["vision"].update(image_size=int(image_size), patch_size=int(patch_size))
    return out


def apply(sizes: dict) -> None:
    """Makes LeRobot's pi0 and pi0.5 (anything built through `modeling_pi0` / `modeling_pi05`) tiny in this
    process."""
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi05 import modeling_pi05

    variants = sizes["variants"]
    assert variants["gemma_2b"]["width"] == sizes["projection_dim"], "the projector maps SigLIP to the VLM width"
    assert all(v["num_heads"] == 8 for v in variants.values()), "compute_layer_complete hard-codes 8 heads"
    for module in (modeling_pi0, modeling_pi05):
        _patch(module, sizes)


def _patch(module, sizes: dict) -> None:
    if getattr(module, "_TINY_SIZES", None) is not None:
        assert module._TINY_SIZES == sizes, "tiny_pi0 applied twice with different sizes"
        return
    variants, vision, vocab = sizes["variants"], sizes["vision"], sizes["vocab_size"]
    paligemma_cls = module.PaliGemmaForConditionalGenerationWithPiGemma
    expert_cls = module.PiGemmaForCausalLM

    def get_gemma_config(variant: str):
        if variant not in variants:
            raise ValueError(f"Unknown variant: {variant}")
        return module.GemmaConfig(**variants[variant])

    def paligemma(config):
        # PaliGemmaWithExpertModel set the text sizes from get_gemma_config; undo its hard-coded constants
        config._vocab_size = vocab
        config.image_token_index = vocab
        config.text_config.vocab_size = vocab
        for key, value in vision.items():
            if key == "image_size":  # LeRobot sets it from the config's image_resolution
                assert config.vision_config.image_size == value, (config.vision_config.image_size, value)
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = sizes["projection_dim"]
        config.projection_dim = sizes["projection_dim"]
        config.hidden_size = variants["gemma_2b"]["width"]
        config.text_config.num_image_tokens = config.vision_config.num_image_tokens = \
            (vision["image_size"] // vision["patch_size"]) ** 2
        return paligemma_cls(config=config)

    def expert(config):
        config.vocab_size = vocab
        return expert_cls(config=config)

    module.get_gemma_config = get_gemma_config
    module.PaliGemmaForConditionalGenerationWithPiGemma = paligemma
    module.PiGemmaForCausalLM = expert
    module._TINY_SIZES = copy.deepcopy(sizes)
