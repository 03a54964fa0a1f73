"""`vlaforge data generate`: scripted-expert demonstrations from Meta-World or LIBERO-Object, written as a
LeRobotDataset v3 (LIBERO: the layout of the LeRobot / openpi LIBERO datasets, `data.libero`).

Episodes are recorded in worker processes (rendering dominates) and written in a fixed order by the main
process, so the dataset depends only on (tasks, episodes, cameras, image size, seed) - not on the number of
workers. Only successful episodes are kept; a failed attempt is replaced by the next seed.

A recording resumes: every finished attempt (its episode, or a mark that it failed) is kept in a spool folder beside
the output (`.<out>.episodes/`, with the recording's settings) until the dataset is written, and a run with the same
settings into the same output takes them from there and records only the attempts still missing, so a cut
recording goes on where it stopped and gives the dataset an uncut one gives.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vlaforge.data import libero, metaworld
from vlaforge.data.lerobot_writer import DatasetWriter, partial_folder
from vlaforge.data.metaworld import TASKS, cached_env, episode_seed, expert_action, make_expert
from vlaforge.errors import VlaforgeError
from vlaforge.progress import progress_bar

PHASE_COLUMN = "annotation.phase"


@dataclass(frozen=True)
class Attempt:
    task: str
    task_index: int
    attempt: int
    seed: int
    cameras: tuple[str, ...]
    image_size: int
    max_steps: int
    hide_distractors: bool = False
    steer_tcp: bool = False


def record(a: Attempt) -> dict[str, Any] | None:
    """Run the expert for one seeded episode; the recording if it succeeded, else None. A LIBERO-Object episode
    starts from LIBERO's placement sampler (seeded; the benchmark's fixed initial states are for evaluation only)."""
    if libero.is_libero_task(a.task):
        env = libero.cached_env(a.task, list(a.cameras), a.image_size)
        # the suite's task index: a task recorded alone gets the episodes a whole-suite recording gives it
        obs = env.reset(episode_seed("train", env.task.index, a.attempt, a.seed))
        expert = libero.ObjectExpert(env)
        rec = _rollout(env, obs, a, lambda _: (expert.act(), expert.describe()))
        if rec is not None:
            rec["instruction"] = env.task.instruction
        return rec
    env, expert = cached_env(a.task, list(a.cameras), a.image_size, a.hide_distractors), make_expert(a.task)
    obs = env.reset(episode_seed("train", a.task_index, a.attempt, a.seed))
    describe = TASKS.get(a.task).phase
    rec = _rollout(env, obs, a, lambda o: (expert_action(expert, env.expert_input(o, a.steer_tcp)), describe(o)))
    if rec is not None:
        rec["instruction"] = random.Random(f"{a.seed}/{a.task}/{a.attempt}").choice(TASKS.get(a.task).instructions)
    return rec


def _rollout(env, obs, a: Attempt, act: Callable[[Any], tuple[np.ndarray, str]]) -> dict[str, Any] | None:
    """Record the views, state, env state, action and phase of every step while `act(observation) -> (action,
    phase)` drives `env` (a `MetaWorldEnv` or a `LiberoEnv`); the recording if the episode succeeded, else None."""
    images: dict[str, list] = {c: [] for c in a.cameras}
    states, env_states, actions, phases = [], [], [], []
    success = False
    for _ in range(min(a.max_steps, env.max_steps)):
        for cam, img in env.views().items():
            images[cam].append(img)
        states.append(env.state(obs))
        env_states.append(env.env_state(obs))
        action, phase = act(obs)
        actions.append(action)
        phases.append(phase)
        obs, success = env.step(action)
        if success:
            break
    if not success:
        return None
    return {"task": a.task, "attempt": a.attempt, "images": {c: np.stack(v) for c, v in images.items()},
            "state": np.stack(states), "env_state": np.stack(env_states), "action": np.stack(actions),
            "phase": phases}


def recorded_tasks(info: dict[str, Any]) -> list[str]:
    """The Meta-World tasks a dataset was generated from (meta/info.json's `vlaforge.tasks`), or []."""
    return list(info.get("vlaforge", {}).get("tasks", []))


def recorded_hidden_distractors(info: dict[str, Any]) -> bool:
    """Whether a dataset was rendered with the tasks' distractors hidden (meta/info.json's
    `vlaforge.hide_distractors`; False for datasets that do not say)."""
    return bool(info.get("vlaforge", {}).get("hide_distractors", False))


def recorded_tcp_steering(info: dict[str, Any]) -> list[str]:
    """The tasks whose expert steered the fingertips to the goal (meta/info.json's `vlaforge.expert_steers_tcp`,
    `data generate --steer-tcp`; [] for datasets that do not say)."""
    return list(info.get("vlaforge", {}).get("expert_steers_tcp", []))


def check_output(out: Path, overwrite: bool) -> None:
    """`out` must be new or empty (or --overwrite) and writable; a `.partial` folder a killed run left is removed.

    Raises:
        VlaforgeError: naming the problem.
    """
    if out.exists() and not out.is_dir():
        raise VlaforgeError(f"--out {out} is a file; give a folder path")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise VlaforgeError(f"output folder {out} is not empty; choose another --out or pass --overwrite")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = partial_folder(out)
        shutil.rmtree(probe, ignore_errors=True)  # a killed run's leftovers
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise VlaforgeError(f"--out {out}: cannot write in {out.parent} ({exc.strerror or exc}); choose a writable "
                            "folder") from None


def generate(tasks: dict[str, int] | list[str], episodes: int, out: str | Path, *, cameras: list[str], image_size: int,
             seed: int = 0, workers: int = 2, max_steps: int = 200, overwrite: bool = False,
             progress: bool = True, hide_distractors: bool = False, steer_tcp: bool = False) -> dict[str, Any]:
    """Record successful episodes into a new LeRobotDataset v3 at `out`: `tasks` maps each task to its episode
    count (a plain list gets `episodes` each); `hide_distractors`: render the tasks' distractor bodies invisible
    (recorded in meta/info.json; `vlaforge eval` then renders its episodes the same way); `steer_tcp`: the experts
    of tasks whose success is measured at the fingertips steer the fingertips to the goal (recorded).

    Returns a summary: episodes and frames per task, failed expert attempts, seconds, env steps per second.
    """
    out = Path(out)
    counts = dict(tasks) if isinstance(tasks, dict) else {t: episodes for t in tasks}
    tasks = list(counts)
    for t in tasks:  # NOTE: before any recording: an attempt would otherwise stop at the limit silently
        check_step_limit(t, max_steps)
    check_output(out, overwrite)
    order = {t: i for i, t in enumerate(tasks)}
    kept: dict[str, list[dict]] = {t: [] for t in tasks}
    failed = {t: 0 for t in tasks}
    next_attempt = {t: 0 for t in tasks}
    t0, steps = time.perf_counter(), 0
    spool = Spool(out, {"tasks": counts, "cameras": list(cameras), "image_size": image_size, "seed": seed,
                        "max_steps": max_steps, "hide_distractors": hide_distractors, "steer_tcp": steer_tcp})

    def attempts_needed() -> list[Attempt]:
        todo = []
        for t in tasks:
            missing = counts[t] - len(kept[t])
            for k in range(missing):
                todo.append(Attempt(t, order[t], next_attempt[t] + k, seed, tuple(cameras), image_size, max_steps,
                                    hide_distractors, steer_tcp))
            next_attempt[t] += max(missing, 0)
        return todo

    ctx = mp.get_context("spawn")  # NOTE: fresh processes: no inherited GL context or torch threads
    with progress_bar(progress, "episodes", sum(counts.values())) as advance, \
            ctx.Pool(workers) if workers > 1 else _InlinePool() as pool:
        while todo := attempts_needed():
            stuck = [a.task for a in todo if a.attempt >= 10 * counts[a.task] + 10]
            if stuck:
                raise VlaforgeError(_stuck_message(stuck[0], failed[stuck[0]], max_steps))
            done = {(a.task, a.attempt): spool.load(a) for a in todo if spool.has(a)}  # a cut run's
            fresh = [a for a in todo if (a.task, a.attempt) not in done]
            for a, rec in zip(fresh, pool.imap(record, fresh)):
                spool.keep(a, rec)
                done[a.task, a.attempt] = rec
                if rec is not None:
                    steps += len(rec["state"])
                    advance(f"{steps / (time.perf_counter() - t0):.0f} env steps/s")
            for a in todo:
                rec = done[a.task, a.attempt]
                if rec is None:
                    failed[a.task] += 1
                else:
                    kept[a.task].append(rec)
    sim = libero if libero.is_libero_task(tasks[0]) else metaworld
    with DatasetWriter(out, fps=sim.FPS, cameras=list(cameras), image_size=image_size, state_names=sim.STATE_NAMES,
                       action_names=sim.ACTION_NAMES, text_features=[PHASE_COLUMN],
                       env_state_names=sim.ENV_STATE_NAMES, robot_type=sim.ROBOT_TYPE) as writer:
        for t in tasks:
            for rec in sorted(kept[t], key=lambda r: r["attempt"]):
                writer.add_episode(rec["instruction"], rec["images"], rec["state"], rec["action"],
                                   {PHASE_COLUMN: rec["phase"]}, rec["env_state"])
        writer.finish({"vlaforge": {"generator": sim.__name__.rpartition(".")[2], "tasks": tasks, "seed": seed,
                                    "hide_distractors": hide_distractors,
                                    "expert_steers_tcp": [t for t in tasks
                                                          if steer_tcp and t in TASKS and TASKS.get(t).success_at_tcp],
                                    "episode_tasks": [t for t in tasks for _ in kept[t]]}})
    spool.remove()
    seconds = time.perf_counter() - t0
    return {"out": str(out), "episodes": {t: len(kept[t]) for t in tasks}, "resumed_attempts": spool.resumed,
            "frames": {t: int(sum(len(r["state"]) for r in kept[t])) for t in tasks}, "expert_failures": failed,
            "seconds": round(seconds, 1), "env_steps_per_s": round(steps / seconds, 1)}


class Spool:
    """The finished attempts of a recording in progress, one file each in `.<out>.episodes/` beside the output: an
    episode's arrays (`<task>__<attempt>.npz`) or a failure mark (`.fail`), written to a temporary name and renamed.
    `settings.json` there names the recording; a spool of other settings is cleared."""

    def __init__(self, out: Path, settings: dict[str, Any]):
        self.root = out.with_name(f".{out.name}.episodes")
        self.resumed = 0
        marker = self.root / "settings.json"
        same = marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(settings))
        if not same:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
            marker.write_text(json.dumps(settings))

    def _path(self, a: Attempt, suffix: str) -> Path:
        return self.root / f"{a.task.replace('/', '+')}__{a.attempt}{suffix}"

    def has(self, a: Attempt) -> bool:
        return self._path(a, ".npz").is_file() or self._path(a, ".fail").is_file()

    def load(self, a: Attempt) -> dict[str, Any] | None:
        self.resumed += 1
        if self._path(a, ".fail").is_file():
            return None
        with np.load(self._path(a, ".npz"), allow_pickle=False) as f:
            cams = [k.removeprefix("images.") for k in f.files if k.startswith("images.")]
            return {"task": a.task, "attempt": a.attempt, "images": {c: f[f"images.{c}"] for c in cams},
                    "state": f["state"], "env_state": f["env_state"], "action": f["action"],
                    "phase": [str(x) for x in f["phase"]], "instruction": str(f["instruction"])}

    def keep(self, a: Attempt, rec: dict[str, Any] | None) -> None:
        suffix = ".fail" if rec is None else ".npz"
        tmp = self._path(a, ".tmp" + suffix)
        if rec is None:
            tmp.write_text("")
        else:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, state=rec["state"], env_state=rec["env_state"], action=rec["action"],
                                    phase=np.asarray(rec["phase"], dtype=str),
                                    instruction=np.asarray(rec["instruction"]),
                                    **{f"images.{c}": v for c, v in rec["images"].items()})
        os.replace(tmp, self._path(a, suffix))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def check_step_limit(task: str, max_steps: int, option: str = "--max-steps") -> None:
    """`max_steps` within the episode limit of `task`'s simulator (a LIBERO suite's, or Meta-World's).

    Raises:
        VlaforgeError: naming the option, the limit and the fix.
    """
    if libero.is_libero_task(task):
        libero.check_max_steps(task.partition("/")[0], max_steps, option)
    elif max_steps > metaworld.MAX_STEPS:
        raise VlaforgeError(f"{option} {max_steps} is beyond Meta-World's episode limit of {metaworld.MAX_STEPS} "
                            f"steps; ask for at most {metaworld.MAX_STEPS}")


def _stuck_message(task: str, failures: int, max_steps: int) -> str:
    """Why the expert of `task` keeps failing: a step limit below the simulator's is the likely cause, else the
    installation."""
    sim, name = (libero, "LIBERO") if libero.is_libero_task(task) else (metaworld, "Meta-World")
    limit = sim.MAX_STEPS[task.partition("/")[0]] if sim is libero else sim.MAX_STEPS
    if max_steps < limit:
        return (f"the scripted expert for {task} failed all {failures} attempts within --max-steps {max_steps}: the "
                f"step limit is too short for it to succeed; raise --max-steps (up to {limit}, {name}'s episode "
                "limit)")
    return f"the scripted expert for {task} keeps failing ({failures} failures); check the {name} installation"


class _InlinePool:
    """Pool stand-in for workers=1 (no processes; easier to debug)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def imap(fn, items):
        return map(fn, items)
