"""What the techniques need to know about an LLM family, read from the built `transformers` module and its config
instead of from Llama's attribute names: the one place that knows families differ.

- `llm_parts`: the decoder body (`get_decoder()`: `model` for most families, `gpt_neox` for GPT-NeoX), its blocks,
  its final norm (`norm`, Phi's `final_layernorm`, GPT-NeoX's `final_layer_norm`: found as the body's one norm
  child), its token embeddings and LM head.
- `tp_plan`: each block's tensor-parallel plan from the config's own `base_model_tp_plan` (transformers ships one
  per family: fused projections gathered, q/k norms `replicated_with_grad_allreduce`, MoE experts), with the
  styles vlaforge runs and a one-line refusal for the others.
- `expert_modules`: the modules holding the 3-D stacked expert weights of MoE blocks, which `nn.Linear`-based
  converters (fp8, quantization) do not see.
- `llm_dims`: the LLM's dimensions (width, FFN width, depth, heads, kv-heads, head dim, vocabulary) as the family's
  modeling code reads them: a config class without a `num_key_value_heads` field (GPT-NeoX) is multi-head, no
  `head_dim` is hidden / heads, and a dimension every decoder family states but this config lacks is refused in one
  line.
- `mrope_section`: whether the LLM takes Qwen-VL's 3-D multimodal RoPE positions (the VLA then gives them).
- `block_norms`: a block's own norm layers (two in Llama, one in Phi, four in Gemma3), for sequence parallel.
- `unlike_llama`: what in a block differs from Llama's (q/k norms, extra norms, fused projections, experts), for
  the planner, whose activation formula counts Llama's block term by term.
- `LLM_BLOCKS`: each family's decoder block (by class) with its attention and feed-forward sub-layers (`Sublayers`),
  which selective checkpointing recomputes by and the planner counts (a tower's are in its models/vision.py row).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from vlaforge.errors import VlaforgeError

# transformers' TP styles vlaforge applies (distributed/parallelize.py maps each to a DTensor ParallelStyle)
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce")
# styles of parts vlaforge keeps replicated (correct, not sharded): the token embeddings (the VLA feeds embeddings)
TP_KEPT_WHOLE = ("embedding_rowwise",)


@dataclass(frozen=True)
class LLMParts:
    decoder: nn.Module
    blocks: nn.ModuleList
    final_norm_name: str  # the attribute of `decoder` holding the final norm

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self.decoder, self.final_norm_name)


def is_norm(module: nn.Module) -> bool:
    """A normalization layer: torch's LayerNorm / RMSNorm or a family's own `...Norm` class."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def decoder_of(llm: nn.Module) -> nn.Module:
    """The decoder body of a causal LM (the module whose forward takes `inputs_embeds`)."""
    decoder = llm.get_decoder() if hasattr(llm, "get_decoder") else getattr(llm, "model", None)
    # NOTE: a module, not only a ModuleList: a pipeline stage keeps its blocks in a dict by their index
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.Module):
        raise VlaforgeError(f"the llm is a {type(llm).__name__}, whose decoder blocks vlaforge cannot find (no "
                            "get_decoder().layers); use a causal-LM folder of a decoder-only family")
    return decoder


def llm_parts(llm: nn.Module) -> LLMParts:
    """The decoder, its blocks and its final norm (raises one line when they cannot be found)."""
    decoder = decoder_of(llm)
    norms = [name for name, child in decoder.named_children() if is_norm(child)]
    if len(norms) != 1:
        raise VlaforgeError(f"the llm's decoder ({type(decoder).__name__}) has {len(norms)} norm layers outside its "
                            f"blocks ({', '.join(norms) or 'none'}), not one final norm; vlaforge cannot place it")
    return LLMParts(decoder, decoder.layers, norms[0])


def family(config) -> str:
    return getattr(config, "model_type", type(config).__name__)


def num_experts(config) -> int:
    """How many routed experts the config's MoE blocks hold (0: dense blocks)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def tp_plan(config) -> dict[str, str]:
    """Block-relative module name -> transformers TP style, from `config.base_model_tp_plan`.

    Raises:
        VlaforgeError: the family has no plan, or one with a style vlaforge does not run (MoE experts).
    """
    experts = num_experts(config)
    if experts:
        # transformers' plans for expert weights changed between releases (5.25 names only the dense projections,
        # which a sparse block does not have): the config, not the plan, says whether the blocks are MoE
        raise VlaforgeError(f"parallel.tp > 1 is not available for {family(config)}: its blocks are mixture-of-experts "
                            f"({experts} experts), which vlaforge's tensor parallel does not run; use tp = 1 with "
                            "dp_shard (FSDP2)")
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise VlaforgeError(f"parallel.tp > 1: the {family(config)} config has no tensor-parallel plan "
                            "(base_model_tp_plan); use tp = 1 with dp_shard")
    out = {}
    for pattern, style in plan.items():
        if not pattern.startswith("layers.*."):
            if style in TP_KEPT_WHOLE:
                continue
            raise VlaforgeError(f"parallel.tp > 1: the {family(config)} plan splits {pattern} ({style}), outside "
                                "the blocks, which vlaforge does not; use tp = 1 with dp_shard")
        if style not in TP_STYLES:
            raise VlaforgeError(f"parallel.tp > 1 is not available for {family(config)}: its plan splits "
                                f"{pattern} as '{style}' (mixture-of-experts weights), which vlaforge's tensor "
                                "parallel does not run; use tp = 1 with dp_shard (FSDP2)")
        out[pattern.removeprefix("layers.*.")] = style
    return out


@dataclass(frozen=True)
class LLMDims:
    """An LLM's dimensions, as its family's modeling code reads them from its config (`llm_dims`)."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


# the dimensions every decoder family's config names alike (transformers' `attribute_map` maps GPT-2-style names)
LLM_DIM_FIELDS = {"hidden": "hidden_size", "ffn": "intermediate_size", "layers": "num_hidden_layers",
                  "heads": "num_attention_heads", "vocab": "vocab_size"}


def declared(config, name: str):
    """`config.<name>` where the family's config class declares the field (a dataclass field, an `attribute_map`
    alias or a property), else None. NOTE: transformers keeps a key a config.json adds beyond its family's fields as
    an attribute, which a family's modeling code may still read (`head_dim`, by getattr) or not (GPT-NeoX's
    attention splits its fused projection into `num_attention_heads` whatever `num_key_value_heads` says)."""
    cls = type(config)
    if dataclasses.is_dataclass(cls) and name not in {f.name for f in dataclasses.fields(cls)} \
            and name not in getattr(cls, "attribute_map", {}) and not isinstance(getattr(cls, name, None), property):
        return None
    return getattr(config, name, None)


def llm_dims(config) -> LLMDims:
    """The LLM's dimensions as its family's modeling code reads them: kv-heads from a declared `num_key_value_heads`
    (a family without the field, or None in it, is multi-head), the head dim as transformers' rotary and attention
    code reads it, `getattr(config, "head_dim", None) or hidden // heads` (Qwen3-MoE's folders state one its config
    class does not declare).

    Raises:
        VlaforgeError: the config lacks a dimension every decoder family states.
    """
    dims = {}
    for key, name in LLM_DIM_FIELDS.items():
        value = getattr(config, name, None)
        if not isinstance(value, int):
            raise VlaforgeError(f"the llm's {family(config)} config ({type(config).__name__}) has no {name}, which "
                                "vlaforge reads its blocks' shape from; use a causal-LM folder of a decoder-only "
                                "family transformers ships (docs/families.md)")
        dims[key] = value
    heads = dims["heads"]
    return LLMDims(**dims, kv_heads=declared(config, "num_key_value_heads") or heads,
                   head_dim=getattr(config, "head_dim", None) or dims["hidden"] // heads)


def mrope_section(config) -> list[int] | None:
    """The (temporal, height, width) split of the rotary frequencies of Qwen-VL's multimodal RoPE (None: 1-D
    RoPE or none), from the config's rope parameters."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("mrope_section") if isinstance(rope, dict) else None


def expert_modules(module: nn.Module) -> list[str]:
    """Names of the modules in `module` that hold stacked (3-D) expert weights (MoE blocks keep each projection of
    all experts as one tensor), which `nn.Linear`-based converters do not see."""
    return [name for name, sub in module.named_modules()
            if any(p.dim() == 3 for p in sub.parameters(recurse=False)) and "expert" in name]


def block_norms(block: nn.Module) -> list[str]:
    """The block's own norm layers (direct children), in order."""
    return [name for name, child in block.named_children() if is_norm(child)]


# the children of a Llama block and of its attention and MLP: the block the planner's formula counts
LLAMA_BLOCK = {"": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
               "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
               "mlp": {"gate_proj", "up_proj", "down_proj", "act_fn"}}


# what the planner also counts: per-head q/k RMSNorms (Qwen3's)
LLAMA_OPTIONAL = {"self_attn": {"q_norm", "k_norm"}}


def unlike_llama(block: nn.Module) -> str | None:
    """What in `block` differs from a Llama block (with or without Qwen3's per-head q/k norms), as
    'block: +post_feedforward_layernorm, -input_layernorm', or None when nothing does."""
    for path, want in LLAMA_BLOCK.items():
        sub = block.get_submodule(path) if path and hasattr(block, path) else (block if not path else None)
        if sub is None:
            return f"no {path}"
        have = {name for name, _ in sub.named_children()} - LLAMA_OPTIONAL.get(path, set())
        if have != want:
            diff = [f"+{n}" for n in sorted(have - want)] + [f"-{n}" for n in sorted(want - have)]
            return f"{path or 'block'}: {', '.join(diff)}"
    return None


@dataclass(frozen=True)
class Sublayers:
    """Where a transformer block keeps its attention and its feed-forward sub-layer (the children's names)."""

    attn: str
    ffn: str


# transformers' own names: the attention in `self_attn`, the feed-forward (MLP, or a MoE block's router + experts)
# in `mlp`
SELF_ATTN_MLP = Sublayers("self_attn", "mlp")
# The decoder blocks of the LLM families vlaforge loads (the family matrix of docs/families.md, the VLMs' text
# models), by block class. A block of a class not named here is refused by what needs its sub-layers.
LLM_BLOCKS = {
    "LlamaDecoderLayer": SELF_ATTN_MLP,
    "MistralDecoderLayer": SELF_ATTN_MLP,
    "Qwen2DecoderLayer": SELF_ATTN_MLP,
    "Qwen3DecoderLayer": SELF_ATTN_MLP,
    "Qwen3MoeDecoderLayer": SELF_ATTN_MLP,
    "Qwen2VLDecoderLayer": SELF_ATTN_MLP,
    "Qwen2_5_VLDecoderLayer": SELF_ATTN_MLP,
    "GemmaDecoderLayer": SELF_ATTN_MLP,
    "Gemma2DecoderLayer": SELF_ATTN_MLP,
    "Gemma3DecoderLayer": SELF_ATTN_MLP,
    "PhiDecoderLayer": SELF_ATTN_MLP,
    "Phi3DecoderLayer": SELF_ATTN_MLP,
    "Olmo2DecoderLayer": SELF_ATTN_MLP,
    "GPTNeoXLayer": Sublayers("attention", "mlp"),
}
