"""A small LeRobot v3 dataset written from arrays (no simulator): smooth, codec-friendly images."""

from __future__ import annotations

import numpy as np

from vlaforge.data.lerobot_writer import DatasetWriter
from vlaforge.data.video import VideoWriter  # noqa: F401 - re-exported for the tests

CAMS = ["front", "top"]
SIZE = 32
LENGTHS = [7, 12, 5]
TASKS = ["open the door", "press the button", "open the door"]


def _images(ep: int, n: int, cam: int) -> np.ndarray:
    """Smooth, frame-dependent images (codec-friendly): a gradient whose offset moves with time."""
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    frames = [np.stack([(x * 4 + t * 9 + ep * 30) % 256, (y * 4 + cam * 60) % 256,
                        np.full_like(x, 40 * ep + 10 * t) % 256], -1) for t in range(n)]
    return np.asarray(frames, dtype=np.uint8)


def _episode(ep: int, n: int) -> dict:
    rng = np.random.default_rng(ep)
    return {"images": {c: _images(ep, n, i) for i, c in enumerate(CAMS)},
            "state": rng.normal(size=(n, 4)).astype(np.float32), "action": rng.uniform(-1, 1, (n, 4)).astype(
                np.float32), "text": {"annotation.phase": [f"phase {t // 4}" for t in range(n)]}}


def write_dataset(root, edit=None, text: bool = True, cams: list[str] = CAMS, env_state: bool = True, **kw):
    """Write the three episodes; `edit(episodes)` may change their arrays first; `text=False` leaves out the
    phase column; `cams` renames the two cameras (Meta-World's names let the simulator evaluate the run);
    `env_state` (as `vlaforge data generate` does): an observation.environment_state column (a 3-D "goal" per
    episode, drawn by the episode's seed) and meta/info.json's episode_tasks."""
    eps = [_episode(i, n) for i, n in enumerate(LENGTHS)]
    for i, e in enumerate(eps):
        goal = np.random.default_rng(100 + i).uniform(-1, 1, 3).astype(np.float32)
        e["env_state"] = np.repeat(goal[None], LENGTHS[i], 0) if env_state else None
    if env_state:
        kw["env_state_names"] = ["goal_x", "goal_y", "goal_z"]
    for e in eps:
        e["images"] = dict(zip(cams, e["images"].values()))
    if edit is not None:
        edit(eps)
    with DatasetWriter(root, fps=10, cameras=cams, image_size=SIZE, state_names=list("abcd"),
                       action_names=list("wxyz"), text_features=["annotation.phase"] if text else [], **kw) as w:
        for task, e in zip(TASKS, eps):
            w.add_episode(task, e["images"], e["state"], e["action"], e["text"] if text else {}, e["env_state"])
        scene_tasks = {"open the door": "door-open-v3", "press the button": "button-press-topdown-v3"}
        w.finish({"vlaforge": {"tasks": ["door-open-v3", "button-press-topdown-v3"],
                               "episode_tasks": [scene_tasks[t] for t in TASKS]}})
    return eps


