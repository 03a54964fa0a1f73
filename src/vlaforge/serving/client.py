"""Clients of `vlaforge serve`.

`PolicyClient` speaks openpi's protocol (what `openpi_client.websocket_client_policy.WebsocketClientPolicy`
sends) and adds the episode controls. `RemoteRuntime` puts a connection behind the part of `PolicyRuntime` that
`inference.ChunkExecutor` uses, so chunk execution - synchronous or asynchronous (the next chunk requested while
the current one executes) - and `vlaforge eval --server` run against a server exactly as they run in process.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from vlaforge.errors import VlaforgeError
from vlaforge.inference.feature_cache import CacheConfig, SessionCache
from vlaforge.inference.runtime import Observation, Prediction, Session
from vlaforge.serving import protocol


class ServerError(VlaforgeError):
    """The server answered with an error frame."""


class PolicyClient:
    """A websocket connection to a policy server: `infer(obs_dict)`, `reset()`, `metadata`."""

    def __init__(self, uri: str, api_key: str | None = None, timeout_s: float = 60.0,
                 max_bytes: int = 64 * 2**20):
        from websockets.sync.client import connect

        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self.max_bytes, self.timeout = max_bytes, timeout_s
        try:
            self.ws = connect(uri, compression=None, max_size=max_bytes, additional_headers=headers,
                              open_timeout=timeout_s, legacy=True)  # a connection object, closed by close()
        except (OSError, TimeoutError) as exc:
            raise VlaforgeError(f"cannot reach the policy server at {uri} ({exc}); start it with vlaforge serve") \
                from None
        except Exception as exc:  # noqa: BLE001 - websockets' handshake errors (401, 503) carry the reason
            raise VlaforgeError(f"the policy server at {uri} refused the connection ({str(exc)[:160]})") from None
        self.metadata = protocol.unpack(self.ws.recv(timeout=timeout_s), max_bytes)

    def _call(self, message: dict) -> dict:
        self.ws.send(protocol.pack(message))
        reply = self.ws.recv(timeout=self.timeout)
        if isinstance(reply, str):
            raise ServerError(reply.removeprefix("error: "))
        return protocol.unpack(reply, self.max_bytes)

    def infer(self, obs: dict[str, Any]) -> dict:
        return self._call(obs)

    def control(self, verb: str, **obs: Any) -> dict:
        return self._call({"__ctrl__": verb, **obs})

    def reset(self) -> None:
        self.control("episode_start")

    def close(self) -> None:
        self.ws.close()


def wire_observation(obs: Observation) -> dict[str, Any]:
    """An `Observation` in openpi's keys."""
    out: dict[str, Any] = {f"observation/images/{cam}": np.ascontiguousarray(img) for cam, img in obs.images.items()}
    out["observation/state"] = np.asarray(obs.state, dtype=np.float32)
    out["prompt"] = obs.instruction
    return out


class RemoteRuntime:
    """What `ChunkExecutor` and the evaluation loop use of a `PolicyRuntime`, over one server connection (one
    session: the connection's)."""

    def __init__(self, client: PolicyClient):
        m = client.metadata
        self.client = client
        self.cameras = list(m["cameras"])
        self.spec = SimpleNamespace(chunk=int(m["action_chunk"]), frames=int(m["frames"]),
                                    render_size=int(m["render_size"]))
        self.supports_prefix = False  # the wire carries no committed prefix
        self._session = Session("remote", SessionCache(CacheConfig(mode="none")))

    def session(self, name: str = "default") -> Session:
        return self._session  # cache figures live in the server (GET /metrics)

    def reset(self, session: str = "default") -> None:
        self.client.reset()

    def observe(self, obs: Observation, session: str = "default") -> None:
        self.client.control("observe", **wire_observation(obs))

    def request(self, obs: Observation, session: str = "default", prefix=None, prefix_weight=None) -> Observation:
        return obs

    def run(self, requests: list[Observation]) -> list[Prediction]:
        out = []
        for obs in requests:
            t0 = time.perf_counter()
            reply = self.client.infer(wire_observation(obs))
            ms = round((time.perf_counter() - t0) * 1000, 3)
            self._session.latencies_ms.append(ms)
            out.append(Prediction(np.asarray(reply["actions"], dtype=np.float32),
                                  {"total_ms": ms, **reply.get("server_timing", {})}))
        return out
