"""Where a policy's reach episodes end: closed-loop reach-v3 on held-out or on the dataset's own training goals.
Prints one JSON: success rate with its Wilson interval, and for the failed episodes the mean final hand - goal
error per axis (signed and absolute), the range of the final hand y, and the mean goal of successes and failures.

Issue 23's diagnosis (README, "What made the difference on reach"): run with `--split train` and `--split eval` on
the same run; equal success on both says the policy does not fail for want of interpolation between goals.
A policy trained with the env_state term (model.env_state_dim) also reports where its probe puts the goal: the mean
absolute error per axis (m) of the probe's estimate at the episode's first prediction and at its last, for successes
and failures (perception against control: a failure with an accurate estimate is one of acting on it).

Training goals are the first N of generation's seeds (`episode_seed("train", 0, e, base_seed)`), so they are the
dataset's episodes when reach is its first task and the expert never failed (make demo's dataset: 0 failures).

    python bench/reach_failures.py runs/tiny_metaworld --split train --episodes 50
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from vlaforge.config.loading import load_config
from vlaforge.data.episodes import group_moments, scene_tasks
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.lerobot_writer import ENV_STATE
from vlaforge.data.metaworld import TASKS, cached_env, episode_seed
from vlaforge.evaluation.closed_loop import InferenceOptions, recorded_scene, wilson_interval
from vlaforge.inference.runtime import Observation, PolicyRuntime, resolve_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run folder (its latest checkpoint) or a checkpoints/step_* folder")
    ap.add_argument("--split", choices=("train", "eval"), default="eval", help="training goals or held-out goals")
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="base seed (generation's --seed for --split train)")
    ap.add_argument("--execute", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("MUJOCO_GL", "egl")
    torch.set_num_threads(args.threads)
    checkpoint = resolve_policy(args.run)
    runtime = PolicyRuntime.load(checkpoint, device="cpu")
    cfg = load_config(checkpoint / "config.toml")
    hidden = recorded_scene(cfg)  # as `vlaforge eval` renders the scene
    probe = ProbeReadout(runtime.model, cfg.data.path) if runtime.model.action_head.env_probe is not None else None
    env = cached_env("reach-v3", runtime.cameras, runtime.spec.render_size, hidden)
    options = InferenceOptions(execute=args.execute)
    instructions = TASKS.get("reach-v3").instructions
    rows = []
    for e in range(args.episodes):
        obs = env.reset(episode_seed(args.split, 0, e, args.seed))
        goal = obs[36:39].copy()
        runtime.reset("episode")
        executor = options.executor(runtime, "episode")
        success = False
        if probe:
            probe.estimates.clear()
        try:
            for _ in range(args.max_steps):
                wanted = executor.needs_observation()
                observation = Observation(env.views(), env.state(obs), instructions[e % len(instructions)]) \
                    if wanted else None
                obs, success = env.step(executor.act(observation))
                if success:
                    break
        finally:
            executor.close()
        rows.append((float(success), *(obs[0:3] - goal), *goal))
        if probe:
            first, last = probe.estimates[0], probe.estimates[-1]
            probe.errors.append((float(success), *np.abs(first - goal), *np.abs(last - goal)))
    r = np.array(rows)
    ok, failed = r[r[:, 0] == 1], r[r[:, 0] == 0]
    lo, hi = wilson_interval(len(ok), len(r))
    out = {"run": args.run, "split": args.split, "episodes": len(r), "success_rate": round(len(ok) / len(r), 4),
           "ci95": [round(lo, 4), round(hi, 4)], "distractors": "hidden" if hidden else "shown",
           "goal_mean_successes": ok[:, 4:7].mean(0).round(3).tolist() if len(ok) else None,
           "goal_mean_failures": failed[:, 4:7].mean(0).round(3).tolist() if len(failed) else None}
    if len(failed):
        hand_y = failed[:, 2] + failed[:, 5]
        out |= {"failed_error_signed_m": failed[:, 1:4].mean(0).round(4).tolist(),
                "failed_error_abs_m": np.abs(failed[:, 1:4]).mean(0).round(4).tolist(),
                "failed_final_hand_y_m": [round(float(hand_y.min()), 3), round(float(hand_y.max()), 3)]}
    if probe:
        out |= probe.summary()
    print(json.dumps(out))


class ProbeReadout:
    """The env_state probe's goal estimate (m) at every prediction, read from the action head's input by a hook."""

    def __init__(self, model: torch.nn.Module, data_path: str):
        reader = LeRobotDataset(data_path)
        groups, names = scene_tasks(reader)
        self.mean, self.std = group_moments(reader.columns[ENV_STATE], groups)[names.index("reach-v3")]
        self.estimates, self.errors = [], []
        model.action_head.register_forward_hook(self._read)

    def _read(self, head, args, _out) -> None:
        z = head.env_probe(args[0].mean(1)).float().cpu()[0]
        self.estimates.append((z * self.std + self.mean).numpy())

    def summary(self) -> dict:
        e = np.array(self.errors)
        out = {}
        for name, rows in (("successes", e[e[:, 0] == 1]), ("failures", e[e[:, 0] == 0])):
            if len(rows):
                out[f"probe_abs_error_first_m_{name}"] = rows[:, 1:4].mean(0).round(4).tolist()
                out[f"probe_abs_error_last_m_{name}"] = rows[:, 4:7].mean(0).round(4).tolist()
        return out


if __name__ == "__main__":
    main()
