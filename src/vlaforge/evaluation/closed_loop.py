"""`vlaforge eval`: closed-loop success rate of a trained policy in Meta-World.

The policy sees exactly what training showed it (the checkpoint's `policy.json`: cameras, frame history,
image size, normalization; `tokenizer.json`) and runs with a receding horizon: it predicts T actions, executes
the first K, then predicts again from the new observation. Initial positions come from the evaluation seed
range, disjoint from the generation seeds. Episodes run in parallel worker processes (rendering dominates).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from vlaforge.config.loading import load_config, write_atomic
from vlaforge.data.batch import Batch
from vlaforge.data.metaworld import TASKS, cached_env, episode_seed, parse_tasks
from vlaforge.data.tokenizer import load_tokenizer
from vlaforge.data.transforms import ObservationSpec, to_model_images
from vlaforge.errors import VlaforgeError
from vlaforge.progress import progress_bar
from vlaforge.training.checkpoint import CONFIG_FILE, load_weights


def eval_tasks(cfg) -> list[str]:
    """The tasks to evaluate a run on: `eval.tasks`, else the tasks its dataset was generated from."""
    from vlaforge.data.generate import recorded_tasks
    from vlaforge.data.lerobot_v3 import read_info

    if cfg.eval.tasks:
        return list(cfg.eval.tasks)
    tasks = recorded_tasks(read_info(Path(cfg.data.path))) if cfg.data.path else []
    if not tasks:
        raise VlaforgeError(f"dataset {cfg.data.path} names no Meta-World tasks to evaluate on; set eval.tasks "
                            "(or pass --tasks)")
    return tasks


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


class Policy:
    """A trained VLA as a controller: `reset(instruction)`, then `act(views, state)` once per env step."""

    def __init__(self, model: torch.nn.Module, spec: ObservationSpec, tokenizer, execute: int):
        if not 1 <= execute <= spec.chunk:
            raise VlaforgeError(f"execute = {execute} must be between 1 and the action chunk ({spec.chunk})")
        self.model, self.spec, self.tokenizer, self.execute = model.eval(), spec, tokenizer, execute
        self.camera_names = [k.removeprefix("observation.images.") for k in spec.cameras]
        self.depth = (spec.frames - 1) * spec.frame_stride + 1

    @classmethod
    def load(cls, ckpt: Path, execute: int) -> "Policy":
        from vlaforge.models.build import build_vla

        cfg = load_config(ckpt / CONFIG_FILE)
        spec = ObservationSpec.load(ckpt)
        tokenizer = load_tokenizer(ckpt, cfg.model.llm.pretrained)
        model = build_vla(cfg.model, cfg.loss)
        load_weights(ckpt, model)
        return cls(model, spec, tokenizer, execute)

    def reset(self, instruction: str) -> None:
        ids, mask = self.tokenizer.encode([instruction], self.spec.instruction_tokens)
        self.instruction = (ids[0], mask[0])
        self.frames: dict[str, deque] = {c: deque(maxlen=self.depth) for c in self.camera_names}
        self.queue: deque = deque()

    def wants_views(self) -> bool:
        """Whether the next `act` needs this step's images: always with a frame history, else only when it
        predicts a new chunk (so executing K actions per chunk renders K times less)."""
        return self.spec.frames > 1 or not self.queue

    def act(self, views: dict[str, np.ndarray] | None, state: np.ndarray) -> np.ndarray:
        if views is not None:
            for cam in self.camera_names:
                self.frames[cam].append(torch.from_numpy(views[cam]))
        if not self.queue:
            self.queue.extend(self._predict(state)[:self.execute])
        return self.queue.popleft()

    def _predict(self, state: np.ndarray) -> np.ndarray:
        actions = self.model.predict_actions(self.observation(state))  # (T, A), normalized
        return self.spec.denormalize_action(actions).numpy()

    def observation(self, state: np.ndarray) -> Batch:
        """The model input for the frames seen so far - built exactly as the training dataset builds it."""
        spec, n = self.spec, len(self.frames[self.camera_names[0]])
        rows = [n - 1 - min(n - 1, k * spec.frame_stride) for k in range(spec.frames - 1, -1, -1)]
        views = torch.stack([to_model_images(torch.stack([self.frames[c][r] for r in rows]), spec.image_size)
                             for c in self.camera_names])  # (V, F, 3, S, S)
        return Batch(images=views.transpose(0, 1).flatten(0, 1), state=spec.normalize_state(state),
                     instruction_ids=self.instruction[0], instruction_mask=self.instruction[1])


@dataclass(frozen=True)
class Job:
    task: str
    task_index: int
    episode: int
    seed: int
    max_steps: int
    record: bool


_WORKER: dict[str, Any] = {}


def _init_worker(ckpt: str, execute: int, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["policy"] = Policy.load(Path(ckpt), execute)


def run_episode(job: Job) -> dict[str, Any]:
    """One held-out episode; returns success, length and (if `record`) the rendered frames."""
    policy: Policy = _WORKER["policy"]
    env = cached_env(job.task, policy.camera_names, policy.spec.render_size)
    torch.manual_seed(job.seed)  # flow-matching heads sample noise
    obs = env.reset(episode_seed("eval", job.task_index, job.episode, job.seed))
    instructions = TASKS.get(job.task).instructions
    policy.reset(instructions[job.episode % len(instructions)])
    success, frames, steps = False, [], 0
    for steps in range(1, job.max_steps + 1):
        views = env.views() if job.record or policy.wants_views() else None
        if job.record:
            frames.append(np.concatenate([views[c] for c in policy.camera_names], axis=1))
        obs, success = env.step(policy.act(views, env.state(obs)))
        if success:
            break
    return {"task": job.task, "episode": job.episode, "success": success, "length": steps,
            "frames": np.stack(frames) if frames else None}


def evaluate(ckpt: str | Path, tasks: list[str], episodes: int, *, execute: int, max_steps: int, workers: int,
             seed: int = 0, out: str | Path | None = None, video: bool = True, progress: bool = True) -> dict[str, Any]:
    """Evaluate a checkpoint; writes `report.json` (and `videos/<task>.mp4`) to `out` (default CKPT/eval)."""
    ckpt = Path(ckpt)
    tasks = parse_tasks(tasks)
    Policy.load(ckpt, execute)  # fail fast, in this process, with a clear message
    out = Path(out) if out else ckpt / "eval"
    jobs = [Job(t, i, e, seed, max_steps, video and e == 0) for e in range(episodes) for i, t in enumerate(tasks)]
    results: list[dict] = []
    succeeded = 0
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(ckpt), execute, 1)) as pool, \
            progress_bar(progress, "eval", len(jobs)) as advance:
        for res in pool.imap_unordered(run_episode, jobs):
            results.append(res)
            succeeded += res["success"]
            advance(f"success {succeeded}/{len(results)}")
    report = summarize(results, tasks)
    report |= {"checkpoint": str(ckpt), "episodes_per_task": episodes, "execute": execute, "max_steps": max_steps,
               "seed": seed, "seconds": round(time.perf_counter() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    if video:
        report["videos"] = _write_videos(results, out / "videos")
    write_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    report["report"] = str(out / "report.json")
    return report


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
    return {"tasks": per_task, "mean_success_rate": mean}


def _write_videos(results: list[dict], folder: Path) -> dict[str, str]:
    from vlaforge.data.video import VideoWriter
    from vlaforge.data.metaworld import FPS

    written = {}
    for r in results:
        if r["frames"] is None:
            continue
        frames = r["frames"]
        h, w = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
        tmp = folder / f".{r['task']}.mp4.tmp"
        writer = VideoWriter(tmp, FPS // 4, (h, w))  # NOTE: played at 20 fps, 4x slower than real time
        writer.add(frames[:, :h, :w])
        writer.close()
        tmp.replace(folder / f"{r['task']}.mp4")
        written[r["task"]] = str(folder / f"{r['task']}.mp4")
    return written


def render_table(report: dict[str, Any]) -> str:
    lines = [f"{'task':<28} {'success':>8} {'95% CI':>12} {'mean len':>9}"]
    for t, v in report["tasks"].items():
        lo, hi = v["ci95"]
        lines.append(f"{t:<28} {v['success_rate']:>8.0%} {f'[{lo:.0%}, {hi:.0%}]':>12} {v['mean_length']:>9.1f}")
    lines.append(f"{'mean':<28} {report['mean_success_rate']:>8.0%}")
    return "\n".join(lines)


def during_training(cfg) -> Callable[[Path], dict[str, float]]:
    """The evaluator `vlaforge train` hands the trainer when eval.every > 0: the tasks are checked now, before
    training, and each call scores a just-saved checkpoint (eval.train_episodes per task) as metrics
    (eval/success/<task>, eval/success)."""
    tasks, e = eval_tasks(cfg), cfg.eval

    def score(path: Path) -> dict[str, float]:
        report = evaluate(path, tasks, e.train_episodes, execute=e.execute, max_steps=e.max_steps, workers=e.workers,
                          seed=e.seed, video=False, progress=False)
        out = {f"eval/success/{t}": v["success_rate"] for t, v in report["tasks"].items()}
        out["eval/success"] = report["mean_success_rate"]
        return out

    return score
