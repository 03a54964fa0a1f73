"""Per-component precision: step time, peak memory and final loss of fp32, bf16, fp16 + dynamic loss scaling and
bf16 + fp8 LLM linears, as ratios to fp32 measured in one invocation. Prints JSON.

Each configuration trains in its own process (same seed, same batches, same number of steps) so peak memory is
its own: CUDA's max_memory_allocated on GPU; on CPU the rise of peak RSS over the process's RSS before the model
is built (weights, optimizer state, activations and allocator slack). The final loss is the mean `loss/total`
over the last 5 steps.

    python bench/precision.py [--flavors tiny] [--steps 60] [--batch 4] [--device auto|cpu|cuda]
                              [--configs fp32 bf16 fp16 fp8] [--fp8-recipe tensorwise|rowwise]

On CPU, fp8 matmuls are an emulation (`torch._scaled_mm` at ~0.1 s per call on the tiny model): the fp8 run checks
accuracy, not speed. The speed claim (bf16 + fp8 LLM >= 1.2x faster than bf16 on the `small` flavor) needs an
FP8-capable GPU: `python bench/precision.py --flavors small --device cuda --steps 30`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"
CONFIGS = {
    "fp32": {"vision": "fp32", "projector": "fp32", "llm": "fp32", "action_head": "fp32"},
    "bf16": {"vision": "bf16", "projector": "bf16", "llm": "bf16", "action_head": "bf16"},
    "fp16": {"vision": "fp16", "projector": "fp16", "llm": "fp16", "action_head": "fp16"},
    "fp8": {"vision": "bf16", "projector": "bf16", "llm": "fp8", "action_head": "bf16"},
}
LAST = 5


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(flavor: str, config: str, steps: int, batch_size: int, device_name: str, recipe: str) -> dict:
    import torch

    from vlaforge.config import load_config
    from vlaforge.data.batch import Batch
    from vlaforge.data.loader import build_data
    from vlaforge.training.numerics import GradientUnderflowWarning
    from vlaforge.training.optim import build_optimizer, build_scheduler
    from vlaforge.training.step import train_step
    from vlaforge.training.trainer import build_guards, build_loss_weighting, build_model, resolve_device

    components = {c: {"precision": p, "fp8_recipe": recipe} for c, p in CONFIGS[config].items()}
    overrides = {"model": {"flavor": flavor}, "components": components,
                 "train": {"batch_size": batch_size, "lr_schedule": "constant", "warmup_steps": 0},
                 "numerics": {"every": 10}}
    if flavor != "tiny":
        overrides["model"]["image_size"] = None
    cfg = load_config(RECIPE, overrides)
    device = resolve_device(device_name)
    torch.manual_seed(0)
    base_rss = rss_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, setup = build_model(cfg, device)
        guards = build_guards(cfg, setup)
        weighting = build_loss_weighting(cfg, model, device)
        opt = build_optimizer(model, cfg, list(weighting.parameters()))
        sched = build_scheduler(opt, cfg.train)
        ds = build_data(cfg, model).dataset
        batches = [Batch.collate([ds[(i * batch_size + j) % len(ds)] for j in range(batch_size)]).to(device)
                   for i in range(min(steps, 8))]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for step in range(steps):
            guards.step = step
            start = time.perf_counter()
            metrics = train_step(model, [batches[step % len(batches)]], opt, sched, weighting, cfg.train.grad_clip,
                                 guards)
            loss = float(metrics["loss/total"])  # syncs the device
            times.append(time.perf_counter() - start)
            losses.append(loss)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    timed = times[min(3, steps - 1):]  # the first steps warm up kernels and allocators
    return {"step_s": statistics.median(timed), "peak_bytes": peak, "final_loss": statistics.fmean(losses[-LAST:]),
            "first_loss": losses[0], "skipped_steps": guards.scaler.skipped_steps, "loss_scale": guards.scaler.scale,
            "underflow_warnings": sum(issubclass(w.category, GradientUnderflowWarning) for w in caught),
            "fp8_linears": sum(len(r.converted) for r in setup.fp8.values())}


def run_one(flavor: str, config: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", flavor, config, str(args.steps), str(args.batch), args.device,
           args.fp8_recipe]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavors", nargs="+", default=["tiny"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--fp8-recipe", default="rowwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        flavor, config, steps, batch, device, recipe = args.worker
        print(json.dumps(worker(flavor, config, int(steps), int(batch), device, recipe)))
        return

    import torch

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    hardware = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    results = {"bench": "precision", "hardware": hardware, "torch": torch.__version__, "steps": args.steps,
               "batch": args.batch, "fp8_recipe": args.fp8_recipe, "flavors": {}}
    for flavor in args.flavors:
        runs = {c: run_one(flavor, c, args) for c in args.configs}
        ref = runs.get("fp32", {})
        for name, r in runs.items():
            if "error" in r or "error" in ref or not ref:
                continue
            r["time_vs_fp32"] = r["step_s"] / ref["step_s"]
            r["memory_vs_fp32"] = r["peak_bytes"] / ref["peak_bytes"]
            r["final_loss_diff_vs_fp32"] = (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
        if "fp8" in runs and "bf16" in runs and "error" not in runs["fp8"] and "error" not in runs["bf16"]:
            runs["fp8"]["speedup_vs_bf16"] = runs["bf16"]["step_s"] / runs["fp8"]["step_s"]
        results["flavors"][flavor] = runs
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
