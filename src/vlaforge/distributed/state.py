"""Full (unsharded) model and optimizer state of a parallelized model, for checkpoints that load at any world
size and in a single process (`torch.distributed.checkpoint.state_dict`, full state dicts).

Every rank must call the getters (they are collectives); only rank 0 receives the tensors (CPU). Under pipeline
parallel each stage holds part of the model: `pp` > 1 gathers every stage's part onto rank 0 (the names are
those of the whole model, so the merged dict is the single-process one).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from vlaforge.techniques.optimizer_state import (
    check_flat_kinds,
    check_moment_kinds,
    flat_pack,
    flat_unpack,
    pack_moments,
    unpack_moments,
)


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every single-process load; reading shards in one process (resume, eval, export) is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: nn.Module, pp: int = 1) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if pp == 1:
        return _untied(model, get_model_state_dict(model, options=_options(cpu_offload=True)))
    # NOTE: cpu_offload would keep the tensors on global rank 0 only, which holds stage 0 alone
    state = get_model_state_dict(model, options=_options())
    return _untied(model, _merge_stages({k: v.cpu() for k, v in state.items()}, _merge_dicts, pp))


def _untied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with one name per tied parameter (Gemma's, Qwen's tied embeddings), the one safetensors'
    `save_model` keeps in one process (the first in sorted order): the gathered state names it twice. Under
    pipeline parallel the names come from the whole model before its split (`pipeline.split_model`)."""
    from vlaforge.distributed.pipeline import tied_names

    for tied in getattr(model, "pipeline_tied", None) or tied_names(model):
        for extra in tied[1:]:
            state.pop(extra, None)
    return state


def _merge_stages(part: dict[str, Any], merge, pp: int) -> dict[str, Any]:
    """Rank 0: every pipeline stage's `part` merged (from each stage's first rank); other ranks: {}."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    sending = part if rank % (world // pp) == 0 else {}  # pp is the outermost mesh dimension
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(sending, gathered, dst=0)
    if rank != 0:
        return {}
    parts = [g for g in gathered if g]
    out = parts[0]
    for other in parts[1:]:
        out = merge(out, other)
    return out


def _merge_dicts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {**a, **b}


def _merge_optimizer(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two stages' full optimizer states (keyed by name) -> one: states joined; parameter groups matched by their
    name (a stage has only the groups of the components it holds), their parameter names joined in stage order."""
    groups = {g["name"]: {**g, "params": list(g["params"])} for g in a["param_groups"]}
    for g in b["param_groups"]:
        if g["name"] in groups:
            groups[g["name"]]["params"] += [n for n in g["params"] if n not in groups[g["name"]]["params"]]
        else:
            groups[g["name"]] = g
    return {"state": {**a["state"], **b["state"]}, "param_groups": list(groups.values())}


def _owner(model: nn.Module, weighting: nn.Module) -> nn.Module:
    """One module over every parameter the optimizer holds (the learned loss weights live outside the model), so
    optimizer state is keyed by names: 'model.<fqn>', 'weighting.<name>'."""
    return nn.ModuleDict({"model": model, "weighting": weighting})


def full_optimizer_state(model: nn.Module, weighting: nn.Module, optimizer: torch.optim.Optimizer,
                         pp: int = 1) -> dict[str, Any]:
    """The full optimizer state by parameter name, 8-bit moments as plain tensors (`pack_moments`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.utils._pytree import tree_map_only

    if pp == 1:
        return pack_moments(get_optimizer_state_dict(_owner(model, weighting), optimizer,
                                                     options=_options(cpu_offload=True)))
    state = pack_moments(get_optimizer_state_dict(_owner(model, weighting), optimizer, options=_options()))
    return _merge_stages(tree_map_only(torch.Tensor, lambda t: t.cpu(), state), _merge_optimizer, pp)


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], optional: set[str] = frozenset()
                          ) -> None:
    """Load a full state dict; tensors of parameters this rank does not hold (other pipeline stages') are skipped,
    every tensor it holds must be there but the `optional` ones (a LoRA checkpoint's frozen base)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    mine = set(model.state_dict())
    missing = mine - state.keys() - optional
    if missing:
        from vlaforge.errors import VlaforgeError

        raise VlaforgeError(f"the checkpoint lacks {len(missing)} tensors of the model (e.g. {sorted(missing)[0]}); "
                            "resume with the config saved in that checkpoint")
    set_model_state_dict(model, {k: v for k, v in state.items() if k in mine},
                         options=_options(strict=not optional))


def load_full_optimizer_state(model: nn.Module, weighting: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # NOTE: strict=False: a parameter that never had a gradient (e.g. the contrastive temperature with that term
    # off) has no optimizer state to restore, exactly as in the run that saved it.
    owner = _owner(model, weighting)
    params = dict(owner.named_parameters())
    check_moment_kinds(optimizer, params, state["state"])
    state = {"state": {k: v for k, v in state["state"].items() if k in params},  # this pipeline stage's share
             "param_groups": [{**g, "params": [n for n in g["params"] if n in params]} for g in state["param_groups"]
                              if any(n in params for n in g["params"])]}
    set_optimizer_state_dict(owner, optimizer, unpack_moments(state), options=_options(strict=False))


# ---- reading DCP files without running code from them -------------------------------------------------------------
# DCP's own reader unpickles `.metadata` with the unrestricted `pickle` loader, and its default planner reads
# non-tensor items (the optimizer's flattened param_groups values) with torch's unrestricted unpickler (weights_only
# off): a crafted checkpoint would run code on load. These two admit data only.

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_CALLABLES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                       ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes (plain dataclasses and enums), torch dtypes, sizes and layouts."""

    def find_class(self, module: str, name: str):
        if module in _METADATA_MODULES and not name.startswith("__"):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CALLABLES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the metadata refers to {module}.{name}, which a checkpoint never holds")


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor items with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------------------
# Every rank writes its own shards of the model and of the optimizer (no gather anywhere); DCP records the global
# layout, so `dcp.load` reshards to whatever the loading run holds: another world size, another FSDP / TP / PP
# layout, or one process. Optimizer state is flattened to per-parameter keys ('state.<fqn>.exp_avg',
# 'param_groups.<fqn>.lr'), so pipeline stages, which hold different parameter groups, never collide.

def _flat():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _sharded_state(model: nn.Module, weighting: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:  # 8-bit moments as their plain tensors (`flat_pack`)
        state["optimizer"] = flat_pack(get_optimizer_state_dict(_owner(model, weighting), optimizer, options=_flat()))
    return state


def save_sharded(folder, model: nn.Module, weighting: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shards of model and optimizer into `folder` (one shared directory)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, weighting, optimizer), checkpoint_id=str(folder))


def load_sharded(folder, model: nn.Module, weighting: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a sharded checkpoint into this run's model (and optimizer), resharding as needed; works in one
    process too.

    Raises:
        VlaforgeError: the checkpoint is incomplete, corrupt or does not match the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    weighting = weighting if weighting is not None else nn.Module()
    state = _sharded_state(model, weighting, optimizer)
    try:
        saved = SafeReader(str(folder)).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - as below
        raise _unreadable(folder, exc, "resume from another checkpoint") from None
    missing = sorted(f"model.{k}" for k in state["model"] if f"model.{k}" not in saved)
    if optimizer is not None:  # NOTE: before the partial load below, which would leave a moment of another kind out
        check_flat_kinds(state["optimizer"], (k[len("optimizer."):] for k in saved if k.startswith("optimizer.")))
    try:
        # Partial load, for the optimizer only: a parameter that never had a gradient (the contrastive temperature
        # with that term off) has no optimizer state in the checkpoint, exactly as in the run that saved it.
        with _quiet_dcp():
            dcp.load(state, storage_reader=SafeReader(str(folder)),
                     planner=SafeLoadPlanner(allow_partial_load=True))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - files missing or cut (CheckpointException: a BaseException)
        raise _unreadable(folder, exc, "resume from another checkpoint") from None
    if missing:
        from vlaforge.errors import VlaforgeError

        raise VlaforgeError(f"sharded checkpoint {folder} does not match the model ({len(missing)} tensors missing, "
                            f"e.g. {missing[0][len('model.'):]}); use the config saved in that checkpoint")
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(_owner(model, weighting), optimizer, flat_unpack(state["optimizer"]),
                                 options=_flat())


def consolidate_sharded(folder) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, read in this one process from the checkpoint's own
    metadata (no model is built; optimizer shards are not read).

    Raises:
        VlaforgeError: the checkpoint's metadata or shards cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = SafeReader(str(folder)).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
                 if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        with _quiet_dcp():
            dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - as above
        raise _unreadable(folder, exc, "use another checkpoint") from None
    return {k[len("model."):]: v for k, v in state.items()}


def _unreadable(folder, exc: BaseException, fix: str):
    from vlaforge.errors import VlaforgeError

    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    why = (lines[-1] if lines else type(exc).__name__).strip()[:200]
    return VlaforgeError(f"sharded checkpoint {folder} cannot be read ({why}); {fix}")
