"""Loss terms of VLA training: action regression (+ smoothness), vision-text contrastive, language CE.

Every function takes masks explicitly and returns a scalar fp32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

TERMS = ("contrastive", "language", "action", "env_state")


@dataclass(frozen=True)
class Objective:
    """What the model's forward computes: which terms, and how the action term is measured.

    Args:
        weights: static weight per term; a term with weight 0 is not computed.
        action: "l1", "mse" or "huber".
        huber_delta: Huber transition point (in normalized action units).
        smoothness: weight of the squared difference between consecutive actions of a chunk.
    """

    weights: dict[str, float]
    action: str = "huber"
    huber_delta: float = 1.0
    smoothness: float = 0.0

    def active(self, term: str) -> bool:
        return self.weights.get(term, 0.0) > 0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is true; `mask` broadcasts over trailing dims.

    `denominator` replaces the local count of valid positions: the trainer passes the count over all micro-batches
    and ranks of the step (divided by their number), so that averaging the micro-batch losses gives the mean over
    every valid position of the global batch."""
    while mask.dim() < values.dim():
        mask = mask.unsqueeze(-1)
    mask = mask.to(values.dtype).expand_as(values)
    return (values * mask).sum() / (mask.sum().clamp_min(1.0) if denominator is None else denominator)


def valid_counts(batch, with_text: bool) -> dict[str, torch.Tensor]:
    """Positions each masked-mean loss term averages over in `batch` (float counts, as masked_mean counts them)."""
    mask = batch.action_mask.float()
    per_step = batch.actions.shape[-1]  # the mask covers every action dimension of a valid step
    counts = {"action": mask.sum() * per_step, "smoothness": (mask[:, 1:] * mask[:, :-1]).sum() * per_step}
    if with_text and batch.text_mask is not None:
        counts["language"] = batch.text_mask.float().sum()
    return counts


def masked_mean_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x (B, L, D) over valid positions of mask (B, L) -> (B, D)."""
    m = mask.to(x.dtype).unsqueeze(-1)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


def action_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                kind: str = "huber", delta: float = 1.0, denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Element-wise L1 / MSE / Huber between (B, T, A) tensors, averaged over valid chunk steps (mask (B, T))."""
    pred, target = pred.float(), target.float()
    if kind == "l1":
        err = (pred - target).abs()
    elif kind == "mse":
        err = (pred - target).square()
    elif kind == "huber":
        err = F.huber_loss(pred, target, reduction="none", delta=delta)
    else:
        raise ValueError(f"unknown action loss {kind!r}; choose l1, mse or huber")
    return masked_mean(err, mask, denominator)


def env_state_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error between the probe's (B, E) estimate and the normalized environment state (B, E)."""
    return F.mse_loss(pred.float(), target.float())


def smoothness_loss(actions: torch.Tensor, mask: torch.Tensor,
                    denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared difference of consecutive actions (B, T, A) where both steps are valid."""
    diff = (actions[:, 1:] - actions[:, :-1]).float().square()
    return masked_mean(diff, mask[:, 1:] & mask[:, :-1], denominator)


def contrastive_loss(vision: torch.Tensor, text: torch.Tensor, text_ids: torch.Tensor,
                     text_mask: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE between pooled vision (B, D) and pooled instruction (B, D) embeddings.

    Samples with identical instructions are all positives of each other (robot datasets repeat a task's
    instruction across episodes); the target distribution is uniform over them.
    """
    v = F.normalize(vision.float(), dim=-1)
    t = F.normalize(text.float(), dim=-1)
    logits = logit_scale.float().exp().clamp(max=100.0) * v @ t.T  # (B, B)
    ids = text_ids.masked_fill(~text_mask, -1)
    same = (ids[:, None, :] == ids[None, :, :]).all(-1).float()  # (B, B) identical instructions
    targets = same / same.sum(-1, keepdim=True)
    return 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets.T))


def language_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                  denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy; logits (B, L, V) already aligned with targets (B, L), mask (B, L)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return masked_mean(ce.view_as(targets), mask, denominator)


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                    temperature: float, denominator: torch.Tensor | None = None) -> torch.Tensor:
    """KL(teacher || student) of logits (B, L, V) both divided by `temperature`, times temperature^2 (so its
    gradients keep their scale as T changes; Hinton et al. 2015), averaged over valid positions of mask (B, L)."""
    log_s = (student_logits.float() / temperature).log_softmax(-1)
    log_t = (teacher_logits.float() / temperature).log_softmax(-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1) * temperature ** 2  # (B, L)
    return masked_mean(kl, mask, denominator)
