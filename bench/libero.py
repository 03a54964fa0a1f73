"""LIBERO figures (issue 44; docs/libero.md). Prints one JSON per stage and writes OUT/<stage>.json.

    python bench/libero.py expert [--states 50] [--placements 20] [--render SIZE]
        the scripted LIBERO-Object expert, physics only: every task from its first --states fixed initial states
        (50: all 500 official ones) and from --placements of LIBERO's own placement sampler (training seeds);
        success per task with Wilson intervals, mean steps, seconds; --render SIZE also renders both cameras at
        every step, as a policy's evaluation does (bench/gpu/libero.sh: the full protocol on a GPU's EGL)
    python bench/libero.py speed
        env steps per second on this machine per camera set and resolution (the expert driving, a task of
        LIBERO-Object), and one reset
    python bench/libero.py policy [--episodes 50] [--steps 6000] [--eval-states 10] [--image-size 128]
                                  [--seeds 0,1] [--curve 2000,6000] [--report]
                                  [--results bench/results/libero_object.json]
        generate LIBERO-Object demonstrations (`data generate --suite libero_object`), train recipes/libero.toml on
        them once per seed, evaluate each run on a reduced protocol (all 10 tasks, the first --eval-states fixed
        initial states each, image + wrist_image) task by task; per task and seed the successes with Wilson
        intervals, the wall time of each stage (times.json, summed over sittings, pauses included) and each
        seed's median step time from its metrics.jsonl (train_speed: the training time without them). Every stage
        resumes from what a cut run left: the recording from its spool, training from its last checkpoint (every
        --checkpoint-every steps, all kept), evaluation from the tasks already reported; the JSON is written after
        each seed. --curve evaluates earlier checkpoints too (success vs steps); --report writes the JSON from
        what is there.

The expert and speed stages run in worker processes (--workers, default 2: this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = "libero_object"
# NOTE: this file's folder comes first on sys.path, where this file would shadow LIBERO's `libero` package: it goes
# last (bench/lora.py's helper is still found there)
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from lora import timed, vlaforge


def _expert_episode(job: tuple[str, int, str, int, int]) -> dict:
    """One expert episode: (task id, task index, 'official' | 'sampler', number, render size or 0) -> success,
    steps."""
    from vlaforge.data import libero
    from vlaforge.data.metaworld import episode_seed

    task, index, kind, k, render = job
    cameras = list(libero.CAMERAS) if render else []
    env = libero.cached_env(task, cameras, render or libero.RENDER_SIZE, render=bool(render))
    if kind == "official":
        env.eval_reset(index, k, seed=7)
    else:
        env.reset(episode_seed("train", index, k))
    expert, success, steps = libero.ObjectExpert(env), False, 0
    for steps in range(1, env.max_steps + 1):  # noqa: B007 - the count is read after the loop
        _, success = env.step(expert.act())
        if render:
            env.views()
        if success:
            break
    return {"task": task, "kind": kind, "k": k, "success": success, "steps": steps, "phase": expert.phase}


def expert(args) -> dict:
    from vlaforge.data import libero
    from vlaforge.evaluation.closed_loop import wilson_interval

    tasks = libero.suite_tasks(SUITE)
    jobs = [(t.id, t.index, "official", k, args.render) for t in tasks for k in range(args.states)]
    jobs += [(t.id, t.index, "sampler", k, args.render) for t in tasks for k in range(args.placements)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        results = list(pool.imap_unordered(_expert_episode, jobs, chunksize=5))
    seconds = time.perf_counter() - t0
    out = {"stage": "expert", "suite": SUITE, "official_states_per_task": args.states,
           "sampler_placements_per_task": args.placements, "render": args.render, "workers": args.workers,
           "seconds": round(seconds, 1), "env_steps_per_s": round(sum(r["steps"] for r in results) / seconds, 1)}
    for kind in ("official", "sampler"):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        per_task = {}
        for t in tasks:
            mine = [r for r in rows if r["task"] == t.id]
            k = sum(r["success"] for r in mine)
            per_task[t.name] = {"successes": k, "episodes": len(mine),
                                "ci95": [round(x, 3) for x in wilson_interval(k, len(mine))],
                                "mean_steps": round(sum(r["steps"] for r in mine) / len(mine), 1),
                                "failures": [(r["k"], r["phase"]) for r in mine if not r["success"]]}
        k = sum(r["success"] for r in rows)
        out[kind] = {"success_rate": round(k / len(rows), 4), "successes": k, "episodes": len(rows),
                     "ci95": [round(x, 4) for x in wilson_interval(k, len(rows))], "tasks": per_task}
    return out


def _speed_case(case: tuple[tuple[str, ...], int]) -> dict:
    from vlaforge.data import libero

    cameras, size = case
    task = libero.suite_tasks(SUITE)[0]
    t0 = time.perf_counter()
    env = libero.LiberoEnv(task.id, list(cameras), size, render=bool(cameras))
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    env.eval_reset(0, 0, seed=7)
    reset = time.perf_counter() - t0
    expert, n = libero.ObjectExpert(env), 60
    t0 = time.perf_counter()
    for _ in range(n):
        env.step(expert.act())
        if cameras:
            env.views()
    seconds = time.perf_counter() - t0
    env.close()
    return {"cameras": list(cameras), "image_size": size, "env_build_s": round(build, 2),
            "reset_s": round(reset, 2), "steps_per_s": round(n / seconds, 1),
            "episode_s_at_120_steps": round(120 * seconds / n + reset, 1)}


def speed(args) -> dict:
    cases = [((), 256), (("image",), 128), (("image", "wrist_image"), 128), (("image",), 256),
             (("image", "wrist_image"), 256)]
    rows = []
    for case in cases:  # NOTE: one process at a time: the figures are per core, undisturbed
        with mp.get_context("spawn").Pool(1) as pool:
            rows.append(pool.apply(_speed_case, (case,)))
        print(json.dumps(rows[-1]), flush=True)
    return {"stage": "speed", "suite": SUITE, "cases": rows, "cpu": os.cpu_count()}


def _latest_step(run: Path) -> int:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().strip().rsplit("_", 1)[-1]) if latest.is_file() else 0


def policy(args) -> dict:
    """Generate, train (per seed) and evaluate (per seed and task; --curve: also earlier checkpoints), each stage
    resumable from what an earlier sitting left: the recording from its spool, training from its last checkpoint,
    evaluation task by task. The JSON is written after each seed, so a cut sitting keeps the seeds it finished
    (those still running are listed under "pending"); --report writes it from what is there and runs nothing."""
    from vlaforge.data.libero import suite_tasks

    out = Path(args.out).resolve()
    data, times_file = out / "data", out / "times.json"
    seeds = [int(x) for x in str(args.seeds).split(",") if x]
    curve = sorted({int(x) for x in str(args.curve).split(",") if x} - {args.steps})
    if not args.report and not (data / "meta" / "info.json").is_file():
        timed(times_file, "generate_s", lambda: vlaforge(
            "data", "generate", "--suite", SUITE, "--out", str(data), "--episodes", str(args.episodes),
            "--image-size", str(args.image_size), "--workers", str(args.workers), "--no-progress",
            log=out / "generate.log"))
    tasks = [t.name for t in suite_tasks(SUITE)]
    command = " ".join(a for a in sys.argv if a != "--report")
    result = {"stage": "policy", "suite": SUITE, "command": command, "episodes_per_task": args.episodes,
              "train_steps": args.steps, "image_size": args.image_size, "eval_states_per_task": args.eval_states,
              "protocol": f"reduced: all {len(tasks)} tasks x the first {args.eval_states} official initial states",
              "seeds": {}, "pending": {}}
    for seed in seeds:
        run = out / f"run_s{seed}"
        if not args.report:
            _train(args, run, seed, data, out, times_file)
        points = {step: _evaluate(args, run, seed, step, tasks, out, times_file) for step in (args.steps, *curve)}
        done = {step: p for step, p in points.items() if p is not None}
        if args.steps in done:
            result["seeds"][str(seed)] = done.pop(args.steps) | {"train_speed": _train_speed(run, args.steps)} | (
                {"curve": {str(k): _brief(v) for k, v in done.items()}} if curve else {})
        else:
            result["pending"][str(seed)] = {"trained_steps": _latest_step(run),
                                            "evaluated": {str(k): _brief(v) for k, v in done.items()}}
        _write_policy(args, result, data, times_file)
    return result


def _train(args, run: Path, seed: int, data: Path, out: Path, times_file: Path) -> None:
    """Train seed `seed` to --steps (resumed from the run's last checkpoint), keeping every checkpoint (the curve)."""
    if _latest_step(run) >= args.steps:
        return
    resume = ["--train.resume=latest"] if _latest_step(run) else []
    timed(times_file, f"train_s{seed}_s", lambda: vlaforge(
        "train", str(ROOT / "recipes" / "libero.toml"), f"--data.path={data}", f"--train.output_dir={run}",
        f"--train.steps={args.steps}", f"--train.checkpoint_every={args.checkpoint_every}",
        f"--train.keep_checkpoints={args.steps // args.checkpoint_every + 1}", f"--train.seed={seed}",
        "--train.progress=false", *resume, log=out / f"train_s{seed}.log"))


def _train_speed(run: Path, steps: int) -> dict:
    """The run's median step seconds from its metrics.jsonl (the planner's `--calibrate` reader), times its steps: the
    training time without the pauses and restarts that times.json's wall clock counts when a run spans sittings."""
    from vlaforge.planner.calibrate import read_run

    step_s = read_run(run).step_s
    return {"median_step_s": round(step_s, 4), "steps_x_median_s": round(step_s * steps, 1)}


def _evaluate(args, run: Path, seed: int, step: int, tasks: list[str], out: Path, times_file: Path) -> dict | None:
    """Seed `seed`'s checkpoint at `step` on the reduced protocol, task by task (each task's report kept); None
    while that checkpoint is missing or, under --report, a task is unevaluated."""
    from vlaforge.evaluation.closed_loop import wilson_interval

    final = step == args.steps
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    root = out / (f"eval_s{seed}" if final else f"eval_s{seed}_step{step}")
    per_task = {}
    for i, task in enumerate(tasks):
        evald = root / f"task_{i:02d}"
        if not (evald / "report.json").is_file():
            if args.report or not ckpt.is_dir():
                return None
            key = f"eval_s{seed}_s" if final else "eval_curve_s"
            timed(times_file, key, lambda evald=evald, task=task, i=i: vlaforge(
                "eval", str(ckpt), "--benchmark", SUITE, "--tasks", task, "--episodes", str(args.eval_states),
                "--workers", str(args.workers), "--out", str(evald), "--no-progress",
                log=out / f"{root.name}_task{i:02d}.log"))
        per_task.update(json.loads((evald / "report.json").read_text())["tasks"])
    wins = {t: v["successes"] for t, v in per_task.items()}
    n = {t: v["episodes"] for t, v in per_task.items()}
    total, count = sum(wins.values()), sum(n.values())
    return {"mean_success_rate": total / count, "successes": total, "episodes": count,
            "ci95": wilson_interval(total, count),
            "tasks": {t: {"successes": wins[t], "episodes": n[t], "success_rate": wins[t] / n[t],
                          "ci95": wilson_interval(wins[t], n[t])} for t in per_task}}


def _brief(point: dict) -> dict:
    """A curve point: the mean with its interval and each task's successes."""
    return {"mean_success_rate": point["mean_success_rate"], "ci95": point["ci95"],
            "successes": {t: v["successes"] for t, v in point["tasks"].items()}}


def _write_policy(args, result: dict, data: Path, times_file: Path) -> None:
    """OUT/policy.json and --results, from what is measured so far (renamed into place)."""
    from vlaforge.outputs import write_atomic

    info = data / "meta" / "info.json"
    summary = json.loads(info.read_text()) if info.is_file() else {}
    result |= {"frames": summary.get("total_frames"), "episodes": summary.get("total_episodes"),
               "times_s": json.loads(times_file.read_text()) if times_file.is_file() else {},
               "machine": {"cores": os.cpu_count()}, "date": time.strftime("%Y-%m-%d")}
    for path in (Path(args.out) / "policy.json", *([args.results] if args.results else [])):
        write_atomic(path, json.dumps(result, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["expert", "speed", "policy"])
    parser.add_argument("--out", default="bench-out/libero")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--states", type=int, default=50)
    parser.add_argument("--placements", type=int, default=20)
    parser.add_argument("--render", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--eval-states", type=int, default=10)
    parser.add_argument("--seeds", default="0", help="policy: training seeds, comma-separated")
    parser.add_argument("--results", help="policy: also write the JSON here (bench/results/libero_object.json)")
    parser.add_argument("--curve", default="", help="policy: also evaluate the checkpoints at these steps, "
                                                    "comma-separated multiples of --checkpoint-every (the steps curve)")
    parser.add_argument("--report", action="store_true", help="policy: write the JSON from what earlier sittings "
                                                              "left, running nothing")
    parser.add_argument("--image-size", type=int, default=128)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"expert": expert, "speed": speed, "policy": policy}[args.stage](args)
    if args.stage != "policy":  # policy writes OUT/policy.json itself, after each seed
        from vlaforge.outputs import write_atomic

        result["date"] = time.strftime("%Y-%m-%d")
        write_atomic(Path(args.out) / f"{args.stage}.json", json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
