"""A served policy never sends a non-finite action: a prediction holding a NaN or inf is answered with one error line
over the websocket, HTTP `POST /act` and LeRobot's gRPC protocol, counted in the metrics, and the next good request
of the same session is answered; in a batch of several robots only the poisoned one is refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from vlaforge.serving import lerobot_pickle as lp
from vlaforge.serving.client import PolicyClient, ServerError, wire_observation

from test_lerobot_serving import TASK, Robot, _close_robots, _frames, _observation, _predict, ask_together  # noqa: F401
from test_serving import Live, _obs, _runtime

# (_close_robots, imported, is autouse here too: it closes each test's robot channels)
POISON = "make the policy predict NaN"  # the instruction whose predictions come out non-finite
SAYS = "the policy produced non-finite actions (NaN or inf) for this observation, so none were sent; check the " \
       "checkpoint's weights and its normalization statistics"


def _poisoned(runtime):
    """The runtime with one NaN and one inf in each prediction for the instruction POISON: what a checkpoint with a
    broken weight or statistic gives for a chosen observation, the rest of the batch's rows untouched."""
    run = runtime.run

    def run_poisoned(requests):
        preds = run(requests)
        for req, pred in zip(requests, preds):
            if req.session.instruction == POISON:
                pred.actions = pred.actions.copy()
                pred.actions[1, 2], pred.actions[3, 0] = np.nan, np.inf
        return preds

    runtime.run = run_poisoned
    return runtime


@pytest.fixture
def live():
    servers: list[Live] = []
    yield lambda **kw: servers.append(Live(_poisoned(_runtime()), **kw)) or servers[-1]
    for s in servers:
        s.close()


def _counted(server: Live, n: int) -> None:
    text = server.server.metrics.text()
    assert f"vlaforge_nonfinite_actions_total {n:.1f}" in text, text
    assert f'vlaforge_errors_total{{kind="nonfinite_actions"}} {n:.1f}' in text, text


def _one_line(message: str) -> None:
    assert SAYS in message and "\n" not in message and "Traceback" not in message
    assert "nan" not in message.lower().replace("nan or inf", "")  # never the actions themselves


def test_the_websocket_answers_an_error_and_the_session_goes_on(live):
    logs: list[str] = []
    server = live()
    server.server.log = logs.append
    client = PolicyClient(server.uri)
    good = client.infer(wire_observation(_obs(0)))["actions"]
    with pytest.raises(ServerError) as refused:
        client.infer(wire_observation(_obs(1, instruction=POISON)))
    _one_line(str(refused.value))
    after = client.infer(wire_observation(_obs(2)))["actions"]  # the same connection, a good observation
    assert after.shape == (4, 4) and np.isfinite(after).all() and np.isfinite(good).all()
    assert sum(SAYS in line for line in logs) == 1, logs  # the operator's one line
    _counted(server, 1)
    client.close()


def _act(server: Live, instruction: str):
    obs = _obs(3, instruction=instruction)
    body = {"observation": {"images": {c: v.tolist() for c, v in obs.images.items()}, "state": obs.state.tolist()},
            "prompt": obs.instruction}
    request = urllib.request.Request(server.http + "/act", data=json.dumps(body).encode(), method="POST")
    return json.loads(urllib.request.urlopen(request).read())


def test_http_act_answers_500_with_one_line_and_goes_on(live):
    server = live()
    with pytest.raises(urllib.error.HTTPError) as refused:
        _act(server, POISON)
    assert refused.value.code == 500  # the server's policy failed, not the client's request
    _one_line(json.loads(refused.value.read())["error"])
    actions = np.asarray(_act(server, "open the door")["actions"])
    assert actions.shape == (4, 4) and np.isfinite(actions).all()
    _counted(server, 1)


def test_grpc_get_actions_fails_and_the_robot_goes_on(live):
    logs: list[str] = []
    server = live(protocol="lerobot")
    server.server.log = logs.append
    host, port, _ = server.server.address
    robot = Robot(f"{host}:{port}")
    robot.ready()
    frames = _frames(2, seed=4)
    robot.send(_observation(frames, 0, step=0, task=POISON))
    with pytest.raises(grpc.RpcError) as refused:
        robot.actions()
    assert refused.value.code().name == "INTERNAL"
    _one_line(refused.value.details())
    robot.send(_observation(frames, 1, step=1))
    chunk = np.stack([a.action.numpy() for a in lp.decode(robot.actions(), list)])
    np.testing.assert_allclose(chunk, _predict(frames, 1), atol=1e-6)
    assert sum(SAYS in line for line in logs) == 1, logs  # the operator's one line
    _counted(server, 1)


def test_a_batch_of_robots_refuses_only_the_poisoned_one(live):
    """Three robots in one forward, the second asking with the poisoned instruction: it alone gets the error."""
    server = live(protocol="lerobot", max_wait_ms=2000)  # the batcher waits for all three open sessions
    frames = _frames(3, seed=5)
    got = ask_together(server.server.address, frames, [TASK, POISON, TASK])
    assert isinstance(got[1], grpc.RpcError) and SAYS in got[1].details()
    for i in (0, 2):
        np.testing.assert_allclose(got[i], _predict(frames, i), atol=1e-6)
    text = server.server.metrics.text()
    assert 'vlaforge_batch_size_bucket{le="2.0"} 0.0' in text and "vlaforge_batch_size_count 1.0" in text
    _counted(server, 1)
