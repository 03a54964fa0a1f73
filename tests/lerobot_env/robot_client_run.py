"""Run under the real LeRobot: its own RobotClient (its config, gRPC stubs, chunked transfer and pickling) against a
`vlaforge serve --protocol lerobot` at ADDRESS, on the simulated robot of sim_robot.py. Prints JSON.

    python robot_client_run.py ADDRESS FRAMES.npz CAMERAS TASK ACTIONS_PER_CHUNK LOOP_SECONDS

1. For each frame: the robot's observation as LeRobot's control loop wraps it (TimedObservation, task added,
   must_go), sent by the client's own send_observation; then the client's stub asks GetActions and the reply is
   unpickled as its receiver thread does: the chunks, in order.
2. Then Ready again and the client's own threads (receive_actions + control_loop, latest_only aggregation) drive the
   robot for LOOP_SECONDS: the actions the robot executed, and the frames it showed.
"""

import json
import pickle
import sys
import threading
import time

import bootstrap  # noqa: F401 - first
from lerobot.async_inference.configs import RobotClientConfig
from lerobot.async_inference.helpers import TimedObservation
from lerobot.async_inference.robot_client import RobotClient
from lerobot.transport import services_pb2

from sim_robot import SimRobotConfig


def main() -> None:
    address, frames, cameras, task, per_chunk, seconds = sys.argv[1:7]
    robot = SimRobotConfig(frames=frames, views=cameras.split(","), id="sim")
    cfg = RobotClientConfig(policy_type="vlaforge", pretrained_name_or_path="vlaforge-run", robot=robot,
                            actions_per_chunk=int(per_chunk), task=task, server_address=address, fps=30,
                            aggregate_fn_name="latest_only", chunk_size_threshold=0.5)
    client = RobotClient(cfg)
    assert client.start(), "Ready / SendPolicyInstructions failed"
    chunks = []
    for i in range(len(client.robot.state)):
        raw = client.robot.get_observation()
        raw["task"] = task
        obs = TimedObservation(timestamp=time.time(), observation=raw, timestep=100 * i, must_go=True)
        assert client.send_observation(obs)
        reply = client.stub.GetActions(services_pb2.Empty())
        timed = pickle.loads(reply.data)
        chunks.append({"timesteps": [a.get_timestep() for a in timed], "type": type(timed[0]).__module__ + "."
                       + type(timed[0]).__name__, "actions": [a.get_action().tolist() for a in timed]})
    client.robot.shown.clear()
    assert client.start()
    receiver = threading.Thread(target=client.receive_actions, daemon=True)
    loop = threading.Thread(target=client.control_loop, args=(task,), daemon=True)
    receiver.start()
    loop.start()
    time.sleep(float(seconds))
    client.shutdown_event.set()
    loop.join(10)
    receiver.join(10)
    print(json.dumps({"chunks": chunks, "executed": client.robot.sent, "shown": client.robot.shown}))
    client.channel.close()


if __name__ == "__main__":
    main()
