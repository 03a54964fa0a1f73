"""Fake-tensor builds (planning, `profile --fake`, `plan --measure`): whether one is active, and the context that
makes one. A leaf of `models/`: the builder and the towers ask it, and it imports nothing of vlaforge."""

from __future__ import annotations

import contextlib


def fake_mode_active() -> bool:
    """Whether a fake-tensor mode is active (a caller's `fake_build`, or torch's own)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


@contextlib.contextmanager
def fake_build():
    """FakeTensorMode plus transformers' no_init_weights (random inits read data, which fake tensors lack), and MoE
    experts' grouped matmuls through transformers' own fallback op (`_fake_grouped_mm`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.initialization import no_init_weights

    with FakeTensorMode(allow_non_fake_inputs=True), no_init_weights(), _fake_grouped_mm(), _no_value_checks():
        yield


@contextlib.contextmanager
def _no_value_checks():
    """transformers' `torch_compilable_check`s read tensor values (SigLIP2's positive patch grid), which fake tensors
    do not hold: they are off while a fake build runs (its documented switch, `TRANSFORMERS_DISABLE_TORCH_CHECK`)."""
    import os

    before = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"]
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = before


@contextlib.contextmanager
def _fake_grouped_mm():
    """MoE experts (transformers' `grouped_mm` experts) run `torch._grouped_mm`, whose meta kernel takes bf16 inputs
    only, while on CPU the experts run it in their fp32 weights' dtype (it is not autocast): under fake tensors they
    take transformers' fallback op instead, which has a fake kernel and saves for backward what `_grouped_mm` saves
    (the input, the weight, the offsets), so the counts are the real run's."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without MoE experts
        yield
        return
    real = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: (
        False if type(input).__name__ == "FakeTensor" else real(input, weight, offs))
    try:
        yield
    finally:
        moe._can_use_grouped_mm = real
