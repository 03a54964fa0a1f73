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
    """FakeTensorMode plus transformers' no_init_weights (random inits read data, which fake tensors lack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.initialization import no_init_weights

    with FakeTensorMode(allow_non_fake_inputs=True), no_init_weights():
        yield
