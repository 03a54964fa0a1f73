"""The `llm` component: a `transformers` causal LM, from a flavor (Llama-shaped) or a pretrained folder of any
decoder-only family `AutoModelForCausalLM` builds (models/families.py finds its parts), or a VLM's text model that
transformers ships with no causal-LM class (Qwen2-VL's, Qwen2.5-VL's: `TextLM` adds its LM head)."""

from __future__ import annotations

import functools

from torch import nn

from vlaforge.config.flavors import Flavor
from vlaforge.errors import VlaforgeError
from vlaforge.models.families import decoder_of, llm_parts
from vlaforge.models.hf_loading import from_config, load_pretrained

# text-model config types transformers builds only inside their VLM (their decoder takes 3-D M-RoPE positions)
TEXT_MODELS = ("qwen2_vl_text", "qwen2_5_vl_text")


def _text_lm_class():
    from transformers import AutoModel, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class TextLM(PreTrainedModel):
        """A VLM's text model (`model`) and its LM head (`lm_head`, tied to the embeddings when the VLM ties them),
        named as the VLM's checkpoint names them, with a causal LM's forward."""

        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        _supports_sdpa = True
        _supports_attention_backend = True

        def __init__(self, config):
            super().__init__(config)
            self.model = AutoModel.from_config(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_decoder(self):
            return self.model

        def get_input_embeddings(self):
            return self.model.embed_tokens

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None,
                    output_hidden_states=None, logits_to_keep: int = 0, use_cache=False, **kwargs):
            out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                             position_ids=position_ids, output_hidden_states=output_hidden_states,
                             use_cache=use_cache, **kwargs)
            hidden = out.last_hidden_state
            logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
            return CausalLMOutputWithPast(logits=logits, hidden_states=out.hidden_states)

    return TextLM


# the `TextLM` class, built on first use (transformers is imported lazily)
text_lm_class = functools.cache(_text_lm_class)


# SDPA under its own name: the same attention, and a mask function that never reads the mask on the host
SDPA_NO_HOST_READ = "vlaforge_sdpa"


@functools.cache
def _register_sdpa_no_host_read() -> str:
    """Register `SDPA_NO_HOST_READ` with transformers: its SDPA attention, and its SDPA mask told never to drop a
    given padding mask for `is_causal`. NOTE: that drop is decided by reading the mask on the host (`fast_all` in
    `masking_utils._ignore_causal_mask_sdpa`), a blocking device sync in every training step on a GPU; a batch known
    on the host to hold no padding passes no mask instead (`VLA.llm_mask`) and keeps the `is_causal` kernels."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def mask(*args, attention_mask=None, allow_is_causal_skip: bool = True, **kwargs):
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs,
                         allow_is_causal_skip=allow_is_causal_skip and attention_mask is None)

    AttentionInterface.register(SDPA_NO_HOST_READ, sdpa_attention_forward)
    AttentionMaskInterface.register(SDPA_NO_HOST_READ, mask)
    return SDPA_NO_HOST_READ


def without_host_reads(llm: nn.Module) -> nn.Module:
    """Switch an SDPA LLM to `SDPA_NO_HOST_READ` (eager and other implementations read nothing: left as they are)."""
    if llm.config._attn_implementation == "sdpa":
        llm.set_attn_implementation(_register_sdpa_no_host_read())
    return llm


def build_llm(flavor: Flavor, pretrained: str | None, config: dict | None = None, attn: str = "sdpa") -> nn.Module:
    """A causal LM (`LlamaForCausalLM` for built-in flavors; any decoder-only family when pretrained). `config`:
    the pretrained model's config alone (weights to come from a checkpoint, or none under fake tensors). `attn`:
    `model.attn_implementation`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if pretrained or config is not None:
        field = "model.llm.pretrained"
        text_model = config is not None and config.get("model_type") in TEXT_MODELS
        model = from_config(text_lm_class() if text_model else AutoModelForCausalLM, config, field, attn) \
            if config is not None else load_pretrained(AutoModelForCausalLM, pretrained, field, attn=attn)
        try:
            llm_parts(model)
        except VlaforgeError as exc:
            raise VlaforgeError(f"model.llm.pretrained: {pretrained or 'the saved config'}: {exc}") from None
        return without_host_reads(model)
    return without_host_reads(LlamaForCausalLM(LlamaConfig(attn_implementation=attn, **flavor.llm)))


def llm_blocks(llm: nn.Module) -> nn.ModuleList:
    """The decoder blocks of the LLM, in order."""
    return decoder_of(llm).layers
