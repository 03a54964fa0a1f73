"""What turns raw robot observations into model inputs, shared by training data and closed-loop evaluation:
normalization from `meta/stats.json`, image conversion and augmentation (torch only, no torchvision), and the
`ObservationSpec` saved with every checkpoint so a policy is evaluated exactly as it was trained.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vlaforge.errors import VlaforgeError

SPEC_FILE = "policy.json"
STD_FLOOR = 1e-2  # features that barely vary (e.g. a gripper held closed) are not blown up
# LeRobot's normalization modes: mode -> the (low, high) statistics it divides by; MEAN_STD's are (mean, std)
MODE_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
              "QUANTILE10": ("q10", "q90")}
MODES = (*MODE_STATS, "IDENTITY")
LEROBOT_EPS = 1e-8  # LeRobot's normalizer eps


def normalize(x: torch.Tensor, stats: dict[str, torch.Tensor], mode: str, eps: float, *,
              inverse: bool = False) -> torch.Tensor:
    """LeRobot's `_apply_transform`: the statistics cast to `x`'s device and dtype, MEAN_STD (x - mean) / (std + eps)
    (inverse x * std + mean, no eps), the range modes 2 (x - low) / (high - low) - 1 with a zero range replaced by
    eps (inverse (x + 1) / 2 * range + low). Operation order kept, so results match bit for bit."""
    if mode == "IDENTITY":
        return x
    s = {k: v.to(device=x.device, dtype=x.dtype) for k, v in stats.items()}
    if mode == "MEAN_STD":
        return x * s["std"] + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + eps)
    low_name, high_name = MODE_STATS[mode]
    low, span = s[low_name], s[high_name] - s[low_name]
    span = torch.where(span == 0, torch.tensor(eps, device=x.device, dtype=x.dtype), span)
    if mode == "MIN_MAX":
        return (x + 1) / 2 * span + low if inverse else 2 * (x - low) / span - 1
    return (x + 1.0) * span / 2.0 + low if inverse else 2.0 * (x - low) / span - 1.0


def _affine(stats: dict[str, np.ndarray], mode: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(offset, scale) with normalize(x) = (x - offset) / scale for LeRobot's `mode` (its eps where it adds one)."""
    if mode == "IDENTITY":
        return np.zeros(size), np.ones(size)
    if mode == "MEAN_STD":
        return stats["mean"], stats["std"] + LEROBOT_EPS
    low, high = (stats[k] for k in MODE_STATS[mode])
    span = np.where(high - low == 0, LEROBOT_EPS, high - low)
    return low + span / 2, span / 2


@dataclass
class ObservationSpec:
    """How one policy input is built: cameras (video keys), frame history, sizes and normalization."""

    cameras: list[str]
    frames: int
    frame_stride: int
    image_size: int  # model input
    render_size: int  # as recorded (and rendered in evaluation); resized to image_size
    instruction_tokens: int
    text_tokens: int
    chunk: int
    state_mean: list[float]
    state_std: list[float]
    action_mean: list[float]
    action_std: list[float]
    # A LeRobot policy's own normalization (its normalization_mapping: {"STATE": mode, "ACTION": mode}) over the
    # dataset's statistics of every kind ({"observation.state": {"q01": [...], ...}, "action": {...}}), computed as
    # LeRobot's normalizer computes it; None: vlaforge's MEAN_STD with the std floored at STD_FLOOR.
    norm_map: dict[str, str] | None = None
    stats: dict[str, dict[str, list[float]]] | None = None

    def _lerobot(self, x, key: str, kind: str, inverse: bool = False) -> torch.Tensor:
        stats = {k: torch.tensor(v, dtype=torch.float32) for k, v in self.stats[key].items()}
        return normalize(torch.as_tensor(x, dtype=torch.float32), stats, self.norm_map.get(kind, "IDENTITY"),
                         LEROBOT_EPS, inverse=inverse)

    def normalize_state(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        if self.norm_map is not None:
            return self._lerobot(x, "observation.state", "STATE")
        return (torch.as_tensor(x, dtype=torch.float32) - torch.tensor(self.state_mean)) / torch.tensor(self.state_std)

    def normalize_action(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        if self.norm_map is not None:
            return self._lerobot(x, "action", "ACTION")
        return (torch.as_tensor(x, dtype=torch.float32) - torch.tensor(self.action_mean)) / \
            torch.tensor(self.action_std)

    def denormalize_action(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_map is not None:
            return self._lerobot(x.float(), "action", "ACTION", inverse=True)
        return x.float() * torch.tensor(self.action_std) + torch.tensor(self.action_mean)

    def affine(self) -> dict[str, list[float]]:
        """The normalization as x_norm = (x - mean) / std per feature, under the names of the MEAN_STD fields: what
        the runtime and exported packages apply on the device. Every LeRobot mode is affine: MEAN_STD divides by
        std + eps, the range modes map [low, high] onto [-1, 1] (offset low + span / 2, scale span / 2)."""
        if self.norm_map is None:
            return {k: list(getattr(self, k)) for k in ("state_mean", "state_std", "action_mean", "action_std")}
        out = {}
        for key, name, kind in (("observation.state", "state", "STATE"), ("action", "action", "ACTION")):
            stats = {k: np.asarray(v, np.float64) for k, v in self.stats[key].items()}
            offset, scale = _affine(stats, self.norm_map.get(kind, "IDENTITY"), len(getattr(self, f"{name}_mean")))
            out[f"{name}_mean"], out[f"{name}_std"] = offset.tolist(), scale.tolist()
        return out

    def history(self, t: int) -> list[int]:
        """Frame indices of the F-frame history ending at t (oldest first), clamped at the episode start."""
        return [max(0, t - k * self.frame_stride) for k in range(self.frames - 1, -1, -1)]

    def save(self, folder: Path) -> None:
        (folder / SPEC_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, folder: Path) -> "ObservationSpec":
        path = folder / SPEC_FILE
        if not path.is_file():
            raise VlaforgeError(f"{folder} has no {SPEC_FILE}; it was not trained on robot data "
                                "(data.source = 'lerobot'), so it cannot be evaluated in the simulator")
        try:
            spec = cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:  # not JSON, not an object, missing or unknown fields
            raise VlaforgeError(f"{path} is not a vlaforge observation spec ({str(exc)[:120]}); use the "
                                f"{SPEC_FILE} that training wrote") from None
        return spec


def normalization_from_stats(stats: dict) -> dict[str, list[float]]:
    """Mean/std of state and action from a LeRobot `meta/stats.json`."""
    out = {}
    for key, name in (("observation.state", "state"), ("action", "action")):
        if key not in stats:
            raise VlaforgeError(f"meta/stats.json has no {key!r} statistics; regenerate the dataset")
        out[f"{name}_mean"] = [float(v) for v in stats[key]["mean"]]
        out[f"{name}_std"] = [max(float(v), STD_FLOOR) for v in stats[key]["std"]]
    return out


def to_model_images(frames: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, S, S) in [-1, 1] (SigLIP's convention), resized if needed."""
    x = frames.permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
    if x.shape[-1] != image_size or x.shape[-2] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=True)
    return x


def augment(images: torch.Tensor, g: torch.Generator, shift: int, color: float) -> torch.Tensor:
    """Random shift (replicate-pad by `shift` px and crop back, DrQ-style) and colour jitter (brightness,
    contrast, saturation each by up to +-`color`), one draw per camera view, applied to all its frames.

    images: (V, F, 3, S, S) in [-1, 1] - V views, F frames each.
    """
    v, f, c, s, _ = images.shape
    out = images
    if shift > 0:
        padded = F.pad(images.reshape(v, f * c, s, s), (shift,) * 4, mode="replicate")
        dx, dy = torch.randint(0, 2 * shift + 1, (2, v), generator=g).tolist()
        out = torch.stack([padded[i, :, dy[i]:dy[i] + s, dx[i]:dx[i] + s] for i in range(v)]).reshape(v, f, c, s, s)
    if color > 0:
        b, k, sat = ((torch.rand(3, v, generator=g) * 2 - 1) * color + 1).unbind(0)
        x = (out + 1) / 2  # [0, 1]
        x = x * b.view(v, 1, 1, 1, 1)
        mean = x.mean(dim=(2, 3, 4), keepdim=True)
        x = (x - mean) * k.view(v, 1, 1, 1, 1) + mean
        gray = (0.299 * x[:, :, 0:1] + 0.587 * x[:, :, 1:2] + 0.114 * x[:, :, 2:3])
        x = (x - gray) * sat.view(v, 1, 1, 1, 1) + gray
        out = x.clamp(0, 1) * 2 - 1
    return out
