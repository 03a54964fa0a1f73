"""`train.step_in_backward`: the optimizer step inside backward. Each parameter steps, and frees its gradient, as soon
as its gradient is complete (`Tensor.register_post_accumulate_grad_hook`), so the whole model's gradient never exists
at once: with one micro-batch per step, the step holds the gradients of the parameters backward is at, not every
gradient under the optimizer step.

How it stays exact (docs/precision.md, "The optimizer step inside backward"):
- one optimizer per parameter, of the class and with the hyperparameters of its parameter group (`per_parameter`,
  the one place that builds them: a different optimizer class plugs in there), reading the group's learning-rate
  tensor, which `StepSchedule` drives; every per-parameter optimizer keeps its state in this optimizer's `state`, so
  `state_dict` / `load_state_dict` (and the checkpoints that call them) see the layout of the one grouped optimizer
  it replaces: a checkpoint resumes with or without the technique. AdamW's update of one tensor does not depend on
  the others: fused AdamW over one tensor equals fused AdamW over its group, bit for bit;
- the hooks step on the last micro-batch of a step only (`arm`): earlier micro-batches accumulate as always;
- each gradient's L2 norm is taken in the hook before the gradient is freed (`torch._foreach_norm`, the kernel the
  plain step's norms use), so the per-component gradient norms are the plain step's;
- a parameter whose gradient is non-finite does not step (`check_finite`: fused AdamW's `found_inf`, on the device);
  the others have stepped already - what can not be had is the plain step's all-or-nothing skip, so global-norm
  clipping and loss scaling (both decided on every gradient at once) are refused in the config.

Parameters of groups outside the four components (learned loss weights, distillation projections: averaged over
ranks after backward) and any gradient the hooks did not consume step in `finish`, after backward.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.techniques.host_optimizer import host_params, restore_host_state

MakeOptimizer = Callable[[torch.optim.Optimizer, dict, nn.Parameter], torch.optim.Optimizer]


def per_parameter(grouped: torch.optim.Optimizer, group: dict, param: nn.Parameter) -> torch.optim.Optimizer:
    """The optimizer of one parameter: `grouped`'s class, with its constructor settings (fused, foreach, ...) and
    `group`'s hyperparameters. The one place per-parameter optimizers are built."""
    source = grouped
    if hasattr(grouped, "parts"):  # a ComponentOptimizer (techniques/optimizer_state.py): the part stepping `group`
        index = next(i for i, g in enumerate(grouped.param_groups) if g["name"] == group["name"])
        source = grouped.parts[grouped.owner[index]]
    accepted = inspect.signature(type(source).__init__).parameters
    settings = {k: v for k, v in source.defaults.items() if k in accepted}  # (the group's own values win)
    # torchao's settings live on the optimizer, not in its defaults (block_size, bf16_stochastic_round)
    settings |= {k: getattr(source, k) for k in accepted if k not in settings and k != "params" and hasattr(source, k)}
    return type(source)([{**{k: v for k, v in group.items() if k != "params"}, "params": [param]}], **settings)


class InBackwardOptimizer(torch.optim.Optimizer):
    """The grouped optimizer's parameter groups and state, stepped one parameter at a time during backward.

    `param_groups` are the grouped optimizer's (their names, component keys and learning-rate tensors); `state` is
    shared with every per-parameter optimizer. `arm(True)` before the last micro-batch's backward lets the hooks
    step; `finish()` after backward steps what remains and returns the step's gradient norms."""

    def __init__(self, grouped: torch.optim.Optimizer, make: MakeOptimizer = per_parameter):
        super().__init__([dict(g) for g in grouped.param_groups], grouped.defaults)
        self._grouped = grouped  # (its state stays empty: the class and settings `make` copies)
        self._make = make
        self._inner: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._index = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._hooked: set[nn.Parameter] = set()
        self.armed = False
        self.check_finite = False  # a non-finite gradient's parameter does not step
        self.observe: Callable[[str, nn.Parameter, torch.Tensor], None] | None = None  # (component, param, grad)
        self.norms: dict[nn.Parameter, torch.Tensor] = {}  # this step's gradient norms (local shards), 0-d

    def eight_bit(self, param: torch.Tensor) -> bool:
        """Whether `param`'s AdamW moments are 8-bit (the grouped optimizer's answer: techniques/optimizer_state.py)."""
        return getattr(self._grouped, "eight_bit", lambda p: False)(param)

    # ---- the hooks ---------------------------------------------------------------------------------------------

    def attach(self) -> None:
        """Hook every parameter of the four components' groups that trains now (a frozen parameter cannot take a
        hook; one unfrozen later is hooked at its first step)."""
        for group in self.param_groups:
            if group.get("component") not in COMPONENTS:
                continue
            for p in group["params"]:
                if p.requires_grad and p not in self._hooked:
                    p.register_post_accumulate_grad_hook(self._hook)
                    self._hooked.add(p)

    def arm(self, armed: bool) -> None:
        """Whether the next backward completes the step's gradients (its last micro-batch): then the hooks step."""
        self.armed = armed

    def begin(self, check_finite: bool = False, observe=None) -> None:
        """Before a step's first micro-batch: hooks attached, disarmed, this step's norms cleared."""
        self.attach()
        self.armed, self.check_finite, self.observe = False, check_finite, observe
        self.norms = {}

    def _hook(self, param: nn.Parameter) -> None:
        if self.armed and param.grad is not None:
            self._consume(param)

    @torch.no_grad()
    def _consume(self, param: nn.Parameter) -> None:
        """Norm (and statistics), step, free the gradient."""
        group = self.param_groups[self._index[param]]
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard (FSDP2)
        norm = torch._foreach_norm([local])[0]
        self.norms[param] = norm
        if self.observe is not None:
            self.observe(group["component"], param, local)
        skip = (~torch.isfinite(norm)).float() if self.check_finite else None
        self._step_one(param, group, skip)
        param.grad = None

    # ---- stepping ----------------------------------------------------------------------------------------------

    def _optimizer_of(self, param: nn.Parameter, group: dict) -> torch.optim.Optimizer:
        inner = self._inner.get(param)
        if inner is None:
            inner = self._inner[param] = self._make(self._grouped, group, param)
            inner.state = self.state  # NOTE: one state for all: state_dict() is the grouped optimizer's layout
        return inner

    def _step_one(self, param: nn.Parameter, group: dict, skip: torch.Tensor | None) -> None:
        inner = self._optimizer_of(param, group)
        own = inner.param_groups[0]
        for key, value in group.items():  # the group's lr tensor (the schedule's), and anything a load restored
            if key != "params":
                own[key] = value
        if skip is None:
            inner.step()
        elif own.get("fused"):
            inner.found_inf = skip  # skipped on the device (its step count too)
            try:
                inner.step()
            finally:
                del inner.found_inf
        elif not bool(skip):  # NOTE: a host read: an optimizer without `found_inf` cannot skip on the device
            inner.step()

    @torch.no_grad()
    def step(self, closure=None):
        """Step every parameter that holds a gradient (what `finish` and DCP's state initialisation call)."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group, None)
        return loss

    def finish(self) -> dict[nn.Parameter, torch.Tensor]:
        """After the step's backward: step (and free) every gradient the hooks did not consume, in group order;
        returns the norm of every gradient this step consumed, by parameter."""
        self.armed = False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._consume(p)
        self.observe = None
        return self.norms

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        restore_host_state(self, state_dict, host_params(self._grouped))  # (torch cast the host's fp32 state)

    def __setstate__(self, state: dict) -> None:
        # NOTE: `load_state_dict` replaces `state` and the group dicts: the per-parameter optimizers follow
        super().__setstate__(state)
        for inner in getattr(self, "_inner", {}).values():
            inner.state = self.state


def apply_step_in_backward(optimizer: torch.optim.Optimizer, make: MakeOptimizer = per_parameter
                           ) -> InBackwardOptimizer:
    """The optimizer step inside backward for `optimizer`'s parameter groups (module docstring): the returned
    optimizer replaces it (schedule, checkpoints, metrics read it as they read the grouped one). `make` builds each
    parameter's optimizer (default: `optimizer`'s class and settings, `per_parameter`)."""
    if any(optimizer.state.values()):
        raise ValueError("apply_step_in_backward takes a fresh optimizer (its state is rebuilt per parameter)")
    return InBackwardOptimizer(optimizer, make)
