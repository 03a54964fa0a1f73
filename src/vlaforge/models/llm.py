"""The `llm` component: a `transformers` causal LM, from a flavor (Llama-shaped) or a pretrained folder of any
decoder-only family `AutoModelForCausalLM` builds (models/families.py finds its parts)."""

from __future__ import annotations

from torch import nn

from vlaforge.errors import VlaforgeError
from vlaforge.config.flavors import Flavor
from vlaforge.models.families import decoder_of, llm_parts
from vlaforge.models.hf_loading import from_config, load_pretrained


def build_llm(flavor: Flavor, pretrained: str | None, config: dict | None = None, attn: str = "sdpa") -> nn.Module:
    """A causal LM (`LlamaForCausalLM` for built-in flavors; any decoder-only family when pretrained). `config`:
    the pretrained model's config alone (weights to come from a checkpoint, or none under fake tensors). `attn`:
    `model.attn_implementation`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if pretrained or config is not None:
        field = "model.llm.pretrained"
        model = from_config(AutoModelForCausalLM, config, field, attn) if config is not None else \
            load_pretrained(AutoModelForCausalLM, pretrained, field, attn=attn)
        try:
            llm_parts(model)
        except VlaforgeError as exc:
            raise VlaforgeError(f"model.llm.pretrained: {pretrained or 'the saved config'}: {exc}") from None
        return model
    return LlamaForCausalLM(LlamaConfig(attn_implementation=attn, **flavor.llm))


def llm_blocks(llm: nn.Module) -> nn.ModuleList:
    """The decoder blocks of the LLM, in order."""
    return decoder_of(llm).layers
