"""`vlaforge eval`: closed-loop success rate of a trained policy in Meta-World or on a LIBERO benchmark suite.

The policy runs through `inference.PolicyRuntime` (it sees exactly what training showed it: the checkpoint's
`policy.json` and `tokenizer.json`) and `inference.ChunkExecutor` (receding horizon by default: predict T actions,
execute the first K, predict again; or asynchronous, with simulated latency, ensembling or RTC), so every inference
option is judged by closed-loop success next to its speed. Meta-World's initial positions come from the evaluation
seed range, disjoint from the generation seeds; LIBERO's are the benchmark's fixed initial states (episode i starts
from state i, after LIBERO's settle steps; `libero_protocol`). Episodes run in parallel worker processes (rendering
dominates); with one worker, in the evaluating process itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from vlaforge.data import libero
from vlaforge.data.metaworld import FPS, cached_env, parse_tasks
from vlaforge.errors import VlaforgeError
from vlaforge.inference.chunking import ChunkExecutor
from vlaforge.inference.feature_cache import CacheConfig, CacheStats
from vlaforge.inference.runtime import Observation, PolicyRuntime, latency_summary
from vlaforge.outputs import write_atomic
from vlaforge.progress import progress_bar
from vlaforge.serving.client import PolicyClient, RemoteRuntime


def eval_tasks(cfg) -> list[str]:
    """The tasks to evaluate a run on: `eval.tasks`, else the tasks its dataset was generated from."""
    from vlaforge.data.generate import recorded_tasks
    from vlaforge.data.hub_dataset import dataset_root
    from vlaforge.data.lerobot_v3 import read_info

    if cfg.eval.tasks:
        return list(cfg.eval.tasks)
    if cfg.model.lerobot.pretrained and cfg.data.source != "lerobot":
        raise VlaforgeError("a LeRobot policy folder names no simulator tasks; pass --tasks (Meta-World) or "
                            "--benchmark (a LIBERO suite) whose cameras the policy reads")
    if cfg.data.source != "lerobot" or not cfg.data.path:
        raise VlaforgeError(f"the run trained on {cfg.data.source} samples (data.source = {cfg.data.source!r}), "
                            "which name no simulator tasks and no simulator can feed its policy; evaluate a run "
                            "trained on a `vlaforge data generate` dataset (e.g. recipes/tiny_metaworld.toml)")
    tasks = recorded_tasks(read_info(dataset_root(cfg.data))) if cfg.data.path else []
    if not tasks:
        raise VlaforgeError(f"dataset {cfg.data.path} names no Meta-World tasks to evaluate on; set eval.tasks "
                            "(or pass --tasks), or pass --benchmark for a LIBERO suite")
    return tasks


def recorded_scene(cfg) -> bool:
    """Whether the run's dataset was rendered with the tasks' distractors hidden (evaluation then renders alike)."""
    from vlaforge.data.generate import recorded_hidden_distractors
    from vlaforge.data.hub_dataset import dataset_root
    from vlaforge.data.lerobot_v3 import read_info

    if not cfg.data.path:
        return False
    root = dataset_root(cfg.data, fetch=False)
    return recorded_hidden_distractors(read_info(root)) if (root / "meta" / "info.json").is_file() else False


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class InferenceOptions:
    """How the policy runs in closed loop: the runtime's options and the chunk execution's."""

    cache: str = "exact"
    compile: str = "off"
    dtype: str = "auto"
    device: str = "cpu"
    execute: int = 1
    asynchronous: bool = False
    merge: str = "replace"
    latency_ms: float = 0.0
    cache_options: dict = field(default_factory=dict)
    server: str | None = None  # ws://HOST:PORT: predict through a running `vlaforge serve` instead
    api_key: str | None = None
    backend: str = "auto"  # torch, onnx (an exported package), auto: by what the folder holds
    lerobot: dict | None = None  # a LeRobot policy folder's model.lerobot settings (tokenizer, vlm, sizes)

    def runtime(self, ckpt: Path) -> PolicyRuntime | RemoteRuntime:
        if self.server:
            return RemoteRuntime(PolicyClient(self.server, self.api_key))
        return PolicyRuntime.load(ckpt, device=self.device, dtype=self.dtype, compile=self.compile,
                                  cache=CacheConfig(mode=self.cache, **self.cache_options), backend=self.backend,
                                  lerobot=self.lerobot)

    def executor(self, runtime: PolicyRuntime, session: str, fps: float = FPS) -> ChunkExecutor:
        return ChunkExecutor(runtime, session, execute=self.execute, period_s=1 / fps, merge=self.merge,
                             asynchronous=self.asynchronous, latency_ms=self.latency_ms)


@dataclass(frozen=True)
class Job:
    task: str
    task_index: int
    episode: int
    seed: int
    max_steps: int
    record: bool
    hide_distractors: bool = False


_WORKER: dict[str, Any] = {}


def _init_worker(ckpt: str, options: InferenceOptions, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["runtime"], _WORKER["options"] = options.runtime(Path(ckpt)), options


def simulator_env(task: str, cameras: list[str], image_size: int, hide_distractors: bool = False):
    """This process's environment of a Meta-World task or a LIBERO task (`suite/name`): both have `eval_reset`,
    `instruction`, `step`, `views`, `state`, `max_steps` and `fps`."""
    if libero.is_libero_task(task):
        return libero.cached_env(task, cameras, image_size)
    return cached_env(task, cameras, image_size, hide_distractors)


def run_episode(job: Job) -> dict[str, Any]:
    """One held-out episode; returns success, length, the inference figures and (if `record`) the frames."""
    runtime: PolicyRuntime = _WORKER["runtime"]
    env = simulator_env(job.task, runtime.cameras, runtime.spec.render_size, job.hide_distractors)
    torch.manual_seed(job.seed)  # flow-matching heads sample noise
    obs = env.eval_reset(job.task_index, job.episode, job.seed)
    instruction = env.instruction(job.episode)
    runtime.reset("episode")
    executor = _WORKER["options"].executor(runtime, "episode", env.fps)
    success, frames, steps = False, [], 0
    try:
        for steps in range(1, job.max_steps + 1):  # noqa: B007 - the count is read after the loop
            wanted = executor.needs_observation()
            views = env.views() if job.record or wanted else None
            if job.record:
                frames.append(np.concatenate([views[c] for c in runtime.cameras], axis=1))
            observation = Observation(views, env.state(obs), instruction) if wanted else None
            obs, success = env.step(executor.act(observation))
            if success:
                break
    finally:
        executor.close()
    return {"task": job.task, "episode": job.episode, "success": success, "length": steps, "fps": env.fps,
            "initial_state_sha256": getattr(env, "start_digest", None),
            "frames": np.stack(frames) if frames else None, "execution": executor.stats,
            "cache": runtime.session("episode").cache.stats}


def libero_protocol(benchmark: str, tasks: str | None, episodes: int | None,
                    max_steps: int | None) -> tuple[list[str], int, int, dict[str, Any]]:
    """LIBERO's evaluation protocol for a suite: every task, 50 episodes each from the fixed initial states, the
    suite's episode limit (openpi's values, `libero.MAX_STEPS`). `tasks` (the first N tasks, or names / indices
    separated by commas) and `episodes` reduce it, and the returned protocol record says so.

    Returns:
        (task ids, episodes per task, max steps, the protocol record for report.json)
    """
    suite = libero.suite_tasks(benchmark)
    if tasks is None:
        chosen = list(suite)
    elif tasks.strip().isdigit():
        n = int(tasks)
        if not 1 <= n <= len(suite):
            raise VlaforgeError(f"--tasks {n}: {benchmark} has {len(suite)} tasks; ask for 1 to {len(suite)}")
        chosen = list(suite[:n])
    else:
        by_name = {t.name: t for t in suite} | {str(t.index): t for t in suite}
        names = [x.strip().removeprefix(f"{benchmark}/") for x in tasks.split(",") if x.strip()]
        bad = [x for x in names if x not in by_name]
        if bad or not names:
            hint = libero.closest_name(bad[0], [t.name for t in suite]) if bad else ""
            raise VlaforgeError(f"--tasks: {bad[0] if bad else '(none)'!r} is not a task of {benchmark}{hint}; give "
                                f"a count, task indices 0-{len(suite) - 1} or names ({suite[0].name}, ...)")
        chosen = [by_name[x] for x in names]
        twice = [t for k, t in enumerate(chosen) if t in chosen[:k]]
        if twice:
            raise VlaforgeError(f"--tasks names task {twice[0].index} ({twice[0].name}) twice; give each task once")
    episodes = libero.EPISODES_PER_TASK if episodes is None else episodes
    if episodes > libero.EPISODES_PER_TASK:
        raise VlaforgeError(f"--episodes {episodes}: LIBERO has {libero.EPISODES_PER_TASK} fixed initial states per "
                            f"task; ask for at most {libero.EPISODES_PER_TASK}")
    limit = libero.MAX_STEPS[benchmark] if max_steps is None else max_steps
    libero.check_max_steps(benchmark, limit)
    full = (len(chosen) == len(suite) and episodes == libero.EPISODES_PER_TASK
            and limit == libero.MAX_STEPS[benchmark])
    record = {"benchmark": benchmark, "protocol": "full" if full else "reduced",
              "initial_states": "the benchmark's fixed initial states: episode i starts from state i",
              "settle_steps": libero.SETTLE_STEPS, "suite_tasks": len(suite),
              "suite_max_steps": libero.MAX_STEPS[benchmark],
              "instructions": {t.id: t.instruction for t in chosen}}
    return [t.id for t in chosen], episodes, limit, record


def evaluate(ckpt: str | Path, tasks: list[str], episodes: int, *, options: InferenceOptions, max_steps: int,
             workers: int, seed: int = 0, out: str | Path | None = None, video: bool = True,
             progress: bool = True, hide_distractors: bool | None = None,
             protocol: dict[str, Any] | None = None, isolated: bool = False) -> dict[str, Any]:
    """Evaluate a checkpoint; writes `report.json` (and `videos/<task>.mp4`) to `out` (default CKPT/eval).
    `hide_distractors`: render the tasks' distractors invisible; None: as the checkpoint's training dataset was
    rendered (`recorded_scene`). `protocol`: a LIBERO benchmark's record (`libero_protocol`; `tasks` are then its
    task ids), copied into the report. One worker runs the episodes in this process with the runtime the checks
    loaded (a spawned worker would import torch and the simulator again, ~8 s, and hold a second copy of the model)
    unless `isolated`: the trainer's evaluations keep the simulator, its GL context and the runtime out of the
    training process."""
    ckpt = Path(ckpt)
    tasks = list(tasks) if protocol else parse_tasks(tasks)
    # fail fast, in this process, with a clear message (a bad checkpoint, execute, merge or cache option)
    runtime = options.runtime(ckpt)
    options.executor(runtime, "check").close()
    check_simulator(runtime, tasks, max_steps)
    if isinstance(runtime, RemoteRuntime):
        runtime.client.close()
    out = Path(out) if out else ckpt / "eval"
    if protocol:
        hide_distractors = False
    if hide_distractors is None:
        from vlaforge.config.loading import load_config

        hide_distractors = recorded_scene(load_config(ckpt / "config.toml")) if (ckpt / "config.toml").is_file() \
            else False
    jobs = [Job(t, i, e, seed, max_steps, video and e == 0, hide_distractors)
            for e in range(episodes) for i, t in enumerate(tasks)]
    results: list[dict] = []
    succeeded = 0
    t0 = time.perf_counter()
    with _episode_pool(workers, isolated, ckpt, options, runtime) as pool, \
            progress_bar(progress, "eval", len(jobs)) as advance:
        for res in pool.imap_unordered(run_episode, jobs):
            results.append(res)
            succeeded += res["success"]
            advance(f"success {succeeded}/{len(results)}")
    report = summarize(results, tasks)
    report |= protocol or {}
    report |= {"checkpoint": str(ckpt), "episodes_per_task": episodes, "execute": options.execute,
               "distractors": "hidden" if hide_distractors else "shown",
               "max_steps": max_steps, "seed": seed, "seconds": round(time.perf_counter() - t0, 1),
               "inference": {"options": asdict(options), **inference_summary(results)}}
    out.mkdir(parents=True, exist_ok=True)
    if video:
        report["videos"] = _write_videos(results, out / "videos")
    write_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    report["report"] = str(out / "report.json")
    return report


@contextlib.contextmanager
def _episode_pool(workers: int, isolated: bool, ckpt: Path, options: InferenceOptions, runtime):
    """Where the episodes run: spawned workers (fresh processes: no inherited GL context or torch threads), or, for
    one worker not `isolated`, this process with `runtime` (a server's client again: the checks closed theirs)."""
    if workers > 1 or isolated:
        with mp.get_context("spawn").Pool(workers, initializer=_init_worker,
                                          initargs=(str(ckpt), options, 1)) as pool:
            yield pool
        return
    _WORKER["runtime"] = options.runtime(ckpt) if isinstance(runtime, RemoteRuntime) else runtime
    _WORKER["options"] = options
    try:
        yield SimpleNamespace(imap_unordered=map)
    finally:
        if isinstance(_WORKER["runtime"], RemoteRuntime):
            _WORKER["runtime"].client.close()
        _WORKER.clear()


def check_simulator(runtime: PolicyRuntime | RemoteRuntime, tasks: list[str], max_steps: int) -> None:
    """Before any rollout: the simulator of `tasks` (LIBERO's or Meta-World's) renders the policy's cameras and
    takes its state and action sizes, and `max_steps` is within its episode limit.

    Raises:
        VlaforgeError: naming what does not fit.
    """
    from vlaforge.data import metaworld
    from vlaforge.data.generate import check_step_limit

    shapes = runtime.client.metadata if isinstance(runtime, RemoteRuntime) else runtime.describe()
    sim = libero if libero.is_libero_task(tasks[0]) else metaworld
    if sim is metaworld and all(c in libero.CAMERAS for c in runtime.cameras):
        raise VlaforgeError(f"the policy takes LIBERO's cameras ({', '.join(runtime.cameras)}), which Meta-World "
                            "does not render; evaluate it on a LIBERO suite: --benchmark SUITE "
                            f"({' | '.join(libero.SUITES)})")
    sim.check_policy(list(runtime.cameras), int(shapes["state_dim"]), int(shapes["action_dim"]))
    check_step_limit(tasks[0], max_steps, "max_steps")


def summarize(results: list[dict], tasks: list[str]) -> dict[str, Any]:
    per_task = {}
    for t in tasks:
        rs = [r for r in results if r["task"] == t]
        k = sum(r["success"] for r in rs)
        lo, hi = wilson_interval(k, len(rs))
        ok = [r["length"] for r in rs if r["success"]]
        per_task[t] = {"episodes": len(rs), "successes": k, "success_rate": k / max(1, len(rs)),
                       "ci95": [round(lo, 4), round(hi, 4)],
                       "mean_length": float(np.mean([r["length"] for r in rs])) if rs else 0.0,
                       "mean_length_success": float(np.mean(ok)) if ok else None}
    mean = float(np.mean([v["success_rate"] for v in per_task.values()])) if per_task else 0.0
    keys = ("task", "episode", "success", "length", "initial_state_sha256")
    episodes = [{k: r[k] for k in keys if r.get(k) is not None}
                for r in sorted(results, key=lambda r: (tasks.index(r["task"]), r["episode"]))]
    return {"tasks": per_task, "mean_success_rate": mean, "episodes": episodes}


def inference_summary(results: list[dict]) -> dict[str, Any]:
    """Per-prediction latency p50/p99 (compute, as the robot clock counts it), cache totals and robot idle time
    over all episodes."""
    compute = [ms for r in results for ms in r["execution"].compute_ms]
    moving = sum(r["execution"].steps * r["execution"].period_s for r in results)
    idle = sum(r["execution"].idle_s for r in results)
    caches = [r["cache"] for r in results]
    totals = {k: sum(getattr(c, k) for c in caches) for k in ("frames", "exact_hits", "similar_hits", "encoded",
                                                               "partial", "reused_tokens", "recomputed_tokens",
                                                               "refreshes")}
    return {"predictions": len(compute), **latency_summary(compute),
            "idle_fraction": round(idle / (moving + idle), 4) if moving else 0.0,
            "idle_steps": sum(r["execution"].idle_steps for r in results),
            "startup_s_mean": round(float(np.mean([r["execution"].startup_s for r in results])), 4) if results else 0,
            "cache": CacheStats(**totals).as_dict()}


def _write_videos(results: list[dict], folder: Path) -> dict[str, str]:
    from vlaforge.data.video import VideoWriter

    written = {}
    for r in results:
        if r["frames"] is None:
            continue
        frames = r["frames"]
        h, w = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
        path = folder / f"{r['task']}.mp4"  # a LIBERO task (suite/name) gets a folder per suite
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        # NOTE: at most 20 fps: Meta-World's 80 Hz steps play 4x slower than real time, LIBERO's in real time
        writer = VideoWriter(tmp, min(r["fps"], 20), (h, w))
        writer.add(frames[:, :h, :w])
        writer.close()
        tmp.replace(path)
        written[r["task"]] = str(path)
    return written


def render_table(report: dict[str, Any]) -> str:
    width = max([28, *(len(t) for t in report["tasks"])])
    lines = [f"{'task':<{width}} {'success':>8} {'95% CI':>12} {'mean len':>9}"]
    for t, v in report["tasks"].items():
        lo, hi = v["ci95"]
        lines.append(f"{t:<{width}} {v['success_rate']:>8.0%} {f'[{lo:.0%}, {hi:.0%}]':>12} {v['mean_length']:>9.1f}")
    lines.append(f"{'mean':<{width}} {report['mean_success_rate']:>8.0%}")
    if report.get("benchmark"):
        lines.append(f"{report['benchmark']}: {report['protocol']} protocol ({report['episodes_per_task']} fixed "
                     f"initial states per task, {report['max_steps']} steps after {report['settle_steps']} settle "
                     "steps)")
    if report.get("distractors") == "hidden":
        lines.append("scene: the tasks' distractor bodies hidden, as the training dataset was rendered")
    inf = report.get("inference")
    if inf:
        o = inf["options"]
        lines.append(f"inference: cache {o['cache']}, {'async' if o['asynchronous'] else 'sync'}, merge {o['merge']}, "
                     f"latency +{o['latency_ms']:g} ms; per prediction p50 {inf['p50_ms']} ms, p99 {inf['p99_ms']} "
                     f"ms; cache hit rate {inf['cache']['hit_rate']:.0%}; robot idle {inf['idle_fraction']:.1%}")
    return "\n".join(lines)


def during_training(cfg) -> Callable[[Path], dict[str, float]]:
    """The evaluator `vlaforge train` hands the trainer when eval.every > 0: the tasks are checked now, before
    training, and each call scores a just-saved checkpoint (eval.train_episodes per task) as metrics
    (eval/success/<task>, eval/success)."""
    tasks, e = eval_tasks(cfg), cfg.eval
    episodes, max_steps, protocol = e.train_episodes, e.max_steps, None
    if all(libero.is_libero_task(t) for t in tasks):  # a LIBERO dataset's tasks: the first initial states of each
        suite = tasks[0].partition("/")[0]
        tasks, episodes, max_steps, protocol = libero_protocol(
            suite, ",".join(t.partition("/")[2] for t in tasks), min(episodes, libero.EPISODES_PER_TASK), None)
    else:
        from vlaforge.data.generate import check_step_limit

        check_step_limit(parse_tasks(tasks)[0], max_steps, "eval.max_steps")  # now, not after training

    def score(path: Path) -> dict[str, float]:
        report = evaluate(path, tasks, episodes, options=InferenceOptions(execute=e.execute), max_steps=max_steps,
                          workers=e.workers, seed=e.seed, video=False, progress=False, protocol=protocol,
                          isolated=True)
        out = {f"eval/success/{t}": v["success_rate"] for t, v in report["tasks"].items()}
        out["eval/success"] = report["mean_success_rate"]
        return out

    return score
