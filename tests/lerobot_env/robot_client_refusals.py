"""Run under the real LeRobot: what its own RobotClient is told when the server refuses, against a `vlaforge serve
--protocol lerobot` at ADDRESS on the simulated robot of sim_robot.py. Prints JSON.

    python robot_client_refusals.py ADDRESS FRAMES.npz CAMERAS TASK TOO_MANY_ACTIONS

1. A client asking for TOO_MANY_ACTIONS per chunk: whether its own start() (Ready + SendPolicyInstructions)
   succeeded, and the errors it logged.
2. A client asking for 2: its start(), then its own send_observation of the robot's observation spoiled three
   ways (the first camera's image without its colour axis, a NaN joint, the last camera missing), then unspoiled:
   what each send returned and the errors it logged.
"""

import json
import logging
import sys
import time

import bootstrap  # noqa: F401 - first (sorts first too)
from lerobot.async_inference.configs import RobotClientConfig
from lerobot.async_inference.helpers import TimedObservation
from lerobot.async_inference.robot_client import RobotClient

from sim_robot import SimRobotConfig


class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def client(address: str, frames: str, cameras: list[str], task: str, per_chunk: int) -> tuple[RobotClient, Errors]:
    robot = SimRobotConfig(frames=frames, views=cameras, id="sim")
    cfg = RobotClientConfig(policy_type="vlaforge", pretrained_name_or_path="vlaforge-run", robot=robot,
                            actions_per_chunk=per_chunk, task=task, server_address=address, fps=30)
    made = RobotClient(cfg)
    errors = Errors()
    made.logger.addHandler(errors)
    return made, errors


def main() -> None:
    address, frames, cameras, task, too_many = sys.argv[1:6]
    cams = cameras.split(",")
    greedy, greedy_errors = client(address, frames, cams, task, int(too_many))
    out = {"too_many_started": greedy.start(), "too_many_errors": greedy_errors.lines}
    greedy.channel.close()
    robot, errors = client(address, frames, cams, task, 2)
    out["started"] = robot.start()
    spoil = {"image without colour axis": lambda raw: raw | {cams[0]: raw[cams[0]][..., 0]},
             "NaN joint": lambda raw: raw | {"j1.pos": float("nan")},
             "missing camera": lambda raw: {k: v for k, v in raw.items() if k != cams[-1]},
             "unspoiled": lambda raw: raw}
    out["sent"] = {}
    for step, (name, change) in enumerate(spoil.items()):
        raw = robot.robot.get_observation() | {"task": task}
        obs = TimedObservation(timestamp=time.time(), observation=change(raw), timestep=step, must_go=True)
        out["sent"][name] = robot.send_observation(obs)
    out["errors"] = errors.lines
    print(json.dumps(out))
    robot.channel.close()


if __name__ == "__main__":
    main()
