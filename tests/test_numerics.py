"""Gradient numerics: the fp16 underflow of vision gradients is detected and named; bf16 stays silent; a
non-finite gradient without loss scaling stops the step and names the parameter."""

import warnings

import pytest
import torch

from vlaforge.training.numerics import (
    FP16_TINY,
    GradientUnderflowWarning,
    NonFiniteGradientError,
    NumericsMonitor,
    component_stats,
)
from vlaforge.training.step import StepGuards, train_step

from conftest import make_batch, tiny_config
from test_precision import InjectInf, _setup


class ShrinkGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor` in the tensor's own dtype."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def shrink_vision_gradients(model, factor: float, on: list[bool]):
    """The phenomenon, exaggerated: the vision tower's gradients are `factor` times smaller (when on[0])."""
    def hook(module, args, out):
        if on[0]:
            out.last_hidden_state = ShrinkGrad.apply(out.last_hidden_state, factor)
        return out
    model.vision.register_forward_hook(hook)


def _run(tmp_path, vision: str, steps: int, shrink_from: int | None, factor: float = 1e-7):
    cfg = tiny_config(tmp_path, components={"vision": {"precision": vision}, "llm": {"precision": "bf16"}},
                      loss_scale={"mode": "off"}, numerics={"every": 1})
    model, setup, weighting, opt, sched = _setup(cfg)
    on = [False]
    shrink_vision_gradients(model, factor, on)
    guards = StepGuards(monitor=NumericsMonitor(cfg.numerics, setup.used))
    batch = make_batch(cfg, model)
    history = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            on[0] = shrink_from is not None and step >= shrink_from
            guards.step = step
            history.append(train_step(model, [batch], opt, sched, weighting, 1.0, guards))
    fired = [w for w in caught if issubclass(w.category, GradientUnderflowWarning)]
    return history, fired


def test_underflow_in_fp16_vision_is_detected_with_the_fix(tmp_path):
    history, fired = _run(tmp_path, "fp16", steps=4, shrink_from=2)
    assert history[1]["numerics/vision/zero_frac"] < 0.05  # healthy at first
    assert history[2]["numerics/vision/zero_frac"] > 0.9  # then the encoder's gradients flush to zero in fp16
    # while the LLM trains normally (its zeros are the rows of tokens absent from the batch)
    assert history[2]["numerics/llm/zero_frac"] == pytest.approx(history[1]["numerics/llm/zero_frac"], abs=0.01)
    assert len(fired) == 1  # once, when it starts
    text = str(fired[0].message)
    assert "step 2: components.vision gradients underflow in fp16" in text
    assert "exactly zero" in text and "x the llm's" in text
    assert "Switch components.vision.precision to 'bf16' or raise the loss scale" in text


def test_bf16_keeps_the_small_gradients_and_stays_silent(tmp_path):
    history, fired = _run(tmp_path, "bf16", steps=3, shrink_from=1)
    assert fired == []
    assert history[2]["numerics/vision/zero_frac"] < 0.05  # bf16 has fp32's exponent range: nothing flushed
    healthy, fired = _run(tmp_path, "bf16", steps=3, shrink_from=None)
    assert fired == []
    assert healthy[2]["numerics/vision/fp16_underflow_frac"] < 0.5


def test_component_stats_by_hand():
    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.tensor([[0.0, 1e-9], [float("inf"), 3.0]])
    layer.bias.grad = torch.tensor([4.0, float("nan")])
    stats = component_stats(layer, scale=1.0)
    assert stats["zero_frac"] == 1 / 6
    assert stats["fp16_underflow_frac"] == 1 / 6  # 1e-9 < 2^-24
    assert (stats["inf"], stats["nan"]) == (1, 1)
    assert stats["grad_norm"] == pytest.approx((1e-18 + 9 + 16) ** 0.5)  # finite values only
    assert component_stats(layer, scale=2 ** 10 * FP16_TINY / 1e-9 * 2)["fp16_underflow_frac"] == 0


def test_nonfinite_gradient_in_bf16_stops_before_the_update(tmp_path):
    cfg = tiny_config(tmp_path, components={"llm": {"precision": "bf16"}})
    model, setup, weighting, opt, sched = _setup(cfg)
    InjectInf(model.llm.model.layers[0].mlp.up_proj.weight, {0})
    before = [p.detach().clone() for p in model.parameters()]
    guards = StepGuards(monitor=NumericsMonitor(cfg.numerics, setup.used), step=7)
    with pytest.raises(NonFiniteGradientError) as err:
        train_step(model, [make_batch(cfg, model)], opt, sched, weighting, 1.0, guards)
    text = str(err.value)
    assert text.startswith("non-finite gradients at step 7 (no loss scaling) in components.llm (bf16): "
                           "llm.model.layers.0.mlp.up_proj.weight (")
    assert "\n" not in text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
