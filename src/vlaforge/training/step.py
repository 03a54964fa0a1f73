"""One optimizer step. The numerics guards (`StepGuards`: loss scaler, monitor) are apart from how the step runs,
an `Executor` chosen once per run: in this process or through a pipeline schedule (`LocalExecutor`), or through a
DeepSpeed engine (`DeepSpeedExecutor`). In this process: forward/backward over the micro-batches (loss-scaled when
fp16 computes), unscaling, per-component gradient norms, numerics checks, clipping, optimizer and schedule. Returns a
metrics dict of tensors; no device value is read on the host between the trainer's logging steps (see
`StepGuards`, `optimizer_step`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.data.batch import Batch
from vlaforge.errors import VlaforgeError
from vlaforge.models.losses import valid_counts
from vlaforge.training.loss_scale import LossScaler
from vlaforge.training.metrics import add_mean
from vlaforge.training.numerics import NumericsMonitor, grad_counts, nonfinite_error
from vlaforge.training.optim import StepSchedule

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from vlaforge.distributed.parallelize import GradReducer
    from vlaforge.distributed.pipeline import Pipeline
    from vlaforge.techniques.step_in_backward import InBackwardOptimizer


def local_grads(optimizer: torch.optim.Optimizer, reducer=None) -> list[torch.Tensor]:
    """Every gradient the optimizer will use, as this rank's local tensors (the shard of a DTensor gradient)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return [reducer.local(g) for g in grads] if reducer is not None else grads


def grad_norms(optimizer: torch.optim.Optimizer, reducer=None,
               taken: dict[nn.Parameter, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """L2 norm of the gradients of each component (from the optimizer's per-component groups; learned loss
    weights excluded), and of all of them ('total'). One fused norm kernel for all gradients; with sharded
    gradients, one all-reduce of the per-component sums of squares. Which gradient belongs to which component is
    known on the host: no device value is read (with ranks, which components any rank holds is asked once per
    layout, `_present_anywhere`). `taken`: each gradient's norm where the step inside backward took it (the
    gradients are gone), combined in the same order."""
    owners, grads, tp, norms = [], [], [], []
    for group in optimizer.param_groups:
        if group["component"] in COMPONENTS:
            for p in group["params"]:
                if reducer is not None and id(p) in reducer.norm_skip:
                    continue
                if taken is not None and p in taken:
                    norms.append(taken[p])
                elif taken is not None or p.grad is None:
                    continue
                else:
                    grads.append(reducer.local(p.grad) if reducer is not None else p.grad)
                owners.append(group["component"])
                tp.append(reducer is not None and reducer.tp_sharded(p.grad if taken is None else p))
    if grads:
        norms = torch._foreach_norm(grads)
    device = optimizer.param_groups[0]["params"][0].device
    squares = torch.stack(norms).square().float() if norms else torch.zeros(0, device=device)
    # row 0: weights replicated over tensor parallel, row 1: TP-sharded ones (summed over the TP group too)
    c = len(COMPONENTS)
    slots = tuple(2 * COMPONENTS.index(o) + t for o, t in zip(owners, tp))
    per = torch.zeros(2 * c, device=squares.device).index_add_(0, _index(slots, squares.device), squares).view(-1, 2)
    present = [o in owners for o in COMPONENTS]
    if reducer is not None:
        per = reducer.combine(per[:, 0].contiguous(), per[:, 1].contiguous())
        present = _present_anywhere(reducer, optimizer, present, squares.device)
    else:
        per = per.sum(1)
    norms = {comp: per[i].sqrt() for i, comp in enumerate(COMPONENTS) if present[i]}
    norms["total"] = per.sum().sqrt()
    return norms


_INDEX: dict[tuple, torch.Tensor] = {}  # (device, slots) -> the index tensor: built once per layout of gradients
_PRESENT: dict[tuple, tuple] = {}  # (reducer id, what trains) -> (the reducer, components any rank has gradients of)


def _index(slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The per-gradient slot index on `device`, made once (a host list copied to the device every step would wait
    for the device's queue)."""
    key = (device, slots)
    if key not in _INDEX:
        _INDEX[key] = torch.tensor(slots, dtype=torch.long, device=device)
    return _INDEX[key]


def _present_anywhere(reducer, optimizer: torch.optim.Optimizer, mine: list[bool], device: torch.device
                      ) -> list[bool]:
    """The components whose gradients any rank holds (a pipeline stage holds some): one all-reduce and read the
    first step, and again only when what trains changes (the same step on every rank: the config's schedule)."""
    trains = tuple(any(p.requires_grad for p in g["params"]) for g in optimizer.param_groups)
    key = (id(reducer), trains)
    if key not in _PRESENT:  # (the reducer is kept, so that its id is not reused)
        counts = reducer.sum_over_ranks(torch.tensor(mine, dtype=torch.float32, device=device))
        _PRESENT[key] = (reducer, (counts > 0).tolist())
    return _PRESENT[key][1]


STOPS = ("no loss scaling", "at the minimum loss scale")  # why a step's non-finite gradients stop the run


@dataclass
class StepGuards:
    """Per-step numerics: the loss scaler, the monitor, and whether the monitor measures this step.

    A step that must stop the run (non-finite gradients without loss scaling, or an overflow at the minimum loss
    scale) is skipped on the device and recorded there (`note_stop`); `raise_pending` reads the record and raises.
    Directly after the step by default; with `defer` (the trainer) at its next logging or checkpoint step, so that
    no step between them waits for the device."""

    scaler: LossScaler = field(default_factory=lambda: LossScaler(enabled=False))
    monitor: NumericsMonitor | None = None
    step: int = 0
    reducer: "GradReducer | None" = None  # when gradients are sharded / replicated over ranks
    sync_every: int = 0  # train.sync_every: reduce gradients every k-th micro-step too (0: the last only)
    defer: bool = False
    _stop: torch.Tensor | None = None  # (first stopping step or -1, why: index into STOPS, one flag per component)

    @property
    def measure(self) -> bool:
        return self.monitor is not None and self.monitor.due(self.step)

    @property
    def check_finite(self) -> bool:
        return self.monitor is not None and self.monitor.cfg.check_finite

    def note_stop(self, stop: torch.Tensor, why: int, norms: dict[str, torch.Tensor]) -> None:
        """Record, on the device, the first step whose 0-d bool `stop` is true, with the components whose
        gradient norm is non-finite."""
        d = stop.device
        bad = [~torch.isfinite(norms[c]) if c in norms else torch.zeros((), dtype=torch.bool, device=d)
               for c in COMPONENTS]
        # NOTE: torch.full, not torch.tensor: a host value copied to the device waits for the device's queue
        row = torch.stack([torch.full((), self.step, device=d), torch.full((), why, device=d),
                           *[b.long() for b in bad]])
        if self._stop is None:
            self._stop = torch.full_like(row, -1)
        self._stop = torch.where(stop & (self._stop[0] < 0), row, self._stop)

    def raise_pending(self, model: nn.Module) -> None:
        """Raise `NonFiniteGradientError` for the first recorded stop, if any (one host read)."""
        if self._stop is None:
            return
        step, why, *bad = self._stop.tolist()
        if step < 0:
            return
        self._stop = None
        later = f"; read at step {self.step}, the steps between were taken" if step != self.step else ""
        precisions = self.monitor.precisions if self.monitor else {}
        raise nonfinite_error(model, precisions, step, f"({STOPS[why]}{later})",
                              [c for c, b in zip(COMPONENTS, bad) if b])


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
class InBackwardExecutor:
    """train.step_in_backward: each parameter steps inside the last micro-batch's backward (`in_backward_step`)."""

    def step(self, model, micro_batches, optimizer, scheduler, weighting, grad_clip, guards):
        return in_backward_step(model, micro_batches, optimizer, scheduler, weighting, guards)


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


def begin_step(model: nn.Module) -> None:
    """Once per optimizer step, before its micro-batches: a model whose step draws its randomness once, for every
    micro-batch (a LeRobot policy's `begin_step`), draws it here."""
    begin = getattr(model, "begin_step", None)
    if begin is not None:
        begin()


def local_step(model: nn.Module, micro_batches: list[Batch], optimizer: torch.optim.Optimizer, scheduler, weighting,
               grad_clip: float, guards: StepGuards, pipeline: "Pipeline | None" = None) -> dict[str, torch.Tensor]:
    """Accumulate gradients over `micro_batches` (loss averaged over them), unscale, clip, step. No device value is
    read on the host (unless `guards` measures numerics or checks right away, see `StepGuards`).

    With loss scaling, a step whose gradients overflow is skipped (no optimizer or schedule update). Without it,
    `guards.check_finite` skips a step with a non-finite gradient and stops the run, naming the parameters.
    """
    scaler, reducer = guards.scaler, guards.reducer
    optimizer.zero_grad(set_to_none=True)
    begin_step(model)
    denominators = loss_denominators(model, micro_batches, reducer)
    if pipeline is not None:  # the schedule runs every micro-batch and syncs gradients after the last
        sums = pipeline.run(micro_batches, weighting, scaler, denominators)
    else:
        sums = forward_backward(model, micro_batches, weighting, scaler, denominators, guards.sync_every)
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
    skip = found_inf
    if found_inf is None and guards.check_finite:
        skip = (~torch.isfinite(norms["total"])).float()
        guards.note_stop(skip > 0, 0, norms)
    stuck = scaler.update(found_inf)
    if stuck is not None:
        guards.note_stop(stuck, 1, norms)
    if grad_clip > 0 and grads:  # as torch.nn.utils.clip_grads_with_norm_, on local tensors (DTensor shards too)
        coef = (grad_clip / (norms["total"] + 1e-6)).clamp(max=1.0)
        if skip is not None:  # a skipped step's gradients stay as they were (the stop names their inf / nan)
            coef = torch.where(skip > 0, 1.0, coef)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    optimizer_step(optimizer, scheduler, skip)
    if not guards.defer:
        guards.raise_pending(model)
    weighting.end_step(reducer)
    sums.update({f"grad_norm/{k}": v for k, v in norms.items()})
    if scaler.enabled:
        sums["precision/loss_scale"] = scaler.scale_tensor(norms["total"].device)
        sums["precision/skipped_steps"] = scaler.skipped_tensor(norms["total"].device)
    return sums


def forward_backward(model: nn.Module, micro_batches: list[Batch], weighting, scaler: LossScaler,
                     denominators: dict[str, torch.Tensor], sync_every: int, arm=None) -> dict[str, torch.Tensor]:
    """Forward and backward of every micro-batch in this process; returns their metrics' mean. `arm(last)`: told
    before each backward whether it is the step's last (the step inside backward steps in that one)."""
    sums: dict[str, torch.Tensor] = {}
    n = len(micro_batches)
    for i, batch in enumerate(micro_batches):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce on the last micro-step (or every k-th)
            model.set_requires_gradient_sync(i == n - 1 or (sync_every > 0 and (i + 1) % sync_every == 0))
        if arm is not None:
            arm(i == n - 1)
        loss, metrics = model.compute_loss(batch, weighting, denominators)
        scaler.scale_loss(loss / n).backward()
        add_mean(sums, metrics, n)
    return sums


def in_backward_step(model: nn.Module, micro_batches: list[Batch], optimizer: "InBackwardOptimizer", scheduler,
                     weighting, guards: StepGuards) -> dict[str, torch.Tensor]:
    """One optimizer step whose parameters step inside the last micro-batch's backward, each as its gradient is
    complete (techniques/step_in_backward.py); the rest - learned loss weights, after their average over ranks -
    after it. The gradient norms and the numerics monitor's statistics are the plain step's, taken in the hooks; a
    non-finite gradient's parameter does not step, the schedule does not advance, and the run stops as the plain
    step's does. No clipping and no loss scaling (refused in the config)."""
    reducer = guards.reducer
    if guards.scaler.enabled:
        raise VlaforgeError("train.step_in_backward cannot undo a step skipped by fp16 loss scaling; use bf16 or "
                            "loss_scale.mode = 'off'")
    optimizer.zero_grad(set_to_none=True)
    counted: dict[nn.Parameter, torch.Tensor] = {}
    observe = (lambda comp, p, g: counted.__setitem__(p, grad_counts(g))) if guards.measure else None
    optimizer.begin(guards.check_finite, observe)
    begin_step(model)
    denominators = loss_denominators(model, micro_batches, reducer)
    sums = forward_backward(model, micro_batches, weighting, guards.scaler, denominators, guards.sync_every,
                            optimizer.arm)
    if reducer is not None:  # learned loss weights live outside the sharded model: averaged before they step
        reducer.mean_grads([p for g in optimizer.param_groups if g["component"] not in COMPONENTS
                            for p in g["params"]])
    norms = grad_norms(optimizer, reducer, optimizer.finish())
    if guards.measure:
        sums.update(guards.monitor.measure(model, 1.0, guards.step, reducer, counted))
    skip = None
    if guards.check_finite:
        skip = (~torch.isfinite(norms["total"])).float()
        guards.note_stop(skip > 0, 0, norms)
    if isinstance(scheduler, StepSchedule):
        scheduler.step(skip)
    elif skip is None or not bool(skip):  # (a host read: torch's LambdaLR cannot skip on the device)
        scheduler.step()
    if not guards.defer:
        guards.raise_pending(model)
    weighting.end_step(reducer)
    sums.update({f"grad_norm/{k}": v for k, v in norms.items()})
    return sums


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler, skip: torch.Tensor | None) -> None:
    """The optimizer and schedule step, skipped where `skip` (0-d, 1.0 or 0.0, on the device) is set: on the device
    for fused AdamW (its `found_inf`, as torch.amp.GradScaler hands it; `StepSchedule` does not advance), else
    decided on the host (one read: a foreach optimizer, or torchao's 8-bit / stochastically rounding ones behind
    `ComponentOptimizer`, cannot take it); a skipped step then steps nothing, so weights and every moment - 8-bit
    codes and scales too - and step counter stay as they were."""
    if skip is None:
        optimizer.step()
        scheduler.step()
    elif optimizer.defaults.get("fused") and isinstance(scheduler, StepSchedule):
        optimizer.found_inf = skip
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        scheduler.step(skip)
    elif not bool(skip):
        optimizer.step()
        scheduler.step()


def deepspeed_step(engine, micro_batches: list[Batch], weighting, reducer) -> dict[str, torch.Tensor]:
    """One optimizer step through a DeepSpeed engine: the same globally normalized losses as `train_step`;
    `engine.backward` divides by the accumulation steps, and the last `engine.step()` reduces the gradients over
    ranks, clips by `train.grad_clip`, steps the optimizer and the schedule. Per-component gradient norms and the
    numerics monitor need the gradients, which ZeRO keeps in its partitions: only the total norm is reported."""
    model = engine.module
    n = len(micro_batches)
    begin_step(model)
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
