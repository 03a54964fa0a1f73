"""Full (unsharded) model and optimizer state of a parallelized model, for checkpoints that load at any world
size and in a single process (`torch.distributed.checkpoint.state_dict`, full state dicts).

Every rank must call the getters (they are collectives); only rank 0 receives the tensors (CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def _owner(model: nn.Module, weighting: nn.Module) -> nn.Module:
    """One module over every parameter the optimizer holds (the learned loss weights live outside the model), so
    optimizer state is keyed by names: 'model.<fqn>', 'weighting.<name>'."""
    return nn.ModuleDict({"model": model, "weighting": weighting})


def full_optimizer_state(model: nn.Module, weighting: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_owner(model, weighting), optimizer, options=_options(cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def load_full_optimizer_state(model: nn.Module, weighting: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # NOTE: strict=False: a parameter that never had a gradient (e.g. the contrastive temperature with that term
    # off) has no optimizer state to restore, exactly as in the run that saved it.
    set_optimizer_state_dict(_owner(model, weighting), optimizer, state, options=_options(strict=False))
