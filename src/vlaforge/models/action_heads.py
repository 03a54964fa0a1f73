"""Action heads: turn the LLM's hidden states at the action-query tokens into a chunk of continuous actions.

Every head owns the learned action-query embeddings (T, D) that the VLA appends to the LLM input, and is called
only through `forward`, so per-component wrappers (precision, checkpointing, FSDP) see all of its compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vlaforge.registry import Registry


@dataclass
class ActionHeadOutput:
    """prediction is compared with target by the action loss; actions is the head's estimate of the chunk."""

    prediction: torch.Tensor  # (B, T, A)
    target: torch.Tensor  # (B, T, A)
    actions: torch.Tensor  # (B, T, A)
    x_t: torch.Tensor | None = None  # flow matching: the noisy actions (B, T, A) the velocity was predicted at
    t: torch.Tensor | None = None  # flow matching: their flow times (B,)
    env_state: torch.Tensor | None = None  # the probe's estimate of the normalized environment state (B, E)


class ActionHead(nn.Module):
    """Base: learned action queries plus a state embedding shared by all heads.

    state_dropout: the probability that a training sample's normalized state is zeroed (the dataset's mean state);
    1 means the head never reads the state, at inference too (a policy must then locate the hand in the images).

    env_state_dim > 0 adds a linear probe from the action queries' mean hidden state to the environment state (the
    goal position), trained by the auxiliary `env_state` loss term and unused at inference: it asks the vision tower
    and the LLM to carry what the actions depend on to where the head reads it."""

    def __init__(self, llm_dim: int, action_dim: int, state_dim: int, chunk: int, hidden: int,
                 state_dropout: float = 0.0, env_state_dim: int = 0, **_: object):
        super().__init__()
        self.chunk, self.action_dim, self.state_dropout = chunk, action_dim, state_dropout
        self.queries = nn.Parameter(torch.randn(chunk, llm_dim) * 0.02)  # (T, D)
        self.state_proj = nn.Linear(state_dim, hidden)
        self.env_probe = nn.Linear(llm_dim, env_state_dim) if env_state_dim else None

    def probe(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The environment-state estimate (B, E) from the query hidden states (B, T, D); None without a probe."""
        return None if self.env_probe is None else self.env_probe(hidden.mean(1))

    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        """The state embedding (B, H) after state dropout."""
        if self.state_dropout >= 1.0:
            state = torch.zeros_like(state)
        elif self.state_dropout > 0.0 and self.training:
            keep = torch.rand(state.shape[0], 1, device=state.device) >= self.state_dropout
            state = state * keep.to(state.dtype)
        return self.state_proj(state)

    def forward(self, hidden: torch.Tensor, state: torch.Tensor, actions: torch.Tensor | None = None,
                prefix: torch.Tensor | None = None,
                prefix_weight: torch.Tensor | None = None) -> ActionHeadOutput | torch.Tensor:
        """Training (actions given): an ActionHeadOutput. Inference: the predicted chunk (B, T, A).

        prefix (B, T, A) and prefix_weight (B, T) in [0, 1]: actions already committed for the chunk's first
        steps, which a head that samples (flow matching) is guided to agree with (Real-Time Chunking); weight 0
        leaves a step free. Heads that do not sample ignore them."""
        raise NotImplementedError

    supports_prefix = False


ACTION_HEADS: Registry[type[ActionHead]] = Registry("action head")


@ACTION_HEADS.register("regression")
class RegressionHead(ActionHead):
    """OpenVLA-OFT style: one parallel decoding pass, an MLP per action query, L1/Huber regression."""

    def __init__(self, llm_dim: int, action_dim: int, state_dim: int, chunk: int, hidden: int, **kw: object):
        super().__init__(llm_dim, action_dim, state_dim, chunk, hidden, **kw)
        self.in_proj = nn.Linear(llm_dim, hidden)
        self.mlp = nn.Sequential(nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, action_dim))

    def forward(self, hidden, state, actions=None, prefix=None, prefix_weight=None):
        x = self.in_proj(hidden) + self.embed_state(state)[:, None, :]  # (B, T, H)
        pred = self.mlp(x)  # (B, T, A)
        if actions is None:
            return pred
        return ActionHeadOutput(prediction=pred, target=actions, actions=pred, env_state=self.probe(hidden))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of flow times t (B,) in [0, 1] -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


@ACTION_HEADS.register("flow_matching")
class FlowMatchingHead(ActionHead):
    """pi0 style conditional flow matching: x_t = t*noise + (1-t)*actions, the network predicts
    the velocity noise - actions; inference integrates from t=1 (noise) to t=0 with Euler steps.

    The velocity network is a small transformer over the T action tokens, conditioned on the LLM's hidden
    states at the action queries, the robot state and the flow time.
    """

    def __init__(self, llm_dim: int, action_dim: int, state_dim: int, chunk: int, hidden: int,
                 flow_steps: int = 10, layers: int = 2, **kw: object):
        super().__init__(llm_dim, action_dim, state_dim, chunk, hidden, **kw)
        self.flow_steps = flow_steps
        self.cond_proj = nn.Linear(llm_dim, hidden)
        self.action_in = nn.Linear(action_dim, hidden)
        self.time_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        layer = nn.TransformerEncoderLayer(hidden, nhead=max(1, hidden // 64), dim_feedforward=4 * hidden,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.net = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.action_out = nn.Linear(hidden, action_dim)

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Velocity (B, T, A) at noisy actions x_t (B, T, A), times t (B,), condition (B, T, H)."""
        temb = self.time_mlp(timestep_embedding(t, cond.shape[-1]).to(cond.dtype))  # (B, H)
        h = self.action_in(x_t) + cond + temb[:, None, :]
        return self.action_out(self.net(h))

    supports_prefix = True

    def condition(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The velocity network's condition (B, T, H) from the LLM's query states and the normalized state."""
        return self.cond_proj(hidden) + self.embed_state(state)[:, None, :]

    def forward(self, hidden, state, actions=None, prefix=None, prefix_weight=None):
        cond = self.condition(hidden, state)
        if actions is None:
            return self.sample(cond, prefix, prefix_weight)
        b = actions.shape[0]
        noise = torch.randn_like(actions)
        # pi0's time distribution: Beta(1.5, 1) leans towards noisy inputs, never exactly 0.
        t = torch.distributions.Beta(1.5, 1.0).sample((b,)).to(actions.device) * 0.999 + 0.001
        tt = t[:, None, None].to(actions.dtype)
        x_t = tt * noise + (1 - tt) * actions
        v = self.velocity(x_t, t, cond)
        return ActionHeadOutput(prediction=v, target=noise - actions, actions=x_t - tt * v, x_t=x_t, t=t,
                                env_state=self.probe(hidden))

    def sample(self, cond: torch.Tensor, prefix: torch.Tensor | None = None,
               prefix_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Actions (B, T, A) from the condition: `euler_sample` with this head's velocity network."""
        return euler_sample(self.velocity, cond, self.chunk, self.action_dim, self.flow_steps, prefix, prefix_weight)


def euler_sample(velocity, cond: torch.Tensor, chunk: int, action_dim: int, steps: int,
                 prefix: torch.Tensor | None = None, prefix_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Euler integration of `velocity(x_t, t, cond)` from noise (t = 1) to actions (t = 0) in `steps` steps; the
    noise is drawn from torch's generator. Shared by the flow-matching head and exported packages (whose velocity is
    an ONNX graph), so both integrate alike.

    With a committed `prefix`, each step is guided towards it by inpainting on the flow's own path: the prefix noised
    to the step's time, x_t = t * noise + (1 - t) * prefix with the sample's starting noise, is blended in with
    `prefix_weight` (1: the step ends exactly on the committed action; in between: a soft pull, as Real-Time
    Chunking's soft mask). This is the guided-inpainting form of RTC, not its vector-Jacobian guidance: no gradient
    through the velocity network is taken."""
    b = cond.shape[0]
    noise = torch.randn(b, chunk, action_dim, device=cond.device, dtype=cond.dtype)
    if prefix is not None:
        prefix, w = prefix.to(cond.dtype), prefix_weight.to(cond.dtype)[..., None]  # (B, T, A), (B, T, 1)
    x = noise
    dt = 1.0 / steps
    for i in range(steps):
        t = torch.full((b,), 1.0 - i * dt, device=cond.device)
        x = x - dt * velocity(x, t, cond)
        if prefix is not None:
            t_next = 1.0 - (i + 1) * dt
            x = w * (t_next * noise + (1 - t_next) * prefix) + (1 - w) * x
    return x
