"""One optimizer step. The numerics guards (`StepGuards`: loss scaler, monitor) are apart from how the step runs,
an `Executor` chosen once per run: in this process or through a pipeline schedule (`LocalExecutor`), or through a
DeepSpeed engine (`DeepSpeedExecutor`). In this process: forward/backward over the micro-batches (loss-scaled when
fp16 computes), unscaling, per-component gradient norms, numerics checks, clipping, optimizer and schedule. Returns a
metrics dict of tensors; host syncs happen only for loss scaling (skip or not) and the non-finite check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.data.batch import Batch
from vlaforge.training.numerics import NumericsMonitor, nonfinite_error
from vlaforge.training.loss_scale import LossScaler
from vlaforge.models.losses import valid_counts
from vlaforge.training.metrics import add_mean

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from vlaforge.distributed.parallelize import GradReducer
    from vlaforge.distributed.pipeline import Pipeline


def local_grads(optimizer: torch.optim.Optimizer, reducer=None) -> list[torch.Tensor]:
    """Every gradient the optimizer will use, as this rank's local tensors (the shard of a DTensor gradient)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return [reducer.local(g) for g in grads] if reducer is not None else grads


def grad_norms(optimizer: torch.optim.Optimizer, reducer=None) -> dict[str, torch.Tensor]:
    """L2 norm of the gradients of each component (from the optimizer's per-component groups; learned loss
    weights excluded), and of all of them ('total'). One fused norm kernel for all gradients; with sharded
    gradients, one all-reduce of the per-component sums of squares and gradient counts."""
    owners, grads, tp = [], [], []
    for group in optimizer.param_groups:
        if group["component"] in COMPONENTS:
            for p in group["params"]:
                if p.grad is not None and (reducer is None or id(p) not in reducer.norm_skip):
                    owners.append(group["component"])
                    grads.append(reducer.local(p.grad) if reducer is not None else p.grad)
                    tp.append(reducer is not None and reducer.tp_sharded(p.grad))
    device = optimizer.param_groups[0]["params"][0].device
    squares = torch.stack(torch._foreach_norm(grads)).square().float() if grads else torch.zeros(0, device=device)
    # row 0: weights replicated over tensor parallel, row 1: TP-sharded ones (summed over the TP group too); then
    # the number of gradients per component, so every rank reports the components any rank (pipeline stage) holds
    c = len(COMPONENTS)
    index = torch.tensor([2 * COMPONENTS.index(o) + t for o, t in zip(owners, tp)], device=squares.device)
    per = torch.zeros(2 * c, device=squares.device).index_add_(0, index, squares).view(-1, 2)
    counts = torch.tensor([float(owners.count(o)) for o in COMPONENTS], device=squares.device)
    if reducer is not None:
        both = reducer.combine(torch.cat([per[:, 0], counts]), torch.cat([per[:, 1], torch.zeros_like(counts)]))
        per, counts = both[:c], both[c:]
    else:
        per = per.sum(1)
    present = (counts > 0).tolist()  # one host sync
    norms = {comp: per[i].sqrt() for i, comp in enumerate(COMPONENTS) if present[i]}
    norms["total"] = per.sum().sqrt()
    return norms


@dataclass
class StepGuards:
    """Per-step numerics: the loss scaler, the monitor, and whether the monitor measures this step."""

    scaler: LossScaler = field(default_factory=lambda: LossScaler(enabled=False))
    monitor: NumericsMonitor | None = None
    step: int = 0
    reducer: "GradReducer | None" = None  # when gradients are sharded / replicated over ranks
    sync_every: int = 0  # train.sync_every: reduce gradients every k-th micro-step too (0: the last only)

    @property
    def measure(self) -> bool:
        return self.monitor is not None and self.monitor.due(self.step)

    @property
    def check_finite(self) -> bool:
        return self.monitor is not None and self.monitor.cfg.check_finite


def loss_denominators(model: nn.Module, micro_batches: list[Batch], reducer=None) -> dict[str, torch.Tensor]:
    """Per masked-mean loss term, its valid positions over every micro-batch and data-parallel rank of the step,
    divided by (micro-batches x ranks): each micro-batch's loss is then a share of the global-batch mean, and the
    average the step takes over micro-batches (and FSDP/DDP over ranks) is exactly that mean."""
    totals: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        for term, count in valid_counts(batch, model.uses_text(batch)).items():
            totals[term] = totals[term] + count if term in totals else count
    keys = list(totals)
    stacked = torch.stack([totals[k] for k in keys])
    ranks = 1
    if reducer is not None:
        stacked = reducer.sum_over_ranks(stacked)
        ranks = reducer.world_size()
    stacked = stacked.clamp_min(1.0) / (len(micro_batches) * ranks)
    return dict(zip(keys, stacked.unbind()))


class Executor(Protocol):
    """How one optimizer step runs: chosen once, in `trainer.build_run`, from the layout."""

    def step(self, model: nn.Module, micro_batches: list[Batch], optimizer: torch.optim.Optimizer, scheduler,
             weighting, grad_clip: float, guards: StepGuards) -> dict[str, torch.Tensor]: ...


@dataclass
class LocalExecutor:
    """Forward and backward in this process - or through a pipeline schedule - then vlaforge's own unscaling,
    per-component norms, numerics, clipping, optimizer and schedule step (`local_step`)."""

    pipeline: "Pipeline | None" = None  # pipeline parallel: the schedule runs forward and backward

    def step(self, model, micro_batches, optimizer, scheduler, weighting, grad_clip, guards):
        return local_step(model, micro_batches, optimizer, scheduler, weighting, grad_clip, guards, self.pipeline)


@dataclass
class DeepSpeedExecutor:
    """parallel.backend = "deepspeed": the engine reduces, clips and steps (`deepspeed_step`)."""

    engine: "DeepSpeedEngine"

    def step(self, model, micro_batches, optimizer, scheduler, weighting, grad_clip, guards):
        return deepspeed_step(self.engine, micro_batches, weighting, guards.reducer)


def train_step(model: nn.Module, micro_batches: list[Batch], optimizer: torch.optim.Optimizer,
               scheduler, weighting, grad_clip: float, guards: StepGuards | None = None,
               executor: Executor | None = None) -> dict[str, torch.Tensor]:
    """One optimizer step over `micro_batches` by `executor` (in this process by default)."""
    return (executor or LocalExecutor()).step(model, micro_batches, optimizer, scheduler, weighting, grad_clip,
                                              guards or StepGuards())


def local_step(model: nn.Module, micro_batches: list[Batch], optimizer: torch.optim.Optimizer, scheduler, weighting,
               grad_clip: float, guards: StepGuards, pipeline: "Pipeline | None" = None) -> dict[str, torch.Tensor]:
    """Accumulate gradients over `micro_batches` (loss averaged over them), unscale, clip, step.

    With loss scaling, a step whose gradients overflow is skipped (no optimizer or schedule update). Without it,
    `guards.check_finite` stops at a non-finite gradient before the optimizer step, naming the parameters.
    """
    scaler, reducer = guards.scaler, guards.reducer
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, torch.Tensor] = {}
    n = len(micro_batches)
    denominators = loss_denominators(model, micro_batches, reducer)
    if pipeline is not None:  # the schedule runs every micro-batch and syncs gradients after the last
        sums = pipeline.run(micro_batches, weighting, scaler, denominators)
    else:
        for i, batch in enumerate(micro_batches):
            if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce on the last micro-step (or every k-th)
                every = guards.sync_every
                model.set_requires_gradient_sync(i == n - 1 or (every > 0 and (i + 1) % every == 0))
            loss, metrics = model.compute_loss(batch, weighting, denominators)
            scaler.scale_loss(loss / n).backward()
            add_mean(sums, metrics, n)
    if reducer is not None:
        reducer.sum_tp_partial()  # replicated weights that see a TP shard of the activations (q/k norms)
        reducer.sum_pp_tied()  # the embeddings the first and last pipeline stage share
        # learned loss weights live outside the sharded model: average their gradients here
        reducer.mean_grads([p for g in optimizer.param_groups if g["component"] not in COMPONENTS
                            for p in g["params"]])
    grads = local_grads(optimizer, reducer)
    found_inf = scaler.unscale_(grads)
    if found_inf is not None and reducer is not None:
        found_inf = reducer.any_rank(found_inf)  # every rank skips, or none
    norms = grad_norms(optimizer, reducer)
    if guards.measure:
        sums.update(guards.monitor.measure(model, scaler.scale, guards.step, reducer))
    skipped = found_inf is not None and bool(found_inf)  # host sync, only with loss scaling
    if found_inf is None and guards.check_finite and not bool(torch.isfinite(norms["total"])):
        raise nonfinite_error(model, guards.monitor.precisions, guards.step, "(no loss scaling)")
    scaler.update(skipped)
    if skipped and scaler.at_floor() and scaler.hysteresis_left <= 0:
        precisions = guards.monitor.precisions if guards.monitor else {}
        raise nonfinite_error(model, precisions, guards.step, f"at the minimum loss scale {scaler.min_scale:g}")
    if not skipped:
        if grad_clip > 0:  # as torch.nn.utils.clip_grads_with_norm_, on local tensors (DTensor shards included)
            coef = (grad_clip / (norms["total"] + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        optimizer.step()
        scheduler.step()
    weighting.end_step(reducer)
    sums.update({f"grad_norm/{k}": v for k, v in norms.items()})
    if scaler.enabled:
        sums["precision/loss_scale"] = torch.tensor(scaler.scale)
        sums["precision/skipped_steps"] = torch.tensor(float(scaler.skipped_steps))
    return sums


def deepspeed_step(engine, micro_batches: list[Batch], weighting, reducer) -> dict[str, torch.Tensor]:
    """One optimizer step through a DeepSpeed engine: the same globally normalized losses as `train_step`;
    `engine.backward` divides by the accumulation steps, and the last `engine.step()` reduces the gradients over
    ranks, clips by `train.grad_clip`, steps the optimizer and the schedule. Per-component gradient norms and the
    numerics monitor need the gradients, which ZeRO keeps in its partitions: only the total norm is reported."""
    model = engine.module
    n = len(micro_batches)
    denominators = loss_denominators(model, micro_batches, reducer)
    sums: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        loss, metrics = model.weigh(engine(batch, denominators=denominators), weighting)
        engine.backward(loss)
        engine.step()
        add_mean(sums, metrics, n)
    weighting.end_step(reducer)
    norm = engine.get_global_grad_norm()
    if norm is not None:
        sums["grad_norm/total"] = torch.as_tensor(float(norm))
    return sums
