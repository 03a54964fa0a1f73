"""LeRobot's async-inference payloads, decoded without trusting them.

LeRobot's robot client pickles what it sends (`TimedObservation`, `RemotePolicyConfig`) and unpickles the action
chunk it gets back (`list[TimedAction]`); LeRobot's own server `pickle.loads` whatever reaches its port, so any
client can run code there. Here a pickle is read by an unpickler whose `find_class` admits only the globals LeRobot's
client emits - its three dataclasses and `PolicyFeature` / `FeatureType` (mapped to data-only stand-ins, so LeRobot
need not be installed), numpy's array / scalar rebuilders, torch's tensor rebuild with the storage read by
`torch.load(weights_only=True)` (torch's own `_load_from_bytes` unpickles with `weights_only=False`) and
`collections.OrderedDict`, `torch.from_numpy` of a numeric array (how replies send tensors) - and refuses any other
global before anything is called. What it built is then checked
as data: numeric arrays and tensors of bounded size, plain containers, bounded depth.

A reply is pickled with the stand-in `TimedAction` written under LeRobot's name, so the client's `pickle.loads`
builds its own class.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
from typing import Any, ClassVar

import numpy as np
import torch

from vlaforge.serving.protocol import RequestError

HELPERS = "lerobot.async_inference.helpers"
TYPES = "lerobot.configs.types"
MAX_DEPTH = 12
MAX_NODES = 100_000
NUMERIC = "biuf"  # numpy kinds: bool, signed, unsigned, float


class UnsafePickle(RequestError):
    """A pickle that names a global LeRobot's client never sends, or builds something that is not its data."""


class Record:
    """A LeRobot dataclass as plain data: unpickling sets only the fields the real class has."""

    fields: ClassVar[tuple[str, ...]] = ()
    lerobot_module: ClassVar[str] = HELPERS

    def __init__(self, **values: Any):
        self.__setstate__(values)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not set(state) <= set(self.fields):
            have = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
            raise UnsafePickle(f"a {type(self).__name__} with fields {have}; LeRobot's has {list(self.fields)}")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


class TimedObservation(Record):
    fields = ("timestamp", "timestep", "observation", "must_go")


class TimedAction(Record):
    fields = ("timestamp", "timestep", "action")


class RemotePolicyConfig(Record):
    fields = ("policy_type", "pretrained_name_or_path", "lerobot_features", "actions_per_chunk", "device",
              "rename_map")


class PolicyFeature(Record):
    fields = ("type", "shape")
    lerobot_module = TYPES


class FeatureType(str):
    """LeRobot's `FeatureType` enum (pickled as a call with its value)."""

    VALUES = ("STATE", "VISUAL", "ENV", "ACTION", "REWARD", "LANGUAGE")

    def __new__(cls, value: Any) -> "FeatureType":
        if value not in cls.VALUES:
            raise UnsafePickle(f"FeatureType {str(value)[:20]!r} is not one of LeRobot's")
        return str.__new__(cls, value)


class _ArrayType:
    """Stands for `numpy.ndarray` in a pickle: only `_reconstruct`'s first argument, never called (ndarray(shape)
    would allocate whatever a pickle asks for)."""

    def __call__(self, *args, **kwargs):
        raise UnsafePickle("numpy.ndarray called directly; LeRobot's arrays arrive through _reconstruct")


NDARRAY = _ArrayType()


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    if subtype is not NDARRAY or shape != (0,):
        raise UnsafePickle("numpy _reconstruct called otherwise than numpy's own pickles call it")
    return np.ndarray.__new__(np.ndarray, (0,), dtype)


class _Storage:
    """A tensor's storage as bytes and a dtype. torch.load gives a pickled tensor's storage as a TypedStorage, whose
    own methods (nbytes, element_size, untyped) warn that TypedStorage is deprecated; `Tensor.set_` takes it without
    a warning, and the flat tensor it gives holds the UntypedStorage every view is then rebuilt on."""

    def __init__(self, storage: torch.TypedStorage | torch.UntypedStorage):
        dtype = storage.dtype if isinstance(storage, torch.TypedStorage) else torch.uint8
        self.dtype = dtype
        self.untyped = torch.empty(0, dtype=dtype).set_(storage).untyped_storage()


def _load_storage(data: Any) -> _Storage:
    """torch's `_load_from_bytes`, restricted to what a tensor's storage is (weights_only)."""
    if not isinstance(data, bytes):
        raise UnsafePickle("a tensor storage that is not bytes")
    try:
        storage = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is a refusal
        raise UnsafePickle(f"a tensor storage that torch.load(weights_only=True) refuses ({type(exc).__name__}: it "
                           "holds more than a storage)") from None
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise UnsafePickle(f"a tensor storage that loads as {type(storage).__name__}")
    try:
        return _Storage(storage)
    except (RuntimeError, TypeError) as exc:  # e.g. a quantized dtype, which no plain tensor holds
        raise UnsafePickle(f"a tensor storage of {type(storage).__name__} that no plain tensor holds "
                           f"({str(exc)[:80]})") from None


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    hooks: Any = None, *rest: Any) -> torch.Tensor:
    if not isinstance(storage, _Storage) or hooks or rest:
        raise UnsafePickle("a tensor rebuilt from something other than a plain storage")
    if not all(isinstance(n, int) and n >= 0 for n in (offset, *size, *stride)):
        raise UnsafePickle("a tensor with a negative or non-integer size, stride or offset")
    nbytes = storage.untyped.nbytes()
    if math.prod(size) * storage.dtype.itemsize > max(nbytes, 1):  # also a stride-0 view of a small storage
        raise UnsafePickle(f"a tensor of {math.prod(size)} elements over a storage of {nbytes} bytes")
    try:  # what torch._utils._rebuild_tensor does, on the untyped storage
        return torch.empty(0, dtype=storage.dtype).set_(storage.untyped, offset, tuple(size), tuple(stride))
    except RuntimeError as exc:
        raise UnsafePickle(f"a tensor view outside its storage ({str(exc)[:80]})") from None


def _from_numpy(array: Any) -> torch.Tensor:
    """How a reply's tensors travel (torch.from_numpy of a numeric array: no torch.save per tensor)."""
    if not isinstance(array, np.ndarray) or array.dtype.kind not in NUMERIC:
        raise UnsafePickle("torch.from_numpy of something other than a numeric array")
    return torch.from_numpy(array)


def _numpy(name: str) -> Any:
    from numpy._core import multiarray, numeric

    return {"scalar": multiarray.scalar, "_frombuffer": numeric._frombuffer}[name]


_GLOBALS: dict[tuple[str, str], Any] = {
    (HELPERS, "TimedObservation"): TimedObservation,
    (HELPERS, "TimedAction"): TimedAction,
    (HELPERS, "RemotePolicyConfig"): RemotePolicyConfig,
    (TYPES, "PolicyFeature"): PolicyFeature,
    (TYPES, "FeatureType"): FeatureType,
    ("numpy", "ndarray"): NDARRAY,
    ("numpy", "dtype"): np.dtype,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "from_numpy"): _from_numpy,
    # numpy 2 writes numpy._core, numpy 1 numpy.core
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("_core", "core")},
    **{(f"numpy.{core}.multiarray", "scalar"): _numpy("scalar") for core in ("_core", "core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _numpy("_frombuffer") for core in ("_core", "core")},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise UnsafePickle(f"the pickle names {module[:60]}.{name[:60]}, which LeRobot's client never sends; "
                               "refused before anything ran")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("the pickle uses persistent ids, which LeRobot's client never sends")


def decode(data: bytes, want: type[Record]) -> Any:
    """A LeRobot payload -> its `want` stand-in, checked as data; `UnsafePickle` / `RequestError` (one line)."""
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except RequestError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RuntimeError, MemoryError, RecursionError, OverflowError) as exc:
        raise RequestError(f"not a pickle LeRobot's client sends ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:80] if str(exc) else ''})") from None
    if not isinstance(obj, want):
        raise UnsafePickle(f"expected LeRobot's {want.__name__}, got {type(obj).__name__}")
    _check(obj, 0, [0])
    return obj


def _check(obj: Any, depth: int, count: list[int]) -> None:
    """Plain data only: numeric arrays / tensors, scalars, strings, containers, records; bounded depth and size."""
    count[0] += 1
    if depth > MAX_DEPTH or count[0] > MAX_NODES:
        raise UnsafePickle(f"a payload nested deeper than {MAX_DEPTH} or with more than {MAX_NODES} values")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return
    if isinstance(obj, (np.ndarray, np.generic)):
        if obj.dtype.kind not in NUMERIC:
            raise UnsafePickle(f"a numpy value of dtype {obj.dtype.str[:12]}; only numeric arrays are data")
        return
    if isinstance(obj, torch.Tensor):
        if obj.dtype.is_complex or obj.is_quantized or obj.layout != torch.strided:
            raise UnsafePickle(f"a tensor of dtype {obj.dtype} / layout {obj.layout}")
        return
    if isinstance(obj, dict):
        items = [v for kv in obj.items() for v in kv]
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, Record):
        items = list(obj.__dict__.values())
    else:
        raise UnsafePickle(f"a {type(obj).__name__} inside the payload")
    for item in items:
        _check(item, depth + 1, count)


class _ReplyPickler(pickle._Pickler):
    """The Python pickler, which lets a global be written by name: LeRobot's classes (not importable here) for the
    stand-ins, `torch.from_numpy` for tensors (a tensor's own pickle torch.saves its storage, ~0.1 ms each)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return torch.from_numpy, (obj.detach().cpu().numpy(),)
        return NotImplemented

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if obj is torch.from_numpy:
            return self._global("torch", "from_numpy", obj)
        if isinstance(obj, type) and issubclass(obj, Record):
            return self._global(obj.lerobot_module, obj.__name__, obj)
        super().save(obj, save_persistent_id)

    def _global(self, module: str, name: str, obj: Any) -> None:
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        self.save(module)
        self.save(name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def dumps(obj: Any) -> bytes:
    """A pickle of `obj` whose stand-ins are named as LeRobot's classes (what LeRobot's client unpickles)."""
    buf = io.BytesIO()
    _ReplyPickler(buf, protocol=4).dump(obj)
    return buf.getvalue()


def dumps_actions(actions: np.ndarray, t0: float, step0: int, dt: float) -> bytes:
    """An action chunk (T, A) -> the pickled `list[TimedAction]` LeRobot's client unpickles (action i at time
    t0 + i dt, timestep step0 + i, a float32 tensor)."""
    rows = torch.from_numpy(np.ascontiguousarray(actions, dtype=np.float32))
    return dumps([TimedAction(timestamp=float(t0) + i * dt, timestep=int(step0) + i, action=row)
                  for i, row in enumerate(rows)])
