"""What the trainer records for `vlaforge diagnose` beyond its per-window metrics (`[diagnostics]`):

- at `memory_steps`: memory per component and kind, the planner's categories - parameters, gradients and optimizer
  state counted from the tensors this rank holds (local shards of sharded ones), activations from the exact
  accounting of what the step's forward saved for backward (`techniques/accounting.py`), and on CUDA the
  allocator's peak and the rest as `other` - logged as `memory/<component>/<kind>_gb`;
- at `profile_steps`: a `torch.profiler` trace per rank (`RUN/traces/step_<N>_rank_<R>.json`, Chrome / Perfetto
  format) and, read from it, the communication share of the step (collectives and point-to-point ops of NCCL /
  gloo / c10d) and how much of the communication overlaps computation, logged as `perf/comm_share`,
  `perf/comm_overlap`;
- on CUDA, `oom_snapshot`: the allocator's history is recorded and dumped to `RUN/oom_snapshot.pickle` when a step
  runs out of memory (open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from vlaforge import COMPONENTS

GB = 1e9
COMM = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
        "alltoall", "all_to_all", "broadcast", "isend", "irecv", "send", "recv")


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    from vlaforge.techniques.lora import stored_bytes

    local = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
    return stored_bytes(local)  # a quantized LoRA base (NF4, int8): the bytes its inner tensors hold


def component_memory(model: nn.Module, optimizer, saved=None) -> dict[str, float]:
    """GB per component and kind on this rank: params, grads, optimizer (state tensors), activations (saved for
    backward during the step, when `saved` is the step's accounting)."""
    out: dict[str, float] = {}
    state = getattr(optimizer, "state", {})
    for comp in COMPONENTS:
        module = getattr(model, comp, None)
        if module is None:
            continue
        params = list(module.parameters())
        kinds = {"params": sum(_bytes(p) for p in params), "grads": sum(_bytes(p.grad) for p in params),
                 "optimizer": sum(_bytes(v) for p in params for v in state.get(p, {}).values()
                                  if isinstance(v, torch.Tensor))}
        if saved is not None:
            kinds["activations"] = saved.per_component().get(comp, 0) + saved.weight_casts.get(comp, 0)
        out |= {f"memory/{comp}/{k}_gb": v / GB for k, v in kinds.items()}
    return out


def cuda_memory(device: torch.device, known_gb: float) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / GB
    return {"memory/peak_gb": peak, "memory/other_gb": max(peak - known_gb, 0.0)}


@contextlib.contextmanager
def recorded_step(cfg, step: int, model: nn.Module, optimizer, device: torch.device, run_dir: Path, rank: int
                  ) -> Iterator[dict[str, float]]:
    """Wrap one training step: fills the yielded dict with what `[diagnostics]` asks for at this step."""
    d = cfg.diagnostics
    out: dict[str, float] = {}
    stack = contextlib.ExitStack()
    saved = prof = None
    if step in d.memory_steps:
        from vlaforge.techniques.accounting import count_saved

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        saved = stack.enter_context(count_saved(model))
    if step in d.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = stack.enter_context(profile(activities=activities))
    with stack:
        yield out
    if saved is not None:
        mem = component_memory(model, optimizer, saved)
        out |= mem | cuda_memory(device, sum(mem.values()))
    if prof is not None:
        folder = run_dir / "traces"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step:08d}_rank_{rank}.json"
        prof.export_chrome_trace(str(path))
        out |= communication(path)


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in COMM)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication(trace: Path) -> dict[str, float]:
    """From a Chrome trace: the share of the step's span during which communication runs, and the share of that
    communication time during which computation runs too (on GPU: kernels on other streams; on CPU: other threads'
    operators). Only top-level spans count (events are unioned, so nesting does not double count)."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    if not spans:
        return {}
    comm_cats = ("kernel", "gpu_memcpy") if any(e.get("cat") == "kernel" for e in spans) else ("cpu_op",)
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in spans
                   if e.get("cat") in comm_cats + ("cpu_op",) and _is_comm(e.get("name", ""))])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in spans
                      if e.get("cat") in comm_cats and not _is_comm(e.get("name", ""))
                      and not e.get("name", "").startswith("ProfilerStep")])
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    comm_time = _length(comm)
    out = {"perf/comm_share": comm_time / max(end - start, 1e-9)}
    if comm_time > 0:
        out["perf/comm_overlap"] = _intersection(comm, compute) / comm_time
    return out


@contextlib.contextmanager
def oom_snapshot(cfg, device: torch.device, run_dir: Path) -> Iterator[None]:
    """CUDA: record allocation history; dump a snapshot when the body runs out of memory, then re-raise."""
    if device.type != "cuda" or not cfg.diagnostics.oom_snapshot:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    except torch.OutOfMemoryError:
        path = run_dir / "oom_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        raise
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

