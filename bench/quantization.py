"""Post-training quantization per component, and quantization-aware training where it breaks, side by side.

Every variant is judged on the same held-out frames (action error against the float policy and against the
demonstrations) and in closed loop (the same episodes):

  float              the run as trained
  ptq <layout>       `vlaforge quantize` of the run, one row per --ptq layout
  finetune + ptq     the run fine-tuned --steps more steps without QAT, then quantized with --breaks (a control: the
                     extra training alone)
  qat                the run fine-tuned --steps more steps with fake quantization of --breaks, then quantized

QAT's recovery is (ptq - qat) / (ptq - float) of the demonstration error and of the success rate.

  python bench/quantization.py --run runs/tiny_metaworld --data /tmp/heldout --episodes 50 --out quant.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlaforge.evaluation.closed_loop import InferenceOptions, eval_tasks, evaluate
from vlaforge.evaluation.quantization import QuantizeOptions, quantize_run


def layout(text: str) -> dict[str, str]:
    """'vision=int8,projector=fp16,llm=int4' -> {component: mode}."""
    return dict(part.split("=", 1) for part in text.split(",") if part)


def closed_loop(folder: Path, cfg, episodes: int, workers: int, out: Path) -> dict:
    r = evaluate(folder, eval_tasks(cfg), episodes, options=InferenceOptions(execute=cfg.eval.execute),
                 max_steps=cfg.eval.max_steps, workers=workers, seed=cfg.eval.seed, out=out, video=False,
                 progress=False)
    return {"mean_success_rate": r["mean_success_rate"], "seconds": r["seconds"],
            "tasks": {t: {"success_rate": v["success_rate"], "ci95": v["ci95"]} for t, v in r["tasks"].items()}}


def quantized(run: Path, out: Path, modes: dict[str, str], args) -> dict:
    r = quantize_run(run, out, QuantizeOptions(modes, group_size=args.group_size, frames=args.frames,
                                               data=args.data, progress=False))
    return {"layout": {c: q["policy"]["mode"] for c, q in r["layout"]["components"].items()},
            "bytes_ratio_disk": r["bytes"]["total"]["ratio_disk"],
            "bytes_ratio_memory": r["bytes"]["total"]["ratio_memory"], "action_error": r["action_error"],
            "expert_mse_normalized": r["expert_mse_normalized"], "latency_ms": r["latency_ms"]}


def finetune(run: Path, out: Path, modes: dict[str, str], qat: bool, args) -> Path:
    """`vlaforge train` from the run's weights for --steps steps at --lr-scale of its lr (fake quantization of
    `modes` when `qat`)."""
    cmd = [sys.executable, "-m", "vlaforge", "train", str(run / "config.toml"), f"--train.init_from={run}",
           f"--train.steps={args.steps}", f"--train.output_dir={out}", "--train.progress=false",
           f"--train.warmup_steps={min(50, args.steps // 10)}", "--train.checkpoint_every=0", "--eval.every=0"]
    from vlaforge.config import load_config

    cfg = load_config(run / "config.toml")
    cmd += [f"--components.{c}.lr={p.lr * args.lr_scale:.3g}" for c, p in cfg.components.items()]
    if qat:
        cmd += [f"--components.{c}.qat={m}" for c, m in modes.items()]
        cmd += [f"--components.{c}.qat_group_size={args.group_size}" for c in modes]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="the float run (a make demo checkpoint)")
    p.add_argument("--data", required=True, help="held-out dataset for the frames")
    p.add_argument("--ptq", action="append", default=None, help="a layout, e.g. vision=int8,projector=fp16,llm=int4")
    p.add_argument("--breaks", default="vision=int2,projector=int2,llm=int2", help="the layout PTQ breaks at; QAT "
                                                                                   "trains it")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=600, help="fine-tuning steps of QAT and its control")
    p.add_argument("--lr-scale", type=float, default=0.3, help="fine-tuning lr: the run's lr of each component times "
                                                               "this")
    p.add_argument("--frames", type=int, default=128)
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--work", default="/tmp/vlaforge_bench_quant")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from vlaforge.checkpoints.layout import CONFIG_FILE, resolve_checkpoint
    from vlaforge.config import load_config

    run, work = resolve_checkpoint(args.run, ".", what="--run"), Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = load_config(run / CONFIG_FILE)
    t0 = time.perf_counter()
    result = {"run": str(run), "data": args.data, "episodes_per_task": args.episodes, "variants": {}}
    v = result["variants"]

    def done(name: str, row: dict, folder: Path) -> None:
        row["closed_loop"] = closed_loop(folder, cfg, args.episodes, args.workers, work / f"eval{len(v)}")
        v[name] = row
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if args.out:  # after every variant: an interrupted run keeps what finished
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({name: row}), file=sys.stderr, flush=True)

    done("float", {}, run)
    breaks = layout(args.breaks)
    for text in (args.ptq or ["vision=int8,projector=fp16,llm=int4"]) + [args.breaks]:
        folder = work / f"q{len(v)}"
        done(f"ptq {text}", quantized(run, folder, layout(text), args), folder)
    for name, qat in (("qat", True), ("finetune + ptq", False)):
        tuned = finetune(run, work / name.replace(" ", "").replace("+", "_"), breaks, qat, args)
        folder = work / f"q{len(v)}"
        done(name, quantized(tuned, folder, breaks, args), folder)
    result["recovery"] = recovery(v, f"ptq {args.breaks}")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def recovery(v: dict, ptq: str) -> dict:
    """Share of what PTQ lost that QAT (and the fine-tuning control) won back: demonstration error, success."""
    def share(key, get):
        lost = get(v[ptq]) - get(v["float"])
        return None if abs(lost) < 1e-12 else round((get(v[ptq]) - get(v[key])) / lost, 3)

    err = lambda d: d["expert_mse_normalized"]["quantized"] if "expert_mse_normalized" in d \
        else v[ptq]["expert_mse_normalized"]["float"]
    succ = lambda d: -d["closed_loop"]["mean_success_rate"]
    return {k: {"expert_error": share(k, err), "success": share(k, succ)} for k in ("qat", "finetune + ptq")}


if __name__ == "__main__":
    main()
