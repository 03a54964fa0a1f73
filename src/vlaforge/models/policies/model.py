"""One composition for LeRobot's flow-matching policies (SmolVLA, pi0): four components - `vision` (the VLM's tower),
`projector` (its connector), `llm` (its text model and LM head), `action_head` (`ExpertHead`: the expert's decoder
blocks, final norm, and the state, action and time projections) - joined by `JointLayer`s. What differs between the
families is data (`Composition`, `PolicySpec`, the layer plan), read here by one code path:

  prefix  = [image 1 tokens] ... [image N tokens] [language tokens] (+ [state] where the state is in the prefix)
  suffix  = (+ [state] where the state is in the suffix) [noisy action tokens + flow time]

The prefix attends bidirectionally within itself and never to the suffix; the suffix sees the whole (unpadded)
prefix and, among actions, either every action (pi0) or the earlier ones (SmolVLA). Positions count real tokens.
Training is flow matching: x_t = t * noise + (1 - t) * actions, the expert predicts noise - actions, loss per element
is the squared error; sampling integrates from t = 1 to 0 in `num_steps` Euler steps with the prefix's keys and values
computed once (`PrefixCache`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from vlaforge.data.batch import Batch
from vlaforge.errors import VlaforgeError
from vlaforge.models import losses as L
from vlaforge.models.policies.inputs import PolicyInputs, batch_inputs, lerobot_inputs, token_inputs
from vlaforge.models.policies.joint import JointContext, JointLayer, PrefixCache, norm, rope_angles
from vlaforge.models.vla import VLA, Layout


@dataclass(frozen=True)
class Composition:
    """The per-family facts of the composition (`families.py` holds one per family)."""

    state_token: str | None  # 'prefix': ends the prefix (SmolVLA); 'suffix': starts it (pi0); None: prompt (pi0.5)
    actions_causal: bool  # SmolVLA: an action token sees the earlier ones; pi0: all of them
    embed_scale: bool  # SmolVLA multiplies image and language embeddings by sqrt(width); LeRobot's pi0 does not
    rope_style: str  # 'divide' (SmolVLA's apply_rope) or 'multiply' (transformers' Gemma rotary embedding)
    resize: str  # the image resize: 'top_left' padding (SmolVLA) or 'centered' (openpi's, pi0)
    mask_value: float  # the additive mask's large negative (the reference's)
    masks_padded_actions: bool = True  # LeRobot's loss leaves out chunk steps past the episode's end (pi0's not)
    time_conditioning: str = "concat"  # flow time joined to each action token ('concat'), or norms' (pi0.5: 'adarms')


@dataclass(frozen=True)
class PolicySpec:
    """The shapes and settings of one policy, read from its LeRobot config.json."""

    family: str
    cameras: tuple[str, ...]  # the input features of type VISUAL, in the config's order, but the empty cameras
    state_dim: int
    action_dim: int
    chunk: int
    max_state_dim: int
    max_action_dim: int
    image_size: tuple[int, int]  # (height, width) the images are resized (with padding) to
    num_steps: int
    min_period: float
    max_period: float
    rope_base: float
    prefix_length: int = -1  # SmolVLA: pad the prefix to this many tokens (<= 0: no padding)
    time_beta: tuple[float, float, float, float] = (1.5, 1.0, 0.999, 0.001)  # alpha, beta, scale, offset
    layers: tuple[tuple[int, int | None, str], ...] = ()  # (VLM block, expert block | None, 'self' | 'cross')
    empty_cameras: int = 0  # masked image slots after the cameras (config.json's empty_cameras: `inputs.py`)
    extra: dict = field(default_factory=dict)  # the rest of config.json, as read


class ExpertHead(nn.Module):
    """The `action_head` of a policy: the action expert's decoder blocks (`blocks`, found by `blocks_of`) and final
    `norm`, the action in / out projections, and (LeRobot's names) either the state projection and the action-time MLP
    (`state_in` given: SmolVLA, pi0) or the time MLP whose output conditions the expert's norms (pi0.5)."""

    def __init__(self, blocks: nn.ModuleList, norm: nn.Module, state_in: int | None, state_out: int, width: int,
                 max_action_dim: int, chunk: int, action_dim: int, time_conditioning: str = "concat"):
        super().__init__()
        self.blocks, self.norm = blocks, norm
        if state_in is not None:
            self.state_proj = nn.Linear(state_in, state_out)
        self.action_in_proj = nn.Linear(max_action_dim, width)
        self.action_out_proj = nn.Linear(width, max_action_dim)
        if time_conditioning == "concat":
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)
        else:
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        self.chunk, self.action_dim, self.width = chunk, action_dim, width

    supports_prefix = False  # no committed-action guidance (RTC) for these policies yet
    prefix_refusal = ("is not built for LeRobot policies yet (LeRobot's real-time chunking guides the velocity; "
                      "vlaforge's inpaints, docs/lerobot_policies.md)")


def att_2d(pad: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
    """(B, L) padding mask and (B, L) block starts -> (B, L, L) bool: a token sees real tokens whose block is not
    after its own (openpi's `make_att_2d_masks`)."""
    c = att.cumsum(1)
    return (c[:, None, :] <= c[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


def drop_padding(emb: torch.Tensor, pad: torch.Tensor,
                 att: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefix (embeddings, padding mask, block starts) without the tokens that are padding in every sample: a
    tokenizer's padding to its maximum length, SmolVLA's zero tokens up to `prefix_length`, empty cameras. No query
    sees them (`att_2d`) and nothing reads what they compute, and positions count real tokens only, so the losses and
    actions are the same; LeRobot runs them through every VLM block. A token that starts a block is kept (dropping it
    would merge blocks). Not while compiling or exporting, nor on fake tensors (the planner's count): their lengths
    are data-dependent, so there the prefix keeps its full length."""
    if torch.compiler.is_compiling() or is_fake(pad) or pad.device.type == "meta":
        return emb, pad, att
    keep = pad.any(0) | (att != 0).any(0)
    if bool(keep.all()):
        return emb, pad, att
    idx = keep.nonzero().squeeze(1)
    return emb.index_select(1, idx), pad.index_select(1, idx), att.index_select(1, idx)


def sinusoidal(time: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """Flow time (B,) -> (B, dim) sine-cosine embedding over periods min..max, computed in float64 as openpi."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = (1.0 / period * 2 * math.pi)[None, :] * time[:, None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def flow_euler(velocity, noise: torch.Tensor, steps: int) -> torch.Tensor:
    """The references' Euler integration of `velocity(x_t, time (B,))` from `noise` at t = 1 to t = 0 (their time
    arithmetic, so an exported package's steps are the PyTorch policy's to the last bit of t)."""
    dt = -1.0 / steps
    x_t = noise
    for step in range(steps):
        time = torch.tensor(1.0 + step * dt, dtype=torch.float32, device=noise.device).expand(noise.shape[0])
        x_t = x_t + dt * velocity(x_t, time)
    return x_t


class PolicyVLA(nn.Module):
    """A LeRobot flow-matching policy on vlaforge's four components; `losses` and `sample_actions` are LeRobot's
    `model.forward` and `model.sample_actions` on the same inputs."""

    def __init__(self, vision: nn.Module, projector: nn.Module, llm: nn.Module, action_head: ExpertHead,
                 spec: PolicySpec, composition: Composition):
        super().__init__()
        self.vision, self.projector, self.llm, self.action_head = vision, projector, llm, action_head
        self.spec, self.composition = spec, composition
        self.objective = L.Objective(weights={"action": 1.0}, action="mse")  # build_vla sets the config's
        self.pipelines = None  # (preprocessor, postprocessor) of the LeRobot folder (models/policies/reader.py)
        vlm_blocks = llm.get_decoder().layers
        scale = vlm_blocks[0].self_attn.scaling
        self.__dict__["joint_layers"] = [
            JointLayer(i, vlm_blocks[i], None if e is None else action_head.blocks[e], mode, scale)
            for i, e, mode in spec.layers]
        self.head_dim = vlm_blocks[0].self_attn.head_dim

    # ---- inputs -------------------------------------------------------------------------------------------
    def prepare(self, batch: dict, with_actions: bool = True) -> PolicyInputs:
        """A preprocessed batch (LeRobot's keys: the preprocessor's output) -> the model's inputs, as LeRobot's
        `prepare_images` / `prepare_state` / `prepare_action` make them, empty cameras included
        (`inputs.lerobot_inputs`).

        Raises:
            VlaforgeError: a real camera of the policy is not in the batch."""
        return lerobot_inputs(self.spec, self.composition.resize, batch, with_actions)

    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, P, Dv) projected image tokens."""
        dtype = next(self.vision.parameters()).dtype
        feats = self.projector(self.vision(pixel_values=image.to(dtype)).last_hidden_state)
        if self.composition.embed_scale:
            feats = feats * torch.tensor(feats.shape[-1] ** 0.5, dtype=feats.dtype, device=feats.device)
        return feats

    def embed_prefix(self, x: PolicyInputs,
                     image_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings (B, Lp, Dv), padding mask (B, Lp) bool, block starts (B, Lp)). `image_tokens`: the real
        cameras' tokens already embedded (B, N*P, Dv), as `encode_frames` gives them (the runtime's feature cache),
        one slice per image slot left None (the empty cameras' images are embedded here)."""
        embs, pads, att = [], [], []
        given = sum(image is None for image in x.images) if image_tokens is not None else 0
        per = image_tokens.shape[1] // given if given else 0
        slices = iter([image_tokens[:, i * per:(i + 1) * per] for i in range(given)])
        for image, mask in zip(x.images, x.image_masks, strict=True):
            e = next(slices) if image is None else self.embed_image(image)
            embs.append(e)
            pads.append(mask[:, None].expand(e.shape[0], e.shape[1]))
            att += [0] * e.shape[1]
        lang = self.llm.get_input_embeddings()(x.tokens)
        if self.composition.embed_scale:
            lang = lang * math.sqrt(lang.shape[-1])
        embs.append(lang)
        pads.append(x.token_mask.bool())
        att += [0] * lang.shape[1]
        if self.composition.state_token == "prefix":
            proj = self.action_head.state_proj
            embs.append(proj(x.state.to(proj.weight.dtype))[:, None].to(lang.dtype))
            pads.append(torch.ones(x.state.shape[0], 1, dtype=torch.bool, device=x.state.device))
            att += [1]
        emb, pad = torch.cat(embs, dim=1), torch.cat(pads, dim=1)
        att_t = torch.tensor(att, dtype=torch.long, device=pad.device)[None].expand(pad.shape[0], -1)
        missing = self.spec.prefix_length - emb.shape[1]
        if missing > 0:  # SmolVLA's prefix_length: zero tokens, masked out
            emb, pad, att_t = F.pad(emb, (0, 0, 0, missing)), F.pad(pad, (0, missing)), F.pad(att_t, (0, missing))
        return emb, pad, att_t

    def embed_suffix(self, state: torch.Tensor, x_t: torch.Tensor, time: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(embeddings (B, Ls, De), padding mask, block starts, the expert norms' condition (B, De) or None) of the
        noisy actions x_t (B, T, A) at flow times (B,)."""
        head, comp = self.action_head, self.composition
        action = head.action_in_proj(x_t.to(head.action_in_proj.weight.dtype))
        t_emb = sinusoidal(time, head.width, self.spec.min_period, self.spec.max_period).to(action.dtype)
        cond = None
        if comp.time_conditioning == "concat":
            h = head.action_time_mlp_out(F.silu(head.action_time_mlp_in(
                torch.cat([action, t_emb[:, None].expand_as(action)], dim=2))))
        else:  # pi0.5: the time MLP's output conditions every expert norm
            h, cond = action, F.silu(head.time_mlp_out(F.silu(head.time_mlp_in(t_emb))))
        t = h.shape[1]
        att = [1] * t if comp.actions_causal else [1] + [0] * (t - 1)
        if comp.state_token == "suffix":
            h = torch.cat([head.state_proj(state.to(head.state_proj.weight.dtype))[:, None].to(h.dtype), h], dim=1)
            att = [1] + att
        pad = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        return h, pad, torch.tensor(att, dtype=torch.long, device=h.device)[None].expand(h.shape[0], -1), cond

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """(B, Lq, Lk) bool -> (B, 1, Lq, Lk) additive float mask."""
        zero = torch.zeros((), dtype=torch.float32, device=allowed.device)
        return torch.where(allowed[:, None], zero, torch.tensor(self.composition.mask_value, device=allowed.device))

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        return rope_angles(positions, self.head_dim, self.spec.rope_base, self.composition.rope_style)

    # ---- training -----------------------------------------------------------------------------------------
    def losses(self, x: PolicyInputs, noise: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """Per-element flow-matching losses (B, T, max_action_dim) at the given noise and flow times (B,)."""
        tt = time[:, None, None]
        x_t = tt * noise + (1 - tt) * x.actions
        prefix, p_pad, p_att = drop_padding(*self.embed_prefix(x))
        suffix, s_pad, s_att, cond = self.embed_suffix(x.state, x_t, time)
        pad, allowed = torch.cat([p_pad, s_pad], 1), att_2d(torch.cat([p_pad, s_pad], 1), torch.cat([p_att, s_att], 1))
        positions = pad.long().cumsum(1) - 1
        n = prefix.shape[1]
        s_pos = positions[:, n:]
        angles, last = self._angles(positions), self.joint_layers[-1].index
        # the prefix's context: its first c tokens, which no trained parameter reaches when the VLM side is frozen
        # (not on the planner's fake tensors: the context's length is read from the block starts' values there; the
        # planner counts the whole graph, an upper bound)
        c = self._context_length(p_att) if self._vlm_side_frozen() and not is_fake(p_att) else 0
        cache = PrefixCache() if c else None
        if c:  # they run once without autograd (nothing to save for backward, no backward through the VLM)
            with torch.no_grad():
                ctx = JointContext(mask=self._additive(allowed[:, :c, :c]), angles=angles[:, :c], cache=cache,
                                   last_prefix=last)
                context = prefix[:, :c].detach()
                for layer in self.joint_layers:
                    context, _ = layer(context, None, ctx)
        ctx = JointContext(mask=self._additive(allowed[:, c:]), angles=angles[:, c:],
                           prefix_mask=self._additive(allowed[:, c:n, :n]),
                           cross_mask=self._additive(allowed[:, n:, :n]),
                           cross_angles=self._angles(s_pos - s_pos.min(dim=1, keepdim=True).values), cond=cond,
                           last_prefix=last, cache=cache, extend=bool(c))
        prefix = prefix[:, c:] if c < n else None
        for layer in self.joint_layers:
            prefix, suffix = layer(prefix, suffix, ctx)
        v_t = self.velocity_out(suffix, cond)
        return F.mse_loss(noise - x.actions, v_t, reduction="none")

    def _vlm_side_frozen(self) -> bool:
        """Whether no parameter before the action expert trains now (SmolVLA's default, `train_expert_only`): then
        the prefix's context needs no autograd. Read every step: a freezing schedule changes it."""
        return torch.is_grad_enabled() and not any(
            p.requires_grad for m in (self.vision, self.projector, self.llm) for p in m.parameters())

    @staticmethod
    def _context_length(p_att: torch.Tensor) -> int:
        """The prefix's context: the tokens before its first block start (SmolVLA's state token, which the trained
        state projection makes and which the context cannot see), or all of it (pi0 / pi0.5: images and text)."""
        starts = p_att[0].nonzero()
        return int(starts[0, 0]) if len(starts) else p_att.shape[1]

    def velocity_out(self, suffix: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's final norm and output projection over the action tokens (B, T, max_action_dim), in fp32."""
        head = self.action_head
        out = norm(head.norm, suffix, cond)[0][:, -head.chunk:].to(torch.float32)
        return head.action_out_proj(out.to(head.action_out_proj.weight.dtype)).to(torch.float32)

    def loss(self, x: PolicyInputs, noise: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """LeRobot's scalar loss: the mean over the real action dimensions and the steps inside the episode."""
        losses = self.losses(x, noise, time)[:, :, :self.spec.action_dim]
        if x.action_is_pad is None or not self.composition.masks_padded_actions:
            return losses.mean()
        keep = ~x.action_is_pad
        return (losses * keep[..., None]).sum() / (keep.sum() * losses.shape[-1]).clamp_min(1)

    # ---- inference ----------------------------------------------------------------------------------------
    def prefix_pass(self, x: PolicyInputs, image_tokens: torch.Tensor | None = None,
                    whole: bool = False) -> tuple[PrefixCache, torch.Tensor]:
        """Run the prefix once: its keys and values per joint layer, and its padding mask (B, Lp). `whole`: with
        the tokens that are padding in every sample (an exported graph's fixed length), else without them."""
        prefix, pad, att = self.embed_prefix(x, image_tokens)
        if not whole:
            prefix, pad, att = drop_padding(prefix, pad, att)
        cache = PrefixCache()
        ctx = JointContext(mask=self._additive(att_2d(pad, att)), angles=self._angles(pad.long().cumsum(1) - 1),
                           cache=cache, last_prefix=self.joint_layers[-1].index)
        for layer in self.joint_layers:
            prefix, _ = layer(prefix, None, ctx)
        return cache, pad

    def velocity(self, cache: PrefixCache, p_pad: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor,
                 time: torch.Tensor) -> torch.Tensor:
        """One denoising step's velocity (B, T, max_action_dim): the suffix alone against the cached prefix."""
        suffix, s_pad, s_att, cond = self.embed_suffix(state, x_t, time)
        b, ls, lp = suffix.shape[0], suffix.shape[1], p_pad.shape[1]
        to_prefix = p_pad[:, None, :].expand(b, ls, lp)
        positions = p_pad.long().sum(-1, keepdim=True) + s_pad.long().cumsum(1) - 1
        ctx = JointContext(mask=self._additive(torch.cat([to_prefix, att_2d(s_pad, s_att)], dim=2)),
                           angles=self._angles(positions), cross_mask=self._additive(to_prefix),
                           cross_angles=self._angles(positions - positions.min(dim=1, keepdim=True).values),
                           cache=cache, cond=cond)
        for layer in self.joint_layers:
            _, suffix = layer(None, suffix, ctx)
        return self.velocity_out(suffix, cond)

    @torch.no_grad()
    def sample_actions(self, x: PolicyInputs, noise: torch.Tensor, steps: int | None = None,
                       image_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Euler integration from noise (B, T, max_action_dim) at t = 1 to actions at t = 0."""
        cache, p_pad = self.prefix_pass(x, image_tokens)
        return flow_euler(lambda x_t, time: self.velocity(cache, p_pad, x.state, x_t, time), noise,
                          steps or self.spec.num_steps)

    def predict_chunk(self, x: PolicyInputs, noise: torch.Tensor) -> torch.Tensor:
        """The normalized action chunk (B, T, action_dim): sampled, the padding dimensions dropped."""
        return self.sample_actions(x, noise)[:, :, :self.spec.action_dim]

    # ---- vlaforge's policy interface: the trainer and PolicyRuntime over vlaforge's Batch ------------------
    # NOTE: a Batch here is what vlaforge's data pipeline builds for this model: one image per camera in [-1, 1]
    # at the policy's size, state and actions normalized by the dataset's statistics (MEAN_STD), the instruction
    # tokenized by the policy's own tokenizer (models/policies/processors.py:PolicyTokenizer)
    weigh = VLA.weigh

    def component_blocks(self, component: str) -> nn.ModuleList | None:
        """The units the techniques wrap per component (`models.blocks.blocks_of`): the tower's blocks; for the LLM
        the joint layers (VLM block i with the expert block it meets: the expert's blocks run there, so the action
        head has none of its own). The list is not a child: parameter names stay the components' own."""
        if component == "vision":
            from vlaforge.models.vision import vision_blocks

            return vision_blocks(self.vision)
        if component == "llm":
            if "_joint_list" not in self.__dict__:
                self.__dict__["_joint_list"] = nn.ModuleList(self.joint_layers)
            return self.__dict__["_joint_list"]
        return None

    def precision_regions(self, component: str) -> list[nn.Module]:
        """The modules whose forwards are `component`'s computation, for its autocast region
        (`techniques.precision.apply_precision`): the tower and the connector themselves; for the LLM the joint layers
        (both streams: their one attention spans the VLM's and the expert's queries, so the expert's blocks compute
        in the LLM's precision, which the config checks equal to the action head's); for the action head its
        projections, time MLP and final norm, which run outside the joint layers."""
        if component == "llm":
            return list(self.joint_layers)
        if component == "action_head":
            return [m for name, m in self.action_head.named_children() if name != "blocks"]
        return [getattr(self, component)]

    def lora_preset(self, component: str) -> list[str]:
        """LeRobot's default LoRA targets (`_get_default_peft_targets` of its SmolVLA, pi0 and pi0.5 policies: the
        expert's q_proj and v_proj, and the state, action and action-time projections, where the family has them:
        pi0.5's time MLP is `time_mlp_*`, which LeRobot's pattern does not name), as names inside `component`.

        Raises:
            VlaforgeError: `component` is not the action head (LeRobot adapts only the expert's side)."""
        if component != "action_head":
            raise VlaforgeError(f"components.{component}.lora.targets = 'lerobot': LeRobot's default targets are all "
                                "in the action expert; set components.action_head.lora and leave the "
                                f"{component} frozen (components.{component}.trainable = false) or name its linears")
        names = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
        own = [n for n in names if isinstance(getattr(self.action_head, n, None), nn.Linear)]
        return own + [f"blocks.{i}.self_attn.{p}" for i in range(len(self.action_head.blocks))
                      for p in ("q_proj", "v_proj")]

    @property
    def layout(self) -> Layout:
        tower = self.vision.config
        merge = getattr(self.projector, "scale_factor", 1)
        side = self.spec.image_size[0] // tower.patch_size // merge
        # NOTE: the empty cameras count: the tower runs on them and the prefix holds their tokens
        return Layout(frames=len(self.spec.cameras) + self.spec.empty_cameras, image_size=self.spec.image_size[0],
                      patches_per_frame=side * side, interpolate_pos=False)

    def uses_text(self, batch: Batch) -> bool:
        return False

    def inputs_from_batch(self, batch: Batch) -> PolicyInputs:
        return batch_inputs(self.spec, batch)

    def draw_time(self, b: int, device: torch.device) -> torch.Tensor:
        """Flow times (B,): Beta(alpha, beta) * scale + offset, the family's distribution."""
        alpha, beta, scale, offset = self.spec.time_beta
        dist = torch.distributions.Beta(torch.tensor(alpha), torch.tensor(beta), validate_args=False)
        return (dist.sample((b,)) * scale + offset).to(device=device, dtype=torch.float32)

    def begin_step(self) -> None:
        """Called by the trainer once per optimizer step, before its micro-batches (`training.step.local_step`):
        draws the step's seed from torch's generator, one draw whatever the step's split into micro-batches."""
        self.__dict__["_step_seed"] = int(torch.randint(0, 2 ** 62, (1,)).item())

    def draw_noise(self, batch: Batch, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The flow-matching noise (B, T, A) and times (B,) of a training batch. Within a step (`begin_step`), each
        sample's own, from its step seed and dataset row (`Batch.index`): the same for a sample whatever the
        micro-batch it is in, so accumulated micro-batches give the large batch's gradient exactly. Without them
        (a caller outside the trainer, a source without rows), from torch's generator for the whole batch."""
        seed = self.__dict__.get("_step_seed")
        if seed is None or batch.index is None:
            noise = torch.randn(actions.shape, device=actions.device)
            return noise, self.draw_time(noise.shape[0], noise.device)
        import numpy as np

        alpha, beta, scale, offset = self.spec.time_beta
        noises, times = [], []
        for row in batch.index.reshape(-1).tolist():
            sample_seed = (seed * 1_000_003 + int(row)) % 2 ** 63
            noises.append(torch.randn(actions.shape[1:], generator=torch.Generator().manual_seed(sample_seed)))
            times.append(np.random.default_rng(sample_seed).beta(alpha, beta) * scale + offset)
        return (torch.stack(noises).to(actions.device),
                torch.tensor(times, dtype=torch.float32, device=actions.device))

    def forward(self, batch: Batch, denominators: dict[str, torch.Tensor] | None = None,
                extra=None) -> dict[str, torch.Tensor]:
        """The flow-matching term at random noise and times, averaged over the chunk steps inside the episode and
        the real action dimensions (LeRobot's loss); `denominators`: the trainer's global counts."""
        if extra is not None:
            raise VlaforgeError("distillation is not built for LeRobot policies; train without [distill]")
        x = self.inputs_from_batch(batch)
        noise, time = self.draw_noise(batch, x.actions)
        losses = self.losses(x, noise, time)[:, :, :self.spec.action_dim]
        den = (denominators or {}).get("action")
        action = L.masked_mean(losses, batch.action_mask, None if den is None else den * losses.shape[-1])
        return {"action": action}

    def compute_loss(self, batch: Batch, weighting=None, denominators=None) -> tuple[torch.Tensor, dict]:
        return self.weigh(self(batch, denominators=denominators), weighting)

    def encode_frames(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) in [-1, 1] -> the image tokens (N, P, Dv) the prefix starts with."""
        return self.embed_image(pixels)

    def token_inputs(self, vision_tokens: torch.Tensor, instruction_ids: torch.Tensor,
                     instruction_mask: torch.Tensor | None, state: torch.Tensor) -> PolicyInputs:
        """The inputs of a prediction from the real cameras' tokens (the images themselves are not kept)."""
        return token_inputs(self.spec, vision_tokens, instruction_ids, instruction_mask, state)

    def actions_from_tokens(self, vision_tokens: torch.Tensor, instruction_ids: torch.Tensor,
                            instruction_mask: torch.Tensor | None, state: torch.Tensor, **head) -> torch.Tensor:
        """The normalized action chunk (B, T, A) from the images' tokens (B, F*P, Dv): a fresh noise draw."""
        if head:
            raise VlaforgeError("a committed-action prefix is not built for LeRobot policies yet")
        b = vision_tokens.shape[0]
        x = self.token_inputs(vision_tokens, instruction_ids, instruction_mask, state)
        noise = torch.randn(b, self.spec.chunk, self.spec.max_action_dim, device=vision_tokens.device)
        actions = self.sample_actions(x, noise.to(vision_tokens.dtype), image_tokens=vision_tokens)
        return actions[:, :, :self.spec.action_dim]

    def policy_tokenizer(self):
        """(a `TextTokenizer` encoding instructions as the folder's pipeline does - its newline step or pi0.5's state
        prompt, its tokenizer's special tokens, right padding - and its max length), for vlaforge's data pipeline."""
        from vlaforge.data.tokenizer import TextTokenizer

        pre = self.pipelines[0]
        tok = pre.tokenizer
        if getattr(pre, "padding_side", "right") != "right":
            raise VlaforgeError("the policy's tokenizer step pads on the left; vlaforge's data pipeline pads "
                                "instructions on the right: fine-tune a policy whose pipeline pads on the right")
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        suffix = "\n" if any("new_line" in n for n in pre.step_names) else ""
        with_state = any("prepare_state_tokenizer" in n for n in pre.step_names)  # pi0.5's prompt
        return (TextTokenizer(tok, pad, None, suffix=suffix, special=True, state_prompt=with_state),
                int(pre.max_length))

    def normalization_mapping(self) -> dict[str, str]:
        """How the policy normalizes each feature type (its config's normalization_mapping; the reader fills in
        LeRobot's default for its type where config.json has none): what a fine-tune normalizes its dataset with."""
        return dict(self.backbones["config"].get("normalization_mapping") or {})

    def reset(self) -> None:
        """Start of an episode: the model keeps no state between calls."""
