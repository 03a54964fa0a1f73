"""A LeRobot robot without hardware, for the robot-client tests (runs under the real LeRobot): its observations
are the frames of an .npz (state (N, S), one (N, H, W, 3) uint8 array per camera), served in turn; the actions it is
sent are recorded. Registered as robot type `vlaforge_sim`; LeRobot's factory finds `SimRobot` beside its config."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from lerobot.robots.config import RobotConfig
from lerobot.robots.robot import Robot


@RobotConfig.register_subclass("vlaforge_sim")
@dataclass
class SimRobotConfig(RobotConfig):
    frames: str = ""  # the .npz
    views: list[str] = field(default_factory=list)  # camera names (RobotConfig reserves `cameras`)
    action_dim: int = 4


class SimRobot(Robot):
    config_class = SimRobotConfig
    name = "vlaforge_sim"

    def __init__(self, config: SimRobotConfig):
        super().__init__(config)
        data = np.load(config.frames)
        self.state, self.images = data["state"], {c: data[c] for c in config.views}
        self.config, self.shown, self.sent, self.connected = config, [], [], False

    @property
    def observation_features(self) -> dict:
        joints = {f"j{i}.pos": float for i in range(self.state.shape[1])}
        return joints | {c: tuple(v.shape[1:]) for c, v in self.images.items()}

    @property
    def action_features(self) -> dict:
        return {f"j{i}.pos": float for i in range(self.config.action_dim)}

    @property
    def is_connected(self) -> bool:
        return self.connected

    def connect(self, calibrate: bool = True) -> None:
        self.connected = True

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        pass

    def configure(self) -> None:
        pass

    def get_observation(self) -> dict:
        i = len(self.shown) % len(self.state)
        self.shown.append(i)
        return {f"j{k}.pos": float(v) for k, v in enumerate(self.state[i])} | {c: v[i] for c, v in self.images.items()}

    def send_action(self, action: dict) -> dict:
        self.sent.append([action[k] for k in self.action_features])
        return action

    def disconnect(self) -> None:
        self.connected = False
