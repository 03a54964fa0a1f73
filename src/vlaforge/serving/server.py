"""`vlaforge serve`: a trained policy behind openpi's websocket protocol (or LeRobot's gRPC service), with dynamic
batching, HTTP and metrics.

- websocket (port P): on connect the server sends a msgpack metadata map; each binary message is a msgpack
  observation (openpi or LeRobot keys) and is answered with `{"actions": (T, A) float32, "server_timing":
  {"infer_ms", "queue_ms", "batch_size"}}`; `{"__ctrl__": "episode_start" | "episode_end"}` resets the connection's
  session and is acknowledged with `{"__ack__": verb}`; `"observe"` records a frame without predicting. An error
  is one text frame (`error: ...`) and the connection stays usable: so is a prediction holding a NaN or inf
  action, which is never sent (serving.batching; HTTP 500, gRPC INTERNAL). `GET /healthz` and `GET /metrics`
  answer on the same port.
- `protocol = "lerobot"`: LeRobot's AsyncInference gRPC service on port P instead of the websocket
  (serving/lerobot_grpc.py), for an unmodified LeRobot robot client; the same batching, metrics and limits.
- HTTP (port `http_port`, default P + 1): `POST /act` with JSON (arrays as nested lists), `GET /metrics`
  (Prometheus text), `GET /healthz`.
- Each connection is a session (frame history, feature cache). Requests of all sessions are batched by
  `serving.batching.Batcher`, which runs the runtime off the event loop.
- Safety: an API key (openpi's `Authorization: Api-Key KEY` header, compared in constant time), a message size
  limit, a connection limit, an idle timeout, data-only decoding (`serving.protocol`). SIGTERM and SIGINT stop
  accepting, answer what is in flight, close the connections and return.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np

from vlaforge.errors import first_line
from vlaforge.inference.runtime import Observation, PolicyRuntime
from vlaforge.serving import protocol
from vlaforge.serving.batching import Batcher
from vlaforge.serving.common import authorized, error_kind, server_fault
from vlaforge.serving.metrics import Metrics


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    http_port: int | None = None  # None: port + 1 (any free port when port is 0); 0: no HTTP server
    max_batch: int = 8
    max_wait_ms: float = 5.0
    api_key: str | None = None
    max_message_bytes: int = 16 * 2**20
    max_connections: int = 64
    idle_timeout_s: float = 300.0
    protocol: str = "openpi"  # "lerobot": LeRobot's AsyncInference gRPC service instead of the websocket
    fps: float = 30.0  # lerobot: the robot's control rate (a chunk's action i is stamped t0 + i / fps)
    observation_wait_s: float = 2.0  # lerobot: how long GetActions waits for an observation (LeRobot's default)


class PolicyServer:
    """One runtime served to many clients. `run()` blocks until SIGTERM/SIGINT (or `stop()`)."""

    def __init__(self, runtime: PolicyRuntime, options: ServeOptions, metadata: dict[str, Any] | None = None,
                 log: Callable[[str], None] = print):
        self.runtime, self.options, self.log = runtime, options, log
        self.metadata = {**runtime.describe(), **(metadata or {})}
        self.metrics = Metrics(runtime)
        self.sessions: set[str] = set()
        self._ids = itertools.count(1)
        self._stop: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.batcher: Batcher | None = None
        self.ready = threading.Event()
        self.address: tuple[str, int, int | None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def run(self) -> None:
        asyncio.run(self._main())

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(lambda: self._stop.done() or self._stop.set_result(None))

    async def _main(self) -> None:
        o = self.options
        self.loop = asyncio.get_running_loop()
        self._stop = self.loop.create_future()
        self.batcher = Batcher(self.runtime, o.max_batch, o.max_wait_ms, on_batch=self.metrics.batch,
                               clients=lambda: len(self.sessions), on_nonfinite=self.metrics.nonfinite)
        self.metrics.queue_depth(lambda: self.batcher.queue.qsize())
        self.metrics.sessions(lambda: len(self.sessions))
        self.batcher.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.loop.add_signal_handler(sig, self.stop)
            except (RuntimeError, ValueError):  # not the main thread (tests run the server in a thread)
                pass
        transport = self._grpc() if o.protocol == "lerobot" else self._websocket()
        async with transport as (port, scheme):
            http = self._start_http(port)
            self.address = (o.host, port, http.server_address[1] if http else None)
            self.log(f"serving {self.runtime.source or 'a policy'} on {scheme}://{o.host}:{port}"
                     + (f" and http://{o.host}:{self.address[2]}" if http else "")
                     + f" (max batch {o.max_batch}, max wait {o.max_wait_ms:g} ms)")
            self.ready.set()
            await self._stop
            self.log("stopping: answering the requests in flight")
        if http:
            http.shutdown()
            http.server_close()
        self.batcher.close()
        self.log("stopped")

    @contextlib.asynccontextmanager
    async def _websocket(self):
        """openpi's websocket protocol; yields (port, scheme)."""
        from websockets.asyncio.server import serve

        o = self.options
        # websockets closes a connection whose message is over max_size; up to twice the limit the protocol
        # answers with an error frame instead and the connection stays usable
        async with serve(self._handle, o.host, o.port, process_request=self._process_request,
                         max_size=2 * o.max_message_bytes, compression=None, ping_interval=20, ping_timeout=20,
                         close_timeout=5) as server:
            yield server.sockets[0].getsockname()[1], "ws"
            server.server.close()  # no new connections; open ones are answered, then closed (going away)
            await self.batcher.drain()
            server.close()

    @contextlib.asynccontextmanager
    async def _grpc(self):
        """LeRobot's AsyncInference gRPC service (serving/lerobot_grpc.py); yields (port, scheme)."""
        from vlaforge.serving.lerobot_grpc import serve_grpc

        async with serve_grpc(self) as port:  # on exit: no new calls, the ones in flight answered
            yield port, "grpc"

    # ---- websocket -----------------------------------------------------------------------------------------
    def _authorized(self, header: str | None) -> bool:
        return authorized(self.options.api_key, header)

    def _process_request(self, connection, request):
        path = request.path.split("?")[0]
        if path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path == "/metrics":
            response = connection.respond(HTTPStatus.OK, self.metrics.text())
            response.headers["Content-Type"] = self.metrics.content_type
            return response
        if not self._authorized(request.headers.get("Authorization")):
            self.metrics.error("auth")
            return connection.respond(HTTPStatus.UNAUTHORIZED, "error: missing or wrong API key (send the "
                                                                "header 'Authorization: Api-Key KEY')\n")
        if len(self.sessions) >= self.options.max_connections:
            self.metrics.error("busy")
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"error: {self.options.max_connections} "
                                                                      "connections already; try again later\n")
        return None

    async def _handle(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        session = f"ws-{next(self._ids)}"
        self.sessions.add(session)
        try:
            await ws.send(protocol.pack(self.metadata))
            while True:
                try:
                    data = await asyncio.wait_for(ws.recv(), self.options.idle_timeout_s)
                except asyncio.TimeoutError:
                    self.metrics.error("idle_timeout")
                    await ws.close(1000, "idle timeout")
                    return
                reply = await self._answer(session, data)
                await ws.send(reply)
        except ConnectionClosed:
            pass
        finally:
            self.sessions.discard(session)
            await self.batcher.reset(session)

    async def _answer(self, session: str, data: bytes | str) -> bytes | str:
        """The reply to one websocket message: msgpack bytes, or an `error: ...` text frame."""
        t0 = time.perf_counter()
        try:
            if isinstance(data, str):
                raise protocol.RequestError("send binary msgpack messages, not text frames")
            msg = protocol.unpack(data, self.options.max_message_bytes)
            verb = protocol.control(msg)
            if verb in ("episode_start", "episode_end"):
                await self.batcher.reset(session)
                return protocol.pack({"__ack__": verb})
            obs = protocol.observation(msg, self.runtime.cameras)
            if verb == "observe":
                await self.batcher.observe(session, obs)
                return protocol.pack({"__ack__": verb})
            actions, timing = await self.batcher.predict(session, obs)
            self.metrics.request("ws", time.perf_counter() - t0)
            return protocol.pack({"actions": actions, "server_timing": timing})
        except Exception as exc:  # noqa: BLE001 - every failure is answered; the session stays usable
            self.metrics.error(error_kind(exc))
            if server_fault(exc):
                self.log(f"{error_kind(exc)} error in {session}: {type(exc).__name__}: {first_line(exc)}")
            return f"error: {first_line(exc)[:500]}"

    # ---- HTTP ----------------------------------------------------------------------------------------------
    def _start_http(self, ws_port: int) -> ThreadingHTTPServer | None:
        o = self.options
        if o.http_port == 0:
            return None
        port = o.http_port or (ws_port + 1 if o.port else 0)  # an ephemeral ws port: an ephemeral HTTP port
        server = ThreadingHTTPServer((o.host, port), _http_handler(self))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="vlaforge-http", daemon=True).start()
        return server

    def act_json(self, body: dict, session: str) -> dict:
        """`POST /act` (called from an HTTP thread): JSON observation -> JSON actions."""
        t0 = time.perf_counter()
        obs = json_observation(body, self.runtime.cameras)
        future = asyncio.run_coroutine_threadsafe(self.batcher.predict(session, obs), self.loop)
        actions, timing = future.result(timeout=60)
        self.metrics.request("http", time.perf_counter() - t0)
        return {"actions": actions.tolist(), "server_timing": timing}


def json_observation(body: Any, cameras: list[str]) -> Observation:
    """`{"observation": {"images": {cam: [[[r, g, b], ...]]}, "state": [...]}, "prompt": "..."}` -> Observation."""
    if not isinstance(body, dict) or not isinstance(body.get("observation"), dict):
        raise protocol.RequestError('send {"observation": {"images": {...}, "state": [...]}, "prompt": "..."}')
    o = body["observation"]
    images = o.get("images")
    if not isinstance(images, dict):
        raise protocol.RequestError("observation.images: missing or not a map of camera -> H x W x 3 lists")
    msg: dict[str, Any] = {"observation/state": o.get("state"), "prompt": body.get("prompt", body.get("task")),
                           "adapter": body.get("adapter")}
    for cam, value in images.items():
        try:
            arr = np.asarray(value)
        except ValueError:
            raise protocol.RequestError(f"observation.images.{cam}: not a rectangular H x W x 3 list") from None
        if arr.dtype.kind not in "iu" or arr.size and (arr.min() < 0 or arr.max() > 255):
            raise protocol.RequestError(f"observation.images.{cam}: send integers 0-255 (H x W x 3)")
        msg[f"observation/images/{cam}"] = arr.astype(np.uint8)
    if msg["observation/state"] is None:
        raise protocol.RequestError("observation.state: missing")
    return protocol.observation(msg, cameras)


def _http_handler(server: PolicyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: metrics count requests
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, kind: str, message: str) -> None:
            server.metrics.error(kind)
            self._send(status, json.dumps({"error": message}).encode())

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif self.path == "/metrics":
                self._send(200, server.metrics.text().encode(), server.metrics.content_type)
            else:
                self._error(404, "not_found", f"no {self.path[:100]}; use POST /act, GET /metrics, GET /healthz")

        def do_POST(self) -> None:
            if self.path != "/act":
                return self._error(404, "not_found", f"no {self.path[:100]}; POST /act")
            if not server._authorized(self.headers.get("Authorization")):
                return self._error(401, "auth", "missing or wrong API key (header 'Authorization: Api-Key KEY')")
            try:
                length = int(self.headers.get("Content-Length", "-1"))
            except ValueError:
                length = -1
            if not 0 <= length <= server.options.max_message_bytes:
                return self._error(413, "bad_message", f"Content-Length must be 0..{server.options.max_message_bytes}")
            try:
                body = json.loads(self.rfile.read(length))
                session = str(self.headers.get("X-Session", "http"))[:100]
                self._send(200, json.dumps(server.act_json(body, f"http-{session}")).encode())
            except json.JSONDecodeError as exc:
                self._error(400, "bad_message", f"not JSON ({exc.msg} at {exc.pos})")
            except Exception as exc:  # noqa: BLE001 - every failure is answered (400 or 500); the server stays up
                self._error(500 if server_fault(exc) else 400, error_kind(exc), first_line(exc)[:500])

    return Handler
