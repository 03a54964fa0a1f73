"""`train.step_in_backward` against the plain step on one model: the most gradient bytes held at once (measured by a
post-accumulate-grad hook that runs before the optimizer's, on every gradient as it completes), the planner's count
of the same (`grads_held`) and of the step's peak, the allocator's peak on CUDA, the dispatched ops the hooks add per
parameter, and the step time (the two runs interleaved step by step). Prints JSON.

    python bench/step_in_backward.py [--flavor tiny] [--batch 4] [--steps 10] [--device cpu] [--grad-accum 1]

Gradient bytes are sampled on step 0 only (the sampling hook is off while steps are timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlaforge.config import load_config
from vlaforge.config.loading import deep_merge

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"


def config(flavor: str, batch: int, accum: int, device: str, out: Path, in_backward: bool, **extra):
    sections = {"model": {"flavor": flavor}, "data": {"num_samples": 256},
                "train": {"steps": 1000, "batch_size": batch, "grad_accum": accum, "grad_clip": 0.0,
                          "step_in_backward": in_backward, "device": device, "progress": False,
                          "tensorboard": False, "output_dir": str(out)}}
    return load_config(RECIPE, deep_merge(sections, extra))


class GradientBytes:
    """The most bytes of `.grad` tensors held at once over the parameters of `model`, sampled whenever a gradient
    completes (hooks registered before the optimizer's run first: they see each gradient before it is freed)."""

    def __init__(self, params):
        self.params, self.peak, self.on = list(params), 0, True
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._sample)

    def _sample(self, _param) -> None:
        if not self.on:  # (off while steps are timed)
            return
        held = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        self.peak = max(self.peak, held)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def build(cfg):
    from vlaforge.data.loader import build_loader
    from vlaforge.training.trainer import build_run

    run = build_run(cfg)
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    return run, GradientBytes(params), iter(build_loader(run.data.dataset, cfg.train.batch_size, 0, 0, 0))


def one_step(run, batches, step: int) -> float:
    from vlaforge.training.step import train_step

    micro = [next(batches).to(run.device) for _ in range(run.cfg.train.grad_accum)]
    run.guards.step = step
    sync = torch.cuda.synchronize if run.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    train_step(run.model, micro, run.optimizer, run.scheduler, run.weighting, 0.0, run.guards, run.executor)
    sync()
    return time.perf_counter() - t0


def planned(cfg) -> dict[str, float]:
    from vlaforge.planner.estimate import estimate
    from vlaforge.planner.hardware import GB, get_gpu
    from vlaforge.planner.types import Cluster, PlanModel

    e = estimate(PlanModel(cfg), cfg, Cluster(get_gpu("h100-80"), 1, 1))
    return {"grads_held_bytes": e.memory["grads_held"] * GB, "at_peak_gb": e.memory["at_peak"],
            "total_gb": e.memory["total"], "optimizer_s": e.time_s.get("optimizer", 0.0),
            "launch_exposed_s": e.time_s.get("launch_exposed", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    report = {"flavor": args.flavor, "device": args.device, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "batch": args.batch, "grad_accum": args.grad_accum}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name in ("plain", "in_backward"):
            cfg = config(args.flavor, args.batch, args.grad_accum, args.device, Path(tmp) / name,
                         name == "in_backward")
            runs[name] = (cfg, *build(cfg))
        times = {name: [] for name in runs}
        peaks = {}
        for step in range(args.steps + 1):
            for name, (_, run, grads, batches) in runs.items():
                grads.on = step == 0
                if run.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(run.device)
                seconds = one_step(run, batches, step)
                if step:  # step 0 allocates the optimizer state
                    times[name].append(seconds)
                if run.device.type == "cuda":
                    peaks[name] = torch.cuda.max_memory_allocated(run.device)
        for name, (cfg, run, grads, batches) in runs.items():
            with CountOps() as ops:
                one_step(run, batches, args.steps + 1)
            trained = sum(p.requires_grad for g in run.optimizer.param_groups for p in g["params"])
            report[name] = {"grad_bytes_held_measured": grads.peak,
                            "grad_bytes_whole_model": sum(p.numel() * p.element_size() for p in grads.params
                                                          if p.requires_grad),
                            "step_s_median": statistics.median(times[name]), "dispatched_ops": ops.count,
                            "trained_tensors": trained, "planned": planned(cfg)}
            if name in peaks:
                report[name]["cuda_peak_bytes"] = peaks[name]
    p, b = report["plain"], report["in_backward"]
    report["step_time_ratio"] = b["step_s_median"] / p["step_s_median"]
    report["ops_per_tensor_added"] = (b["dispatched_ops"] - p["dispatched_ops"]) / b["trained_tensors"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
