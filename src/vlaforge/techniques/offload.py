"""`apply_offload`: move the tensors a component saves for backward to CPU memory or to NVMe files.

Per component (`components.<name>.offload = none | cpu | nvme`):
- `offload_min_bytes`: smaller tensors stay where they are (the copy costs more than it saves);
- `offload_fraction`: the share of the component's blocks whose tensors move, earliest blocks first (theirs are
  used last in backward); the non-block parts (embeddings, final norm, heads) move only at 1.0;
- `offload_path`: the folder for NVMe files.

Saved tensors go through `saved_tensors_hooks` entered around the component's forward. `cpu`: a copy into pinned
host memory; on GPU it is issued on a side stream so it overlaps compute, and the backward prefetches the next
tensors (in reverse order of saving) on that stream. `nvme`: each tensor is written to its own file by a
background thread pool; backward reads ahead. Files are removed when read, and - through a finalizer on each
handle - when the graph that holds them is dropped, e.g. after a step raised. Offload composes with
checkpointing: a checkpointed block's inputs are what it saves, so they are what moves (the op outputs that
selective checkpointing keeps are cached outside autograd and stay on the device).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.models.blocks import blocks_of
from vlaforge.techniques import accounting as memory

PREFETCH = 2  # tensors read ahead in backward
MIN_FREE_BYTES = 1 << 30  # an NVMe folder with less free space is refused before training


class _Handle:
    """A saved tensor's offloaded copy, and how to bring it back."""

    __slots__ = ("index", "device", "dtype", "shape", "stride", "offset", "value", "path", "future", "__weakref__")


class _Offloader:
    """saved_tensors_hooks pack/unpack for one component."""

    def __init__(self, place: str, device: torch.device, min_bytes: int, blocks: set[int] | None,
                 folder: Path | None):
        self.place, self.device, self.min_bytes, self.blocks, self.folder = place, device, min_bytes, blocks, folder
        self.params: set = set()
        self.handles: list[weakref.ref] = []  # pack order, for prefetch
        self.pending: set[Future] = set()  # NVMe writes in flight
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlaforge-nvme") if folder else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def eligible(self, t: torch.Tensor) -> bool:
        """Worth moving: a strided tensor of this offloader's device, not empty, at least `min_bytes`, not a
        parameter, in a chosen block. NOTE: tensors of other devices stay where they are - torch 2.11's
        non-reentrant checkpoint saves a 0-byte CPU dummy input, and a CPU tensor cannot go through the CUDA
        side stream (`record_stream` raised on it in the first GPU run)."""
        size = memory.tensor_bytes(t)
        if t.layout != torch.strided or size == 0 or size < self.min_bytes or not _on(t, self.device):
            return False
        if memory.storage_key(t) in self.params:
            return False
        _, block = memory.current_location()
        return self.blocks is None or (block is not None and block in self.blocks)

    # ---- pack ------------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if not self.eligible(t):
            memory.record(t)
            return t
        memory.record(t, self.place)
        h = _Handle()
        h.index, h.device, h.dtype, h.shape = len(self.handles), t.device, t.dtype, t.shape
        h.stride, h.offset, h.path, h.future, h.value = t.stride(), t.storage_offset(), None, None, None
        storage = _storage_tensor(t)
        if self.place == memory.CPU:
            h.value = self._to_host(storage)
        else:
            h.path = self.folder / f"{uuid.uuid4().hex}.bin"
            host = storage if storage.device.type == "cpu" else storage.cpu()
            h.future = self._track(self.pool.submit(_write, h.path, host))
            weakref.finalize(h, self._discard, h.path, h.future)
        self.handles.append(weakref.ref(h))
        return h

    def _to_host(self, storage: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return storage.clone()  # CPU training: a separate copy (the hooks' path is exercised all the same)
        host = torch.empty(storage.shape, dtype=storage.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(storage, non_blocking=True)
            storage.record_stream(self.stream)
        return host

    def _track(self, future: Future) -> Future:
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)
        return future

    def _discard(self, path: Path, written: Future) -> None:
        """Finalizer of a handle whose graph was dropped: remove its file once the write has finished."""
        if written.done():
            _unlink(path)
        else:
            self._track(self.pool.submit(_unlink_after, path, written))

    def drain(self) -> None:
        """Wait for the NVMe writes and removals in flight."""
        while self.pending:
            wait(list(self.pending))

    # ---- unpack ----------------------------------------------------------------------------------------------
    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        h: _Handle = packed
        for j in range(h.index - 1, max(h.index - 1 - PREFETCH, -1), -1):  # backward runs in reverse order
            other = self.handles[j]()
            if other is not None:
                self._prefetch(other)
        storage = self._fetch(h)
        return torch.as_strided(storage, h.shape, h.stride, h.offset)

    def _prefetch(self, h: _Handle) -> None:
        if h.path is not None and h.future is not None and not isinstance(h.value, Future):
            h.value = self.pool.submit(_read, h.path, h.future, h.dtype)
        elif h.path is None and self.stream is not None and not isinstance(h.value, tuple):
            with torch.cuda.stream(self.stream):
                h.value = (h.value.to(h.device, non_blocking=True),)

    def _fetch(self, h: _Handle) -> torch.Tensor:
        if h.path is not None:
            if not isinstance(h.value, Future):
                self._prefetch(h)
            out = h.value.result()
            _unlink(h.path)
            return out.to(h.device)
        if self.stream is None:  # CPU training: the copy is the tensor
            return h.value
        current = torch.cuda.current_stream(h.device)
        current.wait_stream(self.stream)  # the offload copy (and any prefetch) has finished
        if isinstance(h.value, tuple):  # prefetched on the side stream
            out = h.value[0]
            out.record_stream(current)  # allocated on the side stream, used on this one
            return out
        return h.value.to(h.device, non_blocking=True)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device` (a device without an index, e.g. `cuda`, means its current one)."""
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index is None or t.device.index == device.index


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind `t` as a flat tensor of t's dtype (views restore from it exactly)."""
    n = memory.tensor_bytes(t) // t.element_size()
    return torch.as_strided(t.detach(), (n,), (1,), 0)


def _write(path: Path, t: torch.Tensor) -> None:
    t.contiguous().view(torch.uint8).numpy().tofile(path)


def _read(path: Path, written: Future, dtype: torch.dtype) -> torch.Tensor:
    written.result()  # the write must have finished (and re-raises its error, e.g. a full disk)
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype)


def _unlink_after(path: Path, written: Future) -> None:
    try:
        written.result()
    finally:
        _unlink(path)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_offload_path(path: str | None, component: str) -> Path:
    """The NVMe folder, created if needed; refused before training when unwritable or nearly full."""
    folder = Path(path or tempfile.gettempdir()) / "vlaforge-offload"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as exc:
        raise VlaforgeError(f"components.{component}.offload_path: cannot write to {folder} ({exc.strerror}); "
                            "point it at a writable NVMe folder") from None
    free = shutil.disk_usage(folder).free
    if free < MIN_FREE_BYTES:
        raise VlaforgeError(f"components.{component}.offload_path: {folder} has {free / 2**20:.0f} MiB free, "
                            f"under the {MIN_FREE_BYTES >> 20} MiB minimum; free space or choose another disk")
    return folder


def apply_offload(model: nn.Module, policies: Mapping[str, Any], device: torch.device) -> dict[str, dict]:
    """Offload what each component saves for backward as configured. Returns per component: place and blocks."""
    memory.track_locations(model)
    params = {memory.storage_key(p) for p in model.parameters()}
    done = {}
    for name in COMPONENTS:
        policy = policies[name]
        if policy.offload == "none":
            continue
        blocks = blocks_of(model, name)
        chosen = None
        if blocks is not None and policy.offload_fraction < 1.0:
            chosen = set(range(math.ceil(policy.offload_fraction * len(blocks))))
        folder = check_offload_path(policy.offload_path, name) if policy.offload == "nvme" else None
        off = _Offloader(policy.offload, device, policy.offload_min_bytes, chosen, folder)
        off.params = params
        _wrap_forward(getattr(model, name), off)
        done[name] = {"place": policy.offload, "blocks": sorted(chosen) if chosen is not None else "all"}
    return done


def _wrap_forward(module: nn.Module, off: _Offloader) -> None:
    inner = module.forward
    module._vlaforge_offload = off

    def forward(*args: Any, **kwargs: Any) -> Any:
        off.handles = []
        with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
            return inner(*args, **kwargs)

    module.forward = forward
