"""Run under the real LeRobot: its own RobotClient (its config, gRPC stubs, chunked transfer and pickling) against
`vlaforge serve --protocol lerobot` servers, on the simulated robot of sim_robot.py. Prints JSON: one result per job.

    python robot_client_run.py JOBS.json

Each job ({address, policy_type, path, frames (.npz), cameras, action_dim, chunk (actions_per_chunk), task, and
optionally loop_s}) gets its own client:
1. start() (Ready + SendPolicyInstructions); when it succeeds, for each frame the robot's observation as LeRobot's
   control loop wraps it (TimedObservation, task added, must_go), sent by the client's own send_observation; then
   the client's stub asks GetActions and the reply is unpickled as its receiver thread does: the chunks, in order.
   The errors the client logs are kept (a refused handshake is one of them).
2. For the jobs with loop_s, after every job's chunks: Ready again and the client's own threads (receive_actions +
   control_loop, latest_only aggregation) drive the robot for loop_s seconds: the actions the robot executed, and
   the frames it showed.
"""

import json
import logging
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


class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def chunks(client, task):
    out = []
    for i in range(len(client.robot.state)):
        raw = client.robot.get_observation() | {"task": task}
        assert client.send_observation(TimedObservation(timestamp=time.time(), observation=raw, timestep=100 * i,
                                                        must_go=True))
        timed = pickle.loads(client.stub.GetActions(services_pb2.Empty()).data)
        out.append({"timesteps": [a.get_timestep() for a in timed],
                    "type": type(timed[0]).__module__ + "." + type(timed[0]).__name__,
                    "actions": [a.get_action().tolist() for a in timed]})
    return out


def loop(client, task, seconds):
    client.robot.shown.clear()
    assert client.start()
    receiver = threading.Thread(target=client.receive_actions, daemon=True)
    control = threading.Thread(target=client.control_loop, args=(task,), daemon=True)
    receiver.start()
    control.start()
    time.sleep(seconds)
    client.shutdown_event.set()
    control.join(10)
    receiver.join(10)
    return {"executed": client.robot.sent, "shown": client.robot.shown}


def main() -> None:
    jobs, results, clients = json.load(open(sys.argv[1])), [], []
    for job in jobs:
        robot = SimRobotConfig(frames=job["frames"], views=job["cameras"], id="sim", action_dim=job["action_dim"])
        client = RobotClient(RobotClientConfig(
            policy_type=job["policy_type"], pretrained_name_or_path=job["path"], robot=robot,
            actions_per_chunk=job["chunk"], task=job["task"], server_address=job["address"], fps=30,
            aggregate_fn_name="latest_only", chunk_size_threshold=0.5))
        errors = Errors()
        client.logger.addHandler(errors)
        started = client.start()
        results.append({"started": started, "chunks": chunks(client, job["task"]) if started else [],
                        "errors": errors.lines})
        client.logger.removeHandler(errors)  # (the clients share one logger)
        clients.append(client)
    for job, client, result in zip(jobs, clients, results):
        if job.get("loop_s"):
            result.update(loop(client, job["task"], job["loop_s"]))
    for client in clients:
        client.channel.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
