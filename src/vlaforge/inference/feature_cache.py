"""Frame-feature caches of a policy session: projected vision tokens reused across predictions.

Modes (`CacheConfig.mode`):
- `none`: every frame of the history is encoded at every prediction (the model's own `predict_actions`).
- `exact`: each (camera, frame) of a session is encoded once and kept while it is in the frame history; a new
  prediction encodes one new frame per camera instead of F. Outputs equal the uncached path's.
- `frame`: on top of `exact`, a new frame whose similarity to a cached frame of the same camera (cosine of the
  mean-centred model-space image) is >= `frame_threshold` reuses that frame's tokens; a cached frame is reused at
  most `refresh_every` times before it is encoded again, and at most `max_frames` frames per camera are kept
  (least recently used first out).
- `token`: VLA-Cache style reuse inside the vision tower. Per camera the last encoded frame's per-layer hidden
  states and keys/values are kept; a new frame recomputes only the patches whose pixel cosine to the cached patch
  is below `token_threshold`, plus the `token_refresh` share of patches that went longest without a recompute
  (so none is stale for long), and every layer's attention of the recomputed patches reads the cached keys and
  values of the static ones. Every `refresh_every` frames the whole frame is recomputed. This runs in the vision
  tower, not in the LLM: the frame tokens' LLM keys and values depend on their position in the layout and on
  every earlier token (the frame history shifts each step), so reusing them would be a second approximation;
  a frame's vision features depend only on the frame. It runs the tower's own layers (`TokenReuseEncoder`), so it
  serves every tower vlaforge loads but one whose blocks take the whole patch grid at each call (Qwen-VL's: refused).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from vlaforge.errors import VlaforgeError
from vlaforge.models.vision import vision_blocks, vision_family

CacheMode = Literal["none", "exact", "frame", "token"]
CACHE_MODES = ("none", "exact", "frame", "token")


@dataclass(frozen=True)
class CacheConfig:
    """How a runtime reuses vision features across a session's predictions (see the module docstring)."""

    mode: CacheMode = "exact"
    frame_threshold: float = 0.99  # docs/inference.md: closed loop at 0.9 / 0.99 / 0.998
    token_threshold: float = 0.996
    token_refresh: float = 0.125  # share of a frame's patches always recomputed (the stalest first)
    refresh_every: int = 8  # reuses of a cached frame (frame) / partial frames (token) before a full encode
    max_frames: int = 100  # reference frames per camera and session (frame mode's LRU bound)

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise VlaforgeError(f"cache mode {self.mode!r} is not one of {', '.join(CACHE_MODES)}")
        for name in ("frame_threshold", "token_threshold"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise VlaforgeError(f"cache {name} = {getattr(self, name)} is not a cosine; give a value in [-1, 1]")
        if not 0.0 <= self.token_refresh <= 1.0:
            raise VlaforgeError(f"cache token_refresh = {self.token_refresh} is a share of patches; give 0..1")
        if self.refresh_every < 1 or self.max_frames < 1:
            raise VlaforgeError("cache refresh_every and max_frames must be at least 1")


@dataclass
class CacheStats:
    """What a session's cache did: frames looked up / reused / encoded, tokens reused / recomputed, refreshes."""

    frames: int = 0  # frame slots the predictions needed
    exact_hits: int = 0  # the same frame, encoded before
    similar_hits: int = 0  # frame mode: another, similar frame's tokens reused
    encoded: int = 0  # frames that went through the vision tower in full
    partial: int = 0  # token mode: frames recomputed only in part
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    refreshes: int = 0  # forced full encodes of a frame that could have been reused

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        out["hit_rate"] = round((self.exact_hits + self.similar_hits) / self.frames, 4) if self.frames else 0.0
        tokens = self.reused_tokens + self.recomputed_tokens
        out["reused_token_share"] = round(self.reused_tokens / tokens, 4) if tokens else 0.0
        return out


def centred(pixels: torch.Tensor) -> torch.Tensor:
    """A model-space frame (3, S, S) as a flat, mean-centred float vector (the frame-similarity measure's input)."""
    v = pixels.float().flatten()
    return v - v.mean()


class _Bank:
    """Frame mode's reference frames of one camera: unit-norm centred frames in one (capacity, D) matrix, so a
    lookup is one matrix-vector product; the least recently used slot is overwritten when full."""

    def __init__(self, capacity: int):
        self.capacity, self.n, self.clock = capacity, 0, 0
        self.vectors: torch.Tensor | None = None
        self.tokens: list[torch.Tensor] = []
        self.reuses: list[int] = []
        self.used: list[int] = []

    def best(self, unit: torch.Tensor) -> tuple[int, float]:
        if self.n == 0:
            return -1, -1.0
        sims = self.vectors[:self.n] @ unit
        i = int(sims.argmax())
        return i, float(sims[i])

    def touch(self, i: int) -> None:
        self.clock += 1
        self.used[i] = self.clock

    def add(self, unit: torch.Tensor, tokens: torch.Tensor) -> None:
        if self.vectors is None:
            self.vectors = unit.new_zeros(self.capacity, unit.numel())
        if self.n < self.capacity:
            i, self.n = self.n, self.n + 1
            self.tokens.append(tokens), self.reuses.append(0), self.used.append(0)
        else:
            i = min(range(self.n), key=self.used.__getitem__)
            self.tokens[i], self.reuses[i] = tokens, 0
        self.vectors[i] = unit
        self.touch(i)


def unit_vector(pixels: torch.Tensor) -> torch.Tensor:
    v = centred(pixels)
    return v / v.norm().clamp_min(1e-6)


class SessionCache:
    """One session's cached frame tokens. `entries`: the frames of the current history, keyed by (camera, frame
    index) - the frame index is the session's count of observed frames, so a key always means the same pixels.
    `banks` (frame mode): per camera, encoded frames that later similar frames may reuse, at most max_frames."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self.entries: dict[tuple[str, int], torch.Tensor] = {}
        self.banks: dict[str, _Bank] = {}
        self.patches: dict[str, PatchState] = {}
        self.stats = CacheStats()

    def lookup(self, cam: str, index: int, pixels: torch.Tensor | None) -> torch.Tensor | None:
        """Cached tokens for this frame, or None if it must be encoded. `pixels` (model space) only in frame mode."""
        mode = self.config.mode
        self.stats.frames += 1
        if mode == "none":
            return None
        hit = self.entries.get((cam, index))
        if hit is not None:
            self.stats.exact_hits += 1
            return hit
        if mode != "frame" or pixels is None:
            return None
        bank = self.banks.get(cam)
        if bank is None:
            return None
        i, score = bank.best(unit_vector(pixels))
        if score < self.config.frame_threshold:
            return None
        if bank.reuses[i] >= self.config.refresh_every:
            self.stats.refreshes += 1
            return None
        bank.reuses[i] += 1
        bank.touch(i)
        self.stats.similar_hits += 1
        self.entries[(cam, index)] = bank.tokens[i]
        return bank.tokens[i]

    def store(self, cam: str, index: int, pixels: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep a just-encoded frame's tokens."""
        self.stats.encoded += 1
        self.stats.recomputed_tokens += tokens.shape[0]
        if self.config.mode == "none":
            return
        self.entries[(cam, index)] = tokens
        if self.config.mode == "frame":
            self.banks.setdefault(cam, _Bank(self.config.max_frames)).add(unit_vector(pixels), tokens)

    def remember(self, cam: str, index: int, tokens: torch.Tensor) -> torch.Tensor:
        """Keep the tokens token mode made for this frame (a copy: its patch state changes in place)."""
        self.entries[(cam, index)] = tokens = tokens.clone()
        return tokens

    def retain(self, oldest: int) -> None:
        """Forget the frames older than the history (frame mode's references stay, up to max_frames)."""
        for key in [k for k in self.entries if k[1] < oldest]:
            del self.entries[key]


# ---- token mode: partial recomputation inside the vision tower ----------------------------------------------

@dataclass
class PatchState:
    """A camera's last encoded frame inside the vision tower. A block's sequence: its leading tokens (CLS,
    registers), then the P patches."""

    patches: torch.Tensor  # (P, 3*p*p) model-space pixels of each patch
    outputs: list[torch.Tensor]  # per block, its output over its whole sequence (S, D)
    keys: list[torch.Tensor]  # per block (H, S, hd)
    values: list[torch.Tensor]
    tokens: torch.Tensor  # (P', D_llm) projected
    age: torch.Tensor  # (P,) frames since each patch was recomputed
    partial_frames: int = 0


def patch_pixels(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """(3, S, S) -> (P, 3*patch*patch), patches in the tower's row-major token order."""
    c = pixels.shape[0]
    grid = pixels.unfold(1, patch, patch).unfold(2, patch, patch)  # (3, g, g, p, p)
    return grid.permute(1, 2, 0, 3, 4).reshape(-1, c * patch * patch)


@dataclass
class _Pass:
    """One frame going through the tower in token mode: the patches recomputed (None: all, and `state` is filled
    from scratch), and the block running now with its sequence rows recomputed (leading tokens, then patches)."""

    state: PatchState
    patches: torch.Tensor | None
    block: int = 0
    rows: torch.Tensor | None = None


# NOTE: a runtime predicts on one thread (the server's batcher runs one pool thread): the tower is switched to the
# token attention for the pass alone, which reads the pass from here
_passes: list[_Pass] = []
ATTENTION = "vlaforge_token_cache"  # the transformers attention implementation the tower runs during a pass


def _all_visible(mask: torch.Tensor) -> bool:
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _token_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention of the running pass's block (transformers' AttentionInterface signature, (B=1, H, n, hd)
    inputs): the recomputed rows' keys and values go into the frame's (H, S, hd) caches, and their queries attend
    to every row's, the static rows' cached."""
    run = _passes[-1]
    if attention_mask is not None and not _all_visible(attention_mask):
        raise VlaforgeError("cache mode 'token' attends to every patch of a frame, but the vision tower masked some "
                            "of them; use --cache exact or frame")
    i, state = run.block, run.state
    if run.rows is None:
        state.keys[i], state.values[i] = key[0].contiguous(), value[0].contiguous()
    else:
        state.keys[i][:, run.rows], state.values[i][:, run.rows] = key[0], value[0]
    out = F.scaled_dot_product_attention(query, state.keys[i][None], state.values[i][None], scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # (1, n, H, hd), as transformers expects


def _before_block(i: int):
    """A forward pre-hook of block `i`: during a partial pass, the block takes only the rows recomputed."""

    def hook(module, args, kwargs):
        run = _passes[-1]
        run.block = i
        if run.patches is None:
            return None
        # (1, S, D): the previous block's output (or the embeddings) over the whole sequence
        hidden = args[0] if args else kwargs["hidden_states"]
        lead = hidden.shape[1] - run.state.patches.shape[0]
        run.rows = torch.cat([torch.arange(lead, device=hidden.device), run.patches + lead])
        if args:
            return (hidden[:, run.rows], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden[:, run.rows]}

    return hook


def _after_block(i: int):
    """A forward hook of block `i`: its output over the whole sequence (the recomputed rows new, the others the
    cached ones), kept for the next frame."""

    def hook(module, args, kwargs, out):
        run = _passes[-1]
        if run.patches is None:
            run.state.outputs[i] = out[0]
            return None
        full = run.state.outputs[i]
        full[run.rows] = out[0]
        return full[None]

    return hook


class TokenReuseEncoder:
    """Encodes frames through a VLA's vision tower and projector (`VLA.encode_frames`: the tower's own embeddings,
    positions, masks, blocks and final norm), recomputing in each block only the patches that changed."""

    def __init__(self, model: torch.nn.Module, config: CacheConfig):
        fam = vision_family(model.vision)
        if fam.whole_grid:
            raise VlaforgeError(f"cache mode 'token' runs some of a frame's patches through the {fam.name} vision "
                                f"tower, but {fam.whole_grid}; use --cache exact or frame")
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(ATTENTION, _token_attention)
        # NOTE: the mask of a whole frame (all patches valid) is none: sdpa's mask function says so
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        self.model, self.config = model, config
        self.patch = model.vision.config.patch_size

    def encode(self, cache: SessionCache, cam: str, pixels: torch.Tensor) -> torch.Tensor:
        """Tokens (P', D) of `pixels` (3, S, S); updates the camera's patch state and the cache's statistics."""
        state = cache.patches.get(cam)
        patches = patch_pixels(pixels, self.patch)
        n = patches.shape[0]
        if state is None or state.partial_frames >= self.config.refresh_every:
            if state is not None:
                cache.stats.refreshes += 1
            return self._full(cache, cam, pixels, patches)
        changed = F.cosine_similarity(patches.float(), state.patches.float(), dim=1, eps=1e-6) \
            < self.config.token_threshold
        k = min(n, math.ceil(self.config.token_refresh * n))
        if k:
            changed[torch.topk(state.age.masked_fill(changed, -1), k).indices] = True
        idx = changed.nonzero().flatten()
        if len(idx) * 2 > n:  # most patches changed: one full pass costs the same
            return self._full(cache, cam, pixels, patches)
        self._update(state, pixels, patches, idx)
        cache.stats.partial += 1
        cache.stats.recomputed_tokens += len(idx)
        cache.stats.reused_tokens += n - len(idx)
        return state.tokens

    def _full(self, cache: SessionCache, cam: str, pixels: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """Every patch through the tower; the camera's patch state starts over."""
        blocks = len(vision_blocks(self.model.vision))
        state = PatchState(patches, [None] * blocks, [None] * blocks, [None] * blocks, None,
                           torch.zeros(len(patches), dtype=torch.long, device=patches.device))
        state.tokens = self._run(_Pass(state, None), pixels)
        cache.patches[cam] = state
        cache.stats.encoded += 1
        cache.stats.recomputed_tokens += len(patches)
        return state.tokens

    def _update(self, state: PatchState, pixels: torch.Tensor, patches: torch.Tensor, idx: torch.Tensor) -> None:
        """Recompute the patches `idx` of the camera's last frame from `pixels`; the others keep their states."""
        state.tokens = self._run(_Pass(state, idx.to(patches.device)), pixels)
        state.patches[idx] = patches[idx]
        state.age += 1
        state.age[idx] = 0
        state.partial_frames += 1

    def _run(self, run: _Pass, pixels: torch.Tensor) -> torch.Tensor:
        """`VLA.encode_frames` of one frame with `run` active: each block hooked (`_before_block`, `_after_block`)
        and the tower's attention switched to `_token_attention`, for this call only."""
        vision = self.model.vision
        configs = {id(m.config): m.config for m in vision.modules()
                   if hasattr(getattr(m, "config", None), "_attn_implementation")}
        kinds = {k: c._attn_implementation for k, c in configs.items()}
        hooks = [h for i, block in enumerate(vision_blocks(vision)) for h in (
            block.register_forward_pre_hook(_before_block(i), with_kwargs=True),
            block.register_forward_hook(_after_block(i), with_kwargs=True))]
        dtype = next((p.dtype for p in vision.parameters() if p.is_floating_point()), pixels.dtype)
        _passes.append(run)
        try:
            for c in configs.values():
                c._attn_implementation = ATTENTION
            return self.model.encode_frames(pixels[None].to(dtype))[0]
        finally:
            _passes.pop()
            for k, c in configs.items():
                c._attn_implementation = kinds[k]
            for h in hooks:
                h.remove()
