"""`vlaforge serve --protocol lerobot` (LeRobot's AsyncInference gRPC service): the real LeRobot 0.4.4 robot client
(its own classes and pickling, in its own environment) gets the runtime's action chunks and drives a simulated robot;
a corpus of malicious or broken payloads is refused without running anything, one logged line each, while a
well-behaved robot interleaved with them keeps getting actions; too many actions a chunk refused at the handshake
and a spoiled observation when it arrives (the real client told both); the API key, the call order and the CLI."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import subprocess
import sys
import warnings

import grpc
import numpy as np
import pytest
import torch

from vlaforge.inference.runtime import Observation
from vlaforge.serving import lerobot_pickle as lp
from vlaforge.serving.lerobot_grpc import SERVICE, messages

from conftest import served, train_on_dataset
from real_lerobot import SCRIPTS, lerobot_env
from test_serving import CAMS, Live, _runtime

TASK = "open the door"
M = messages()


def _frames(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"state": g.normal(size=(n, 4)).astype(np.float32),
            **{c: g.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for c in CAMS}}


def _predict(frames: dict, i: int) -> np.ndarray:
    """The reference: PolicyRuntime.predict of frame i in a fresh session (the tiny model has one frame)."""
    ref = _runtime()
    return ref.predict(Observation({c: frames[c][i] for c in CAMS}, frames["state"][i], TASK), f"ref{i}").actions


@pytest.fixture(autouse=True)
def _close_robots():
    yield
    while Robot.opened:
        Robot.opened.pop().channel.close()


@pytest.fixture
def lerobot_server():
    logs: list[str] = []
    live = Live(_runtime(), protocol="lerobot", max_message_bytes=2**20)
    live.server.log = logs.append
    host, port, _ = live.server.address
    yield f"{host}:{port}", logs, live
    live.close()


@pytest.mark.slow
def test_the_real_lerobot_robot_client_gets_the_runtime_actions(tmp_path, lerobot_server):
    address, _, live = lerobot_server
    frames = _frames(3)
    np.savez(tmp_path / "frames.npz", **frames)
    job = {"address": address, "policy_type": "vlaforge", "path": "vlaforge-run", "task": TASK, "chunk": 3,
           "frames": str(tmp_path / "frames.npz"), "cameras": list(CAMS), "action_dim": 4, "loop_s": 2.0}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    done = subprocess.run([sys.executable, str(SCRIPTS / "robot_client_run.py"), str(tmp_path / "jobs.json")],
                          env=lerobot_env(), capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)  # (its logger writes logs/ into the working folder)
    assert done.returncode == 0, done.stderr[-3000:]
    (out,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["started"] and not out["errors"], out  # Ready / SendPolicyInstructions
    predictions = [_predict(frames, i) for i in range(3)]
    for i, chunk in enumerate(out["chunks"]):
        assert chunk["type"] == "lerobot.async_inference.helpers.TimedAction"  # the client's own class
        assert chunk["timesteps"] == [100 * i + k for k in range(3)]  # actions_per_chunk = 3
        np.testing.assert_allclose(chunk["actions"], predictions[i][:3], atol=1e-6)
    # its own threads then drove the robot: every action executed is a row of the chunk of a frame it showed
    rows = np.concatenate([p[:3] for p in predictions])
    executed = np.asarray(out["executed"])
    assert len(executed) >= 10, out
    assert np.abs(executed[:, None, :] - rows[None]).max(-1).min(-1).max() < 1e-5
    assert set(out["shown"]) == {0, 1, 2}
    assert live.server.metrics.text().count('vlaforge_requests_total{transport="grpc"}') == 1


@pytest.mark.slow
def test_the_real_client_is_told_its_refusals_when_it_calls(tmp_path, lerobot_server):
    """LeRobot's own client: asking for more actions a chunk than the policy predicts fails its handshake (start()),
    and a spoiled observation fails its SendObservations (send_observation), each with the server's one line."""
    address, logs, _ = lerobot_server
    np.savez(tmp_path / "frames.npz", **_frames(2))
    done = subprocess.run([sys.executable, str(SCRIPTS / "robot_client_refusals.py"), address,
                           str(tmp_path / "frames.npz"), ",".join(CAMS), TASK, "12"], env=lerobot_env(),
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["too_many_started"] is False
    assert any("actions_per_chunk 12: this policy predicts 4 actions a chunk" in e for e in out["too_many_errors"])
    assert out["started"] is True
    assert out["sent"] == {"image without colour axis": False, "NaN joint": False, "missing camera": False,
                           "unspoiled": True}
    for says in ("camera 'front': shape (32, 32); send H x W x 3", "joint 'j1.pos' of the robot's state is nan",
                 "no camera 'top'"):
        assert any(says in e for e in out["errors"]), (says, out["errors"])
    assert any("2 actions a chunk of the policy's 4" in line for line in logs), logs  # what it is served


def test_actions_per_chunk_is_served_as_asked_or_refused_at_the_handshake(lerobot_server):
    address, logs, _ = lerobot_server
    robot = Robot(address)
    with pytest.raises(grpc.RpcError) as refused:
        robot.ready(chunk=12)  # the tiny policy predicts 4
    assert refused.value.code().name == "INVALID_ARGUMENT"
    assert refused.value.details() == ("actions_per_chunk 12: this policy predicts 4 actions a chunk (its "
                                       "action_chunk); ask for 1-4")
    with pytest.raises(grpc.RpcError) as refused:  # a refused handshake configures nothing
        robot.send(_observation(_frames(1), 0, step=0))
    assert refused.value.code().name == "FAILED_PRECONDITION"
    frames = _frames(1)
    for asked in (3, 4):
        robot.ready(chunk=asked)
        robot.send(_observation(frames, 0, step=asked))
        chunk = lp.decode(robot.actions(), list)
        assert [a.timestep for a in chunk] == [asked + k for k in range(asked)]
        np.testing.assert_allclose(np.stack([a.action.numpy() for a in chunk]), _predict(frames, 0)[:asked],
                                   atol=1e-6)
        assert f"{asked} actions a chunk of the policy's 4" in [x for x in logs if "asks for" in x][-1]


def test_a_spoiled_observation_is_refused_when_it_arrives(lerobot_server):
    """A wrong-shaped image, a NaN joint or a missing camera fails SendObservations with a line naming it; nothing
    is queued, so GetActions answers the robot's last good observation (or nothing), never an error."""
    address, logs, live = lerobot_server
    robot = Robot(address)
    robot.ready()
    frames = _frames(1, seed=3)
    raw = {f"j{k}.pos": float(v) for k, v in enumerate(frames["state"][0])} | {c: frames[c][0] for c in CAMS}
    spoiled = {"camera 'front': shape (3, 32, 32); send H x W x 3 RGB images": {"front": frames["front"][0].T},
               "camera 'top': dtype float32; send uint8 RGB images": {"top": frames["top"][0].astype(np.float32)},
               "joint 'j2.pos' of the robot's state is nan; send finite numbers": {"j2.pos": float("nan")},
               "joint 'j0.pos' of the robot's state is inf": {"j0.pos": float("inf")},
               "the observation has no camera 'top'": {"top": None}}
    for says, change in spoiled.items():
        observation = {k: v for k, v in (raw | change | {"task": TASK}).items() if v is not None}
        with pytest.raises(grpc.RpcError) as refused:
            robot.send(lp.dumps(lp.TimedObservation(timestamp=1.0, timestep=1, observation=observation,
                                                    must_go=True)))
        assert refused.value.code().name == "INVALID_ARGUMENT" and says in refused.value.details(), says
        assert "\n" not in refused.value.details()
    assert robot.actions() == b""  # nothing was queued: LeRobot's empty reply, the client asks again
    robot.send(_observation(frames, 0, step=2))
    np.testing.assert_allclose(np.stack([a.action.numpy() for a in lp.decode(robot.actions(), list)]),
                               _predict(frames, 0), atol=1e-6)
    assert len([x for x in logs if x.startswith("lerobot: refused")]) == len(spoiled)
    assert 'vlaforge_errors_total{kind="bad_observation"} 4.0' in live.server.metrics.text()


def test_a_pickled_tensor_is_rebuilt_without_typed_storage_warnings(monkeypatch):
    """torch's pickle of a tensor carries a TypedStorage, whose own methods warn that it is deprecated (once a
    process: re-armed here); the unpickler rebuilds views on its untyped bytes: the same values, strides and offset,
    and no warning."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {"view": base[:, 1:3], "bool": torch.tensor([True, False]), "bf16": torch.ones(3, dtype=torch.bfloat16)}
    payload = pickle.dumps(tensors)  # as LeRobot's client pickles a tensor in its observation
    monkeypatch.setattr(torch.storage._warn_typed_storage_removal, "has_warned", False, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        got = lp.decode(payload, dict)
    for k, v in tensors.items():
        assert torch.equal(got[k], v) and got[k].stride() == v.stride(), k
        assert got[k].storage_offset() == v.storage_offset(), k


def ask_together(address, frames: dict[str, np.ndarray], tasks: list[str]) -> list:
    """One robot per task, all ready, each sending its observation (`_observation(frames, i)`) at once from its own
    thread: per robot the decoded action chunk, or the grpc.RpcError its call raised."""
    import concurrent.futures as cf

    import grpc

    host, port, _ = address
    robots = [Robot(f"{host}:{port}") for _ in tasks]
    for r in robots:
        r.ready()

    def ask(i):
        robots[i].send(_observation(frames, i, step=0, task=tasks[i]))
        try:
            return np.stack([a.action.numpy() for a in lp.decode(robots[i].actions(), list)])
        except grpc.RpcError as exc:
            return exc

    with cf.ThreadPoolExecutor(len(tasks)) as pool:
        return list(pool.map(ask, range(len(tasks))))


class Robot:
    """A robot speaking LeRobot's gRPC protocol from this process (stubs from serving.lerobot_grpc), sending
    whatever bytes a test gives it. Closed at the end of the test (`robots` fixture): gRPC's threads live while a
    channel is open, and this process cannot fork CLI runs meanwhile (tests/forked.py)."""

    opened: list["Robot"] = []

    def __init__(self, address: str, key: str | None = None):
        Robot.opened.append(self)
        # a connection of its own (a robot is its gRPC peer; channels of one process would share one)
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.md = (("authorization", f"Api-Key {key}"),) if key else None

        def call(name, request, reply, kind="unary_unary"):
            return getattr(self.channel, kind)(f"/{SERVICE}/{name}", request_serializer=lambda m: m.SerializeToString(),
                                                response_deserializer=M[reply].FromString)

        self._ready = call("Ready", "Empty", "Empty")
        self._setup = call("SendPolicyInstructions", "PolicySetup", "Empty")
        self._send = call("SendObservations", "Observation", "Empty", "stream_unary")
        self._act = call("GetActions", "Empty", "Actions")

    def ready(self, features: dict | None = None, chunk: int = 4, config: bytes | None = None) -> None:
        self._ready(M["Empty"](), metadata=self.md, timeout=30)
        features = features or {"observation.state": {"dtype": "float32", "shape": (4,),
                                                      "names": [f"j{i}.pos" for i in range(4)]},
                                **{f"observation.images.{c}": {"dtype": "image", "shape": (32, 32, 3),
                                                               "names": ["height", "width", "channels"]}
                                   for c in CAMS}}
        config = config or lp.dumps(lp.RemotePolicyConfig(
            policy_type="act", pretrained_name_or_path="x", lerobot_features=features, actions_per_chunk=chunk,
            device="cpu", rename_map={}))
        self._setup(M["PolicySetup"](data=config), metadata=self.md, timeout=30)

    def send(self, payload: bytes, states=None, chunk: int = 2**21) -> None:
        """payload in chunks of LeRobot's 2 MiB (`states` overrides their transfer states)."""
        parts = [payload[i:i + chunk] for i in range(0, max(len(payload), 1), chunk)]
        states = states or ([1] + [2] * (len(parts) - 2) + [3] if len(parts) > 1 else [3])
        self._send(iter([M["Observation"](transfer_state=s, data=p) for s, p in zip(states, parts)]),
                   metadata=self.md, timeout=30)

    def actions(self) -> bytes:
        return self._act(M["Empty"](), metadata=self.md, timeout=30).data


def _observation(frames: dict, i: int, step: int, **extra) -> bytes:
    raw = {f"j{k}.pos": float(v) for k, v in enumerate(frames["state"][i])} | {c: frames[c][i] for c in CAMS}
    return lp.dumps(lp.TimedObservation(timestamp=1.0, timestep=step, observation=raw | {"task": TASK} | extra,
                                        must_go=True))


class Reduce:
    """Pickles as the call `fn(*args)` (what a hostile client can put anywhere in a payload)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _corpus(marker: str) -> dict[str, tuple[bytes, str] | tuple[bytes, str, int]]:
    """name -> (payload for SendObservations, the status code it must get[, the chunk size it is sent in])."""
    touch = f"touch {marker}"
    evil_storage = io.BytesIO()
    torch.save(Reduce(os.system, touch), evil_storage, _use_new_zipfile_serialization=False)
    with warnings.catch_warnings():  # a TypedStorage (what torch's tensor pickles carry) warns it is deprecated
        warnings.simplefilter("ignore", UserWarning)
        small = torch.zeros(2).storage()
    ok = {"j0.pos": 0.0}
    return {
        "reduce os.system": (pickle.dumps(Reduce(os.system, touch)), "INVALID_ARGUMENT"),
        "nested os.system inside a TimedObservation": (lp.dumps(lp.TimedObservation(
            timestamp=1.0, timestep=1, observation={"deep": [{"x": os.system}]}, must_go=True)), "INVALID_ARGUMENT"),
        "builtins.eval": (pickle.dumps(Reduce(eval, f"__import__('os').system('{touch}')")), "INVALID_ARGUMENT"),
        "subprocess.Popen": (pickle.dumps(Reduce(subprocess.Popen, ["touch", marker])), "INVALID_ARGUMENT"),
        "evil tensor storage": (lp.dumps(lp.TimedObservation(timestamp=1.0, timestep=1, must_go=True, observation={
            "t": Reduce(torch.storage._load_from_bytes, evil_storage.getvalue())})), "INVALID_ARGUMENT"),
        "stride-0 tensor bomb": (lp.dumps(lp.TimedObservation(timestep=1, timestamp=1.0, must_go=True, observation={
            "t": Reduce(torch._utils._rebuild_tensor_v2, small, 0, (10**10,), (0,), False,
                        collections.OrderedDict())})), "INVALID_ARGUMENT"),
        "ndarray allocation": (lp.dumps(lp.TimedObservation(timestep=1, timestamp=1.0, must_go=True, observation={
            "a": Reduce(np.ndarray, (10**12,))})), "INVALID_ARGUMENT"),
        "object array": (lp.dumps(lp.TimedObservation(timestep=1, timestamp=1.0, must_go=True,
                                                      observation={"a": np.array([1, "x"], dtype=object)} | ok)),
                         "INVALID_ARGUMENT"),
        "not a TimedObservation": (pickle.dumps({"timestep": 1, "observation": ok}), "INVALID_ARGUMENT"),
        "a TimedObservation without the robot's joints": (lp.dumps(lp.TimedObservation(
            timestep=1, timestamp=1.0, must_go=True, observation={"front": np.zeros((4, 4, 3), np.uint8)})),
            "INVALID_ARGUMENT"),
        "garbage": (b"\x80\x04\x95\x10\x00\x00not a pickle", "INVALID_ARGUMENT"),
        "deep nesting": (lp.dumps(lp.TimedObservation(timestep=1, timestamp=1.0, must_go=True, observation={
            "x": _nested(100)})), "INVALID_ARGUMENT"),
        "a chunk over gRPC's message limit": (b"\x00" * (5 * 2**20), "RESOURCE_EXHAUSTED"),
        "chunks adding up to over the 1 MiB limit": (b"\x00" * (3 * 2**19), "RESOURCE_EXHAUSTED", 2**19),
    }


def _nested(n: int) -> list:
    out: list = []
    for _ in range(n):
        out = [out]
    return out


@pytest.mark.slow
def test_malicious_payloads_are_refused_and_a_good_robot_keeps_getting_actions(tmp_path, lerobot_server):
    address, logs, live = lerobot_server
    marker = tmp_path / "PWNED"
    frames = _frames(2, seed=1)
    good, evil = Robot(address), Robot(address)
    good.ready()
    evil.ready()
    expected = [_predict(frames, i) for i in range(2)]
    corpus = _corpus(str(marker))
    for n, (name, (payload, code, *chunk)) in enumerate(corpus.items()):
        with pytest.raises(grpc.RpcError) as refused:
            evil.send(payload, chunk=chunk[0] if chunk else 2**21)
        assert refused.value.code().name == code, (name, refused.value.details())
        assert "\n" not in refused.value.details(), name
        i = n % 2
        good.send(_observation(frames, i, step=n))
        chunk = lp.decode(good.actions(), list)  # (LeRobot's client pickle.loads it: the first test)
        np.testing.assert_allclose(np.stack([a.action.numpy() for a in chunk]), expected[i], atol=1e-6,
                                   err_msg=f"after {name}")
    assert not marker.exists()
    refusals = [line for line in logs if line.startswith("lerobot: refused")]
    assert len(refusals) == len(corpus) and all("\n" not in line for line in refusals), logs
    # the policy instructions are read the same way; a truncated stream and an unknown transfer state
    with pytest.raises(grpc.RpcError) as refused:
        evil.ready(config=pickle.dumps(Reduce(os.system, f"touch {marker}")))
    assert refused.value.code().name == "INVALID_ARGUMENT" and "posix.system" in refused.value.details()
    evil.ready()
    for states in ([1], [1, 2], [0]):
        with pytest.raises(grpc.RpcError) as refused:
            evil.send(_observation(frames, 0, step=99), states=states)
        assert refused.value.code().name == "INVALID_ARGUMENT", refused.value.details()
    assert not marker.exists()
    assert 'vlaforge_errors_total{kind="unsafe_pickle"}' in live.server.metrics.text()


def test_call_order_features_and_the_api_key(lerobot_server):
    address, _, _ = lerobot_server
    robot = Robot(address)
    with pytest.raises(grpc.RpcError) as refused:
        robot.actions()
    assert refused.value.code().name == "FAILED_PRECONDITION"
    with pytest.raises(grpc.RpcError) as refused:  # the policy takes 4 joints
        robot.ready(features={"observation.state": {"names": ["a", "b"]}})
    assert "2 joints" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:  # a refused instruction configures nothing
        robot.actions()
    assert refused.value.code().name == "FAILED_PRECONDITION"
    with pytest.raises(grpc.RpcError) as refused:
        robot.ready(features={"observation.state": {"names": [f"j{i}" for i in range(4)]},
                              "observation.images.side": {"shape": (32, 32, 3)}})
    assert "cameras" in refused.value.details()
    keyed = Live(_runtime(), protocol="lerobot", api_key="s3cret")
    try:
        host, port, _ = keyed.server.address
        with pytest.raises(grpc.RpcError) as refused:
            Robot(f"{host}:{port}").ready()
        assert refused.value.code().name == "UNAUTHENTICATED"
        with pytest.raises(grpc.RpcError):
            Robot(f"{host}:{port}", key="wrong").ready()
        frames = _frames(1)
        robot = Robot(f"{host}:{port}", key="s3cret")
        robot.ready()
        robot.send(_observation(frames, 0, step=0))
        np.testing.assert_allclose(np.stack([a.action.numpy() for a in lp.decode(robot.actions(), list)]),
                                   _predict(frames, 0), atol=1e-6)
    finally:
        keyed.close()


@pytest.mark.slow
def test_the_cli_serves_a_trained_run_over_grpc(tmp_path):
    """`vlaforge serve RUN --protocol lerobot`: a robot gets a chunk of the run's action size; SIGTERM stops it."""
    from fake_lerobot import write_dataset

    write_dataset(tmp_path / "ds")
    run = train_on_dataset(tmp_path, "run")
    frames = _frames(1)
    with served(run, "--protocol", "lerobot", "--fps", "10") as uri:
        robot = Robot(uri.removeprefix("grpc://"))
        robot.ready(features={"observation.state": {"names": [f"j{i}.pos" for i in range(4)]},
                              "observation.images.front": {}, "observation.images.top": {}}, chunk=2)
        robot.send(_observation(frames, 0, step=7))
        chunk = lp.decode(robot.actions(), list)
    assert [a.timestep for a in chunk] == [7, 8] and chunk[1].timestamp - chunk[0].timestamp == pytest.approx(0.1)
    assert chunk[0].action.shape == (4,)


def test_robots_are_batched_together_each_getting_its_own_actions():
    """Three robots asking at once: one batched forward (the batcher waits for every open session), each chunk
    its own observation's."""

    live = Live(_runtime(), protocol="lerobot", max_wait_ms=2000)
    try:
        frames = _frames(3, seed=2)
        chunks = ask_together(live.server.address, frames, [TASK] * 3)
        for i, chunk in enumerate(chunks):
            np.testing.assert_allclose(chunk, _predict(frames, i), atol=1e-6)
        assert 'vlaforge_batch_size_bucket{le="2.0"} 0.0' in live.server.metrics.text()  # one batch of three
    finally:
        live.close()
