import functools
import math
import warnings

import pytest
import torch

from vlaforge import COMPONENTS
from vlaforge.models.build import build_vla
from vlaforge.techniques.freezing import apply_freezing
from vlaforge.training.optim import LRSpreadWarning, build_optimizer, build_param_groups, build_scheduler, lr_factor
from vlaforge.training.step import train_step
from vlaforge.training.trainer import build_loss_weighting

from conftest import make_batch, tiny_config

LRS = {"vision": 1e-5, "projector": 2e-4, "llm": 1e-4, "action_head": 5e-4}
WDS = {"vision": 0.0, "projector": 0.05, "llm": 0.1, "action_head": 0.01}


def _cfg(tmp_path, **components):
    comps = {c: {"lr": LRS[c], "weight_decay": WDS[c]} for c in COMPONENTS}
    for c, extra in components.items():
        comps[c].update(extra)
    return tiny_config(tmp_path, components=comps)


def test_param_groups_carry_component_lr_and_wd(tmp_path):
    cfg = _cfg(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    opt = build_optimizer(model, cfg)
    names = {g["name"]: g for g in opt.param_groups}
    for c in COMPONENTS:
        assert names[c]["lr"] == LRS[c] and names[c]["weight_decay"] == WDS[c]
        assert names[f"{c}.no_decay"]["weight_decay"] == 0.0 and names[f"{c}.no_decay"]["lr"] == LRS[c]
        owned = {id(p) for p in getattr(model, c).parameters()}
        assert all(id(p) in owned for p in names[c]["params"])
        assert all(p.ndim < 2 for p in names[f"{c}.no_decay"]["params"])
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted({id(p) for p in model.parameters()})


def test_frozen_component_gets_no_gradient_and_no_state(tmp_path):
    cfg = _cfg(tmp_path, vision={"trainable": False})
    model = build_vla(cfg.model, cfg.loss)
    apply_freezing(model, dict(cfg.components.items()), step=0)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg.train)
    before = {k: v.clone() for k, v in model.vision.state_dict().items()}
    weighting = build_loss_weighting(cfg, model, torch.device("cpu"))
    train_step(model, [make_batch(cfg, model)], opt, sched, weighting, 1.0)
    assert all(p.grad is None for p in model.vision.parameters())
    assert not any(p in opt.state for p in model.vision.parameters())
    assert any(p in opt.state for p in model.llm.parameters())
    for k, v in model.vision.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_staged_unfreezing_of_last_blocks(tmp_path):
    cfg = _cfg(tmp_path, vision={"trainable": False, "unfreeze_at_step": 3, "unfreeze_last_blocks": 1})
    model = build_vla(cfg.model, cfg.loss)
    policies = dict(cfg.components.items())
    counts = apply_freezing(model, policies, step=2)
    assert counts["vision"] == 0
    counts = apply_freezing(model, policies, step=3)
    last = model.vision.encoder.layers[-1]
    trained = {n for n, p in model.vision.named_parameters() if p.requires_grad}
    assert trained == {f"encoder.layers.1.{n}" for n, _ in last.named_parameters()} | {
        "post_layernorm.weight", "post_layernorm.bias"}
    assert counts["vision"] == sum(p.numel() for p in model.vision.parameters() if p.requires_grad)
    assert counts["llm"] == sum(p.numel() for p in model.llm.parameters())


def test_lr_spread_warning(tmp_path):
    cfg = _cfg(tmp_path, vision={"lr": 1e-6}, action_head={"lr": 1e-3})
    model = build_vla(cfg.model, cfg.loss)
    with pytest.warns(LRSpreadWarning, match=r"components.action_head.lr .* 1000x components.vision.lr"):
        build_optimizer(model, cfg)
    frozen = _cfg(tmp_path, vision={"lr": 1e-6, "trainable": False}, action_head={"lr": 1e-3})
    with warnings.catch_warnings():
        warnings.simplefilter("error", LRSpreadWarning)
        build_optimizer(model, frozen)  # a component that never trains does not count


def test_schedule_warmup_cosine_constant():
    assert lr_factor(0, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 100, 0, "constant", 0.1) == 1.0


def test_schedule_cosine_decay_with_warmup():
    """LeRobot's formula by hand (tests/test_lerobot_schedule.py compares every step with LeRobot itself)."""
    f = functools.partial(lr_factor, schedule="cosine_decay_with_warmup", min_ratio=0.1)
    # 30 steps of decay 100: warmup 10 scaled to int(10 * 0.3) = 3, from 1/4; the cosine over 30 steps from step 0
    assert [f(s, 30, 10, decay=100) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert f(3, 30, 10, decay=100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 3 / 30)))
    assert f(30, 30, 10, decay=100) == pytest.approx(0.1)
    # 120 steps of decay 100: warmup 10 from 1/11, the floor from step 100 on
    assert f(0, 120, 10, decay=100) == pytest.approx(1 / 11)
    assert f(10, 120, 10, decay=100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 10 / 100)))
    assert f(100, 120, 10, decay=100) == f(119, 120, 10, decay=100) == pytest.approx(0.1)
    assert f(40, 120, 10) == f(40, 120, 10, decay=120)  # decay unset: train.steps


def test_decay_all_leaves_no_no_decay_group(tmp_path):
    cfg = _cfg(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    groups = build_param_groups(model, cfg.components, decay_all=True)
    assert [g["name"] for g in groups] == list(COMPONENTS)
    for g in groups:
        assert g["weight_decay"] == WDS[g["name"]] and g["lr"] == LRS[g["name"]]
        assert [id(p) for p in g["params"]] == [id(p) for p in getattr(model, g["name"]).parameters()]
