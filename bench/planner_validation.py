"""The planner's prediction next to a real training step in one process: peak device memory and step time for
six configurations (checkpointing none / selective / full x two micro-batches), bf16 compute over fp32 masters
with AdamW, and two LoRA rows (rank 32 on the tower and the LLM over a bf16 base, and QLoRA over an NF4 base).
Prints JSON with each configuration's predicted and measured figures and their ratios.

On a GPU (`--device cuda`, the issue's check: the `small` flavor, peak within 10 %, step time within 25 %), the
measured peak is `torch.cuda.max_memory_allocated` over a step after warm-up, and the planner is given the GPU
named by `--gpu` (one GPU, no parallelism). `calibration` is `vlaforge plan --calibrate`'s fit on the micro-batch-2
configurations, with the error on the micro-batch-4 ones before and after (or `error`, the fit's one line, when the
step times leave nothing to fit). The suggested efficiency is the matmul efficiency that would make the predicted
compute time equal the measured step time (median over the configurations): the figure to calibrate
`planner.estimate.Assumptions` with. On CPU it runs as a dry run of the script (memory is not measured; the step
times compare against a GPU model and mean nothing).

    python bench/planner_validation.py [--device cuda] [--flavor small] [--gpu h200-141] [--seq 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vlaforge.config import load_config

CONFIGS = [(ck, batch) for ck in ("none", "selective", "full") for batch in (2, 4)]
# LoRA rows (issue 42): rank-32 adapters on the tower and the LLM over a bf16 base, and QLoRA over an NF4 base
LORA_ROWS = [("none", 4, {"rank": 32, "base": "bf16"}), ("none", 4, {"rank": 32, "base": "nf4"})]


def config(flavor: str, checkpointing: str, batch: int, seq: int | None, lora: dict | None = None):
    from vlaforge.models.build import with_seq_len

    comps = {c: {"precision": "bf16"} for c in ("vision", "projector", "llm", "action_head")}
    comps["llm"]["checkpointing"] = checkpointing
    comps["vision"]["checkpointing"] = checkpointing if checkpointing != "selective" else "none"
    for c in ("vision", "llm") if lora else ():
        comps[c]["lora"] = lora
    cfg = load_config(None, {"model": {"flavor": flavor}, "components": comps,
                             "train": {"batch_size": batch, "progress": False, "tensorboard": False}})
    return with_seq_len(cfg, seq)


def measure(cfg, device: torch.device, steps: int) -> dict:
    """Peak device bytes and median step seconds of real training steps (after one warm-up step)."""
    from vlaforge.models.build import synthetic_batch
    from vlaforge.training.optim import build_optimizer, build_scheduler
    from vlaforge.training.step import train_step
    from vlaforge.training.trainer import build_loss_weighting, build_model

    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs, not on the host's CPU and then copied
        model, _ = build_model(cfg, device)
    weighting = build_loss_weighting(cfg, model, device)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.train)
    batch = synthetic_batch(cfg, model, cfg.train.batch_size, padded=False).to(device)  # as planned: unpadded
    cuda = device.type == "cuda"
    times = []
    for i in range(steps + 1):
        if cuda:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        train_step(model, [batch], optimizer, scheduler, weighting, cfg.train.grad_clip)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return {"peak_bytes": peak, "step_s": statistics.median(times)}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def held_out_calibration(measured: list, gpu) -> dict:
    """`vlaforge plan --calibrate`'s fit on the micro-batch-2 runs of `measured` (one MeasuredRun per CONFIGS entry)
    and the mean error on the micro-batch-4 ones before and after it. Step times the fit cannot use (noisy CPU
    timings where more compute measured faster) give `error` in place of the fitted figures: the rows still count."""
    from vlaforge.errors import VlaforgeError
    from vlaforge.planner.calibrate import fit, predict, terms
    from vlaforge.planner.types import Assumptions

    x = [terms(m, gpu, Assumptions()) for m in measured]
    fitted_idx = [i for i, (_, b) in enumerate(CONFIGS) if b == 2]
    held = [i for i in range(len(CONFIGS)) if i not in fitted_idx]
    err = lambda i, a: abs(predict(x[i], a) / measured[i].step_s - 1)
    out = {"held_out_mean_abs_error_before": _sig(statistics.mean(err(i, Assumptions()) for i in held))}
    try:
        fitted = fit([x[i] for i in fitted_idx], [measured[i].step_s for i in fitted_idx], Assumptions())
    except VlaforgeError as e:
        return out | {"error": str(e)}
    return out | {"fitted": {k: _sig(getattr(fitted, k)) for k in ("matmul_efficiency", "attention_efficiency",
                                                                     "elementwise_passes", "micro_overhead_s")},
                  "held_out_mean_abs_error_after": _sig(statistics.mean(err(i, fitted) for i in held))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--flavor", default=None, help="default: small on a GPU, tiny on CPU")
    ap.add_argument("--gpu", default="h200-141", help="the catalog GPU the planner predicts for")
    ap.add_argument("--seq", type=int, default=None, help="LLM tokens per sample (default: the flavor's)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    flavor = args.flavor or ("small" if device.type == "cuda" else "tiny")

    from vlaforge.planner.calibrate import MeasuredRun
    from vlaforge.planner.estimate import GB, Assumptions, Cluster, PlanModel, estimate
    from vlaforge.planner.hardware import get_gpu

    cluster = Cluster(get_gpu(args.gpu), gpus_per_node=1, nodes=1)
    rows, measured = [], []
    for ck, batch, lora in [(ck, b, None) for ck, b in CONFIGS] + LORA_ROWS:
        cfg = config(flavor, ck, batch, args.seq, lora)
        predicted = estimate(PlanModel(cfg, padded=False), cfg, cluster)
        try:
            got = measure(cfg, device, args.steps)
        except Exception as exc:  # noqa: BLE001 - one configuration's failure (OOM, a technique) keeps the others
            rows.append({"checkpointing": ck, "micro_batch": batch, "lora": lora,
                         "error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if lora is None:  # (the calibration fits and holds out the full fine-tuning rows)
            measured.append(MeasuredRun(f"{ck}/mb{batch}", cfg, got["step_s"], 1))
        row = {"checkpointing": ck, "micro_batch": batch, "lora": lora,
               "predicted_gb": _sig(predicted.memory["total"]),
               "predicted_step_s": _sig(predicted.step_time_s), "measured_step_s": _sig(got["step_s"]),
               "predicted_compute_s": _sig(predicted.time_s["compute"])}
        if got["peak_bytes"] is not None:
            row["measured_gb"] = _sig(got["peak_bytes"] / GB)
            row["memory_ratio"] = _sig(predicted.memory["total"] * GB / got["peak_bytes"])
            row["time_ratio"] = _sig(predicted.step_time_s / got["step_s"])
        rows.append(row)
    base = Assumptions().matmul_efficiency
    full = [r for r in rows if not r["lora"] and "error" not in r]
    eff = statistics.median(base * r["predicted_compute_s"] / r["measured_step_s"] for r in full) if full else None
    calibration = held_out_calibration(measured, cluster.gpu) if len(measured) == len(CONFIGS) else \
        {"error": f"{len(CONFIGS) - len(measured)} of the {len(CONFIGS)} configurations failed (rows)"}
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "flavor": flavor,
           "planner_gpu": cluster.gpu.name, "rows": rows, "suggested_matmul_efficiency": eff and _sig(eff),
           "calibration": calibration,
           "targets": "memory_ratio within 0.9-1.1, time_ratio within 0.75-1.25 (GPU only)"}
    if device.type == "cuda":
        out["within_targets"] = all("error" not in r and 0.9 <= r["memory_ratio"] <= 1.1
                                    and 0.75 <= r["time_ratio"] <= 1.25 for r in rows)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
