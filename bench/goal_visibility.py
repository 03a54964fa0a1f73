"""How much of reach's goal each camera shows along the scripted expert's course: each view is rendered with and
without the goal marker, and the pixels that differ are the goal's visible pixels. Prints one JSON.

Issue 23's finding (README, "What made the difference on reach"): the top view loses the goal behind the arm for the
last part of every episode, longest for high goals; the corner view keeps it. A policy that sees only the current
frame must then place the goal in depth from one view. Giving it each camera's first frame as well (commit b92b7ca,
reverted) did not raise reach success, so this occlusion is not what limits it.

    python bench/goal_visibility.py --episodes 50
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--cameras", default="corner,topview")
    ap.add_argument("--size", type=int, default=96, help="rendered pixels per side (make demo's dataset: 96)")
    ap.add_argument("--seed", type=int, default=0, help="generation's base seed: the dataset's training goals")
    args = ap.parse_args()
    os.environ.setdefault("MUJOCO_GL", "egl")
    from vlaforge.data.metaworld import cached_env, episode_seed, expert_action, make_expert

    cams = args.cameras.split(",")
    env = cached_env("reach-v3", cams, args.size, hide_distractors=True)  # as make demo records it
    rows = []
    for e in range(args.episodes):
        expert, obs = make_expert("reach-v3"), env.reset(episode_seed("train", 0, e, args.seed))
        goal, counts, success = obs[36:39].copy(), [], False
        while not success and len(counts) < env.max_steps:
            counts.append({c: int(m.sum()) for c, m in env.goal_mask().items()})
            obs, success = env.step(expert_action(expert, obs))
        c = np.array([[d[cam] for cam in cams] for d in counts])  # (steps, cameras) visible goal pixels
        rows.append({"goal_z": float(goal[2]), "steps": len(c), "hidden": (c == 0).mean(0),
                     "hidden_last10": (c[-10:] == 0).mean(0), "first_pixels": c[0],
                     "all_hidden": (c == 0).all(1).mean()})
    high = np.array([r["goal_z"] for r in rows]) > np.median([r["goal_z"] for r in rows])
    out = {"episodes": len(rows), "cameras": cams, "size": args.size}
    for name, pick in (("all", np.ones(len(rows), bool)), ("high_goals", high), ("low_goals", ~high)):
        sel = [r for r, keep in zip(rows, pick) if keep]
        out[name] = {"goal_z_mean": round(float(np.mean([r["goal_z"] for r in sel])), 3),
                     **{f"{key}_frac": dict(zip(cams, np.mean([r[key] for r in sel], 0).round(3).tolist()))
                        for key in ("hidden", "hidden_last10")},
                     "first_frame_pixels": dict(zip(cams, np.mean([r["first_pixels"] for r in sel], 0)
                                                    .round(1).tolist())),
                     "every_view_hidden_frac": round(float(np.mean([r["all_hidden"] for r in sel])), 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
