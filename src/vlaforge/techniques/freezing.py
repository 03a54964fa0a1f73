"""`apply_freezing`: which parameters train at a given step, per component (freeze / staged unfreeze).

A frozen parameter has requires_grad=False, so it gets no gradient and AdamW creates no state for it. Every
parameter stays in the optimizer's groups from the start, so unfreezing needs no optimizer rebuild.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from vlaforge import COMPONENTS
from vlaforge.models.llm import llm_blocks
from vlaforge.models.vision import vision_blocks
from vlaforge.techniques.lora import full_parameters, lora_trains

BLOCKS = {"vision": vision_blocks, "llm": llm_blocks}


def trainable_at(policy: Any, step: int) -> bool:
    """Whether a component with this policy trains (at least partly) at `step`."""
    if policy.trainable:
        return True
    return policy.unfreeze_at_step is not None and step >= policy.unfreeze_at_step


def ever_trains(policy: Any) -> bool:
    """Whether a component with this policy trains at some step of the run (now, or once unfrozen)."""
    return policy.trainable or policy.unfreeze_at_step is not None


def schedule_changes(policies: Mapping[str, Any]) -> set[int]:
    """Steps after step 0 at which some component's trainable set changes."""
    return {p.unfreeze_at_step for p in policies.values() if p.unfreeze_at_step}


def apply_freezing(model: nn.Module, policies: Mapping[str, Any], step: int) -> dict[str, int]:
    """Set requires_grad for every parameter according to the schedules at `step`.

    With `unfreeze_last_blocks = K`, only the last K transformer blocks of the component and the modules after
    them (e.g. the final norm) train; the embeddings and earlier blocks stay frozen. A component with LoRA trains
    only its adapters (its base stays frozen at every step; its adapters and `lora.full` modules follow the schedule).

    Returns:
        Trainable parameter count per component.
    """
    counts = {}
    for name in COMPONENTS:
        module, policy = getattr(model, name), policies[name]
        on = trainable_at(policy, step)
        lora = getattr(policy, "lora", None)
        full = full_parameters(module, lora) if lora is not None else set()
        for pname, p in module.named_parameters():
            p.requires_grad_(on and (lora is None or lora_trains(pname, full)))
        k = policy.unfreeze_last_blocks
        if on and not policy.trainable and k is not None:
            _train_only_tail(module, name, k)
        counts[name] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return counts


def _train_only_tail(module: nn.Module, name: str, k: int) -> None:
    """Freeze everything registered before the last k blocks of `module`."""
    if name not in BLOCKS:
        return  # projector / action head have no blocks: the whole component trains
    blocks = BLOCKS[name](module)
    first_trained = blocks[max(0, len(blocks) - k)]
    seen_tail = False
    for sub in module.modules():
        if sub is first_trained:
            seen_tail = True
        if not seen_tail:
            for p in sub.parameters(recurse=False):
                p.requires_grad_(False)
