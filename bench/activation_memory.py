"""Activation memory and recomputation time of each checkpointing strategy at 1k / 2k / 4k tokens. Prints JSON.

Bytes: the `small` flavor (`--bytes-flavor`) under fake tensors. These are exact: the accounting counts every tensor
saved for backward, and tests/test_activation_memory.py checks that fake and real runs agree. Times: on CPU, the
`tiny` flavor on real tensors (forward + backward; per round the median of --repeats after a warm-up, then the median
over --rounds whole profiles run one after another); `--time-flavor small` times the `small` flavor instead (a step
at 512 tokens takes ~11 s on 2 cores, so pick a few --time-strategies). With a GPU (`--device cuda`), everything is
measured on the `small` flavor (`--bytes-flavor`) on real tensors, with CUDA's peak.

Targets checked (from the issue):
- `full` saves at least 85 % of activation bytes;
- `selective` saves at least 50 % at no more than 60 % of full's time overhead;
- CPU offload of the LLM (min bytes 0) leaves none of the LLM's saved tensors in device accounting.

    python bench/activation_memory.py [--seq 1024 2048 4096] [--repeats 3] [--rounds 3] [--device auto|cpu|cuda]
        [--time-flavor tiny|small] [--time-strategies full selective] [--bytes-flavor small|tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from vlaforge.config import load_config
from vlaforge.diagnostics.profile import STRATEGIES, profile

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_synthetic.toml"


def config(flavor: str, precision: str):
    comps = {c: {"precision": precision, "offload_min_bytes": 0} for c in ("vision", "projector", "llm",
                                                                            "action_head")}
    model = {"flavor": flavor, **({"image_size": None} if flavor != "tiny" else {})}
    return load_config(RECIPE, {"model": model, "components": comps, "data": {"max_text_tokens": 8}})


def summarize(report: dict) -> dict:
    rows = report["strategies"]
    out = {}
    for name, r in rows.items():
        row = {"activation_bytes": r["activation_bytes"], "activation_vs_none": r["activation_vs_none"],
               "llm_bytes": r["per_component"].get("llm", 0), "weight_cast_bytes": r["weight_cast_bytes"]}
        if "step_s" in r:
            row |= {"step_s": r["step_s"], "overhead_vs_none": r["overhead_vs_none"]}
            if "rounds_step_s" in r:
                row["rounds_step_s"] = r["rounds_step_s"]
        if report["device"].startswith("cuda"):
            row["cuda_peak_bytes"] = r["peak_bytes"]
        out[name] = row
    return out


def timed_rounds(cfg, seq: int, args, device) -> dict:
    """`--rounds` whole profiles one after another, the strategies in reverse order every other round (the process
    warms up over the first minutes, which would favour whichever strategy always comes last); per strategy the
    median step time over rounds, so that machine noise hits every strategy alike."""
    order = ["none", *[s for s in args.time_strategies or STRATEGIES if s != "none"]]
    reports = [profile(cfg, seq_len=seq, repeats=args.repeats, device=device,
                       strategies=order if i % 2 == 0 else order[::-1]) for i in range(args.rounds)]
    merged = reports[0]
    for name, row in merged["strategies"].items():
        row["step_s"] = statistics.median(r["strategies"][name]["step_s"] for r in reports)
        row["rounds_step_s"] = [r["strategies"][name]["step_s"] for r in reports]
    base = merged["strategies"]["none"]["step_s"]
    for row in merged["strategies"].values():
        row["overhead_vs_none"] = row["step_s"] / base - 1
    return merged


def targets(bytes_rows: dict, time_rows: dict) -> dict:
    full, sel = bytes_rows["full"], bytes_rows["selective"]
    out = {"full_saves": 1 - full["activation_vs_none"], "selective_saves": 1 - sel["activation_vs_none"],
           "llm_bytes_on_device_with_cpu_offload": bytes_rows["none+cpu_offload"]["llm_bytes"]}
    full_overhead = time_rows.get("full", {}).get("overhead_vs_none", 0.0)
    if full_overhead > 0:  # a ratio of overheads means nothing when full's is lost in the noise
        out["selective_overhead_over_full_overhead"] = time_rows["selective"]["overhead_vs_none"] / full_overhead
    out["full_saves_at_least_85pct"] = out["full_saves"] >= 0.85
    out["selective_saves_at_least_50pct"] = out["selective_saves"] >= 0.50
    if "selective_overhead_over_full_overhead" in out:
        out["selective_overhead_at_most_60pct_of_full"] = out["selective_overhead_over_full_overhead"] <= 0.60
    out["offload_empties_llm_device_accounting"] = out["llm_bytes_on_device_with_cpu_offload"] == 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per strategy per round")
    ap.add_argument("--rounds", type=int, default=3, help="CPU: whole profiles whose median time is reported")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--time-flavor", default="tiny", choices=["tiny", "small"],
                    help="CPU: the flavor whose step times are measured (small: ~11 s a step at 512 tokens)")
    ap.add_argument("--bytes-flavor", default="small", choices=["small", "tiny"],
                    help="the flavor whose activation bytes are counted (tiny: the GPU campaign's CPU dry run)")
    ap.add_argument("--time-strategies", nargs="+", default=None, choices=list(STRATEGIES),
                    help="CPU: time only these strategies (none is always timed), e.g. full selective")
    args = ap.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    timed = f"{args.bytes_flavor}, real tensors" if cuda else f"{args.time_flavor}, real tensors, fp32"
    results = {"bench": "activation_memory", "torch": torch.__version__,
               "hardware": torch.cuda.get_device_name(0) if cuda else f"CPU ({torch.get_num_threads()} threads)",
               "bytes_from": f"{args.bytes_flavor}, " + ("real tensors" if cuda else "fake tensors (exact)"),
               "times_from": timed,
               "seq": {}}
    for seq in args.seq:
        counted = config(args.bytes_flavor, "bf16")
        bytes_report = profile(counted, fake=not cuda, seq_len=seq, offload=True, repeats=args.repeats, device=device)
        if cuda:
            time_report = bytes_report
        else:
            time_report = timed_rounds(config(args.time_flavor, "fp32"), seq, args, device)
        bytes_rows, time_rows = summarize(bytes_report), summarize(time_report)
        results["seq"][str(seq)] = {"bytes": bytes_rows, "times": time_rows, "targets": targets(bytes_rows,
                                                                                                 time_rows)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
