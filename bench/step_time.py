"""Tiny-flavor train step: vlaforge's step (freezing schedule, per-component precision regions, loss weighting,
per-component grad norms, clipping, schedule, metrics) vs. a plain hand-written PyTorch loop on the same model,
batch and optimizer. Rounds alternate between the two so machine noise hits both alike. Prints JSON.

    python bench/step_time.py [--steps 30] [--rounds 5] [--batch 8] [--precision fp32|bf16]
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
from vlaforge.models.build import build_vla, tokens_per_sample
from vlaforge.techniques.freezing import apply_freezing, schedule_changes
from vlaforge.techniques.precision import apply_precision
from vlaforge.training.metrics import to_floats
from vlaforge.training.optim import build_optimizer, build_scheduler
from vlaforge.training.step import train_step
from vlaforge.training.trainer import build_loss_weighting

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"


def setup(precision: str, batch_size: int):
    lrs = {c: {"precision": precision, "lr": 1e-4, "weight_decay": 0.0} for c in COMPONENTS}
    cfg = load_config(RECIPE, {"components": lrs, "train": {"batch_size": batch_size, "lr_schedule": "constant",
                                                            "warmup_steps": 0}})
    torch.manual_seed(0)
    model = build_vla(cfg.model, cfg.loss)
    ds = build_data(cfg, model).dataset
    batch = Batch.collate([ds[i] for i in range(batch_size)])
    return cfg, model, batch


def ours(precision: str, batch_size: int):
    cfg, model, batch = setup(precision, batch_size)
    apply_precision(model, dict(cfg.components.items()), torch.device("cpu"))
    weighting = build_loss_weighting(cfg, model, torch.device("cpu"))
    opt = build_optimizer(model, cfg, list(weighting.parameters()))
    sched = build_scheduler(opt, cfg.train)
    policies = dict(cfg.components.items())
    changes = schedule_changes(policies) | {0}
    state = {"step": 0}

    def step():
        if state["step"] in changes:  # as the trainer does
            apply_freezing(model, policies, state["step"])
        metrics = train_step(model, [batch], opt, sched, weighting, cfg.train.grad_clip)
        state["step"] += 1
        if state["step"] % cfg.train.log_every == 0:
            to_floats(metrics)

    return step, cfg, model


def plain(precision: str, batch_size: int):
    cfg, model, batch = setup(precision, batch_size)
    # The same optimizer: AdamW over the same per-component groups with the same settings.
    opt = build_optimizer(model, cfg)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = model.compute_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=True)
        opt.step()

    return step, cfg, model


def timed(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "batch": args.batch, "runs": {}}
    for precision in args.precision:
        (a, cfg, model), (b, _, _) = ours(precision, args.batch), plain(precision, args.batch)
        for fn in (a, b):
            timed(fn, 5)  # warm-up
        ta, tb = [], []
        for _ in range(args.rounds):
            ta.append(timed(a, args.steps))
            tb.append(timed(b, args.steps))
        t_ours, t_plain = statistics.median(ta), statistics.median(tb)
        tokens = args.batch * tokens_per_sample(model, cfg.data.max_instruction_tokens, cfg.data.max_text_tokens)
        results["runs"][precision] = {
            "vlaforge_step_s": round(t_ours, 5), "plain_step_s": round(t_plain, 5),
            "vlaforge_tokens_per_s": round(tokens / t_ours, 1), "plain_tokens_per_s": round(tokens / t_plain, 1),
            "overhead": round(t_ours / t_plain - 1, 4), "tokens_per_step": tokens,
        }
    results["max_overhead"] = max(r["overhead"] for r in results["runs"].values())
    results["target_overhead"] = 0.05
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
