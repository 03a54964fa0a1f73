"""What crosses `PolicyRuntime`'s door: the typed observation, the prediction, a session's state, a prepared
request, and the device / dtype choice - shared by every runtime (inference/runtime.py, inference/lerobot_policy.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from vlaforge.errors import VlaforgeError
from vlaforge.inference.feature_cache import SessionCache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ObservationError(VlaforgeError):
    """An observation that does not fit the policy; the message names the field."""


@dataclass
class Observation:
    """One robot observation: images per camera name (uint8 H x W x 3, any size), state, instruction text."""

    images: Mapping[str, Any]
    state: Any
    instruction: str
    adapter: str | None = None  # with several LoRA adapters served (inference/adapters.py): the one to run with


@dataclass
class Prediction:
    """A denormalized action chunk (T, A) float32 and where the time went (milliseconds)."""

    actions: np.ndarray
    timings: dict[str, float]


@dataclass
class _Request:
    session: "Session"
    slots: list[tuple[str, int, torch.Tensor]]  # (camera, frame index, uint8 frame) in layout order
    state: torch.Tensor
    prefix: tuple[torch.Tensor, torch.Tensor] | None  # normalized (T, A) committed actions, (T,) weights
    noise: torch.Tensor | None = None  # a LeRobot policy's starting noise (T, max_action_dim), when given


@dataclass
class Session:
    """One robot episode's state: frame history, tokenized instruction, feature cache, latencies."""

    name: str
    cache: SessionCache
    frames: dict[str, deque] = field(default_factory=dict)  # camera -> (index, uint8 frame)
    count: int = 0  # frames observed this episode
    instruction: str | None = None
    tokens: tuple[torch.Tensor, torch.Tensor, int] | None = None  # ids, mask, real length
    latencies_ms: list[float] = field(default_factory=list)
    adapter: str | None = None  # the LoRA adapter it runs with, when the runtime holds several

    def report(self) -> dict[str, Any]:
        """Per-session figures: predictions, latency p50/p99, cache statistics."""
        lat = self.latencies_ms
        return {"predictions": len(lat), **latency_summary(lat), "cache": self.cache.stats.as_dict()}


def latency_summary(values_ms: Sequence[float]) -> dict[str, float | None]:
    if not values_ms:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": round(float(np.percentile(values_ms, 50)), 3),
            "p99_ms": round(float(np.percentile(values_ms, 99)), 3)}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise VlaforgeError(f"device {device!r} is not a torch device; use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise VlaforgeError(f"device {device!r} asked for but no CUDA device is present; use --device cpu")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise VlaforgeError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_image(img: Any, name: str) -> torch.Tensor:
    """A camera image as a uint8 (H, W, 3) tensor, or ObservationError naming `name`."""
    arr = img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
    if arr.dtype != np.uint8:
        raise ObservationError(f"{name}: dtype {arr.dtype}; send uint8 RGB images (H x W x 3, values 0-255)")
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ObservationError(f"{name}: shape {tuple(arr.shape)}; send H x W x 3 RGB images")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ObservationError(f"{name}: empty image of shape {tuple(arr.shape)}")
    arr = np.ascontiguousarray(arr)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # decoded messages are read-only views
