"""The VLA: exactly four children - vision, projector, llm, action_head - and the token layout that joins them.

LLM input: [frame 1 patches]...[frame F patches][instruction tokens][action queries][text targets].
Text targets (the language-loss targets) come last: under causal attention nothing before them sees them, so the
action queries are computed exactly as at inference, where no text is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from vlaforge.data.batch import Batch
from vlaforge.models import losses as L
from vlaforge.models.action_heads import ActionHead, ActionHeadOutput
from vlaforge.models.families import decoder_of
from vlaforge.models.vision import tower_features

# (student VLA, batch, run_llm's pieces, the action head's output, denominators) -> more unweighted loss terms
ExtraTerms = Callable[["VLA", Batch, dict, ActionHeadOutput, dict], dict[str, torch.Tensor]]


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding: the n-th real token of a row is at position n-1 (padding repeats a neighbour's)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def mrope_positions(positions: torch.Tensor, frames: int, side: int) -> torch.Tensor:
    """(B, N) layout positions (`position_ids`) -> (3, B, N) (temporal, height, width) positions of Qwen-VL's
    multimodal RoPE, as its `get_rope_index` gives a sequence of `frames` images of `side` x `side` merged tokens
    followed by text: frame k's token (i, j) at (s_k, s_k + i, s_k + j) with s_k = k * side (each frame one still
    image, advancing the position by its grid's side), every later token at s_F + n, n counting real tokens only."""
    per = side * side
    v = frames * per
    b = positions.shape[0]
    ar = torch.arange(side, device=positions.device)
    start = torch.arange(frames, device=positions.device).repeat_interleave(per) * side
    rows, cols = ar.repeat_interleave(side).repeat(frames), ar.repeat(side * frames)
    vision = torch.stack([start, start + rows, start + cols])[:, None].expand(3, b, v)
    text = (positions[:, v:] - v + frames * side)[None].expand(3, b, -1)
    return torch.cat([vision, text], dim=2)


PROJECTOR_NORMS = {"layer": lambda d: nn.LayerNorm(d, eps=1e-6), "rms": lambda d: nn.RMSNorm(d, eps=1e-6)}


class Projector(nn.Module):
    """MLP from vision width to LLM width; also holds the contrastive loss's learned temperature.

    Two layers (linear, GELU, linear: vlaforge's, LLaVA's) or one linear (PaliGemma's connector). `merge` > 1 joins
    `merge` x `merge` patches into one token first: Idefics3's / SmolVLM's pixel shuffle (`order` 'shuffle', over
    a row-major grid), or Qwen-VL's patch merger ('units': the tower already put each block's patches side by
    side), after a per-patch `norm` ('layer', 'rms': the merger's `ln_q`). `spec`: these arguments, which rebuild
    it (a checkpoint's backbones.json)."""

    def __init__(self, vision_dim: int, llm_dim: int, hidden: int | None, layers: int = 2, merge: int = 1,
                 bias: bool = True, norm: str | None = None, order: str = "shuffle"):
        super().__init__()
        self.spec = {"hidden": hidden, "layers": layers, "merge": merge, "bias": bias, "norm": norm, "order": order}
        self.merge, self.order = merge, order
        self.norm = PROJECTOR_NORMS[norm](vision_dim) if norm else None
        width = vision_dim * merge * merge
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, llm_dim)) if layers == 2 \
            else nn.Sequential(nn.Linear(width, llm_dim, bias=bias))
        # (1,), not a scalar: FSDP2 cannot shard 0-d parameters.
        self.logit_scale = nn.Parameter(torch.tensor([math.log(1 / 0.07)]))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            features = self.norm(features)
        if self.merge > 1:
            b, n, d = features.shape
            s = self.merge
            features = features.reshape(b, n // (s * s), d * s * s) if self.order == "units" else \
                pixel_shuffle(features, s)
        return self.mlp(features)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """(B, h*w, D) patch tokens of a square grid -> (B, h*w / s^2, D * s^2): each s x s block of patches as one token,
    in Idefics3's order (its connector's `pixel_shuffle`)."""
    b, n, d = x.shape
    side = math.isqrt(n)
    x = x.reshape(b, side, side // s, d * s).permute(0, 2, 1, 3)
    x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
    return x.reshape(b, n // (s * s), d * s * s)


@dataclass(frozen=True)
class Layout:
    """Static shape facts of the token layout."""

    frames: int  # F = time steps x cameras
    image_size: int
    patches_per_frame: int
    interpolate_pos: bool  # a pretrained tower used at another resolution
    mrope: bool = False  # the LLM takes Qwen-VL's 3-D multimodal RoPE positions (`mrope_positions`)


class VLA(nn.Module):
    """Vision-Language-Action model. Knows nothing of parallelism, precision or memory techniques."""

    def __init__(self, vision: nn.Module, projector: Projector, llm: nn.Module, action_head: ActionHead,
                 layout: Layout, objective: L.Objective):
        super().__init__()
        self.vision = vision
        self.projector = projector
        self.llm = llm
        self.action_head = action_head
        self.layout = layout
        self.objective = objective
        # NOTE: the decoder's final hidden states reach `run_llm` through this hook, not through transformers'
        # `output_hidden_states`, whose capture hooks (installed on every decoder layer on first use) break
        # torch.compile's graph at each layer (`ContextVar.get` cannot be traced)
        decoder_of(llm).register_forward_hook(self._keep_last_hidden)

    # ---- token layout -------------------------------------------------------------------------------------
    def encode_frames(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) frames -> projected patch tokens (N, P, D): the vision tower and the projector."""
        return self.projector(tower_features(self.vision, pixels, self.layout.interpolate_pos))

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, F, C, H, W) -> projected patch tokens (B, F*P, D); frames are encoded independently."""
        b, f = images.shape[:2]
        tokens = self.encode_frames(images.flatten(0, 1))  # (B*F, P, D)
        return tokens.reshape(b, f * tokens.shape[1], tokens.shape[2])

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.llm.get_input_embeddings()(ids)  # (B, L, D)

    def input_embeddings(self, images: torch.Tensor, instruction_ids: torch.Tensor,
                         text_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(LLM input embeddings (B, N, D), projected vision tokens, instruction embeddings) in the layout order."""
        vision_tokens = self.embed_images(images)
        instruction = self.embed_text(instruction_ids)
        dtype = instruction.dtype
        queries = self.action_head.queries.to(dtype).expand(images.shape[0], -1, -1)  # (B, T, D)
        parts = [vision_tokens.to(dtype), instruction, queries]
        if text_ids is not None:
            parts.append(self.embed_text(text_ids))
        return torch.cat(parts, dim=1), vision_tokens, instruction

    def token_mask(self, batch: Batch, with_text: bool) -> torch.Tensor:
        """Which of the N layout positions are real tokens (B, N) bool; padding sits in instruction and text."""
        device = batch.instruction_ids.device
        vision = self.layout.frames * self.layout.patches_per_frame
        ones = lambda n: torch.ones(batch.size, n, dtype=torch.bool, device=device)
        masks = [ones(vision), batch.instruction_mask.bool(), ones(self.action_head.chunk)]
        if with_text:
            masks.append(batch.text_mask.bool())
        return torch.cat(masks, dim=1)

    def llm_positions(self, mask: torch.Tensor) -> torch.Tensor:
        """The LLM's position ids for a layout's (B, N) token mask: (B, N), or (3, B, N) for Qwen-VL's M-RoPE."""
        pos = position_ids(mask)
        if not self.layout.mrope:
            return pos
        return mrope_positions(pos, self.layout.frames, math.isqrt(self.layout.patches_per_frame))

    def llm_mask(self, batch: Batch, with_text: bool) -> dict[str, torch.Tensor | None]:
        """The LLM's `attention_mask` and `position_ids` for `batch`. A batch known on the host to hold no padding
        (`batch.full`) gets neither: causal attention without a mask (SDPA's `is_causal` kernels), default positions,
        and nothing read back from the device to find that out (transformers would check a given mask, or the
        positions, on the host). Qwen-VL's M-RoPE positions are always passed."""
        if batch.full and not self.layout.mrope:
            return {"attention_mask": None, "position_ids": None}
        mask = self.token_mask(batch, with_text)
        return {"attention_mask": mask.long(), "position_ids": self.llm_positions(mask)}

    def _keep_last_hidden(self, module: nn.Module, args, output) -> None:
        """Forward hook of the LLM's decoder: its final normed hidden states (B, N, D), for `run_llm`."""
        self._last_hidden = output[0]

    def run_llm(self, batch: Batch, with_text: bool, keep_hidden: bool = False) -> dict[str, torch.Tensor]:
        """One LLM pass over the full layout; returns the pieces the losses and the action head need (and, with
        `keep_hidden`, every block's output hidden states as 'hidden_states': the embeddings, blocks 1..L-1, the
        final normed one)."""
        embeds, vision_tokens, instruction = self.input_embeddings(batch.images, batch.instruction_ids,
                                                                   batch.text_ids if with_text else None)
        n_text = batch.text_ids.shape[1] if with_text else 0
        out = self.llm(inputs_embeds=embeds, **self.llm_mask(batch, with_text), output_hidden_states=keep_hidden,
                       logits_to_keep=n_text + 1, use_cache=False)
        h = self.split_outputs(self.__dict__.pop("_last_hidden"), out.logits, n_text)
        if keep_hidden:
            h["hidden_states"] = out.hidden_states
        if self.objective.active("contrastive"):
            h.update(self.contrastive_inputs(vision_tokens, instruction, batch.instruction_mask))
        return h

    def contrastive_inputs(self, vision_tokens: torch.Tensor, instruction: torch.Tensor,
                           instruction_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pooled vision (B, D) and instruction (B, D) embeddings and the temperature, for the contrastive term."""
        return {"vision_pool": vision_tokens.mean(1), "text_pool": L.masked_mean_rows(instruction, instruction_mask),
                "logit_scale": self.projector.logit_scale}

    def split_outputs(self, hidden: torch.Tensor, logits: torch.Tensor | None, n_text: int) -> dict[str, torch.Tensor]:
        """The action queries' final hidden states (B, T, D) and the text logits (B, Lt, V) that predict the text
        targets, from the LLM's final (normed) hidden states and its logits over the last n_text + 1 positions."""
        t = self.action_head.chunk
        q_end = -n_text if n_text else None
        return {"action_hidden": hidden[:, -(n_text + t):q_end],
                "text_logits": logits[:, :-1] if n_text else None}

    # ---- policy interface ---------------------------------------------------------------------------------
    def forward(self, batch: Batch, denominators: dict[str, torch.Tensor] | None = None,
                extra: ExtraTerms | None = None) -> dict[str, torch.Tensor]:
        """The unweighted loss terms of the objective, plus detached monitoring values (names ending in _m).

        `denominators`: per masked-mean term, the count to divide by instead of this batch's own (the trainer's
        global normalization over micro-batches and ranks). `extra`: terms of an objective outside the model
        (distillation) from this forward's pieces, which then include every block's hidden states."""
        h = self.run_llm(batch, self.uses_text(batch), keep_hidden=extra is not None)
        return self.loss_terms(batch, h, denominators, extra)

    def loss_terms(self, batch: Batch, h: dict[str, torch.Tensor],
                   denominators: dict[str, torch.Tensor] | None = None,
                   extra: ExtraTerms | None = None) -> dict[str, torch.Tensor]:
        """The objective's terms from `run_llm`'s pieces (or a pipeline's last stage's): the action head runs here."""
        obj = self.objective
        den = denominators or {}
        head = self.action_head(h["action_hidden"], batch.state, batch.actions)
        terms = {"action": L.action_loss(head.prediction, head.target, batch.action_mask, obj.action,
                                         obj.huber_delta, den.get("action"))}
        if obj.smoothness > 0:
            smooth = L.smoothness_loss(head.actions, batch.action_mask, den.get("smoothness"))
            terms["action"] = terms["action"] + obj.smoothness * smooth
            terms["action_smoothness_m"] = smooth.detach()
        if obj.active("contrastive"):
            terms["contrastive"] = L.contrastive_loss(h["vision_pool"], h["text_pool"], batch.instruction_ids,
                                                      batch.instruction_mask.bool(), h["logit_scale"])
        if obj.active("env_state") and head.env_state is not None and batch.env_state is not None:
            terms["env_state"] = L.env_state_loss(head.env_state, batch.env_state)
        if h["text_logits"] is not None:
            terms["language"] = L.language_loss(h["text_logits"], batch.text_ids, batch.text_mask, den.get("language"))
        terms["action_l1_m"] = L.masked_mean((head.actions.detach() - batch.actions).abs(), batch.action_mask,
                                             den.get("action"))
        if extra is not None:
            terms.update(extra(self, batch, h, head, den))
        return terms

    def uses_text(self, batch: Batch) -> bool:
        """Whether the language term is computed for `batch`."""
        return self.objective.active("language") and batch.text_ids is not None

    def compute_loss(self, batch: Batch, weighting: Callable | None = None,
                     denominators: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
        """(weighted total loss, metrics). `weighting` maps the term dict to (loss, weights); static by default. A
        weighting with `extra_terms` (the distillation objective) adds its terms to this forward's."""
        extra = getattr(weighting, "extra_terms", None)
        return self.weigh(self(batch, denominators=denominators, extra=extra), weighting)

    def weigh(self, out: dict[str, torch.Tensor], weighting: Callable | None = None) -> tuple[torch.Tensor, dict]:
        """`forward`'s terms -> (weighted total loss, metrics)."""
        terms = {k: v for k, v in out.items() if not k.endswith("_m")}
        if weighting is None:
            weights = {k: self.objective.weights.get(k, 1.0) for k in terms}
            loss = sum(weights[k] * v for k, v in terms.items())
        else:
            loss, weights = weighting(terms)
        metrics = {f"loss/{k}": v.detach() for k, v in terms.items()}
        metrics.update({f"weight/{k}": torch.as_tensor(w).detach() for k, w in weights.items()})
        metrics.update({f"metric/{k[:-2]}": v for k, v in out.items() if k.endswith("_m")})
        # total: what is optimized (with uncertainty/GradNorm regularizers); weighted: sum_k w_k L_k alone.
        metrics["loss/total"] = loss.detach()
        metrics["loss/weighted"] = sum(torch.as_tensor(weights[k]).detach() * v.detach() for k, v in terms.items())
        return loss, metrics

    @torch.no_grad()
    def predict_actions(self, obs: Batch) -> torch.Tensor:
        """Actions for an observation: (T, A) for one unbatched observation (images (F, C, H, W)), else (B, T, A)."""
        single = obs.images.dim() == 4
        if single:
            obs = Batch(obs.images[None], obs.state[None], obs.instruction_ids[None], obs.instruction_mask[None])
        actions = self.actions_from_tokens(self.embed_images(obs.images), obs.instruction_ids, obs.instruction_mask,
                                           obs.state)
        return actions[0] if single else actions

    def actions_from_tokens(self, vision_tokens: torch.Tensor, instruction_ids: torch.Tensor,
                            instruction_mask: torch.Tensor | None, state: torch.Tensor,
                            **head: torch.Tensor) -> torch.Tensor:
        """The action chunk (B, T, A) from projected vision tokens (B, F*P, D): the LLM over the layout without
        text targets (its final normed hidden states; no logits) and the action head. `instruction_mask` None:
        no instruction token is padding. `head`: extra inference inputs of the head (a flow-matching head's
        committed prefix)."""
        return self.action_head(self.query_states(vision_tokens, instruction_ids, instruction_mask), state, **head)

    def query_states(self, vision_tokens: torch.Tensor, instruction_ids: torch.Tensor,
                     instruction_mask: torch.Tensor | None) -> torch.Tensor:
        """The LLM's final normed hidden states at the action queries (B, T, D): what the action head reads."""
        instruction = self.embed_text(instruction_ids)
        b, t = vision_tokens.shape[0], self.action_head.chunk
        queries = self.action_head.queries.to(instruction.dtype).expand(b, -1, -1)
        embeds = torch.cat([vision_tokens.to(instruction.dtype), instruction, queries], dim=1)
        ones = lambda n: torch.ones(b, n, dtype=torch.bool, device=embeds.device)
        if instruction_mask is None:  # no padding: causal attention without a mask
            positions = self.llm_positions(ones(embeds.shape[1]))
            out = decoder_of(self.llm)(inputs_embeds=embeds, position_ids=positions, use_cache=False)
        else:
            mask = torch.cat([ones(vision_tokens.shape[1]), instruction_mask.bool(), ones(t)], dim=1)
            out = decoder_of(self.llm)(inputs_embeds=embeds, attention_mask=mask.long(),
                                       position_ids=self.llm_positions(mask), use_cache=False)
        self.__dict__.pop("_last_hidden", None)  # (the hook's copy: this path reads the output)
        return out.last_hidden_state[:, -t:]

    def reset(self) -> None:
        """Start of a new episode; the model keeps no state between calls (policy runtimes may)."""
