"""The wire format: openpi's websocket protocol, decoded as data only.

Messages are msgpack; numpy arrays travel as openpi's `{__ndarray__: True, data, dtype, shape}` maps (numpy
scalars as `{__npgeneric__: True, data, dtype}`). Decoding admits only plain numeric dtypes and checks that a
declared shape matches the bytes; nothing is ever unpickled. Every problem raises `RequestError` with one line that
the server sends back as a text frame.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from vlaforge.errors import VlaforgeError
from vlaforge.inference.runtime import Observation

# little-endian / byte-order-free numeric dtypes only: no object, void, string or complex arrays
DTYPES = {"|u1", "|i1", "|b1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"}
MAX_DIMS = 4
MAX_SIDE = 4096  # pixels per image side
MAX_PROMPT = 1000  # characters
MAX_KEYS = 256
CONTROL = ("episode_start", "episode_end", "observe")


class RequestError(VlaforgeError):
    """A request the server cannot use; the message (one line) goes back to the client."""


def _decode_array(obj: dict) -> Any:
    get = lambda k: obj.get(k.encode(), obj.get(k))
    if get("__ndarray__") is not None:
        data, dtype, shape = get("data"), get("dtype"), get("shape")
        if not isinstance(data, bytes) or not isinstance(dtype, (str, bytes)) or not isinstance(shape, (list, tuple)):
            raise RequestError("an __ndarray__ needs bytes 'data', a 'dtype' string and a 'shape' list")
        dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
        if dtype not in DTYPES:
            raise RequestError(f"array dtype {dtype[:20]!r} is not accepted; send one of {', '.join(sorted(DTYPES))}")
        if len(shape) > MAX_DIMS or not all(isinstance(n, int) and 0 <= n for n in shape):
            raise RequestError(f"array shape {list(shape)[:8]} is not a list of at most {MAX_DIMS} sizes >= 0")
        want = math.prod(shape) * np.dtype(dtype).itemsize
        if want != len(data):
            raise RequestError(f"array of shape {list(shape)} and dtype {dtype} needs {want} bytes, the message has "
                               f"{len(data)}")
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    if get("__npgeneric__") is not None:
        dtype = get("dtype")
        dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
        if dtype not in DTYPES or not isinstance(get("data"), (int, float, bool)):
            raise RequestError("an __npgeneric__ needs a numeric 'data' and an accepted 'dtype'")
        return np.dtype(dtype).type(get("data"))
    return obj


def unpack(data: bytes, max_bytes: int) -> dict:
    """A client's binary message -> a dict of str keys, arrays decoded; RequestError otherwise."""
    if len(data) > max_bytes:
        raise RequestError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
    try:
        msg = msgpack.unpackb(data, object_hook=_decode_array, raw=False, strict_map_key=False)
    except RequestError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            msgpack.OutOfData) as exc:
        raise RequestError(f"not a msgpack message ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(msg, dict):
        raise RequestError(f"a message must be a msgpack map, got {type(msg).__name__}")
    if len(msg) > MAX_KEYS:
        raise RequestError(f"a message has at most {MAX_KEYS} keys")
    return {(k.decode(errors="replace") if isinstance(k, bytes) else str(k)): v for k, v in msg.items()}


def _encode_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def pack(obj: Any) -> bytes:
    """msgpack with numpy arrays in openpi's layout (what `openpi_client.msgpack_numpy.unpackb` reads)."""
    return msgpack.packb(obj, default=_encode_array)


def control(msg: dict) -> str | None:
    """The control verb of a `{"__ctrl__": ...}` message, or None for an observation."""
    if "__ctrl__" not in msg:
        return None
    verb = msg["__ctrl__"]
    if verb not in CONTROL:
        raise RequestError(f"__ctrl__ {str(verb)[:40]!r} is not one of {', '.join(CONTROL)}")
    return verb


def observation(msg: dict, cameras: list[str]) -> Observation:
    """openpi keys (`observation/images/<camera>`, `observation/state`, `prompt`) or LeRobot's
    (`observation.images.<camera>`, `observation.state`, `task`), and an optional `adapter` (a server holding
    several LoRA runs, `--keep-adapters`) -> an `Observation` (checked further by the runtime)."""
    images = {}
    for cam in cameras:
        for key in (f"observation/images/{cam}", f"observation.images.{cam}", f"observation/{cam}"):
            if key in msg:
                images[cam] = _image(msg[key], key)
                break
        else:
            raise RequestError(f"observation/images/{cam}: missing; the policy takes cameras {', '.join(cameras)}")
    state = msg.get("observation/state", msg.get("observation.state"))
    if state is None:
        raise RequestError("observation/state: missing")
    if not isinstance(state, np.ndarray):
        try:
            state = np.asarray(state, dtype=np.float64)
        except (TypeError, ValueError):
            raise RequestError("observation/state: not a list of numbers") from None
    prompt = msg.get("prompt", msg.get("task"))
    if not isinstance(prompt, str):
        raise RequestError("prompt: missing or not a string")
    if len(prompt) > MAX_PROMPT:
        raise RequestError(f"prompt: {len(prompt)} characters, at most {MAX_PROMPT}")
    adapter = msg.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or len(adapter) > 64):
        raise RequestError("adapter: the name of a LoRA adapter the server holds (a string of at most 64 characters)")
    return Observation(images, state, prompt, adapter)


def _image(value: Any, key: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise RequestError(f"{key}: send a uint8 H x W x 3 array (an __ndarray__), not {type(value).__name__}")
    if value.ndim == 3 and max(value.shape[:2]) > MAX_SIDE:
        raise RequestError(f"{key}: {value.shape[0]} x {value.shape[1]} pixels; at most {MAX_SIDE} a side")
    return value
