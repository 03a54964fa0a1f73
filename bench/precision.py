"""Per-component precision: step time, peak memory and final loss of fp32, bf16, fp16 + dynamic loss scaling and
bf16 + fp8 LLM linears, as ratios to fp32 and to bf16 (whichever ran) measured in one invocation. Prints JSON.

Every configuration trains from the same seed on the same batches for the same number of steps. On a GPU they run
in ONE process (`--processes one`, the default there): each builds its model on the device (no host-side
initialization and copy), compiles its blocks (`--compile`, the default there) and ends with `torch._dynamo.reset()`,
so the next configuration's blocks compile afresh and dynamo's recompile limit is never reached; peak memory is
CUDA's max_memory_allocated over that configuration's steps. On CPU each configuration runs in its own process
(`--processes each`, the default there), because its peak memory is the rise of the process's peak RSS over its RSS
before the model is built (weights, optimizer state, activations and allocator slack); in one CPU process the peak
is not measured. The final loss is the mean `loss/total` over the last 5 steps. Past `--budget-s` no new
configuration starts (the ones left are listed in `skipped`).

    python bench/precision.py [--flavors tiny] [--steps 60] [--batch 4] [--device auto|cpu|cuda]
                              [--configs fp32 bf16 fp16 fp8] [--fp8-recipe tensorwise|rowwise]
                              [--processes one|each] [--compile | --no-compile] [--budget-s 50]

On CPU, fp8 matmuls are an emulation (`torch._scaled_mm` at ~0.1 s per call on the tiny model): the fp8 run checks
accuracy, not speed. fp8 does not pay on `small` either (its LLM is 896 wide: 0.37-0.80x bf16's speed on an H100,
2026-12-06): `bench/mfu.py`'s fp8 check measures it on vla-7b layer shapes.
"""

from __future__ import annotations

import argparse
import gc
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


def worker(flavor: str, config: str, steps: int, batch_size: int, device_name: str, recipe: str,
           compile_: bool = False) -> dict:
    import torch

    from vlaforge.config import load_config
    from vlaforge.data.batch import Batch
    from vlaforge.data.loader import build_data
    from vlaforge.training.numerics import GradientUnderflowWarning
    from vlaforge.training.optim import build_optimizer, build_scheduler
    from vlaforge.training.step import train_step
    from vlaforge.training.trainer import build_guards, build_loss_weighting, build_model, resolve_device

    components = {c: {"precision": p, **({"fp8_recipe": recipe} if p == "fp8" else {})}  # read by fp8 only
                  for c, p in CONFIGS[config].items()}
    overrides = {"model": {"flavor": flavor}, "components": components,
                 "train": {"batch_size": batch_size, "lr_schedule": "constant", "warmup_steps": 0,
                           "compile": compile_},
                 "numerics": {"every": 10}}
    if flavor != "tiny":
        overrides["model"]["image_size"] = None
    cfg = load_config(RECIPE, overrides)
    device = resolve_device(device_name)
    torch.manual_seed(0)
    base_rss = rss_bytes()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device(device):  # initialized where it runs, not on the host's CPU and then copied
            model, setup = build_model(cfg, device)
        build_s = time.perf_counter() - start
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
            t0 = time.perf_counter()
            metrics = train_step(model, [batches[step % len(batches)]], opt, sched, weighting, cfg.train.grad_clip,
                                 guards)
            loss = float(metrics["loss/total"])  # syncs the device
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    timed = times[min(3, steps - 1):]  # the first steps warm up kernels and allocators (and compile)
    return {"step_s": statistics.median(timed), "peak_bytes": peak, "final_loss": statistics.fmean(losses[-LAST:]),
            "wall_s": round(time.perf_counter() - start, 1), "build_s": round(build_s, 1),
            "first_step_s": round(times[0], 2),
            "first_loss": losses[0], "skipped_steps": guards.scaler.skipped_steps, "loss_scale": guards.scaler.scale,
            "underflow_warnings": sum(issubclass(w.category, GradientUnderflowWarning) for w in caught),
            "fp8_linears": sum(len(r.converted) for r in setup.fp8.values())}


def run_one(flavor: str, config: str, args) -> dict:
    """One configuration in its own process (`--processes each`)."""
    cmd = [sys.executable, __file__, "--worker", flavor, config, str(args.steps), str(args.batch), args.device,
           args.fp8_recipe, str(int(args.compile))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_here(flavor: str, config: str, args) -> dict:
    """One configuration in this process (`--processes one`), then dynamo's and the allocator's caches emptied."""
    import torch

    try:
        row = worker(flavor, config, args.steps, args.batch, args.device, args.fp8_recipe, args.compile)
    except Exception as exc:  # noqa: BLE001 - record it (OOM, no torchao) and go on to the next configuration
        row = {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"}
    torch._dynamo.reset()  # NOTE: the next configuration's linears differ (dtype, Float8Linear): a fresh compile
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.device != "cuda" and "peak_bytes" in row:
        row["peak_bytes"] = None  # a process-wide RSS peak says nothing about one configuration
    return row


def ratios(runs: dict) -> None:
    """Time, memory and final loss of every configuration against fp32 and bf16, where those ran."""
    for ref_name in ("fp32", "bf16"):
        ref = runs.get(ref_name, {})
        if "step_s" not in ref:
            continue
        for r in runs.values():
            if "step_s" not in r:
                continue
            r[f"time_vs_{ref_name}"] = r["step_s"] / ref["step_s"]
            if r["peak_bytes"] and ref["peak_bytes"]:
                r[f"memory_vs_{ref_name}"] = r["peak_bytes"] / ref["peak_bytes"]
            r[f"final_loss_diff_vs_{ref_name}"] = (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
    if "step_s" in runs.get("fp8", {}) and "step_s" in runs.get("bf16", {}):
        runs["fp8"]["speedup_vs_bf16"] = runs["bf16"]["step_s"] / runs["fp8"]["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavors", nargs="+", default=["tiny"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--fp8-recipe", default="rowwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--processes", choices=["one", "each"], default=None,
                    help="one process for all configurations (default on GPU) or one each (default on CPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="train.compile (default: on GPU)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new configuration after this")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        flavor, config, steps, batch, device, recipe, compile_ = args.worker
        print(json.dumps(worker(flavor, config, int(steps), int(batch), device, recipe, bool(int(compile_)))))
        return

    import torch

    args.device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    gpu = args.device == "cuda"
    args.processes = args.processes or ("one" if gpu else "each")
    args.compile = gpu if args.compile is None else args.compile
    deadline = time.monotonic() + (args.budget_s if args.budget_s is not None else float("inf"))
    hardware = torch.cuda.get_device_name(0) if gpu else f"CPU ({torch.get_num_threads()} threads)"
    results = {"bench": "precision", "hardware": hardware, "torch": torch.__version__, "steps": args.steps,
               "batch": args.batch, "fp8_recipe": args.fp8_recipe, "processes": args.processes,
               "compile": args.compile, "flavors": {}, "skipped": []}
    run = run_here if args.processes == "one" else run_one
    for flavor in args.flavors:
        runs = {}
        for c in args.configs:
            if time.monotonic() > deadline:
                results["skipped"].append(f"{flavor}/{c}")
                continue
            runs[c] = run(flavor, c, args)
            print(json.dumps({f"{flavor}/{c}": runs[c]}), file=sys.stderr, flush=True)
        ratios(runs)
        results["flavors"][flavor] = runs
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
