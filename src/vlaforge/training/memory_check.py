"""Sizes that cannot fit: refused before they are allocated (a lower-bound estimate), and an allocation that fails
anyway ends in one line naming what to lower."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from vlaforge.config.schema import VLAConfig
from vlaforge.errors import VlaforgeError, first_line
from vlaforge.models.vision import tower_width, vision_blocks
from vlaforge.techniques.freezing import ever_trains
from vlaforge.techniques.optimizer_state import adam_state_bytes
from vlaforge.techniques.precision import master_dtype
from vlaforge.training.optim import owned_parameters


def check_memory(cfg: VLAConfig, model: nn.Module, device: torch.device, tps: int) -> None:
    """Refuse sizes whose step cannot fit this device, before anything of that size is allocated. The estimate is
    a lower bound (images as loaded and batched, and the one hidden state per transformer block that even full
    checkpointing keeps), so it refuses only what surely does not fit.

    Raises:
        VlaforgeError: naming the sizes to lower.
    """
    lay, b = model.layout, cfg.train.batch_size
    images = 2 * lay.frames * 3 * lay.image_size ** 2 * 4  # float32, per sample and again in the collated batch
    vision = lay.frames * lay.patches_per_frame * tower_width(model.vision) * len(vision_blocks(model.vision)) * 2
    llm = tps * model.llm.config.hidden_size * model.llm.config.num_hidden_layers * 2
    need = b * (images + vision + llm)
    have = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise VlaforgeError(f"one step needs at least {need / 2**30:.1f} GiB (train.batch_size = {b} samples of "
                            f"{lay.frames} images at {lay.image_size} px and {tps} LLM tokens) but the {device.type} "
                            f"has {have / 2**30:.1f} GiB; lower train.batch_size (raise train.grad_accum to keep the "
                            "global batch), model.image_size or the token counts")
    check_host_optimizer(cfg, model)


def host_optimizer_bytes(cfg: VLAConfig, model: nn.Module) -> tuple[int, list[str]]:
    """Bytes of optimizer state this node's host keeps, counted as the planner counts them
    (`optimizer_state.adam_state_bytes` over the trained tensors, as `planner.memory.model_state`), and what keeps
    them: the components with `optim_state = "cpu"` (techniques/host_optimizer.py: fp32 master and moments), or with
    DeepSpeed's `offload_optimizer = "cpu"` every training component (ZeRO partitions it over the ranks, all on this
    host on one node). A LoRA component's adapters (built later, a few per cent of it) are not counted."""
    par = cfg.parallel
    offloaded = par.backend == "deepspeed" and par.offload_optimizer == "cpu"
    need, why = 0, []
    for name, params in owned_parameters(model).items():
        policy = getattr(cfg.components, name)
        if not ever_trains(policy) or policy.lora is not None or not (offloaded or policy.optim_state == "cpu"):
            continue
        size = torch.empty((), dtype=master_dtype(policy.precision, cfg.train.precision_master)).element_size()
        need += sum(adam_state_bytes(p.numel(), size, policy.optim_state) for p in params)
        why += [] if offloaded else [f"components.{name}.optim_state = 'cpu'"]
    if offloaded:
        nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        return need // nodes, ["parallel.offload_optimizer = 'cpu'"]
    return need, why


def host_available_bytes() -> int:
    """Memory this process can still take on the host: /proc/meminfo's MemAvailable, and no more than its cgroup's
    limit less what the cgroup uses (a container sees the whole machine in /proc/meminfo)."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            have = min(have, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return have


def check_host_optimizer(cfg: VLAConfig, model: nn.Module) -> None:
    """Refuse an optimizer kept on the host (vlaforge's `optim_state = "cpu"`, DeepSpeed's CPU offload) when the
    host lacks the memory the planner counts for it, before the optimizer allocates any of it.

    Raises:
        VlaforgeError: naming the need, what the host has and the ways out."""
    need, why = host_optimizer_bytes(cfg, model)
    if not need:
        return
    have = host_available_bytes()
    if need > have:
        raise VlaforgeError(f"{' and '.join(why)} keep {need / 2**30:.1f} GiB of optimizer state on the host, which "
                            f"has {have / 2**30:.1f} GiB available; free host memory, keep fewer components' state "
                            "there, or keep it on the device (optim_state = '8bit' holds 2 bytes a parameter)")


@contextlib.contextmanager
def memory_errors():
    """An allocation that fails (a size `check_memory`'s lower bound let through) ends in one line, not a trace."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "allocate" not in str(exc):
            raise
        raise VlaforgeError(f"out of memory ({first_line(exc, 120)});"
                            " lower train.batch_size (raise train.grad_accum to keep the global batch), "
                            "model.image_size or the token counts, or turn on activation checkpointing") from None
