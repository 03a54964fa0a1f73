"""Model FLOPs utilization of a real training step on one device, with the planner's prediction beside each point,
and fp8 against bf16 where fp8 can pay. Prints one JSON.

fp8 (first): `--fp8-flavor` (default vla-7b-4l: vla-7b's SigLIP-so400m and Llama-2-7B layers, 4 + 4 blocks, so
the LLM's matmuls are 4096 wide with 11008-wide MLPs and 8192 tokens per micro-batch at the default seq and
micro-batch) in bf16 and with the LLM's linears in fp8 under each torchao recipe (tensorwise, rowwise), compiled.
`speedup` = bf16 step time / the variant's. Each variant runs in its own process: dynamo then compiles the decoder
layer's code for one kind of linear, so `Linear` and `Float8Linear` never share its cache (in one process they ran
into the recompile limit). Why not `small`: the first GPU run (2026-12-06, H100) measured fp8 at 0.37-0.80x bf16's
speed at all six of its points - its LLM is 896 wide, where the casts and scales cost more than the fp8 matmul saves
(torchao's own table: 0.80x at M,K,N = 1024, 2048, 1024, 1.39x at 4096, 8192, 16384), on a step that was
launch-bound already.

MFU points (then): for each flavor (default: the largest flavor the planner fits on one GPU of `--gpu`, in the
configuration it recommends there, and `small` at micro-batch 16) and each (sequence length, micro-batch) point:
bf16 components with `train.compile`, a warm-up step (compilation; its time is in `wall_s`), then `--steps` timed
steps. Reported per point (and per fp8 variant): tokens/s, achieved TFLOP/s from the planner's FLOP count
(`planner.throughput.step_flops`, the count `tests/test_planner.py` checks against `FlopCounterMode`), MFU against
the catalog's dense bf16 peak, the peak device memory, and the planner's predicted step time and peak.

The JSON is rewritten after every point (`--out`), so a time limit keeps what finished; a point that fails (out of
memory, a missing package) records its error and the run goes on; past `--budget-s` no new point starts (the ones
left are listed in `skipped`).

    python bench/mfu.py [--gpu h200-141] [--flavors auto small] [--seq 2048] [--micro 16] [--steps 5]
                        [--fp8-flavor vla-7b-4l] [--fp8-seq 2048] [--fp8-micro 4] [--budget-s 130]
                        [--out mfu.json] [--dry-run]

`--dry-run` runs every step on this CPU with the tiny flavor and small shapes (the numbers mean nothing; the keys
are the GPU run's; the fp8 variants run eagerly there: a compile of each costs ~100 s on 2 cores, and the MFU point
checks compilation already), so a broken script is found before a device is spent on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlaforge.config import load_config
from vlaforge.errors import VlaforgeError

from inference import layer_shapes_flavor
from planner_validation import measure

LARGEST_FIRST = ("vla-70b", "vla-30b", "vla-7b", "small")
FP8_VARIANTS = {"bf16": None, "fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}  # name -> torchao recipe


def base_config(flavor: str, overrides: dict | None = None):
    """bf16 components, compiled blocks, one micro-batch per step, the flavor's own image size."""
    comps = {c: {"precision": "bf16"} for c in ("vision", "projector", "llm", "action_head")}
    model = {"flavor": layer_shapes_flavor(flavor), **({"image_size": None} if flavor != "tiny" else {})}
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
        plan = search(PlanModel(cfg, padded=False), cluster, global_batch=8, fixed=fixed, alternatives=False)
        if plan.best is not None:
            best = plan.best.config
            return flavor, {"components": {c: {"checkpointing": p.checkpointing} for c, p in best.components.items()},
                            "train": {"batch_size": best.train.batch_size}}
    raise VlaforgeError(f"none of {', '.join(flavors)} fits one {cluster.gpu.name} by the planner")


def predict(cfg, cluster) -> dict:
    """The planner's step time, peak and FLOPs of one micro-batch for `cfg` on one GPU."""
    from vlaforge.planner.estimate import PlanModel, build_case, estimate
    from vlaforge.planner.throughput import step_flops

    pm = PlanModel(cfg, padded=False)  # measure() runs full-length batches without a mask
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


def variant_config(flavor: str, variant: str, seq: int, micro: int, compile_: bool):
    """`flavor` at (seq, micro) in bf16, or with the LLM's linears in fp8 under the variant's recipe."""
    from vlaforge.models.build import with_seq_len

    recipe = FP8_VARIANTS[variant]
    llm = {"precision": "fp8", "fp8_recipe": recipe} if recipe else {}
    return with_seq_len(base_config(flavor, {"components": {"llm": llm},
                                             "train": {"batch_size": micro, "compile": compile_}}), seq)


def run_variant(args, variant: str, timeout: float | None) -> dict:
    """One fp8-check variant in its own process (`--variant`): its row, or the error it ended with."""
    cmd = [sys.executable, __file__, "--variant", variant, "--fp8-flavor", args.fp8_flavor, "--fp8-seq",
           str(args.fp8_seq), "--fp8-micro", str(args.fp8_micro), "--steps", str(args.steps), "--gpu", args.gpu,
           *(["--dry-run"] if args.dry_run else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}  # (the budget's end and GRACE_S)
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1][:300] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def variant_main(args, cluster, device) -> None:
    """The `--variant` process: one point, its row as one JSON line."""
    # eager in the dry run: compiling each variant costs ~100 s on 2 cores (the MFU point compiles already)
    cfg = variant_config(args.fp8_flavor, args.variant, args.fp8_seq, args.fp8_micro, not args.dry_run)
    print(json.dumps(run_point(cfg, cluster, device, args.steps)))


def fp8_check(args, report: dict, deadline: float, save) -> None:
    """bf16 and each fp8 recipe on the fp8 flavor, one process each; `speedup` against bf16."""
    base = None
    for variant in FP8_VARIANTS:
        key = {"variant": variant, "flavor": args.fp8_flavor, "seq": args.fp8_seq, "micro_batch": args.fp8_micro}
        if time.monotonic() > deadline:
            report["skipped"].append(key)
            continue
        left = deadline - time.monotonic()
        row = key | run_variant(args, variant, left + GRACE_S if left < float("inf") else None)
        base = row if variant == "bf16" else base
        if base and "measured_step_s" in base and "measured_step_s" in row:
            row["speedup"] = round(base["measured_step_s"] / row["measured_step_s"], 4)
        report["fp8"].append(row)
        save()
        print(json.dumps(row), file=sys.stderr, flush=True)


def mfu_points(args, cluster, device, report: dict, deadline: float, save) -> None:
    """bf16 MFU of each flavor at each (seq, micro) point, in this process."""
    from vlaforge.models.build import with_seq_len

    seen = set()  # (the largest flavor that fits may be `small` itself: each point once)
    for flavor in args.flavors:
        overrides: dict = {}
        if flavor == "auto":
            flavor, overrides = largest_fitting(cluster, ["tiny"] if args.dry_run else LARGEST_FIRST, max(args.seq))
            report["largest_flavor"] = {"flavor": flavor, "recommended": overrides}
        micros = args.micro or [overrides["train"]["batch_size"] if overrides else 16]
        for seq in args.seq:
            for micro in micros:
                key = {"flavor": flavor, "seq": seq, "micro_batch": micro, "precision": "bf16"}
                if (flavor, seq, micro) in seen:
                    continue
                seen.add((flavor, seq, micro))
                if time.monotonic() > deadline:
                    report["skipped"].append(key)
                    continue
                cfg = with_seq_len(base_config(flavor, overrides), seq)
                cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": micro})})
                row = key | run_point(cfg, cluster, device, args.steps)
                report["points"].append(row)
                save()
                print(json.dumps(row), file=sys.stderr, flush=True)


GRACE_S = 45  # a variant started just before the budget's end may still compile and finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h200-141", help="the catalog GPU: its bf16 peak is MFU's denominator")
    ap.add_argument("--flavors", nargs="+", default=["auto", "small"], help="'auto': the largest that fits")
    ap.add_argument("--seq", type=int, nargs="+", default=[2048])
    ap.add_argument("--micro", type=int, nargs="+", default=None, help="micro-batches (default: 16, the GPU-bound "
                                                                      "one, and the planner's for 'auto')")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 check")
    ap.add_argument("--fp8-flavor", default="vla-7b-4l", help="the fp8 check's model (<flavor>-<N>l: N blocks)")
    ap.add_argument("--fp8-seq", type=int, default=2048)
    ap.add_argument("--fp8-micro", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=None, help="start no new point after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every point")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny flavor, small shapes")
    ap.add_argument("--variant", choices=list(FP8_VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run:
        # "auto" alone: on this CPU it resolves to tiny, so a "tiny" entry would compile and time the same point
        # again (the dry run checks the script, not the numbers); tiny-1l goes through the layer-shape flavor
        args.flavors, args.seq, args.micro, args.steps = ["auto"], [40], [2], 1
        args.fp8_flavor, args.fp8_seq, args.fp8_micro = "tiny-1l", 40, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")

    from vlaforge.planner.estimate import Cluster
    from vlaforge.planner.hardware import get_gpu

    cluster = Cluster(get_gpu(args.gpu), gpus_per_node=1, nodes=1)
    if args.variant:
        return variant_main(args, cluster, device)
    deadline = time.monotonic() + (args.budget_s if args.budget_s is not None else float("inf"))
    report = {"bench": "mfu", "torch": torch.__version__, "dry_run": args.dry_run,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "catalog_gpu": cluster.gpu.name, "peak_bf16_tflops": cluster.gpu.bf16_tflops, "fp8": [], "points": [],
              "skipped": []}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    if not args.no_fp8:
        fp8_check(args, report, deadline, save)
    mfu_points(args, cluster, device, report, deadline, save)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
