"""One optimizer step: forward/backward over the micro-batches, per-component gradient norms, clipping,
optimizer and schedule. Returns a metrics dict of tensors (no host sync here)."""

from __future__ import annotations

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.data.batch import Batch


def grad_norms(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """L2 norm of the gradients of each component (from the optimizer's per-component groups; learned loss
    weights excluded), and of all of them ('total'). One fused norm kernel for all gradients."""
    owners, grads = [], []
    for group in optimizer.param_groups:
        if group["component"] in COMPONENTS:
            for p in group["params"]:
                if p.grad is not None:
                    owners.append(group["component"])
                    grads.append(p.grad)
    if not grads:
        return {"total": torch.zeros(())}
    squares = torch.stack(torch._foreach_norm(grads)).square()  # (N,)
    index = torch.tensor([COMPONENTS.index(o) for o in owners], device=squares.device)
    per = torch.zeros(len(COMPONENTS), device=squares.device).index_add_(0, index, squares.float())
    norms = {c: per[i].sqrt() for i, c in enumerate(COMPONENTS) if c in owners}
    norms["total"] = per.sum().sqrt()
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
            sums[k] = sums[k] + v / n if k in sums else v / n
    norms = grad_norms(optimizer)
    if grad_clip > 0:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norms["total"], foreach=True)
    optimizer.step()
    scheduler.step()
    weighting.end_step()
    sums.update({f"grad_norm/{k}": v for k, v in norms.items()})
    return sums
