"""Does distillation beat training the small model on the same data? Teacher, student from scratch, student
distilled with every term, and ablations with each term off - every run on the same data, steps and seed.

Each run is judged the same way: parameters per component, per-prediction latency through `PolicyRuntime`
(interleaved with the teacher's on the same frames, so the ratio is side by side), action error against the expert
on held-out frames (a dataset generated from other seeds), and closed-loop success per task on the same held-out
episodes. Runs and results already in --out are reused (the bench resumes, and a later --variants adds to it; the
teacher's latency is then from the earlier invocation); the distilled runs share one teacher-output cache.

  python bench/distillation.py --data data/metaworld_demo --heldout data/metaworld_heldout --out runs/distill_bench

Writes OUT/distillation.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np
import torch

from vlaforge.checkpoints.layout import CONFIG_FILE, resolve_checkpoint
from vlaforge.config.loading import load_config
from vlaforge.evaluation.closed_loop import InferenceOptions, eval_tasks, evaluate
from vlaforge.evaluation.quantization import action_error, dataset_frames, side_by_side
from vlaforge.inference.runtime import PolicyRuntime
from vlaforge.models.build import parameter_counts
from vlaforge.outputs import write_atomic

# variant -> the [distill] overrides of the student (None: no teacher)
VARIANTS = {
    "scratch": None,
    "distilled": {},
    "no_action": {"weights.action": 0.0},
    "no_kl": {"weights.kl": 0.0},
    "no_feature": {"weights.feature": 0.0},
    "distill_only": {"no_data": True},  # the teacher's targets alone: data action loss off
}


def train(recipe: Path, out: Path, args, extra: list[str]) -> float:
    """`vlaforge train RECIPE` into `out` (skipped when it already finished); returns the seconds it took."""
    if (out / "checkpoints" / "latest").is_file():
        return json.loads((out / "bench_train.json").read_text())["seconds"] if (out / "bench_train.json").is_file() \
            else float("nan")
    cmd = [sys.executable, "-m", "vlaforge", "train", str(recipe), f"--data.path={args.data}",
           f"--train.output_dir={out}", f"--train.steps={args.steps}", f"--train.seed={args.seed}",
           "--train.progress=false", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"training {out} failed:\n{done.stderr[-3000:]}")
    seconds = round(time.perf_counter() - t0, 1)
    write_atomic(out / "bench_train.json", json.dumps({"seconds": seconds, "command": cmd}) + "\n")
    return seconds


def student_args(variant: str, teacher: Path, cache: Path) -> list[str]:
    spec = VARIANTS[variant]
    if spec is None:
        return []
    extra = [f"--distill.teacher={teacher}", f"--distill.cache={cache}"]
    for key, value in spec.items():
        if key == "no_data":
            extra.append("--loss.weights.action=0.0")
        else:
            extra.append(f"--distill.{key}={value}")
    return extra


def closed_loop(run: Path, episodes: int, execute: int, workers: int) -> dict:
    cfg = load_config(resolve_checkpoint(str(run), ".") / CONFIG_FILE)
    r = evaluate(run, eval_tasks(cfg), episodes, options=InferenceOptions(execute=execute),
                 max_steps=cfg.eval.max_steps, workers=workers, seed=cfg.eval.seed, out=run / "bench_eval",
                 video=False, progress=False)
    return {"mean_success_rate": r["mean_success_rate"], "seconds": r["seconds"],
            "tasks": {t: {"success_rate": v["success_rate"], "ci95": v["ci95"]} for t, v in r["tasks"].items()}}


def offline(teacher_rt: PolicyRuntime, run: Path, frames, rounds: int) -> dict:
    """Parameters, latency side by side with the teacher, and error against the expert on held-out frames."""
    rt = PolicyRuntime.load(run, device="cpu")
    ref, got, t_teacher, t_mine = side_by_side(teacher_rt, rt, frames, seed=0, rounds=rounds)
    expert = np.stack([f.expert for f in frames])
    p50 = lambda v: float(np.percentile(v, 50))
    return {"params": parameter_counts(rt.model),
            "latency_ms_p50": round(p50(t_mine), 3), "teacher_latency_ms_p50": round(p50(t_teacher), 3),
            "speedup_vs_teacher": round(p50(t_teacher) / p50(t_mine), 3),
            "expert_mse_normalized": float(np.mean((got - expert) ** 2)),
            "against_teacher": action_error(ref, got)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/metaworld_demo")
    ap.add_argument("--heldout", default="data/metaworld_heldout", help="held-out frames (other generation seeds)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "distill_bench")
    ap.add_argument("--teacher-recipe", type=Path, default=ROOT / "recipes" / "distill_teacher.toml")
    ap.add_argument("--student-recipe", type=Path, default=ROOT / "recipes" / "distill_student.toml")
    ap.add_argument("--steps", type=int, default=None, help="every run's steps (default: the recipes')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--execute", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--frames", type=int, default=200, help="held-out frames for latency and action error")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = load_config(args.student_recipe).train.steps
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = args.out / "teacher"
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{torch.get_num_threads()} threads, CPU",
              "steps": args.steps, "seed": args.seed, "episodes_per_task": args.episodes, "execute": args.execute,
              "runs": {}}
    report["runs"]["teacher"] = {"train_s": train(args.teacher_recipe, teacher, args, [])}
    cache = args.out / "teacher_cache.safetensors"
    for variant in args.variants.split(","):
        report["runs"][variant] = {"train_s": train(args.student_recipe, args.out / variant, args,
                                                    student_args(variant, teacher, cache))}
    teacher_rt = PolicyRuntime.load(teacher, device="cpu")
    frames = dataset_frames(args.heldout, teacher_rt.spec, args.frames, seed=args.seed)
    for name, row in report["runs"].items():
        run = args.out / name
        done = run / "bench_result.json"  # a later invocation (more variants) reuses what was measured
        if done.is_file():
            row.update(json.loads(done.read_text()))
        else:
            row.update(offline(teacher_rt, run, frames, args.rounds))
            row["closed_loop"] = closed_loop(run, args.episodes, args.execute, args.workers)
            write_atomic(done, json.dumps(row) + "\n")  # a killed bench leaves no half-written row
        print(json.dumps({name: row}), flush=True)
    t_mean = report["runs"]["teacher"]["closed_loop"]["mean_success_rate"]
    for row in report["runs"].values():
        row["success_vs_teacher"] = round(row["closed_loop"]["mean_success_rate"] / max(t_mean, 1e-9), 4)
    if "scratch" in report["runs"] and "distilled" in report["runs"]:
        s, d = (report["runs"][k]["closed_loop"]["mean_success_rate"] for k in ("scratch", "distilled"))
        report["distilled_minus_scratch"] = round(d - s, 4)
    text = json.dumps(report, indent=1)
    write_atomic(args.out / "distillation.json", text + "\n")
    print(text)


if __name__ == "__main__":
    main()
