"""Loader throughput vs. the tiny model's training throughput, measured side by side in one run.

The loader (LeRobot v3 reader, video frames, augmentation, tokens, collation; `--workers` processes) must
deliver at least 3x the samples/s that one training step of the tiny VLA consumes, so training never waits on
data. Prints one JSON object. Usage:

    python bench/dataloader.py [--data data/metaworld_demo] [--workers 2] [--batches 60]

Without a dataset at --data, a small one is generated first (Meta-World, 5 episodes per demo task).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vlaforge.config import load_config
from vlaforge.data.loader import build_data, build_loader
from vlaforge.training.optim import build_optimizer, build_scheduler
from vlaforge.training.step import train_step
from vlaforge.training.trainer import build_loss_weighting, build_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_metaworld.toml"


def loader_rate(loader, batches: int, warmup: int) -> tuple[float, float]:
    """(samples/s after warm-up, seconds to the first batch)."""
    it = iter(loader)
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        next(it)
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        n += next(it).size
    return n / (time.perf_counter() - t0), first


def train_rate(cfg, model, batch, steps: int) -> float:
    weighting = build_loss_weighting(cfg, model, torch.device("cpu"))
    opt = build_optimizer(model, cfg, list(weighting.parameters()))
    sched = build_scheduler(opt, cfg.train)
    for _ in range(3):
        train_step(model, [batch], opt, sched, weighting, cfg.train.grad_clip)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, [batch], opt, sched, weighting, cfg.train.grad_clip)
    return steps * batch.size / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/metaworld_demo")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--train-steps", type=int, default=20)
    args = ap.parse_args()
    cfg = load_config(RECIPE, {"data": {"path": args.data, "num_workers": args.workers},
                               "train": {"progress": False, "tensorboard": False}})
    if not Path(args.data).exists():  # a small dataset with the recipe's own views and size
        from vlaforge.data.generate import generate
        from vlaforge.data.metaworld import DEMO_TASKS

        generate(list(DEMO_TASKS), 5, args.data, cameras=cfg.model.cameras, image_size=cfg.model.image_size,
                 progress=False)
    torch.manual_seed(0)
    model, _ = build_model(cfg, torch.device("cpu"))
    t0 = time.perf_counter()
    data = build_data(cfg, model)
    setup = time.perf_counter() - t0
    loader = build_loader(data.dataset, cfg.train.batch_size, 0, 0, args.workers)
    loader_sps, first = loader_rate(loader, args.batches, warmup=5)
    del loader
    batch = next(iter(build_loader(data.dataset, cfg.train.batch_size, 0, 0, 0)))
    train_sps = train_rate(cfg, model, batch, args.train_steps)
    print(json.dumps({
        "dataset": args.data, "frames": len(data.dataset), "cameras": data.spec.cameras,
        "image_size": data.spec.image_size, "batch_size": cfg.train.batch_size, "workers": args.workers,
        "decoded_up_front": data.dataset.store.preloaded, "setup_s": round(setup, 2),
        "first_batch_s": round(first, 2), "loader_samples_per_s": round(loader_sps, 1),
        "train_samples_per_s": round(train_sps, 1), "ratio": round(loader_sps / train_sps, 2),
        "target_ratio": 3.0, "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
