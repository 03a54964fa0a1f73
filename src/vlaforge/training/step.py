"""One optimizer step: forward/backward over the micro-batches, per-component gradient norms, clipping,
optimizer and schedule. Returns a metrics dict of tensors (no host sync here)."""

from __future__ import annotations

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.data.batch import Batch


def grad_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    """L2 norm of the gradients of each component, and of all of them ('total')."""
    norms = {}
    for name in COMPONENTS:
        grads = [p.grad for p in getattr(model, name).parameters() if p.grad is not None]
        if grads:
            norms[name] = torch.nn.utils.get_total_norm(grads)
    norms["total"] = torch.linalg.vector_norm(torch.stack(list(norms.values()))) if norms else torch.zeros(())
    return norms


def train_step(model: nn.Module, micro_batches: list[Batch], optimizer: torch.optim.Optimizer,
               scheduler, weighting, grad_clip: float) -> dict[str, torch.Tensor]:
    """Accumulate gradients over `micro_batches` (loss averaged over them), clip, step."""
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, torch.Tensor] = {}
    n = len(micro_batches)
    for batch in micro_batches:
        loss, metrics = model.compute_loss(batch, weighting)
        (loss / n).backward()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0) + v.float() / n
    norms = grad_norms(model)
    if grad_clip > 0:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norms["total"])
    optimizer.step()
    scheduler.step()
    weighting.end_step()
    sums.update({f"grad_norm/{k}": v for k, v in norms.items()})
    return sums
