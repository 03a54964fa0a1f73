"""`components.<c>.optim_state = "cpu"`: the component's AdamW on the host, without DeepSpeed. The host keeps the
fp32 master weights and both moments and runs the step (torch's fused CPU AdamW kernel); the device keeps only the
weights it computes with and their gradients - ZeRO-Offload's layout in one process, for the components that choose
it. Per parameter on the device: its weights and gradient (2 + 2 bytes with bf16 weights); on the host: master and
moments (12 bytes).

One step, per parameter group: every gradient goes to the host (fp32, into pinned memory on CUDA, `non_blocking`,
one synchronization for the group), the host steps the masters, and the weights go back to the device (`copy_`, to
the nearest bf16 from the fp32 master: rounding happens once, on the copy, never in the master). With
`train.step_in_backward` each parameter does this in its gradient hook: its gradient leaves the device and is freed
while backward goes on with the kernels it has queued.

Exactness: the step is torch's fused AdamW kernel over the same numbers. A parameter that is an fp32 tensor on the
CPU is its own master (stepped in place): the plain fused AdamW's step, bit for bit, and the state layout of the
plain optimizer (a checkpoint resumes with or without this option). Weights kept in bf16 get an fp32 master on the
host ("master" in the parameter's state, saved with the checkpoint): unlike `precision_master = "bf16"` with the
plain optimizer, small updates accumulate in fp32 instead of rounding away.

What it refuses (one line each, config/unused.py and distributed/parallel_dims.py): stochastic rounding (the master
is fp32: nothing rounds stochastically), DeepSpeed (its own optimizer), and any layout whose parameters are sharded
or replicated DTensors (FSDP2, DDP, TP, PP): one process only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adamw import adamw

HOST = torch.device("cpu")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")  # what lives on the host, fp32 (torch would cast it on load)


def own_master(param: torch.Tensor) -> bool:
    """Whether `param` is its own master (an fp32 tensor on the host): stepped in place, no copy kept."""
    return param.device.type == "cpu" and param.dtype == torch.float32


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose state and step are on the host (see the module docstring); `state` and `param_groups` as torch's
    AdamW has them, plus "master" for a parameter that is not its own master."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=HOST)
        if not own_master(p) and "master" not in state:
            state["master"] = _host(p.detach())
        master = p if own_master(p) else state["master"]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(master, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            grads = [_host(p.grad) for p in params]
            if any(p.is_cuda for p in params):
                torch.cuda.current_stream().synchronize()  # the gradients' copies into pinned memory are done
            masters = [p if own_master(p) else s["master"] for p, s in zip(params, states)]
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            adamw(
                masters, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
                [s["step"] for s in states], fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=lr.to(HOST) if isinstance(lr, torch.Tensor) else lr, weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False)
            for p, master in zip(params, masters):
                if master is not p:
                    p.copy_(master, non_blocking=True)  # (to the nearest bf16: the master keeps every bit)
        return loss


def run_closure(closure) -> Any:
    """An optimizer step's `closure` (the loss recomputed with gradients), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def host_params(optimizer: torch.optim.Optimizer) -> set[int]:
    """ids of the parameters a `HostAdamW` steps among `optimizer`'s (a ComponentOptimizer's parts)."""
    parts, owner = getattr(optimizer, "parts", []), getattr(optimizer, "owner", [])
    return {id(p) for group, o in zip(optimizer.param_groups, owner) if isinstance(parts[o], HostAdamW)
            for p in group["params"]}


def restore_host_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], hosted: set[int]) -> None:
    """After `Optimizer.load_state_dict(saved)` (which casts every floating state tensor to its parameter's dtype
    and device): the host entries of the `hosted` parameters again as they were saved, fp32 on the host."""
    if not hosted:
        return
    by_id = {i: p for group_saved, group in zip(saved["param_groups"], optimizer.param_groups)
             for i, p in zip(group_saved["params"], group["params"])}
    for key, entry in saved.get("state", {}).items():
        p = by_id.get(key)
        if p is None or id(p) not in hosted or own_master(p):
            continue
        for name in STATE_KEYS:
            if name in entry:
                optimizer.state[p][name] = _host(entry[name])


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t` as fp32 on the host (pinned when CUDA runs, copied without blocking); a host fp32 tensor as it is."""
    if t.device.type == "cpu":
        return t.to(torch.float32)
    out = torch.empty(t.shape, dtype=torch.float32, device=HOST, pin_memory=torch.cuda.is_available())
    return out.copy_(t, non_blocking=True)
