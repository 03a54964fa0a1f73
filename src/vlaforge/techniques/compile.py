"""`train.compile`: `torch.compile` per transformer block, torchtitan's unit (repeated blocks compile once)."""

from __future__ import annotations

from torch import nn

from vlaforge.models.blocks import blocks_of, components_with_blocks


def compile_blocks(model: nn.Module) -> int:
    """`torch.compile` every transformer block in place (`nn.Module.compile`: names and hooks unchanged; blocks of
    one shape share the compiled code), of every component the model says has blocks. Returns how many were
    compiled."""
    count = 0
    for comp in components_with_blocks(model):
        for block in blocks_of(model, comp):
            block.compile()
            count += 1
    return count
