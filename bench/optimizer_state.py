"""Optimizer state per component (techniques/optimizer_state.py) on the tiny VLA: each option on every component,
trained `--steps` steps on the synthetic task from the same weights and batches. Prints JSON per option: the bytes
of model state per trained parameter (weights + gradients + AdamW state, measured on the live tensors), how far the
weights drift from the reference run (|w - w_ref| / |w_ref - w_0|, over all parameters), the last loss, the first
step's seconds (torchao compiles its step per parameter shape) and the median step after it.

References: fp32 AdamW (fp32 weights and compute) for `8bit`; bf16 compute with fp32 masters for the bf16-master
options, so that only the optimizer state / rounding differs.

    python bench/optimizer_state.py [--steps 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vlaforge import COMPONENTS
from vlaforge.config import load_config
from vlaforge.data.batch import Batch
from vlaforge.data.loader import build_data
from vlaforge.techniques.lora import stored_bytes
from vlaforge.training.optim import build_optimizer, build_scheduler
from vlaforge.training.step import train_step
from vlaforge.training.trainer import build_loss_weighting, build_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"
# option -> (compute precision, precision_master, optim_state, stochastic_rounding, reference option)
OPTIONS = {
    "fp32": ("fp32", "fp32", "master", False, None),
    "8bit": ("fp32", "fp32", "8bit", False, "fp32"),
    "bf16 compute, fp32 master": ("bf16", "fp32", "master", False, None),
    "bf16 master": ("bf16", "bf16", "master", False, "bf16 compute, fp32 master"),
    "bf16 master + SR": ("bf16", "bf16", "master", True, "bf16 compute, fp32 master"),
    "bf16 master + SR + 8bit": ("bf16", "bf16", "8bit", True, "bf16 compute, fp32 master"),
}


def run(option: str, steps: int, device: torch.device) -> dict:
    precision, master, state, rounding, _ = OPTIONS[option]
    policy = {"precision": precision, "optim_state": state, "stochastic_rounding": rounding}
    cfg = load_config(RECIPE, {"components": {c: policy for c in COMPONENTS}, "data": {"num_samples": 256},
                               "train": {"precision_master": master, "steps": steps, "progress": False}})
    torch.manual_seed(0)
    model, _ = build_model(cfg, device)
    start = [p.detach().float().clone() for p in model.parameters()]
    weighting = build_loss_weighting(cfg, model, device)
    opt = build_optimizer(model, cfg, list(weighting.parameters()))
    sched = build_scheduler(opt, cfg.train)
    data = build_data(cfg, model).dataset
    b = cfg.train.batch_size
    times, loss = [], None
    for step in range(steps):
        batch = Batch.collate([data[(step * b + i) % len(data)] for i in range(b)]).to(device)
        t0 = time.perf_counter()
        metrics = train_step(model, [batch], opt, sched, weighting, cfg.train.grad_clip)
        loss = float(metrics["loss/total"])
        times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    held = sum(stored_bytes(p) + stored_bytes(p.grad) for p in params) + sum(
        stored_bytes(v) for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    return {"weights": [p.detach().float().clone() for p in params], "start": start, "loss": loss,
            "bytes_per_param": held / sum(p.numel() for p in params), "first_step_s": times[0],
            "step_s": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    runs = {o: run(o, args.steps, device) for o in OPTIONS}
    report = {"device": str(device), "torch": torch.__version__, "steps": args.steps, "options": {}}
    for option, r in runs.items():
        row = {k: round(v, 4) for k, v in r.items() if isinstance(v, float)}
        ref = OPTIONS[option][4]
        if ref is not None:
            w, wr, w0 = r["weights"], runs[ref]["weights"], runs[ref]["start"]
            moved = sum(float((a - s).norm() ** 2) for a, s in zip(wr, w0)) ** 0.5
            row["drift_vs_" + ref] = sum(float((a - b).norm() ** 2) for a, b in zip(w, wr)) ** 0.5 / moved
            row["loss_vs_" + ref] = round(r["loss"] - runs[ref]["loss"], 5)
        report["options"][option] = row
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
