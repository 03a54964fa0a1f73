"""LoRA and QLoRA in the planner (`components.<c>.lora`; techniques/lora.py, docs/lora.md): what a component's
adapters change in its state, its activations and its FLOPs, counted from the model's own linears.

State: the adapted linears' frozen weights in their storage (`base`: fp32 / bf16 casts, torchao int8 = 1 byte a
weight + a scale and a zero point per row, NF4 = 4 bits a weight + an int8 scale per 64 + an fp32 factor per scale
group + the 16-entry table; an int8 base is not planned: torchao's int8 linear keeps a dense dequantized copy of its
weight until backward), the component's other parameters frozen in the master dtype, and per adapted linear
A (r x in) and B (out x r) in the master dtype (peft's cast to the base's dtype at injection, before the base is
stored as asked) with gradients and AdamW state.

Activations, per token of a block (c: the compute dtype's bytes; what autograd keeps, checked against
`techniques.accounting.count_saved` on real and fake tensors in tests/test_planner_lora.py):
- each adapter keeps A's output (r x c) for B's gradient; its input is the one the trained linear kept (the same
  tensor, or autocast's copy of it);
- a frozen RMSNorm weight needs no normalized input (-4D per Llama norm); the LM head (not adapted) no input, the
  final norm no normalized input;
- under a lower compute precision the attention output projection's adapter keeps autocast's copy of its input (a
  trained output projection kept the input itself);
- an NF4 / int8 base adds a linear's bias in fp32: a SigLIP fc1's output (GELU's input) is then fp32;
- `selective` keeps every matmul output of the attention sub-layer: A's and B's outputs too;
- a LoRA vision tower's patch embedding and position embedding are frozen: the pixels, a conv stem's tensors, the
  position ids and the first block's first norm (its input needs no gradient) are not kept.
FLOPs: a frozen base computes no weight gradient (backward: the input gradient only); each adapter costs
2 r (in + out) per token forward and twice that backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

NF4_BLOCK = 64  # techniques.lora.NF4_BLOCK
# The components whose adapters the planner counts (and `--lora` adds): the tower and the LLM, whose blocks
# activations.py and throughput.py count term by term. LoRA itself adapts any component (techniques/lora.py); a
# LeRobot policy's action head is counted too (its expert's blocks run in the joint layers, whose activations the
# planner measures with the adapters in place: planner/measured.py).
LORA_COUNTED = ("vision", "llm")


@dataclass(frozen=True)
class Adapted:
    """One component's adapters as the planner counts them: every adapted linear (in, out, bias) and which of them
    sit in one transformer block (all blocks alike), by sub-layer; whether each sub-layer's output projection (its
    last linear) has one; the ids of the adapted weights and biases."""

    rank: int
    base: str
    linears: tuple[tuple[int, int, bool], ...]
    block_attn: tuple[tuple[int, int], ...] = ()
    block_ffn: tuple[tuple[int, int], ...] = ()
    attn_out_adapted: bool = False  # the attention output projection has an adapter
    ffn_out_adapted: bool = False  # the FFN's output projection has one
    base_ids: tuple[tuple[int, str], ...] = ()  # (id of an adapted linear's weight / bias, "weight" | "bias")

    @property
    def numel(self) -> int:
        return self.rank * sum(i + o for i, o, _ in self.linears)


def adapted(model: nn.Module, comp: str, policy) -> Adapted | None:
    """The component's adapters under `policy` (None without `lora`), from the model's linears: a bare model's
    targets, or the layers `apply_lora` already made (a model built with its techniques)."""
    cfg = getattr(policy, "lora", None)
    if cfg is None:
        return None
    from vlaforge.errors import VlaforgeError
    from vlaforge.models.blocks import is_policy

    if comp not in LORA_COUNTED and not (is_policy(model) and comp == "action_head"):
        raise VlaforgeError(f"the planner counts LoRA on the vision tower and the LLM; components.{comp}.lora is "
                            f"not counted yet: plan the {comp} trained in full (its adapters would be a few per cent "
                            "of it)")
    if cfg.full:
        raise VlaforgeError(f"the planner does not count components.{comp}.lora.full yet (modules trained in full "
                            "beside the adapters: their state, and the activations they keep); plan without it - at "
                            "7B the convolutions and norms it names are well under 1 % of the state")
    if cfg.base == "int8":
        # NOTE: measured (tests/test_planner_lora.py's accounting): torchao's int8 linear dequantizes its weight and
        # autograd keeps that dense copy for the input gradient, per linear, until backward
        raise VlaforgeError(f"the planner does not count components.{comp}.lora.base = 'int8': torchao's int8 "
                            "linear keeps a dense dequantized copy of each weight until backward, so it saves no "
                            "training memory over 'bf16'; plan with lora.base = 'nf4' (QLoRA) or 'bf16'")
    cache = model.__dict__.setdefault("_planner_lora", {})
    key = (comp, cfg.model_dump_json())
    if key not in cache:
        cache[key] = _adapted(model, comp, cfg)
    return cache[key]


def _units(module: nn.Module, adapted_ids: set[int]) -> list[tuple[nn.Module, bool]]:
    """The projections inside `module` in order, each (its linear, whether it has an adapter): an injected peft
    layer is one projection (its base), the linears inside it are not."""
    from vlaforge.techniques.lora import lora_layers

    inside = {id(x) for layer in lora_layers(module).values() for x in layer.modules() if x is not layer}
    out = []
    for m in module.modules():
        if id(m) in inside:
            continue
        base = getattr(m, "base_layer", None)
        if base is not None and hasattr(m, "lora_A"):
            out.append((base, True))
        elif isinstance(m, nn.Linear):
            out.append((m, id(m) in adapted_ids))
    return out


def _adapted(model: nn.Module, comp: str, cfg) -> Adapted:
    from vlaforge.models.blocks import blocks_of
    from vlaforge.techniques.checkpointing import sublayer
    from vlaforge.techniques.lora import lora_layers, target_linears

    module = getattr(model, comp)
    injected = bool(lora_layers(module))
    chosen = set() if injected else {id(module.get_submodule(n)) for n in target_linears(model, comp, cfg.targets)}
    units = [m for m, on in _units(module, chosen) if on]
    linears = tuple((m.in_features, m.out_features, m.bias is not None) for m in units)
    from vlaforge.models.blocks import is_policy

    # a policy's blocks (joint layers) are measured with their adapters, not counted by sub-layer
    blocks = None if is_policy(model) else blocks_of(model, comp)
    rows, last = {"attn": (), "ffn": ()}, {"attn": False, "ffn": False}
    if blocks is not None:
        for region in ("attn", "ffn"):
            found = _units(sublayer(blocks[0], region), chosen)
            rows[region] = tuple((m.in_features, m.out_features) for m, on in found if on)
            last[region] = bool(found) and found[-1][1]
    head = module.get_output_embeddings() if comp == "llm" and hasattr(module, "get_output_embeddings") else None
    head_adapted = head is not None and any(m is head or getattr(head, "base_layer", None) is m for m in units)
    if head_adapted:
        from vlaforge.errors import VlaforgeError

        raise VlaforgeError("the planner does not count an adapter on the LLM's output head; drop it from "
                            "components.llm.lora.targets to plan")
    ids = tuple((id(t), kind) for m in units for kind, t in (("weight", m.weight), ("bias", m.bias)) if t is not None)
    return Adapted(cfg.rank, cfg.base, linears, rows["attn"], rows["ffn"], last["attn"], last["ffn"], ids)


def frozen_param_bytes(a: Adapted, p, master_bytes: int) -> int:
    """Bytes a parameter of a LoRA component holds: an adapted linear's weight in its base storage (its bias cast
    with a bf16 base), anything else frozen in the master dtype."""
    kind = dict(a.base_ids).get(id(p))
    if kind == "weight":
        return base_weight_bytes(p.shape[0], p.shape[1], a.base, master_bytes)
    if kind == "bias" and a.base == "bf16":
        return 2 * p.numel()
    return master_bytes * p.numel()


def adapter_state(a: Adapted, master_bytes: int, eight_bit: bool = False) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of the adapters: A and B per linear, AdamW's two moments (8-bit where
    `eight_bit` and torchao quantizes that shape) and step each."""
    from vlaforge.techniques.optimizer_state import moment_bytes

    n, size = a.numel, adapter_bytes(a, master_bytes)
    moments = sum(2 * (moment_bytes(a.rank * i, size, eight_bit) + moment_bytes(o * a.rank, size, eight_bit))
                  for i, o, _ in a.linears)
    return n * size, n * size, moments + 4 * 2 * len(a.linears)


def adapters_of(model: nn.Module, policies) -> dict[str, Adapted]:
    out = {}
    for comp, policy in policies.items():
        found = adapted(model, comp, policy)
        if found is not None:
            out[comp] = found
    return out


def base_weight_bytes(out: int, inp: int, base: str, master_bytes: int) -> int:
    """Bytes of one frozen base weight (out x in) stored as `base` (techniques.lora._store_base; the NF4 scale groups
    as it chooses them; a shape NF4's blocks do not divide stays in the master dtype)."""
    n = out * inp
    if base == "nf4" and n % NF4_BLOCK == 0:
        blocks = n // NF4_BLOCK
        group = math.gcd(blocks // math.gcd(blocks, 64), 256)
        # 4-bit codes, int8 scales, fp32 factors per scale group, the fp32 scaler mean and the 16-entry fp32 table
        return n // 2 + blocks + 4 * (blocks // group) + 4 + 4 * 16
    if base == "int8":  # int8 weights, a scale (the weight's dtype) and an int8 zero point per output row
        return n + out * (master_bytes + 1)
    return n * {"fp32": 4, "bf16": 2}.get(base, master_bytes)


def adapter_bytes(a: Adapted, master_bytes: int) -> int:
    """Bytes per adapter parameter: peft gives adapters their base's dtype at injection, the master dtype (the base
    is stored as asked afterwards)."""
    return master_bytes


def block_delta(a: Adapted, strategy: str, kind: str, c: int, master_bytes: int, hidden: int, ffn_width: int,
                tokens: int, first: bool) -> int:
    """What one block's adapters change in the bytes it keeps (see the module docstring), `tokens` its tokens;
    `first`: the block of a LoRA tower whose input needs no gradient."""
    if strategy == "full":
        return 0
    r = a.rank
    if strategy == "selective":  # the attention sub-layer's matmul outputs: A's and B's too
        return sum(r + o for _, o in a.block_attn) * c * tokens
    attn = 0 if strategy == "selective_attn" else len(a.block_attn) * r * c
    if attn and a.attn_out_adapted and c < 4:  # the output projection's adapter keeps autocast's copy of its input
        attn += c * a.block_attn[-1][0]
    ffn = 0 if strategy == "selective_ffn" else len(a.block_ffn) * r * c
    if ffn and kind == "siglip" and a.base in ("nf4", "int8") and c < 4:  # the biased fc1's fp32 output
        ffn += (4 - c) * ffn_width
    norms = 0
    if kind == "llama":  # two RMSNorms whose frozen weights need no normalized input
        norms = -2 * 4 * hidden
    elif first and strategy != "selective":  # the tower's first LayerNorm: its input needs no gradient
        norms = -(4 * hidden + 8)
    return (attn + ffn + norms) * tokens


def _matmuls(pairs, tokens: float, rank: int) -> float:
    """Forward FLOPs of adapters (in, out) at `tokens`: A then B, 2 r (in + out) per token."""
    return sum(2.0 * tokens * rank * (i + o) for i, o in pairs)


def block_flops(a: Adapted, tokens: float, strategy: str, base_attn: float, base_ffn: float, attn_out: float,
                ffn_out: float) -> tuple[float, float, float]:
    """(forward, backward, recomputed) matmul FLOPs of one block of a LoRA component: the frozen base forward and
    its input gradients, the adapters' forward and both gradients, and what checkpointing recomputes - a region
    without its last matmul, which is the output projection's B when that is adapted (peft runs the base first:
    the base output projection is then recomputed)."""
    fa, ff = _matmuls(a.block_attn, tokens, a.rank), _matmuls(a.block_ffn, tokens, a.rank)
    last_b = lambda rows: 2.0 * tokens * a.rank * rows[-1][1]
    attn_last = last_b(a.block_attn) if a.attn_out_adapted else attn_out
    ffn_last = last_b(a.block_ffn) if a.ffn_out_adapted else ffn_out
    attn, ffn = base_attn + fa, base_ffn + ff
    rec = {"none": 0.0, "full": attn + ffn - ffn_last, "selective": ffn - ffn_last, "selective_ffn": ffn - ffn_last,
           "selective_attn": attn - attn_last}[strategy]
    return base_attn + base_ffn + fa + ff, base_attn + base_ffn + 2 * (fa + ff), rec


def first_block_input_free(a: Adapted, tokens: float, base_qkv: float) -> float:
    """Backward FLOPs block 0 does not run when its input needs no gradient: the attention input projections' input
    gradients (base and adapters)."""
    pairs = a.block_attn[:-1] if a.attn_out_adapted else a.block_attn
    return base_qkv + sum(2.0 * tokens * a.rank * i for i, _ in pairs)


def block_gather_bytes(a: Adapted, block_numel: int, compute_bytes: int, master_bytes: int) -> float:
    """What FSDP2 holds gathered for one block of a LoRA component: the adapted weights in their base storage (NF4
    gathers its inner tensors), the block's other parameters in the compute dtype, and the adapters in the compute
    dtype with fp32 gradients for the reduce-scatter (a frozen base has none)."""
    weights = [(i, o) for i, o in (*a.block_attn, *a.block_ffn)]
    stored = sum(base_weight_bytes(o, i, a.base, master_bytes) for i, o in weights)
    adapters = a.rank * sum(i + o for i, o in weights)
    return stored + (block_numel - sum(i * o for i, o in weights)) * compute_bytes + adapters * (compute_bytes + 4)


def cast_share(a: Adapted) -> float:
    """The share of a LoRA component's matmul weights autocast still copies and keeps: all of them over an fp32
    base ('auto' / 'fp32' masters), none of a bf16 or NF4 base (NF4 dequantizes per use and keeps nothing)."""
    return 1.0 if a.base in ("auto", "fp32") else 0.0
