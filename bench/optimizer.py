"""Fused vs. foreach AdamW on this machine: one optimizer step over a flavor's parameter set (the VLA's
per-component groups, random gradients), the two implementations interleaved round by round so machine noise hits
both alike. Prints JSON: per flavor, the median milliseconds per step of each and their ratio.

    python bench/optimizer.py [--flavors tiny small] [--steps 20] [--rounds 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vlaforge.config import load_config
from vlaforge.models.build import build_vla
from vlaforge.training.optim import build_param_groups

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"


def optimizers(flavor: str, device: torch.device) -> tuple[dict[str, torch.optim.Optimizer], int]:
    """One AdamW per implementation, each over its own copy of the flavor's parameters (with gradients)."""
    cfg = load_config(RECIPE, {"model": {"flavor": flavor}})
    out, count = {}, 0
    for impl in ("foreach", "fused"):
        torch.manual_seed(0)
        model = build_vla(cfg.model, cfg.loss).to(device)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        count = sum(p.numel() for p in model.parameters())
        out[impl] = torch.optim.AdamW(build_param_groups(model, cfg.components), betas=cfg.train.betas,
                                      eps=cfg.train.eps, **{impl: True})
    return out, count


def timed(opt: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """Milliseconds per step over `steps` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavors", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    report = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(), "flavors": {}}
    for flavor in args.flavors:
        opts, count = optimizers(flavor, device)
        for opt in opts.values():
            timed(opt, 2, device)  # warm-up: state allocation
        ms = {impl: [] for impl in opts}
        for _ in range(args.rounds):
            for impl, opt in opts.items():
                ms[impl].append(timed(opt, args.steps, device))
        med = {impl: statistics.median(v) for impl, v in ms.items()}
        report["flavors"][flavor] = {"parameters": count, "ms_per_step": med, "rounds": ms,
                                     "fused_over_foreach": med["fused"] / med["foreach"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
