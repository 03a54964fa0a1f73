"""`vlaforge serve` against live servers: the real openpi client gets the runtime's actions, a corpus of bad
requests is answered one line each without harming anyone, batching keeps every reply with its request, API keys,
episode controls, metrics, a drain on SIGTERM, and a bounded soak with random disconnects."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import resource
import threading
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest

from vlaforge.inference.runtime import Observation, PolicyRuntime
from vlaforge.serving import protocol
from vlaforge.serving.client import PolicyClient, ServerError, wire_observation
from vlaforge.serving.server import PolicyServer, ServeOptions

from test_inference import TOKENIZER, _model, _spec

CAMS = ["front", "top"]


_MODELS: dict = {}


def _runtime(frames=1):
    """A runtime over one shared tiny model per frame history (so a reference runtime has the server's weights)."""
    if frames not in _MODELS:
        _MODELS[frames] = _model(frames=frames)
    model, cfg = _MODELS[frames]
    return PolicyRuntime(model, _spec(model, cfg, stride=1), TOKENIZER, device="cpu")


class Live:
    """A PolicyServer in a thread on free loopback ports."""

    def __init__(self, runtime, **options):
        self.server = PolicyServer(runtime, ServeOptions(port=0, **options), log=lambda m: None)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert self.server.ready.wait(30)
        host, port, http = self.server.address
        self.uri, self.http = f"ws://{host}:{port}", f"http://{host}:{http}"

    def close(self):
        self.server.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def live():
    servers = []
    yield lambda runtime=None, **kw: servers.append(Live(runtime or _runtime(), **kw)) or servers[-1]
    for s in servers:
        s.close()


def _obs(seed, instruction="open the door", size=32):
    g = np.random.default_rng(seed)
    return Observation({c: g.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in CAMS},
                       g.normal(size=4).astype(np.float32), instruction)


def test_the_openpi_client_gets_the_runtime_actions(live):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    server = live(_runtime(frames=2))
    host, port, _ = server.server.address
    client = WebsocketClientPolicy(host, port)
    meta = client.get_server_metadata()
    assert meta["cameras"] == CAMS and meta["action_chunk"] == 4 and meta["frames"] == 2
    reference = _runtime(frames=2)  # the same weights, its own sessions
    for seed in range(4):
        obs = _obs(seed)
        reply = client.infer(wire_observation(obs))
        assert reply["actions"].dtype == np.float32 and reply["actions"].shape == (4, 4)
        np.testing.assert_allclose(reply["actions"], reference.predict(obs).actions, atol=1e-6)
        assert {"infer_ms", "queue_ms", "batch_size"} <= reply["server_timing"].keys()
    # LeRobot keys are accepted as well
    lerobot = {f"observation.images.{c}": v for c, v in _obs(9).images.items()}
    lerobot |= {"observation.state": np.zeros(4, np.float32), "task": "open the door"}
    assert client.infer(lerobot)["actions"].shape == (4, 4)


def test_episode_controls_reset_the_connection_session(live):
    server = live(_runtime(frames=2))
    c = PolicyClient(server.uri)
    first = c.infer(wire_observation(_obs(0)))["actions"]
    c.infer(wire_observation(_obs(1)))
    assert c.control("episode_start") == {"__ack__": "episode_start"}
    np.testing.assert_array_equal(c.infer(wire_observation(_obs(0)))["actions"], first)
    assert c.control("observe", **wire_observation(_obs(1))) == {"__ack__": "observe"}
    assert not np.allclose(c.infer(wire_observation(_obs(0)))["actions"], first)  # the observed frame counts
    c.close()


def _raw(obs_dict: dict) -> bytes:
    return protocol.pack(obs_dict)


def _array(data: bytes, dtype: str, shape) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def _good() -> dict:
    return wire_observation(_obs(0))


def _with(**changes) -> bytes:
    msg = _good()
    for k, v in changes.items():
        key = {"corner": "observation/images/front", "state": "observation/state", "prompt": "prompt"}[k]
        if v is None:
            msg.pop(key)
        else:
            msg[key] = v
    return msgpack.packb(msg, default=protocol._encode_array)


def _deep(n: int) -> bytes:
    return b"\x91" * n + b"\xc0"  # n nested one-element arrays


BAD = {
    "not msgpack": b"\xc1\xc1\xc1 not msgpack",
    "truncated": _raw(_good())[:-10],
    "text frame": "hello",
    "a list, not a map": msgpack.packb([1, 2, 3]),
    "a number": msgpack.packb(7),
    "missing camera": _with(corner=None),
    "missing state": _with(state=None),
    "missing prompt": _with(prompt=None),
    "prompt not a string": _with(prompt=12),
    "1 MB prompt": _with(prompt="x" * 2**20),
    "float32 image": _with(corner=np.zeros((32, 32, 3), np.float32)),
    "object dtype": msgpack.packb({"observation/images/front": _array(b"\0" * 8, "|O", [1])}),
    "complex dtype": msgpack.packb({"observation/images/front": _array(b"\0" * 16, "<c16", [1])}),
    "shape does not match the bytes": msgpack.packb({"observation/images/front": _array(b"\0" * 10, "|u1",
                                                                                         [32, 32, 3])}),
    "negative shape": msgpack.packb({"observation/images/front": _array(b"", "|u1", [-1, 3])}),
    "too many dims": msgpack.packb({"observation/images/front": _array(b"\0", "|u1", [1, 1, 1, 1, 1, 1])}),
    "NaN state": _with(state=np.array([0, np.nan, 0, 0], np.float32)),
    "inf state": _with(state=np.array([0, np.inf, 0, 0], np.float32)),
    "state of the wrong length": _with(state=np.zeros(7, np.float32)),
    "state not numbers": _with(state=["a", "b"]),
    "image of 0 pixels": _with(corner=np.zeros((0, 0, 3), np.uint8)),
    "image of 20,000 pixels a side": _with(corner=np.zeros((20000, 1, 3), np.uint8)),
    "2-D image": _with(corner=np.zeros((32, 32), np.uint8)),
    "deep nesting": _deep(5000),
    "unknown control": msgpack.packb({"__ctrl__": "format_disk"}),
    "over the size limit": _with(prompt="y" * (3 * 2**20)),
}


def test_every_bad_request_gets_one_line_and_harms_no_one(live):
    server = live(max_message_bytes=2 * 2**20)
    bad, good = PolicyClient(server.uri), PolicyClient(server.uri)
    assert len(BAD) >= 20
    answers = {}
    for name, message in BAD.items():
        bad.ws.send(message)
        reply = bad.ws.recv(timeout=30)
        answers[name] = reply
        assert isinstance(reply, str) and reply.startswith("error: ") and "\n" not in reply, (name, reply)
        # the well-behaved client, interleaved, is answered every time; so is the bad one's next good request
        assert good.infer(_good())["actions"].shape == (4, 4)
        assert bad.infer(_good())["actions"].shape == (4, 4), name
    assert "observation/images/front: missing" in answers["missing camera"]
    assert "needs 3072 bytes, the message has 10" in answers["shape does not match the bytes"]
    assert "'|O' is not accepted" in answers["object dtype"]
    assert "state: contains NaN or inf" in answers["NaN state"]
    assert "at most 4096 a side" in answers["image of 20,000 pixels a side"]
    assert "over the 2097152-byte limit" in answers["over the size limit"]
    metrics = urllib.request.urlopen(server.uri.replace("ws", "http") + "/metrics").read().decode()
    assert 'vlaforge_errors_total{kind="bad_message"}' in metrics and "vlaforge_sessions 2.0" in metrics


def test_api_key_is_required_on_both_transports(live):
    server = live(api_key="s3cret")
    with pytest.raises(Exception, match="401"):
        PolicyClient(server.uri)
    with pytest.raises(Exception, match="401"):
        PolicyClient(server.uri, api_key="wrong")
    assert PolicyClient(server.uri, api_key="s3cret").infer(_good())["actions"].shape == (4, 4)
    body = json.dumps({"observation": {"images": {c: v.tolist() for c, v in _obs(0).images.items()},
                                       "state": [0, 0, 0, 0]}, "prompt": "open the door"}).encode()
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(urllib.request.Request(server.http + "/act", data=body, method="POST"))
    req = urllib.request.Request(server.http + "/act", data=body, method="POST",
                                 headers={"Authorization": "Api-Key s3cret"})
    reply = json.loads(urllib.request.urlopen(req).read())
    assert np.asarray(reply["actions"]).shape == (4, 4)
    assert urllib.request.urlopen(server.http + "/healthz").status == 200  # health needs no key


def test_http_act_equals_the_websocket_and_refuses_bad_json(live):
    server = live()
    obs = _obs(3)
    body = {"observation": {"images": {c: v.tolist() for c, v in obs.images.items()}, "state": obs.state.tolist()},
            "prompt": obs.instruction}
    reply = json.loads(urllib.request.urlopen(urllib.request.Request(
        server.http + "/act", data=json.dumps(body).encode(), method="POST")).read())
    ws = PolicyClient(server.uri).infer(wire_observation(obs))["actions"]
    np.testing.assert_allclose(np.asarray(reply["actions"], np.float32), ws, atol=1e-6)
    for data, message in ((b"{not json", "not JSON"), (json.dumps({"x": 1}).encode(), "send {")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(server.http + "/act", data=data, method="POST"))
        assert err.value.code == 400 and message in json.loads(err.value.read())["error"]


def test_batching_answers_each_request_with_its_own_actions(live):
    runtime = _runtime()
    server = live(runtime, max_batch=8, max_wait_ms=50)
    reference = _runtime()
    want = {i: reference.predict(_obs(i, instruction=["open the door", "press the button"][i % 2]), f"r{i}").actions
            for i in range(8)}

    def client(i):
        c = PolicyClient(server.uri)
        out = []
        for _ in range(3):
            reply = c.infer(wire_observation(_obs(i, instruction=["open the door", "press the button"][i % 2])))
            out.append((reply["actions"], reply["server_timing"]["batch_size"]))
        c.close()
        return out

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client, range(8)))
    sizes = [b for r in results for _, b in r]
    assert max(sizes) > 1  # requests of several connections shared a forward
    for i, r in enumerate(results):
        for actions, _ in r:
            np.testing.assert_allclose(actions, want[i], atol=2e-6)
    time.sleep(0.2)
    assert runtime.sessions == {}  # closed connections leave no session behind


def test_a_stalled_client_times_out_and_blocks_no_one(live):
    server = live(idle_timeout_s=1.0)
    stalled = PolicyClient(server.uri)
    good = PolicyClient(server.uri)
    assert good.infer(_good())["actions"].shape == (4, 4)
    time.sleep(1.5)
    from websockets.exceptions import ConnectionClosed

    with pytest.raises(ConnectionClosed):
        stalled.infer(_good())  # closed by the server
    fresh = PolicyClient(server.uri)
    assert fresh.infer(_good())["actions"].shape == (4, 4)


@pytest.mark.slow
def test_soak_many_clients_with_random_disconnects(live):
    """Bounded soak: 16 clients for 12 s, each reconnecting at random; every reply matches its request, no session
    leaks, memory stays flat."""
    runtime = _runtime()
    server = live(runtime, max_batch=8, max_wait_ms=5)
    reference = _runtime()
    want = {i: reference.predict(_obs(i), f"r{i}").actions for i in range(16)}
    stop = time.monotonic() + 12
    rss = []
    errors, replies = [], [0]

    def client(i):
        rng = random.Random(i)
        while time.monotonic() < stop:
            c = PolicyClient(server.uri)
            for _ in range(rng.randint(1, 6)):
                actions = c.infer(wire_observation(_obs(i)))["actions"]
                if not np.allclose(actions, want[i], atol=2e-6):
                    errors.append(i)
                replies[0] += 1
            if rng.random() < 0.5:
                c.ws.close()
            else:
                c.ws.socket.close()  # vanish without a close frame

    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, i) for i in range(16)]
        while any(not f.done() for f in futures):
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            time.sleep(1)
        for f in futures:
            f.result()
    deadline = time.monotonic() + 30
    while runtime.sessions and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not errors and replies[0] > 100
    assert runtime.sessions == {} and not server.server.sessions
    assert rss[-1] <= rss[len(rss) // 3] * 1.05  # peak memory after the warm-up grows under 5 %


def test_errors_from_the_server_raise_in_the_client(live):
    server = live()
    c = PolicyClient(server.uri)
    with pytest.raises(ServerError, match="observation/state: missing"):
        c.infer({k: v for k, v in _good().items() if k != "observation/state"})
