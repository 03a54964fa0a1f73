"""Model structure the techniques and the planner share: which modules are a component's transformer blocks."""

from __future__ import annotations

from torch import nn


def blocks_of(model: nn.Module, component: str) -> nn.ModuleList | None:
    """The transformer blocks of `component` (None for the projector and the action head, and for a component
    another pipeline stage holds)."""
    from vlaforge.models.llm import llm_blocks
    from vlaforge.models.vision import vision_blocks

    if getattr(getattr(model, component), "removed", False):
        return None
    if component == "vision":
        return vision_blocks(model.vision)
    if component == "llm":
        return llm_blocks(model.llm)
    return None
