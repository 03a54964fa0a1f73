"""The weights one token meets in a model's matmuls, read off its modules (what `throughput.step_flops` multiplies
by tokens): per block and sub-layer (a MoE block's experts by the share a token is routed to), and outside the
blocks (a tower's patch embedding). LoRA's adapters are left to planner/lora.py."""

from __future__ import annotations


def model_matmuls(model, comp: str) -> tuple[list[dict[str, float]], int]:
    """(`block_matmuls` of each of `comp`'s blocks, the weights of its linears and convolutions outside them), read
    from the model once (the search asks for every candidate)."""
    cache = model.__dict__.setdefault("_vlaforge_matmuls", {})
    if comp not in cache:
        from vlaforge.models.llm import llm_blocks
        from vlaforge.models.vision import vision_blocks

        blocks = {"vision": lambda: vision_blocks(model.vision), "llm": lambda: llm_blocks(model.llm),
                  "action_head": lambda: model.action_head.blocks}[comp]()
        cache[comp] = ([block_matmuls(b) for b in blocks], outside_matmuls(getattr(model, comp), blocks))
    return cache[comp]


def block_matmuls(block) -> dict[str, float]:
    """Weights one token meets in `block`'s matmuls, per sub-layer: 'attn' and 'ffn' (every weight of two or more
    dimensions; a MoE block's 3-D expert weights by the share of experts a token is routed to, top-k / experts),
    'attn_out' / 'ffn_out' (the sub-layer's last matmul: o_proj, down_proj), and 'width' (the attention's heads x
    head dim: the last matmul's input)."""
    from vlaforge.techniques.checkpointing import sublayer

    out = {}
    for region in ("attn", "ffn"):
        weights = []
        for name, p in sublayer(block, region).named_parameters():
            if "lora_" in name:  # LoRA's adapters: planner/lora.py counts them (`_lora_flops`)
                continue
            if p.dim() == 3:  # (experts, out, in): a token meets top-k of them
                weights.append((p, p[0].numel() * _routed(block)))
            elif p.dim() >= 2:
                weights.append((p, p.numel()))
        out[region] = float(sum(n for _, n in weights))
        out[f"{region}_out"] = float(weights[-1][1]) if weights else 0.0
        if region == "attn":
            last = weights[-1][0] if weights else None
            out["width"] = float(last.shape[-1]) if last is not None else 0.0
    return out


def _routed(block) -> float:
    """Experts a token is routed to in `block`'s MoE layer (1 without one)."""
    for m in block.modules():
        k = getattr(m, "top_k", None) or getattr(getattr(m, "config", None), "num_experts_per_tok", None)
        if isinstance(k, int) and k > 0:
            return float(k)
    return 1.0


def outside_matmuls(module, blocks) -> int:
    """Weights of `module`'s linears and convolutions outside its `blocks` (a tower's patch embedding)."""
    from torch import nn

    inside = {id(m) for b in blocks for m in b.modules()}
    return sum(m.weight.numel() for m in module.modules()
               if isinstance(m, (nn.Linear, nn.Conv2d)) and id(m) not in inside)
