"""`vlaforge serve --protocol lerobot`: LeRobot's `AsyncInference` gRPC service (LeRobot 0.4-0.6), so an unmodified
LeRobot `robot_client` streams observations to a vlaforge policy and receives action chunks.

The service as LeRobot's `lerobot/transport/services.proto` defines it (package `transport`):
  Ready(Empty) -> Empty                         a robot (the gRPC peer) starts: its session is reset
  SendPolicyInstructions(PolicySetup) -> Empty  a pickled RemotePolicyConfig: the robot's features (which joint
                                                names make the state, which cameras), actions per chunk, the
                                                policy_type (checked for a LeRobot policy folder, else logged)
  SendObservations(stream Observation) -> Empty a pickled TimedObservation in 2 MiB chunks (TRANSFER_BEGIN /
                                                MIDDLE / END; a small one is a single END)
  GetActions(Empty) -> Actions                  the chunk for the latest queued observation, a pickled
                                                list[TimedAction]; empty `data` when none arrived in time
The messages are built here from their layout in a private descriptor pool (no generated code, no clash with
LeRobot's own `transport` package in one process). Each peer is a session of the shared `PolicyRuntime`, and
GetActions of all robots are batched by the server's `Batcher`, as the openpi transport's requests are. A chunk
is the first `actions_per_chunk` of the policy's; more than the policy predicts is refused at the handshake, and so
is, for a served LeRobot policy folder (SmolVLA, pi0, pi0.5: a `LeRobotRuntime`), a policy_type other than the
folder's config.json `type` (a vlaforge run serves whatever policy_type the client names). An
observation is checked as the runtime will take it when it arrives (its SendObservations fails otherwise), and is
queued as LeRobot's server queues it: the latest only, and only if it must go, or its timestep was
not predicted yet and its state moved (L2 >= 1) since the last predicted one. Payloads are read by
`serving.lerobot_pickle` (a restricted unpickler); a refused one is one logged line and the robot's RPC fails,
other robots are untouched. A chunk holding a NaN or inf action is never sent: that GetActions fails (INTERNAL).
A robot is told apart by its connection (the gRPC peer address), as LeRobot's server does. docs/lerobot.md says
how this is safer than LeRobot's own server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlaforge.errors import VlaforgeError, first_line
from vlaforge.inference.runtime import LeRobotRuntime, ObservationError, check_image
from vlaforge.serving import lerobot_pickle, protocol
from vlaforge.serving.common import authorized, error_kind, server_fault

SERVICE = "transport.AsyncInference"
TRANSFER = ("TRANSFER_UNKNOWN", "TRANSFER_BEGIN", "TRANSFER_MIDDLE", "TRANSFER_END")
CHUNK_BYTES = 2 * 2**20  # LeRobot's transport chunk
SIMILAR_STATE = 1.0  # LeRobot's observations_similar: joint-space L2 below this is "the same observation"
IMAGE_PREFIX = "observation.images."


@functools.cache
def messages() -> dict[str, Any]:
    """The service's message classes, from LeRobot's layout, in a pool of their own."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="vlaforge/lerobot_transport.proto", package="transport",
                                            syntax="proto3")
    enum = fd.enum_type.add(name="TransferState")
    for number, name in enumerate(TRANSFER):
        enum.value.add(name=name, number=number)
    chunked = [("transfer_state", F.TYPE_ENUM, ".transport.TransferState"), ("data", F.TYPE_BYTES, None)]
    layouts = {"Observation": chunked, "Actions": [("data", F.TYPE_BYTES, None)],
               "PolicySetup": [("data", F.TYPE_BYTES, None)], "Empty": []}
    for name, fields in layouts.items():
        msg = fd.message_type.add(name=name)
        for number, (fname, ftype, type_name) in enumerate(fields, 1):
            f = msg.field.add(name=fname, number=number, type=ftype, label=F.LABEL_OPTIONAL)
            if type_name:
                f.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"transport.{name}"))
            for name in layouts}


@dataclass
class RobotSession:
    """One robot (gRPC peer): what its policy instructions said, its queued observation, LeRobot's filter state."""

    name: str
    state_names: list[str] = field(default_factory=list)
    cameras: dict[str, str] = field(default_factory=dict)  # policy camera -> the robot's observation key
    actions_per_chunk: int = 0
    adapter: str | None = None  # with --keep-adapters: the LoRA run its pretrained_name_or_path names
    queued: Any = None  # the latest (TimedObservation, its checked runtime Observation) waiting for GetActions
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    predicted: set[int] = field(default_factory=set)
    last_state: np.ndarray | None = None
    seen: float = field(default_factory=time.monotonic)


class LeRobotService:
    """The four RPCs over a `PolicyServer` (its runtime, batcher, metrics, options and log)."""

    def __init__(self, server):
        self.server = server
        self.msg = messages()
        self.robots: dict[str, RobotSession] = {}

    @property
    def options(self):
        return self.server.options

    # ---- the gRPC plumbing --------------------------------------------------------------------------------------
    def handler(self):
        import grpc

        m = self.msg

        def unary(fn, request):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=m[request].FromString,
                                                       response_serializer=lambda r: r.SerializeToString())

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Ready": unary(self.ready, "Empty"),
            "SendPolicyInstructions": unary(self.policy_instructions, "PolicySetup"),
            "SendObservations": grpc.stream_unary_rpc_method_handler(
                self.observations, request_deserializer=m["Observation"].FromString,
                response_serializer=lambda r: r.SerializeToString()),
            "GetActions": unary(self.get_actions, "Empty"),
        })

    async def _refuse(self, context, code: str, kind: str, message: str) -> None:
        import grpc

        self.server.metrics.error(kind)
        self.server.log(f"lerobot: refused {context.peer()}: {message}")
        await context.abort(getattr(grpc.StatusCode, code), message[:500])

    async def _guard(self, context) -> None:
        """The API key (metadata `authorization: Api-Key KEY`, compared in constant time)."""
        header = dict(context.invocation_metadata() or ()).get("authorization")
        if not authorized(self.options.api_key, header):
            await self._refuse(context, "UNAUTHENTICATED", "auth", "missing or wrong API key (send the metadata "
                                                                    "'authorization: Api-Key KEY')")

    async def _robot(self, context) -> RobotSession:
        robot = self.robots.get(context.peer())
        if robot is None or not robot.state_names:
            await self._refuse(context, "FAILED_PRECONDITION", "bad_message", "call Ready, then "
                               "SendPolicyInstructions, before sending observations or asking for actions")
        robot.seen = time.monotonic()
        return robot

    # ---- the RPCs -----------------------------------------------------------------------------------------------
    async def ready(self, request, context):
        await self._guard(context)
        await self._forget_idle()
        peer = context.peer()
        if peer not in self.robots and len(self.robots) >= self.options.max_connections:
            await self._refuse(context, "RESOURCE_EXHAUSTED", "busy", f"{self.options.max_connections} robots "
                               "already; try again later")
        await self._drop(peer)
        self.robots[peer] = RobotSession(peer)
        self.server.sessions.add(peer)
        self.server.log(f"lerobot: robot {peer} ready")
        return self.msg["Empty"]()

    async def policy_instructions(self, request, context):
        await self._guard(context)
        robot = self.robots.get(context.peer())
        if robot is None:
            await self._refuse(context, "FAILED_PRECONDITION", "bad_message", "call Ready first")
        try:
            config = self._decode(request.data, lerobot_pickle.RemotePolicyConfig)
            policy_type(config.get("policy_type"), served_policy_type(self.server.runtime))
            names, cameras = robot_features(config, self.server.runtime.cameras,
                                            len(self.server.runtime.spec.state_mean))
            chunk = actions_per_chunk(config.get("actions_per_chunk"), self.server.runtime.spec.chunk)
            adapter = self._adapter(config.get("pretrained_name_or_path"))
        except protocol.RequestError as exc:
            await self._refuse(context, "INVALID_ARGUMENT", _kind(exc), first_line(exc))
        # NOTE: all checked before any is set: a refused instruction leaves the robot unconfigured
        robot.state_names, robot.cameras, robot.actions_per_chunk, robot.adapter = names, cameras, chunk, adapter
        self.server.log(f"lerobot: robot {robot.name} asks for {config.get('policy_type')!r} "
                        f"{config.get('pretrained_name_or_path')!r}, served "
                        f"{self.server.runtime.source or 'this policy'} ({len(robot.state_names)} joints, cameras "
                        f"{robot.cameras}, {chunk} actions a chunk of the policy's {self.server.runtime.spec.chunk})")
        return self.msg["Empty"]()

    def _adapter(self, asked) -> str | None:
        """A server holding several LoRA runs (--keep-adapters) serves the one the client's pretrained_name_or_path
        names; otherwise that field is only logged."""
        held = self.server.runtime.adapters
        if held is None:
            return None
        if asked not in held.adapters:
            raise protocol.RequestError(f"pretrained_name_or_path {str(asked)[:64]!r}: this server holds adapters "
                                        f"{', '.join(held.adapters)}; name one of them")
        return asked

    async def observations(self, request_iterator, context):
        await self._guard(context)
        robot = await self._robot(context)
        try:
            data = await receive_chunks(request_iterator, self.options.max_message_bytes)
            obs = self._decode(data, lerobot_pickle.TimedObservation)
            check_timed(obs)
            state = robot_state(obs.observation, robot.state_names)
            # checked now, as the runtime will check it, so that the robot's SendObservations fails (not a later
            # GetActions, which LeRobot's client answers by waiting for actions that never come)
            checked = to_observation(obs.observation, robot)
            self.server.runtime.check(checked)
        except VlaforgeError as exc:  # a RequestError (the payload) or an ObservationError (what the policy takes)
            code = "RESOURCE_EXHAUSTED" if _kind(exc) == "too_large" else "INVALID_ARGUMENT"
            await self._refuse(context, code, _kind(exc), first_line(exc))
        fresh = obs.timestep not in robot.predicted and (
            robot.last_state is None or state.shape != robot.last_state.shape
            or float(np.linalg.norm(state - robot.last_state)) >= SIMILAR_STATE)
        if obs.get("must_go") or robot.last_state is None or fresh:
            robot.queued = (obs, checked)  # replaces an older one: the latest only
            robot.arrived.set()
        return self.msg["Empty"]()

    async def get_actions(self, request, context):
        await self._guard(context)
        robot = await self._robot(context)
        t0 = time.perf_counter()
        queued = await next_observation(robot, self.options.observation_wait_s)
        if queued is None:
            return self.msg["Actions"]()  # LeRobot's server answers so too: the client asks again
        obs, checked = queued
        robot.predicted.add(int(obs.timestep))
        robot.last_state = robot_state(obs.observation, robot.state_names)
        try:
            actions, _ = await self.server.batcher.predict(robot.name, checked)
        except Exception as exc:  # noqa: BLE001 - answered as an error; the robot's session stays usable
            await self._refuse(context, "INTERNAL" if server_fault(exc) else "INVALID_ARGUMENT", error_kind(exc),
                               first_line(exc))
        data = lerobot_pickle.dumps_actions(actions[:robot.actions_per_chunk], obs.timestamp, obs.timestep,
                                            1.0 / self.options.fps)
        self.server.metrics.request("grpc", time.perf_counter() - t0)
        return self.msg["Actions"](data=data)

    # ---- sessions -------------------------------------------------------------------------------------------------
    def _decode(self, data: bytes, want):
        if len(data) > self.options.max_message_bytes:
            raise TooLarge(f"a payload of {len(data)} bytes is over the {self.options.max_message_bytes}-byte limit")
        return lerobot_pickle.decode(data, want)

    async def _drop(self, peer: str) -> None:
        if self.robots.pop(peer, None) is not None:
            self.server.sessions.discard(peer)
            await self.server.batcher.reset(peer)

    async def _forget_idle(self) -> None:
        """Robots silent for idle_timeout_s are forgotten (a gRPC server is not told when a client goes)."""
        now = time.monotonic()
        for peer in [p for p, r in self.robots.items() if now - r.seen > self.options.idle_timeout_s]:
            self.server.metrics.error("idle_timeout")
            await self._drop(peer)


class TooLarge(protocol.RequestError):
    pass


def _kind(exc: BaseException) -> str:
    if isinstance(exc, lerobot_pickle.UnsafePickle):
        return "unsafe_pickle"
    return "too_large" if isinstance(exc, TooLarge) else error_kind(exc)


async def next_observation(robot: RobotSession, wait_s: float):
    """The robot's queued (TimedObservation, Observation), taken (waiting up to `wait_s` for one), or None."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while robot.queued is None:
        robot.arrived.clear()
        try:
            await asyncio.wait_for(robot.arrived.wait(), max(0.0, end - loop.time()))
        except asyncio.TimeoutError:
            return None
    obs, robot.queued = robot.queued, None
    return obs


async def receive_chunks(request_iterator, max_bytes: int) -> bytes:
    """LeRobot's chunked transfer -> one payload: BEGIN starts it, MIDDLE adds, END adds and completes (a lone END is
    a whole payload). A stream that ends before END, an unknown state or more than `max_bytes` is refused."""
    parts: list[bytes] = []
    size = 0
    async for item in request_iterator:
        state = TRANSFER[item.transfer_state] if 0 <= item.transfer_state < len(TRANSFER) else "TRANSFER_UNKNOWN"
        if state == "TRANSFER_UNKNOWN":
            raise protocol.RequestError(f"a chunk with transfer state {item.transfer_state}; send BEGIN / MIDDLE / "
                                        "END")
        if state == "TRANSFER_BEGIN":
            parts, size = [], 0
        size += len(item.data)
        if size > max_bytes:
            raise TooLarge(f"an observation of more than {max_bytes} bytes; the limit is --max-message-mb")
        parts.append(item.data)
        if state == "TRANSFER_END":
            return b"".join(parts)
    raise protocol.RequestError("the observation stream ended before its TRANSFER_END chunk (truncated)")


def robot_features(config, cameras: list[str], state_dim: int) -> tuple[list[str], dict[str, str]]:
    """From RemotePolicyConfig.lerobot_features: the joint names that make the state, in order, and for each of the
    policy's cameras the robot's camera (by name, after rename_map; one camera each side pairs up)."""
    feats = config.get("lerobot_features")
    if not isinstance(feats, dict):
        raise protocol.RequestError("RemotePolicyConfig.lerobot_features is not a map of features")
    rename = config.get("rename_map") or {}
    state = feats.get("observation.state")
    names = _feature_field(state, "names")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise protocol.RequestError("lerobot_features has no observation.state with joint names")
    if len(names) != state_dim:
        raise protocol.RequestError(f"the robot's state has {len(names)} joints ({', '.join(names[:8])}) but the "
                                    f"policy takes {state_dim}")
    robot_cams = {str(rename.get(k, k)).removeprefix(IMAGE_PREFIX): k.removeprefix(IMAGE_PREFIX)
                  for k in feats if isinstance(k, str) and k.startswith(IMAGE_PREFIX)}
    if len(cameras) == 1 and len(robot_cams) == 1:
        return list(names), {cameras[0]: next(iter(robot_cams.values()))}
    missing = [c for c in cameras if c not in robot_cams]
    if missing:
        raise protocol.RequestError(f"the policy takes cameras {cameras}; the robot has {sorted(robot_cams)} - "
                                    f"name them alike (the robot's camera names, or rename_map)")
    return list(names), {c: robot_cams[c] for c in cameras}


def served_policy_type(runtime) -> str | None:
    """The LeRobot type of a served LeRobot policy folder (its config.json's `type`: smolvla, pi0, pi05); None for a
    vlaforge run (whose policy_type is only logged: LeRobot has no type for it)."""
    if not isinstance(runtime, LeRobotRuntime):
        return None
    spec = runtime.model.spec
    return str(spec.extra.get("type") or spec.family)


def policy_type(asked: Any, served: str | None) -> None:
    """A LeRobot policy folder is served to a client that names its type (LeRobot's server loads the policy_type the
    client names: another would be another policy); anything goes for a vlaforge run."""
    if served is not None and asked != served:
        raise protocol.RequestError(f"policy_type {str(asked)[:32]!r}: this server serves a LeRobot '{served}' policy "
                                    f"folder; ask for policy_type={served}")


def actions_per_chunk(asked: Any, policy_chunk: int) -> int:
    """The client's actions_per_chunk, served as asked: a chunk is the first `asked` of the `policy_chunk` actions
    the policy predicts at once, so more than those is refused (not silently cut to them)."""
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise protocol.RequestError(f"actions_per_chunk {asked!r} is not a count >= 1")
    if asked > policy_chunk:
        raise protocol.RequestError(f"actions_per_chunk {asked}: this policy predicts {policy_chunk} actions a chunk "
                                    f"(its action_chunk); ask for 1-{policy_chunk}")
    return asked


def _feature_field(feature: Any, name: str) -> Any:
    if isinstance(feature, dict):
        return feature.get(name)
    return feature.get(name) if isinstance(feature, lerobot_pickle.Record) else None


def check_timed(obs) -> None:
    if not isinstance(obs.get("timestep"), int) or not isinstance(obs.get("timestamp"), (int, float)):
        raise protocol.RequestError("a TimedObservation without an integer timestep and a timestamp")
    if not isinstance(obs.get("observation"), dict):
        raise protocol.RequestError("a TimedObservation whose observation is not a map")


def robot_state(raw: dict, names: list[str]) -> np.ndarray:
    """The joint values in `names` order (LeRobot's build_dataset_frame), float64."""
    try:
        state = np.asarray([float(np.asarray(raw[n]).reshape(())) for n in names], dtype=np.float64)
    except KeyError as exc:
        raise protocol.RequestError(f"the observation has no joint {exc.args[0]!r} of the robot's state") from None
    except (TypeError, ValueError):
        raise protocol.RequestError("a joint value that is not one number") from None
    for name, value in zip(names, state):
        if not np.isfinite(value):
            raise ObservationError(f"joint {name!r} of the robot's state is {value}; send finite numbers")
    return state


def to_observation(raw: dict, robot: RobotSession):
    """A robot's raw observation -> the runtime's Observation (through the openpi transport's checks)."""
    msg: dict[str, Any] = {"observation.state": robot_state(raw, robot.state_names), "task": raw.get("task", "")}
    for cam, key in robot.cameras.items():
        image = raw.get(key)
        if image is None:
            raise protocol.RequestError(f"the observation has no camera {key!r} (the policy's camera {cam!r}); "
                                        "send every camera the policy instructions named")
        msg[f"{IMAGE_PREFIX}{cam}"] = check_image(image, f"camera {key!r}").numpy()
    if robot.adapter is not None:
        msg["adapter"] = robot.adapter
    return protocol.observation(msg, list(robot.cameras))


@contextlib.asynccontextmanager
async def serve_grpc(server):
    """The service on `server.options`' host / port (grpc.aio, on the server's event loop); yields the bound port."""
    import grpc

    o = server.options
    per_message = min(o.max_message_bytes, CHUNK_BYTES) + 64 * 1024  # one chunk and its framing
    service = LeRobotService(server)
    grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", per_message),
                                           ("grpc.max_send_message_length", o.max_message_bytes)])
    grpc_server.add_generic_rpc_handlers((service.handler(),))
    port = grpc_server.add_insecure_port(f"{o.host}:{o.port}")
    if port == 0:
        raise OSError(f"gRPC could not bind {o.host}:{o.port}")
    await grpc_server.start()
    try:
        yield port
    finally:
        await grpc_server.stop(grace=5)
