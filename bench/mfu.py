"""Model FLOPs utilization of a real training step on one device, with the planner's prediction beside each point.

For each flavor (default: `small` and the largest flavor the planner fits on one GPU of `--gpu`, in the
configuration it recommends there) and each (sequence length, micro-batch) point: bf16 components with
`train.compile`, a warm-up step (compilation; its time is reported), then `--steps` timed steps. Reported per
point: tokens/s, achieved TFLOP/s from the planner's FLOP count (`planner.throughput.step_flops`, the count
`tests/test_planner.py` checks against `FlopCounterMode`), MFU against the catalog's dense bf16 peak, the peak
device memory, and the planner's predicted step time and peak. Then the same point with the LLM's linears in fp8
(torchao float8): `speedup` = bf16 step time / fp8 step time.

The JSON is rewritten after every point (`--out`), so a time limit keeps what finished; a point that fails (out of
memory, a missing package) records its error and the run goes on.

    python bench/mfu.py [--gpu h200-141] [--flavors small auto] [--seq 512 2048] [--micro 4 16] [--steps 5]
                        [--out mfu.json] [--dry-run]

`--dry-run` runs every step on this CPU with the tiny flavor and small shapes (the numbers mean nothing; the keys
are the GPU run's), so a broken script is found before a device is spent on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_validation import measure  # noqa: E402 - one measurement loop for the bench scripts

from vlaforge.config import load_config  # noqa: E402
from vlaforge.errors import VlaforgeError  # noqa: E402

LARGEST_FIRST = ("vla-70b", "vla-30b", "vla-7b", "small")


def base_config(flavor: str, overrides: dict | None = None):
    """bf16 components, compiled blocks, one micro-batch per step, the flavor's own image size."""
    comps = {c: {"precision": "bf16"} for c in ("vision", "projector", "llm", "action_head")}
    model = {"flavor": flavor, **({"image_size": None} if flavor != "tiny" else {})}
    raw = {"model": model, "components": comps,
           "train": {"compile": True, "grad_accum": 1, "progress": False, "tensorboard": False}}
    from vlaforge.config.loading import deep_merge

    return load_config(None, deep_merge(raw, overrides or {}))


def largest_fitting(cluster, flavors, seq: int) -> tuple[str, dict]:
    """The largest flavor the planner fits on one GPU at `seq` tokens, and the component settings it recommends
    (bf16 LLM: fp8 is measured as its own variant)."""
    from vlaforge.models.build import with_seq_len
    from vlaforge.planner.estimate import PlanModel
    from vlaforge.planner.search import search

    fixed = {"components.llm.precision": "bf16", "components.llm.offload": "none"}
    for flavor in flavors:
        cfg = with_seq_len(base_config(flavor), seq)
        plan = search(PlanModel(cfg), cluster, global_batch=8, fixed=fixed, alternatives=False)
        if plan.best is not None:
            best = plan.best.config
            return flavor, {"components": {c: {"checkpointing": p.checkpointing} for c, p in best.components.items()},
                            "train": {"batch_size": best.train.batch_size}}
    raise VlaforgeError(f"none of {', '.join(flavors)} fits one {cluster.gpu.name} by the planner")


def predict(cfg, cluster) -> dict:
    """The planner's step time, peak and FLOPs of one micro-batch for `cfg` on one GPU."""
    from vlaforge.planner.estimate import PlanModel, build_case, estimate
    from vlaforge.planner.throughput import step_flops

    pm = PlanModel(cfg)
    case = build_case(pm, cfg, cluster)
    flops = step_flops(pm.model, case.seq, case.policies, pm.contrastive).model_flops
    est = estimate(pm, cfg, cluster)
    return {"flops": flops, "step_s": est.step_time_s, "peak_gb": est.memory["total"], "fits": est.fits,
            "tokens_per_sample": case.seq.llm_tokens}


def point(cfg, cluster, device: torch.device, steps: int) -> dict:
    """Measure one configuration and set it beside the planner's prediction."""
    pred = predict(cfg, cluster)
    start = time.perf_counter()
    got = measure(cfg, device, steps)
    micro = cfg.train.batch_size
    row = {"tokens_per_sample": pred["tokens_per_sample"], "wall_s": round(time.perf_counter() - start, 2),
           "measured_step_s": got["step_s"], "predicted_step_s": pred["step_s"],
           "tokens_per_s": micro * pred["tokens_per_sample"] / got["step_s"],
           "tflops": pred["flops"] / got["step_s"] / 1e12, "predicted_peak_gb": pred["peak_gb"],
           "predicted_fits": pred["fits"]}
    row["mfu"] = row["tflops"] / cluster.gpu.bf16_tflops
    row["peak_gb"] = got["peak_bytes"] / 1e9 if got["peak_bytes"] is not None else None
    if row["peak_gb"]:
        row["peak_ratio"] = pred["peak_gb"] / row["peak_gb"]
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}


def run_point(cfg, cluster, device, steps) -> dict:
    try:
        return point(cfg, cluster, device, steps)
    except Exception as exc:  # noqa: BLE001 - record it (OOM, no torchao) and go on to the next point
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h200-141", help="the catalog GPU: its bf16 peak is MFU's denominator")
    ap.add_argument("--flavors", nargs="+", default=["small", "auto"], help="'auto': the largest that fits")
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--micro", type=int, nargs="+", default=None, help="micro-batches (default: 4 16, and the "
                                                                      "planner's for the largest flavor)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every point")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny flavor, small shapes")
    args = ap.parse_args()
    if args.dry_run:
        # "auto" alone: on this CPU it resolves to tiny, so a "tiny" entry would compile and time the same two
        # points again (the dry run checks the script, not the numbers)
        args.flavors, args.seq, args.micro, args.steps = ["auto"], [64], [2], 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")

    from vlaforge.models.build import with_seq_len
    from vlaforge.planner.estimate import Cluster
    from vlaforge.planner.hardware import get_gpu

    cluster = Cluster(get_gpu(args.gpu), gpus_per_node=1, nodes=1)
    report = {"bench": "mfu", "torch": torch.__version__, "dry_run": args.dry_run,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "catalog_gpu": cluster.gpu.name, "peak_bf16_tflops": cluster.gpu.bf16_tflops, "points": [], "fp8": []}

    def save() -> None:
        text = json.dumps(report, indent=2)
        if args.out:
            args.out.write_text(text)

    for flavor in args.flavors:
        overrides: dict = {}
        if flavor == "auto":
            flavor, overrides = largest_fitting(cluster, ["tiny"] if args.dry_run else LARGEST_FIRST, max(args.seq))
            report["largest_flavor"] = {"flavor": flavor, "recommended": overrides}
        micros = args.micro or sorted({4, 16} if not overrides else {overrides["train"]["batch_size"]})
        for seq in args.seq:
            for micro in micros:
                cfg = with_seq_len(base_config(flavor, overrides), seq)
                cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": micro})})
                row = {"flavor": flavor, "seq": seq, "micro_batch": micro, "precision": "bf16",
                       **run_point(cfg, cluster, device, args.steps)}
                report["points"].append(row)
                save()
                print(json.dumps(row), file=sys.stderr, flush=True)
                if args.no_fp8:
                    continue
                fp8 = cfg.model_copy(update={"components": cfg.components.model_copy(update={
                    "llm": cfg.components.llm.model_copy(update={"precision": "fp8"})})})
                row8 = {"flavor": flavor, "seq": seq, "micro_batch": micro, "precision": "fp8",
                        **run_point(fp8, cluster, device, args.steps)}
                if "measured_step_s" in row and "measured_step_s" in row8:
                    row8["speedup"] = round(row["measured_step_s"] / row8["measured_step_s"], 4)
                report["fp8"].append(row8)
                save()
                print(json.dumps(row8), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
