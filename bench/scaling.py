"""Scaling on this machine: per-rank parameter + gradient + optimizer bytes and step time of FSDP2, DDP and tensor
parallel (the LLM's blocks split over the N ranks, which share the batch) at N ranks against one process, measured
in one invocation. Prints JSON.

Bytes are counted from each rank's local tensors (the DTensor shards under FSDP2) after real optimizer steps, so
they are exact; the target is FSDP2 at N ranks <= 1/N of one process + 5 %. Step times on CPU gloo measure the
communication overhead of the layouts on a shared 2-core machine (each rank gets 1 thread), not GPU throughput.

    python bench/scaling.py [--flavor tiny|small] [--ranks 2] [--steps 5] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def worker(rank: int, world: int, port: int, backend: str, args, out) -> None:
    from vlaforge.config import load_config
    from vlaforge.data.batch import Batch
    from vlaforge.data.loader import build_data
    from vlaforge.distributed.parallel_dims import ParallelDims
    from vlaforge.distributed.parallelize import parallelize
    from vlaforge.training.optim import build_optimizer, build_scheduler
    from vlaforge.training.step import StepGuards, train_step
    from vlaforge.training.trainer import build_loss_weighting, build_model

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    overrides = {"model": {"flavor": args.flavor, **({"image_size": None} if args.flavor != "tiny" else {})},
                 "train": {"batch_size": args.batch}}
    if backend == "ddp":
        overrides["parallel"] = {"backend": "ddp", "dp_replicate": world, "dp_shard": 1}
    if backend == "tp":
        overrides["parallel"] = {"tp": world, "dp_shard": 1}
    cfg = load_config(RECIPE, overrides)
    guards = StepGuards()
    torch.manual_seed(0)
    model, _ = build_model(cfg, torch.device("cpu"))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dims = ParallelDims.build(cfg.parallel, world)
        guards.reducer = parallelize(model, dims, dims.build_mesh("cpu"), dict(cfg.components.items()))
    weighting = build_loss_weighting(cfg, model, torch.device("cpu"))
    opt = build_optimizer(model, cfg, list(weighting.parameters()))
    sched = build_scheduler(opt, cfg.train)
    ds = build_data(cfg, model).dataset
    data_rank = 0 if backend == "tp" else rank  # tensor-parallel ranks read the same samples
    batch = Batch.collate([ds[(data_rank * args.batch + j) % len(ds)] for j in range(args.batch)])
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        train_step(model, [batch], opt, sched, weighting, cfg.train.grad_clip, guards)
        times.append(time.perf_counter() - start)
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out[(backend, world, rank)] = {"param_bytes": local_bytes(params),
                                   "grad_bytes": local_bytes(p.grad for p in params),
                                   "optimizer_bytes": local_bytes(state), "step_s": statistics.median(times[1:])}
    if world > 1:
        dist.destroy_process_group()


def run(backend: str, world: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(world, port, backend, args, out), nprocs=world)
    rows = [out[(backend, world, r)] for r in range(world)]
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    return {**{k: max(r[k] for r in rows) for k in keys}, "step_s": max(r["step_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2, help="per-rank batch")
    args = ap.parse_args()
    one = run("fsdp2", 1, args)
    results = {"bench": "scaling", "flavor": args.flavor, "hardware": f"CPU, gloo, {torch.get_num_threads()} threads",
               "ranks": args.ranks, "one_process": one}
    for backend in ("fsdp2", "ddp", "tp"):
        r = run(backend, args.ranks, args)
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        base = one["param_bytes"] + one["grad_bytes"] + one["optimizer_bytes"]
        r |= {"state_bytes_per_rank_vs_one": state / base, "step_time_vs_one": r["step_s"] / one["step_s"]}
        results[backend] = r
    share = results["fsdp2"]["state_bytes_per_rank_vs_one"]
    results["fsdp2_within_1_over_n_plus_5pct"] = share <= 1 / args.ranks + 0.05
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
