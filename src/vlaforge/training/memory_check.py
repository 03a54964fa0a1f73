"""Sizes that cannot fit: refused before they are allocated (a lower-bound estimate), and an allocation that fails
anyway ends in one line naming what to lower."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from vlaforge.config.schema import VLAConfig
from vlaforge.errors import VlaforgeError, first_line
from vlaforge.models.vision import tower_width, vision_blocks


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
