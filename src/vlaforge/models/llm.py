"""The `llm` component: a `transformers` Llama-family causal LM, from a flavor or a pretrained folder."""

from __future__ import annotations

from torch import nn

from vlaforge.errors import VlaforgeError
from vlaforge.config.flavors import Flavor
from vlaforge.models.hf_loading import load_pretrained


def build_llm(flavor: Flavor, pretrained: str | None) -> nn.Module:
    """A causal LM (`LlamaForCausalLM` for built-in flavors; any Llama-family folder when pretrained)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if pretrained:
        model = load_pretrained(AutoModelForCausalLM, pretrained, "model.llm.pretrained")
        if not hasattr(getattr(model, "model", None), "layers"):
            raise VlaforgeError(f"model.llm.pretrained: {pretrained} is a {type(model).__name__}, not a "
                                "Llama-family causal LM (expected .model.layers); use a Llama or Qwen2 folder")
        return model
    return LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **flavor.llm))


def llm_blocks(llm: nn.Module) -> nn.ModuleList:
    """The decoder blocks of the LLM, in order."""
    return llm.model.layers
