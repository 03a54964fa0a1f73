"""Model structure the techniques and the planner share: which modules are a component's transformer blocks, and
which components have any. Code that asks "which components have blocks" asks here, never a literal list: the
answer changes the day an action head grows a decoder stack (the pretrained policies' action expert)."""

from __future__ import annotations

from torch import nn

from vlaforge import COMPONENTS


def blocks_of(model: nn.Module, component: str) -> nn.ModuleList | None:
    """The transformer blocks of `component` (None for a component without blocks - the projector, an MLP action
    head - and for a component another pipeline stage holds). A component other than the tower and the LLM declares
    its blocks as a `blocks` ModuleList attribute; a model whose blocks are not its components' own units says which
    are (`component_blocks`: a LeRobot policy's joint layers, models/policies/joint.py)."""
    from vlaforge.models.llm import llm_blocks
    from vlaforge.models.vision import vision_blocks

    child = getattr(model, component)
    if getattr(child, "removed", False):
        return None
    own = getattr(model, "component_blocks", None)
    if own is not None:  # a model whose blocks run otherwise than inside their component (a policy's joint layers)
        return own(component)
    if component == "vision":
        return vision_blocks(model.vision)
    if component == "llm":
        return llm_blocks(model.llm)
    blocks = getattr(child, "blocks", None)
    return blocks if isinstance(blocks, nn.ModuleList) and len(blocks) else None


def components_with_blocks(model: nn.Module) -> tuple[str, ...]:
    """The components whose transformer blocks the techniques wrap and the planner counts, in COMPONENTS order."""
    return tuple(c for c in COMPONENTS if blocks_of(model, c) is not None)


def is_policy(model) -> bool:
    """A LeRobot policy (models/policies/): its blocks are its own units (`component_blocks`: joint layers)."""
    return hasattr(model, "component_blocks")
