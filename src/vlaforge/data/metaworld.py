"""Meta-World tasks as vlaforge sees them: seeded environments with several camera views, scripted experts,
instruction paraphrases and expert-phase descriptions.

The policy observes only the camera images, the proprioceptive state (hand position + gripper opening,
`obs[0:4]`) and the instruction; object and goal positions (`obs[4:]`) are used only by the expert and the
phase describer. Rendering uses one `mujoco.Renderer` per process with shadows and reflections off (software
EGL rendering is ~2x faster without them).

Seeding: Meta-World's gym wrapper ignores `reset(seed=)` and draws one of 50 fixed tasks, so we build the
environment class directly, `set_task` once, then let `env.seed(s)` alone decide the initial positions.
Generation and evaluation use disjoint seed ranges (`episode_seed`).
"""

from __future__ import annotations

import atexit
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from vlaforge.errors import VlaforgeError
from vlaforge.registry import Registry, parse_names

STATE_NAMES = ["hand_x", "hand_y", "hand_z", "gripper"]
ACTION_NAMES = ["dx", "dy", "dz", "grip"]
# privileged scene state recorded beside the policy's inputs (`observation.environment_state`): a training target
# only (`loss.weights.env_state`), never a policy input
ENV_STATE_NAMES = ["goal_x", "goal_y", "goal_z"]


@dataclass(frozen=True)
class FreeView:
    """A view of our own, rendered by a MuJoCo free camera (`MjvCamera`) aimed at `lookat` (m) from `distance` (m) at
    `azimuth` / `elevation` (degrees; azimuth 0 looks along +x)."""

    lookat: tuple[float, float, float]
    distance: float
    azimuth: float
    elevation: float


# "side" looks along +x from beside the table at reach's goal box (y 0.8-0.9, z 0.05-0.3): the goal's depth (y) and
# height (z) are its image column and row, which Meta-World's own views mix.
FREE_VIEWS = {"side": FreeView((0.0, 0.75, 0.17), 0.7, 0.0, -15.0)}
CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV", *FREE_VIEWS)
FPS = 80  # Meta-World's control rate: frame_skip 5 x timestep 2.5 ms
MAX_STEPS = 500  # Meta-World's episode limit (max_path_length): a step past it raises in the environment
ROBOT_TYPE = "sawyer"
SPLIT_OFFSET = {"train": 0, "eval": 1_000_000}  # generation and evaluation never share an initial position


@dataclass(frozen=True)
class Task:
    """A Meta-World task: its expert, ways to say it, and what the expert is doing at a step."""

    expert: str  # class name in metaworld.policies
    instructions: tuple[str, ...]
    phase: Callable[[np.ndarray], str]  # full observation -> short description of the expert's phase
    distractors: tuple[str, ...] = ()  # bodies the task never needs, which `hide_distractors` renders invisible
    # success is the fingertips' midpoint (Meta-World's `tcp_center`, 4.5 cm below the hand body that the observation
    # reports and Meta-World's expert steers) near the goal: `steer_tcp` generation steers it there instead
    success_at_tcp: bool = False


def _near(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    return float(np.linalg.norm(a - b)) <= tol


def _reach_phase(o: np.ndarray) -> str:
    return "hold the hand at the goal" if _near(o[0:3], o[36:39], 0.05) else "move the hand to the goal"


def _button_phase(o: np.ndarray) -> str:
    return "press the button down" if _near(o[0:2], o[4:6], 0.04) else "move above the button"


def _drawer_phase(o: np.ndarray) -> str:
    hand, handle = o[0:3], o[4:7] + np.array([0.0, 0.0, -0.02])
    if hand[1] > handle[1]:
        return "rise above the drawer"
    return "push the drawer closed" if abs(hand[2] - handle[2]) <= 0.04 else "lower in front of the handle"


def _door_phase(o: np.ndarray) -> str:
    hand, handle = o[0:3], o[4:7] - np.array([0.05, 0.0, 0.0])
    if not _near(hand[:2], handle[:2], 0.12):
        return "reach above the door handle"
    return "pull the door open" if abs(hand[2] - handle[2]) <= 0.04 else "lower onto the door handle"


TASKS: Registry[Task] = Registry("Meta-World task")
TASKS.add("reach-v3", Task("SawyerReachV3Policy", (
    "reach the red goal", "move the gripper to the red dot", "put the hand on the target point",
    "reach for the goal position"), _reach_phase, distractors=("obj",),  # the puck: placed at random, never touched
    success_at_tcp=True))
TASKS.add("button-press-topdown-v3", Task("SawyerButtonPressTopdownV3Policy", (
    "press the button from the top", "push the button down from above", "press the red button downwards",
    "press down on the button"), _button_phase))
TASKS.add("drawer-close-v3", Task("SawyerDrawerCloseV3Policy", (
    "close the drawer", "push the drawer shut", "slide the drawer closed", "shut the open drawer"),
    _drawer_phase))
TASKS.add("door-open-v3", Task("SawyerDoorOpenV3Policy", (
    "open the door", "pull the door open", "swing the door open by its handle", "open the cabinet door"),
    _door_phase))

DEMO_TASKS = ("reach-v3", "button-press-topdown-v3", "drawer-close-v3", "door-open-v3")


def parse_tasks(text: str | list[str]) -> list[str]:
    """'a,b' or a list -> validated task names for evaluation (with 'did you mean' on typos).

    Raises:
        VlaforgeError: an unknown or repeated task, or a task:N count (evaluation runs --episodes of every task).
    """
    counted = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if ":" in t]
    if counted:
        raise VlaforgeError(f"task {counted[0]!r}: evaluation takes no task:N counts; --episodes (eval.episodes) sets "
                            "the episodes of every task")
    return list(parse_task_counts(text, 1))


def parse_task_counts(text: str | list[str], default: int) -> dict[str, int]:
    """'a,b:40' -> {a: default, b: 40}: validated task names with their episode counts."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not items:
        raise VlaforgeError(f"no tasks given; choose from {', '.join(TASKS.names())}")
    out = {}
    for item in items:
        name, _, count = item.partition(":")
        if name not in TASKS:
            raise VlaforgeError(TASKS.unknown_message(name))
        if name in out:
            raise VlaforgeError(f"task {name} is listed twice; give each task once (with data generate, {name}:N "
                                "records N episodes of it)")
        if count and (not count.isdigit() or int(count) < 1):
            raise VlaforgeError(f"episode count {count!r} of task {name} must be a positive integer (task:N)")
        out[name] = int(count) if count else default
    return out


def parse_cameras(text: str | list[str]) -> list[str]:
    return parse_names(text, CAMERAS, "camera")


def check_policy(cameras: list[str], state_dim: int, action_dim: int) -> None:
    """A policy Meta-World can run: its cameras among Meta-World's views, a 4-D state and 4-D actions.

    Raises:
        VlaforgeError: naming what does not fit.
    """
    bad = [c for c in cameras if c not in CAMERAS]
    if bad:
        raise VlaforgeError(f"the policy takes camera {bad[0]!r}, which Meta-World does not render (its views: "
                            f"{', '.join(CAMERAS)}); evaluate it on the benchmark it was trained on (a LIBERO-trained "
                            "run: --benchmark SUITE), or a policy trained on `vlaforge data generate` data")
    if (state_dim, action_dim) != (len(STATE_NAMES), len(ACTION_NAMES)):
        raise VlaforgeError(f"the policy takes a {state_dim}-D state and predicts {action_dim}-D actions; Meta-World's "
                            f"are {len(STATE_NAMES)}-D and {len(ACTION_NAMES)}-D - evaluate a policy trained on "
                            "`vlaforge data generate` data")


def episode_seed(split: str, task_index: int, attempt: int, seed: int = 0) -> int:
    """The environment seed of one attempt: disjoint across splits, tasks and base seeds."""
    return SPLIT_OFFSET[split] + seed * 100_000 + task_index * 10_000 + attempt


class MetaWorldEnv:
    """One seeded Meta-World task with multi-camera rendering; `reset(seed)` / `step(action)` / `views()`.

    `hide_distractors`: the task's distractor bodies (reach's puck) are drawn fully transparent - physics, the
    expert and success are unchanged. A policy trained on few episodes otherwise tells the episodes apart by the
    puck's random position, an easier cue than the 2 cm goal, and does not generalize (README, issue 23)."""

    def __init__(self, task: str, cameras: list[str], image_size: int, hide_distractors: bool = False):
        os.environ.setdefault("MUJOCO_GL", "egl")
        import metaworld
        import mujoco
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        self.name, self.cameras, self.image_size = task, list(cameras), image_size
        self.env = ALL_V3_ENVIRONMENTS[task]()
        self.env.set_task(metaworld.MT1(task, seed=0).train_tasks[0])
        self.env._freeze_rand_vec = False  # NOTE: with seeded_rand_vec, env.seed() alone sets the positions
        self.env.seeded_rand_vec = True
        self.env.model.light_castshadow[:] = 0
        self.env.model.mat_reflectance[:] = 0
        if hide_distractors:
            model = self.env.model
            for body in TASKS.get(task).distractors:
                index = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, body)
                model.geom_rgba[model.geom_bodyid == index, 3] = 0.0
        self.max_steps = min(int(self.env.max_path_length), MAX_STEPS)
        self._renderer = mujoco.Renderer(self.env.model, image_size, image_size)
        self._free: dict[str, mujoco.MjvCamera] = {}
        for name in set(self.cameras) & set(FREE_VIEWS):
            view, cam = FREE_VIEWS[name], mujoco.MjvCamera()
            cam.type, cam.distance = mujoco.mjtCamera.mjCAMERA_FREE, view.distance
            cam.azimuth, cam.elevation, cam.lookat[:] = view.azimuth, view.elevation, view.lookat
            self._free[name] = cam
        self.obs: np.ndarray | None = None
        atexit.register(self.close)  # NOTE: a GL context freed during interpreter teardown prints EGL errors

    fps = FPS

    def reset(self, seed: int) -> np.ndarray:
        import mujoco

        self.env.seed(seed)
        self.obs, _ = self.env.reset()
        # NOTE: reset moves the goal site in the model but not in the derived data the renderer reads, so
        # without a forward pass the first frame shows the previous episode's goal.
        mujoco.mj_forward(self.env.model, self.env.data)
        return self.obs

    def eval_reset(self, task_index: int, episode: int, seed: int) -> np.ndarray:
        """Evaluation episode `episode`: an initial position from the evaluation seed range."""
        return self.reset(episode_seed("eval", task_index, episode, seed))

    def instruction(self, episode: int) -> str:
        """The instruction of evaluation episode `episode` (the task's paraphrases in turn)."""
        instructions = TASKS.get(self.name).instructions
        return instructions[episode % len(instructions)]

    def step(self, action: np.ndarray) -> tuple[np.ndarray, bool]:
        """Apply one action (clipped to [-1, 1]); returns (observation, success)."""
        self.obs, _, _, _, info = self.env.step(np.clip(action, -1.0, 1.0).astype(np.float32))
        return self.obs, bool(info["success"])

    def views(self) -> dict[str, np.ndarray]:
        """camera -> (H, W, 3) uint8, upright."""
        out = {}
        for cam in self.cameras:
            self._renderer.update_scene(self.env.data, camera=self._free.get(cam, cam))
            img = self._renderer.render()
            # NOTE: Meta-World's corner cameras are mounted upside down; flip them so videos read naturally.
            out[cam] = np.ascontiguousarray(img[::-1, ::-1]) if cam.startswith("corner") else img.copy()
        return out

    def goal_mask(self) -> dict[str, np.ndarray]:
        """camera -> (H, W) bool: where the task's goal marker (site "goal") shows in the current state, found by
        drawing each view with the marker and without it (diagnostics: bench/goal_visibility.py)."""
        import mujoco

        model = self.env.model
        site = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, "goal")
        shown, alpha = self.views(), float(model.site_rgba[site, 3])
        model.site_rgba[site, 3] = 0.0
        try:
            hidden = self.views()
        finally:
            model.site_rgba[site, 3] = alpha
        return {c: np.abs(shown[c].astype(int) - hidden[c].astype(int)).sum(-1) > 30 for c in shown}

    def expert_input(self, obs: np.ndarray, steer_tcp: bool) -> np.ndarray:
        """The observation the scripted expert reads. With `steer_tcp`, for `Task.success_at_tcp` tasks, the goal
        is moved by the fingertips' offset from the hand, so the expert brings the fingertips - what success
        measures - to the goal instead of the hand body (which leaves them 4.5 cm below it)."""
        if not (steer_tcp and TASKS.get(self.name).success_at_tcp):
            return obs
        out = obs.copy()
        out[36:39] += obs[0:3] - self.env.tcp_center
        return out

    @staticmethod
    def state(obs: np.ndarray) -> np.ndarray:
        """What the policy may know of the robot: hand position and gripper opening."""
        return obs[0:4].astype(np.float32)

    @staticmethod
    def env_state(obs: np.ndarray) -> np.ndarray:
        """What the policy must find in the images (ENV_STATE_NAMES): the task's goal position (`obs[36:39]`)."""
        return obs[36:39].astype(np.float32)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self.env.close()
            self._renderer = None


_ENVS: dict[tuple, MetaWorldEnv] = {}


def cached_env(task: str, cameras: list[str], image_size: int, hide_distractors: bool = False) -> MetaWorldEnv:
    """This process's environment for (task, cameras, size, scene), built on first use (worker processes reuse it)."""
    key = (task, tuple(cameras), image_size, hide_distractors)
    if key not in _ENVS:
        _ENVS[key] = MetaWorldEnv(task, list(cameras), image_size, hide_distractors)
    return _ENVS[key]


def make_expert(task: str):
    # NOTE: Meta-World warns about its own experts' high gains; the env clips actions, as do we.
    warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high")
    import metaworld.policies

    return getattr(metaworld.policies, TASKS.get(task).expert)()


def expert_action(expert, obs: np.ndarray) -> np.ndarray:
    # NOTE: some experts edit the observation in place (door-open shifts the handle x); give them a copy.
    return np.clip(expert.get_action(obs.copy()), -1.0, 1.0).astype(np.float32)
