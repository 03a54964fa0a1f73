"""A LeRobot policy folder (SmolVLA, pi0) behind `PolicyRuntime`'s interface (`runtime.LeRobotRuntime` holds the
sessions; this module the folder's own path), so `eval` and `serve` run it as any vlaforge checkpoint. An
observation goes through the folder's own pipelines (models/policies/
processors.py: normalization, newline, tokenizer as the JSON lists them), the policy's input preparation (resize
with padding, [-1, 1], zero padding to max_state_dim), `PolicyVLA.sample_actions` (the prefix once, then the
denoising steps against its cached keys and values) and the postprocessor - LeRobot's `predict_action_chunk` path.

`predict(obs, noise=...)` takes the noise the policy draws (chunk_size x max_action_dim), so an action chunk can be
compared with LeRobot's for the same inputs.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vlaforge.data.transforms import ObservationSpec
from vlaforge.errors import VlaforgeError
from vlaforge.inference.observation import Prediction, _Request


def observation_spec(model, pre) -> ObservationSpec:
    """The `ObservationSpec` a client reads (`describe`): the folder's cameras, sizes and chunk, and its MEAN_STD
    statistics where it has them (zeros and ones otherwise: the pipelines normalize, not the spec)."""
    spec = model.spec
    stats = getattr(pre, "stats", {}) or {}
    raw = spec.extra.get("input_features", {}).get(spec.cameras[0], {}).get("shape", [3, *spec.image_size])

    def moments(key: str, n: int) -> tuple[list[float], list[float]]:
        s = stats.get(key, {})
        mean, std = s.get("mean"), s.get("std")
        if mean is None or std is None:
            return [0.0] * n, [1.0] * n
        return [float(v) for v in torch.as_tensor(mean).flatten()], [float(v) for v in torch.as_tensor(std).flatten()]

    state_mean, state_std = moments("observation.state", spec.state_dim)
    action_mean, action_std = moments("action", spec.action_dim)
    return ObservationSpec(cameras=list(spec.cameras), frames=1, frame_stride=1, image_size=spec.image_size[0],
                           render_size=int(max(raw[1:])), instruction_tokens=int(getattr(pre, "max_length", 0) or 0),
                           text_tokens=0, chunk=spec.chunk, state_mean=state_mean, state_std=state_std,
                           action_mean=action_mean, action_std=action_std)


def check_noise(model, noise: np.ndarray | None) -> torch.Tensor | None:
    """A caller's starting noise as a (chunk_size, max_action_dim) tensor (None: drawn per prediction).

    Raises:
        VlaforgeError: another shape.
    """
    if noise is None:
        return None
    spec = model.spec
    arr = np.asarray(noise, dtype=np.float32)
    if arr.shape != (spec.chunk, spec.max_action_dim):
        raise VlaforgeError(f"noise: shape {arr.shape}; this policy draws ({spec.chunk}, {spec.max_action_dim}) "
                            "(chunk_size x max_action_dim)")
    return torch.from_numpy(arr.copy())


def predict_requests(model, pre, post, cameras: list[str], requests: list[_Request],
                     device: torch.device) -> list[Prediction]:
    """LeRobot's `predict_action_chunk` path for prepared requests: one batch per camera-size group (robots whose
    cameras send other sizes are resized by the pipeline, apart), in the requests' order."""
    groups: dict[tuple, list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(tuple(tuple(frame.shape) for _, _, frame in req.slots), []).append(i)
    out: list[Prediction | None] = [None] * len(requests)
    for rows in groups.values():
        for i, pred in zip(rows, _predict_batch(model, pre, post, cameras, [requests[i] for i in rows], device)):
            out[i] = pred
    return out


@torch.inference_mode()
def _predict_batch(model, pre, post, cameras: list[str], requests: list[_Request],
                   device: torch.device) -> list[Prediction]:
    """One batch of requests whose frames share their sizes: uint8 frames to [0, 1], the preprocessor, `prepare`,
    sampling (the given noise, else a fresh draw), the postprocessor."""
    t0 = time.perf_counter()
    raw = {f"observation.images.{cam}": torch.stack([r.slots[j][2] for r in requests]).permute(0, 3, 1, 2)
           .float().div(255.0) for j, cam in enumerate(cameras)}
    raw["observation.state"] = torch.stack([r.state for r in requests])
    raw["task"] = [r.session.instruction for r in requests]
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in pre(raw).items()}
    x = model.prepare(batch, with_actions=False)
    spec = model.spec
    noise = torch.stack([r.noise if r.noise is not None else torch.randn(spec.chunk, spec.max_action_dim)
                         for r in requests]).to(device)
    t1 = time.perf_counter()
    actions = model.predict_chunk(x, noise)
    t2 = time.perf_counter()
    actions = post(actions.float().cpu()).numpy()
    t3 = time.perf_counter()
    ms = lambda a, b: round((b - a) * 1000, 3)
    out = []
    for k, req in enumerate(requests):
        req.session.latencies_ms.append(ms(t0, t3))
        out.append(Prediction(actions[k], {"total_ms": ms(t0, t3), "prepare_ms": ms(t0, t1), "model_ms": ms(t1, t2),
                                           "post_ms": ms(t2, t3), "batch_size": len(requests)}))
    return out
