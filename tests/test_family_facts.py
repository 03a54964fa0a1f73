"""Family facts read from their rows (models/families.py, models/vision.py): the sub-layers selective
checkpointing recomputes and the planner counts, checked against transformers' own record of each family's
attention class; an unknown block refused in one line; the components that have blocks asked of the model."""

import pytest
import torch
from torch import nn

from vlaforge.models.build import build_vla

from conftest import tiny_config


def test_compile_wraps_the_blocks_of_every_component_that_has_them():
    """`compile_blocks` asks the model which components have blocks (an action head with a decoder stack, as the
    pretrained policies' action expert, included), not a literal (vision, llm)."""
    from vlaforge.techniques.compile import compile_blocks

    cfg = tiny_config()
    model = build_vla(cfg.model, cfg.loss)
    model.action_head.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert compile_blocks(model) == 2 + 2 + 2  # vision, llm, action head


# ---- the sub-layers of a block ---------------------------------------------------------------------------------

def _llm(name):
    from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM

    from families import COMMON, FAMILIES

    if name.endswith("_vl_text"):  # a VLM's text model: transformers builds it with no causal-LM class
        return AutoModel.from_config(CONFIG_MAPPING[name](**COMMON))
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[name](**{**COMMON, **FAMILIES[name]}))


# tiny towers of each family vlaforge loads (a fused tower's blocks are its towers')
TOWERS = {"siglip": dict(intermediate_size=64, image_size=32), "siglip2": dict(intermediate_size=64, num_patches=16),
          "clip": dict(intermediate_size=64, image_size=32), "dinov2": dict(mlp_ratio=2, image_size=32),
          "dinov2_with_registers": dict(mlp_ratio=2, image_size=32, num_register_tokens=2),
          "idefics3": dict(intermediate_size=64, image_size=32), "smolvlm": dict(intermediate_size=64, image_size=32),
          "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8, mlp_ratio=2),
          "qwen2_5_vl": dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                             patch_size=4, window_size=16, fullatt_block_indexes=[0])}


def _tower(name):
    from vlaforge.models.vision import VISION_FAMILIES

    from families import VISION_COMMON

    fam = next(f for f in VISION_FAMILIES if f.name == name)
    cls = fam.cls()
    extra = TOWERS[name] if name.startswith("qwen") else {**VISION_COMMON, "num_hidden_layers": 1, **TOWERS[name]}
    return cls(cls.config_class(**extra)), cls


def _check_sublayers(block, owner_cls):
    """The row's attention sub-layer holds the attention class transformers records for the family, its
    feed-forward sub-layer does not, and every linear layer of the block is in one of the two."""
    from vlaforge.techniques.checkpointing import sublayer

    attn, ffn = sublayer(block, "attn"), sublayer(block, "ffn")
    want = owner_cls._can_record_outputs["attentions"]
    assert any(isinstance(m, want) for m in attn.modules()), (type(block).__name__, want)
    assert not any(isinstance(m, want) for m in ffn.modules())
    inside = {id(m) for m in [*attn.modules(), *ffn.modules()]}
    rest = [n for n, m in block.named_modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    assert not rest, (type(block).__name__, rest)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "mistral",
                                  "phi3", "phi", "olmo2", "gpt_neox", "qwen2_vl_text", "qwen2_5_vl_text"])
def test_each_llm_familys_row_names_its_blocks_sublayers(name):
    from vlaforge.models.families import decoder_of

    llm = _llm(name)
    layers = llm.layers if name.endswith("_vl_text") else decoder_of(llm).layers
    _check_sublayers(layers[0], type(llm))


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_each_towers_row_names_its_blocks_sublayers(name):
    from vlaforge.models.vision import vision_blocks

    tower, cls = _tower(name)
    _check_sublayers(vision_blocks(tower)[0], cls)


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    from families import family_folder

    return {"llm": {"pretrained": str(family_folder("gpt_neox", tmp_path_factory.mktemp("families")))}}


def test_selective_checkpointing_of_gpt_neox_blocks_gives_the_plain_gradients(neox):
    """GPT-NeoX's row names its `attention` sub-layer: each selective strategy recomputes by it, exactly."""
    from conftest import policy_grads

    ref = policy_grads(tiny_config(model=neox))
    for strategy in ("selective", "selective_attn", "selective_ffn"):
        got = policy_grads(tiny_config(model=neox, components={"llm": {"checkpointing": strategy}}))
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-6, msg=f"{strategy}: {n}")


class _Block(nn.Module):
    """A block no family row names, with transformers' sub-layer names."""

    def __init__(self, width):
        super().__init__()
        self.self_attn, self.mlp = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, hidden, *args, **kwargs):
        return self.mlp(self.self_attn(hidden))


@pytest.mark.parametrize("strategy", ["selective", "selective_attn", "selective_ffn"])
def test_a_block_no_family_row_names_is_refused_in_one_line_naming_its_type(strategy):
    from vlaforge.errors import VlaforgeError
    from vlaforge.models.llm import llm_blocks
    from vlaforge.techniques.checkpointing import apply_checkpointing

    cfg = tiny_config(components={"llm": {"checkpointing": strategy}})
    model = build_vla(cfg.model, cfg.loss)
    llm_blocks(model.llm)[1] = _Block(model.llm.config.hidden_size)
    with pytest.raises(VlaforgeError) as err:
        apply_checkpointing(model, dict(cfg.components.items()))
    line = str(err.value)
    assert "\n" not in line and "_Block" in line and "'full'" in line, line
