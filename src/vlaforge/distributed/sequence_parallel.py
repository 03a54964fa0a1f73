"""Sequence (context) parallelism for the VLA: the method, the token layout across the cp ranks, and the wiring into
the model.

The kernels: `ring.ring_attention` (K/V around a ring, overlapped, zigzag-balanced for causal attention),
`ulysses.ulysses_attention` (two all-to-alls around local attention) and `ulysses.allgather_attention` (gather
K/V). All three are exact and take sequence shards of (B, H, S_local, D).

The wiring (`apply_sequence_parallel`) leaves the model's code path as in one process:
- **Layout.** A forward pre-hook on the LLM (`SequenceParallel.enter`) takes the model's full-layout input and
  feeds the LLM this rank's shard instead. Each row's real tokens move to the front in order and its padding to
  the end (`ShardLayout`), with the position ids the unsharded model gives them. Under causal attention no real
  token then sees padding, so the kernels need no key-padding mask and the result is the masked full-sequence
  attention exactly. The compacted sequence is padded to a multiple of 2 x cp and cut into zigzag shards (ring)
  or contiguous ones (Ulysses, all-gather).
- **Gather.** A forward hook on the LLM's final norm all-gathers the shards and restores the original layout, so
  the LM head, the action head and the losses run on the full sequence, the same on every cp rank. Its backward
  hands each rank its own shard's gradient times cp: what went through the sharded LLM (its blocks, the
  embeddings, the vision tower's LLM path) holds cp x its share, what did not (the heads, the contrastive path)
  is whole on every rank, so averaging over the dp_shard x cp ranks (FSDP2's mesh) gives the true gradient.
- **Attention.** The method is registered in the `transformers` attention registry and set on the LLM; the vision
  tower encodes every frame on every cp rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vlaforge.errors import VlaforgeError

RING_ABOVE = 16384  # tokens: from here a ring's O(S/cp) K/V memory and overlapped transfers win
ALLGATHER_BELOW = 4096  # tokens: below this gathering all of K/V is cheap and simplest


def check_ulysses_heads(degree: int, heads: int) -> None:
    """Ulysses splits the attention heads (per tp rank) over the cp ranks.

    Raises:
        VlaforgeError: cp does not divide them.
    """
    if heads % degree:
        raise VlaforgeError(f"parallel.cp_method = 'ulysses' needs cp = {degree} to divide the llm's {heads} "
                            "attention heads; use cp_method = 'ring' or a cp degree that divides them")


def choose_cp_method(method: str, seq_len: int, degree: int, heads: int) -> tuple[str, str]:
    """(method, why) for `parallel.cp_method`; 'auto' picks by sequence length and degree."""
    if method != "auto":
        if method == "ulysses":
            check_ulysses_heads(degree, heads)
        return method, "set in parallel.cp_method"
    if seq_len >= RING_ABOVE:
        return "ring", (f"{seq_len} tokens >= {RING_ABOVE}: K/V stay sharded (1/{degree} per rank) and their "
                        "transfers overlap compute")
    if seq_len < ALLGATHER_BELOW:
        return "allgather", (f"{seq_len} tokens < {ALLGATHER_BELOW}: gathering K/V is cheap and needs one "
                             "collective per layer")
    if heads % degree == 0:
        return "ulysses", (f"{seq_len} tokens in [{ALLGATHER_BELOW}, {RING_ABOVE}) and cp = {degree} divides the "
                           f"{heads} heads: two all-to-alls move less than a ring at this length")
    return "ring", f"cp = {degree} does not divide the {heads} heads, which Ulysses needs"


def cp_method_for(parallel, tokens: int, heads: int) -> tuple[str, str]:
    """`choose_cp_method` for a `[parallel]` section: the LLM's `heads` are split over its tp ranks first."""
    return choose_cp_method(parallel.cp_method, tokens, parallel.cp, heads // parallel.tp)


def attention_function(method: str, group=None, places=None):
    """An attention function with the `transformers` AttentionInterface signature that runs `method` over the
    sequence shards of `group`. Causality comes from the module (Llama: causal; SigLIP: not). It applies the global
    causal pattern itself; `register_attention` refuses a padding mask (one line) rather than ignore it: the trainer
    compacts each row's padding to its end, behind every real token, and passes no mask. `places`: a callable
    giving each compacted slot's index in the uncompacted layout (B, N), which a sliding window counts in, as one
    process counts it (padding in the middle of a row included)."""
    from vlaforge.distributed.ring import ring_attention
    from vlaforge.distributed.ulysses import allgather_attention, ulysses_attention

    kernels = {"ring": lambda q, k, v, c, s, **w: ring_attention(q, k, v, group, causal=c, zigzag=True, scale=s,
                                                                 **w),
               "ring_contiguous": lambda q, k, v, c, s, **w: ring_attention(q, k, v, group, causal=c, zigzag=False,
                                                                            scale=s, **w),
               "allgather": lambda q, k, v, c, s, **w: allgather_attention(q, k, v, group, causal=c, scale=s, **w)}
    shards = dist.get_world_size(group) if dist.is_initialized() else 1

    def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs):
        # every kernel computes the layer's sliding window (counted in `places`) and soft-capped logits
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        if window is not None and window >= query.shape[2] * shards:
            window = None  # every query sees its whole prefix
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        device = query.device.type
        if torch.is_autocast_enabled(device):  # NOTE: as autocast casts SDPA's inputs (Llama's rotary step returns
            # fp32 q/k under fp32 masters): the kernels then save, send and return the autocast dtype, as SDPA would
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        at = places() if places is not None and window else None
        if method == "ulysses":  # whole sequences per head group: windows and soft-caps as one process
            out = ulysses_attention(query, key, value, group, causal=bool(causal), scale=scaling, window=window,
                                    softcap=softcap, places=at)
        else:  # (B, H, S_local, D)
            out = kernels[method](query, key, value, bool(causal), scaling, window=window, softcap=softcap,
                                  places=at)
        return out.transpose(1, 2).contiguous(), None  # (B, S_local, H, D), as transformers expects

    return attend


def register_attention(method: str, group=None, places=None) -> str:
    """Register `method` over `group` in the `transformers` attention registry; returns the implementation name
    to pass as `attn_implementation` (or to `set_attn_implementation`). `places`: see `attention_function`."""
    from transformers import AttentionInterface, AttentionMaskInterface

    name = f"vlaforge_{method}"
    AttentionInterface.register(name, attention_function(method, group, places))
    # NOTE: without a mask function of its own, transformers drops a padded batch's mask on the way to the
    # attention function, which would then attend to the padding. This one builds no (S x S) mask at all: it
    # refuses padding, in one line, from the 2-D mask.
    AttentionMaskInterface.register(name, _refuse_padding(method))
    return name


def _refuse_padding(method: str):
    """A `transformers` mask function that builds no mask: the kernels apply the causal pattern themselves."""

    def mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{method} context-parallel attention applies the causal pattern itself and cannot "
                             "honour a padding mask; pass no attention_mask, with each row's padding at its end "
                             "(the trainer's compacted layout does this)")
        return None

    return mask


@dataclass(frozen=True)
class ShardLayout:
    """Where one batch's tokens go: `order` (B, N_pad) indexes the (padded) layout in compacted order."""

    order: torch.Tensor
    length: int  # N, the layout's length before padding
    padded: int  # N_pad


def compact_order(mask: torch.Tensor, multiple: int) -> ShardLayout:
    """Per row, the real tokens first (in order), then padding; the length padded to `multiple`."""
    b, n = mask.shape
    padded = -(-n // multiple) * multiple
    full = torch.zeros(b, padded, dtype=torch.bool, device=mask.device)
    full[:, :n] = mask
    order = torch.argsort((~full).to(torch.int8), dim=1, stable=True)
    return ShardLayout(order, n, padded)


class _GatherShards(torch.autograd.Function):
    """All-gather the cp ranks' sequence shards into the full sequence; backward: this rank's shard of the
    (identical on every rank) gradient, times cp."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: "SequenceParallel") -> torch.Tensor:
        ctx.sp = sp
        pieces = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(pieces, x.contiguous(), group=sp.group)
        return sp.unshard(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sp = ctx.sp
        return sp.shard(grad) * sp.size, None


@dataclass
class SequenceParallel:
    """The cp group and method; its `enter` shards the LLM's input (a forward pre-hook), its `gather` restores the
    full sequence after the final norm (a forward hook). The VLA's code path is the one-process one."""

    group: Any
    rank: int
    size: int
    method: str
    why: str
    layout: ShardLayout | None = None  # the batch in flight (set by `enter`, used by the gather hook)

    @property
    def zigzag(self) -> bool:
        return self.method == "ring"

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        from vlaforge.distributed.ring import zigzag_shard

        return zigzag_shard(x, self.rank, self.size, dim=1) if self.zigzag else x.chunk(self.size, 1)[self.rank]

    def unshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        from vlaforge.distributed.ring import zigzag_unshard

        return zigzag_unshard(pieces, dim=1) if self.zigzag else torch.cat(pieces, dim=1)

    def enter(self, module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Forward pre-hook of the LLM: its full-layout `inputs_embeds` / `attention_mask` / `position_ids` become
        this rank's shard of the compacted layout (no mask: padding sits at the end, behind every real token)."""
        embeds, mask, positions = kwargs["inputs_embeds"], kwargs.pop("attention_mask"), kwargs["position_ids"]
        if mask is None:  # a batch without padding (`Batch.full`): every place is a token, at its own position
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        if positions is None:
            positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[0], -1)
        kwargs["inputs_embeds"], kwargs["position_ids"] = self.shard_layout(embeds, mask.bool(), positions)
        return args, kwargs

    def shard_layout(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of the compacted layout: (inputs_embeds, position_ids); positions (B, N), or (3, B, N)
        for Qwen-VL's M-RoPE (each of the three rows gathered alike)."""
        lay = compact_order(mask, 2 * self.size if self.zigzag else self.size)
        self.layout = lay
        extra = lay.padded - lay.length
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, extra))
        positions = torch.nn.functional.pad(positions, (0, extra))
        # NOTE: only this rank's rows are picked, by indexing, whose backward keeps the (B, S / cp) indices alone;
        # gathering the whole layout first would keep the padded (B, S, D) embeddings alive until backward (gather
        # saves its input) and the shard would be a view of them
        rows = self.shard(lay.order)  # (B, S / cp): this rank's places in the padded layout
        batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
        return embeds[batch, rows], positions.gather(-1, rows.expand(*positions.shape[:-2], *rows.shape))

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full sequence in the original layout from this rank's shard of final hidden states."""
        lay = self.layout
        full = _GatherShards.apply(hidden, self)  # compacted order, (B, N_pad, D)
        index = lay.order.unsqueeze(-1).expand(-1, -1, full.shape[-1])
        return torch.zeros_like(full).scatter(1, index, full)[:, :lay.length]


def apply_sequence_parallel(model, dims, mesh, cfg, tokens: int) -> SequenceParallel:
    """Shard the LLM's sequence over `mesh["cp"]`: register the method's attention, set it on the LLM, and gather
    the final hidden states (see the module docstring). `tokens`: the LLM sequence of one sample, for `auto`."""
    from vlaforge.models.families import llm_parts

    method, why = cp_method_for(cfg.parallel, tokens, model.llm.config.num_attention_heads)
    group = mesh.get_group("cp")
    sp = SequenceParallel(group, dist.get_rank(group), dims.cp, method, why)
    model.llm.set_attn_implementation(register_attention(method, group, places=lambda: sp.layout.order))
    model.llm.register_forward_pre_hook(sp.enter, with_kwargs=True)
    llm_parts(model.llm).final_norm.register_forward_hook(lambda module, args, out: sp.gather(out))
    return sp


def token_summary(cfg) -> str:
    """TOML comment lines: the LLM sequence of one sample, part by part, and each context-parallel rank's share
    (built under fake tensors: seconds even for 70B flavors)."""
    from vlaforge.models.build import build_vla, tokens_per_sample
    from vlaforge.models.fake import fake_build

    if not cfg.model.shapes_known():
        return "# tokens per sample: known once the dataset's cameras are read (model.cameras = 'auto'; no dataset " \
               f"at data.path {cfg.data.path})\n"
    with fake_build():
        model = build_vla(cfg.model, cfg.loss)
    lay, d = model.layout, cfg.data
    total = tokens_per_sample(model, d.max_instruction_tokens, d.max_text_tokens)
    lines = [f"# tokens per sample: {lay.frames} frames x {lay.patches_per_frame} patches + "
             f"{d.max_instruction_tokens} instruction + {model.action_head.chunk} action queries + "
             f"{d.max_text_tokens} text = {total}"]
    cp = cfg.parallel.cp
    lines.append(f"# tokens per rank: {total}" if cp == 1 else
                 f"# tokens per rank with parallel.cp = {cp}: {-(-total // cp)}")
    if cp > 1:
        method, why = cp_method_for(cfg.parallel, total, model.llm.config.num_attention_heads)
        lines.append(f"# context-parallel method: {method} ({why})")
    return "\n".join(lines) + "\n"
