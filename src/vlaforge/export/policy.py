"""The graphs of a LeRobot policy's package (SmolVLA, pi0, pi0.5 fine-tuned by vlaforge: `models/policies/`), kind
`flow_matching_kv` in `inference/packages.py`:

- `vision`: pixels (N, 3, S, S) in [-1, 1] -> the image tokens the prefix starts with (N, P, Dv), one frame per row
  (the frame-feature cache works as with a checkpoint);
- `prefix`: the images' tokens (B, F*P, Dv), instruction ids and mask (B, L), the normalized state (B, S) -> the
  prefix's keys and values every denoising step reads, packed per joint layer into one tensor `prefix_kv`
  (B, Lp, C) (`models.policies.joint.pack_cache`: keys then values per layer, flattened over heads; a SmolVLA cross
  layer's expert projections of them, computed once here rather than at every step), and `prefix_mask` (B, Lp)
  (1 for a real prefix token);
- `denoise`: x_t (B, T, A_max), flow time t (B,), the state, `prefix_kv`, `prefix_mask` -> the velocity
  (B, T, A_max): the suffix alone against the prefix, as `PolicyVLA.velocity` runs it.

The runtime integrates `denoise` with the policy's Euler steps (`models.policies.model.flow_euler`, the same function
the PyTorch policy uses) from noise over the padded action width A_max, and keeps the first `action_dim` columns.
"""

from __future__ import annotations

from typing import Any

import torch

from vlaforge.models.policies.images import pad_vector
from vlaforge.models.policies.joint import pack_cache, unpack_cache


def _prefix(model, tokens, ids, mask, state):
    # the whole prefix, padding included: the graph's length is the instruction's, whatever a prompt's padding
    cache, pad = model.prefix_pass(model.token_inputs(tokens, ids, mask.bool(), state), tokens, whole=True)
    return pack_cache(model.joint_layers, cache), pad.long()


def _denoise(model, x_t, t, state, prefix_kv, prefix_mask):
    cache = unpack_cache(model.joint_layers, prefix_kv)
    return model.velocity(cache, prefix_mask.bool(), pad_vector(state, model.spec.max_state_dim), x_t, t)


def regions() -> dict[str, Any]:
    return {"vision": lambda m, pixels: m.encode_frames(pixels), "prefix": _prefix, "denoise": _denoise}


def example_inputs(model, examples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`examples` (the package writer's: pixels, tokens, ids, mask, state at the trace batch) with the denoising
    graph's inputs added: x_t over the padded action width, t, and the prefix graph's outputs on those examples."""
    spec, b = model.spec, examples["tokens"].shape[0]
    dtype = examples["tokens"].dtype
    with torch.no_grad():
        kv, pad = _prefix(model, examples["tokens"], examples["ids"], examples["mask"], examples["state"])
    g = torch.Generator().manual_seed(1)
    return examples | {"x_t": torch.randn(b, spec.chunk, spec.max_action_dim, generator=g).to(dtype),
                       "t": torch.full((b,), 0.5, dtype=dtype), "prefix_kv": kv, "prefix_mask": pad}


def head_entry(model) -> dict[str, Any]:
    """The manifest's `action_head` of a policy package."""
    spec = model.spec
    return {"kind": "flow_matching_kv", "family": spec.family, "chunk": spec.chunk, "action_dim": spec.action_dim,
            "noise_dim": spec.max_action_dim, "flow_steps": spec.num_steps,
            "integration": "euler from t=1 (noise over noise_dim) to t=0; the first action_dim columns"}
