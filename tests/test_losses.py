import math

import pytest
import torch
import torch.nn.functional as F

from vlaforge.config.schema import LossConfig
from vlaforge.models import losses as L
from vlaforge.training.trainer import train
from vlaforge.training.weighting import build_weighting

from conftest import tiny_config


def test_action_losses_on_known_values():
    pred = torch.tensor([[[0.0], [3.0], [100.0]]])  # (B=1, T=3, A=1); the last step is padding
    target = torch.zeros(1, 3, 1)
    mask = torch.tensor([[True, True, False]])
    assert L.action_loss(pred, target, mask, "l1").item() == pytest.approx(1.5)
    assert L.action_loss(pred, target, mask, "mse").item() == pytest.approx(4.5)
    # Huber with delta 1: 0 for 0, 1*(3 - 0.5) = 2.5 for 3 -> mean 1.25; an outlier grows linearly, not squared.
    assert L.action_loss(pred, target, mask, "huber", 1.0).item() == pytest.approx(1.25)
    assert L.action_loss(pred, target, mask, "huber", 2.0).item() == pytest.approx(2.0)  # 2*(3-1) / 2


def test_smoothness_ignores_padding():
    actions = torch.tensor([[[0.0], [1.0], [2.0], [50.0]]])
    mask = torch.tensor([[True, True, True, False]])
    assert L.smoothness_loss(actions, mask).item() == pytest.approx(1.0)
    assert L.smoothness_loss(torch.ones(2, 5, 3), torch.ones(2, 5, dtype=torch.bool)).item() == 0.0


def test_contrastive_treats_identical_instructions_as_positives():
    v = torch.eye(3)
    ids = torch.tensor([[1, 2], [1, 2], [3, 4]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    scale = torch.tensor(math.log(10.0))
    loss = L.contrastive_loss(v, v, ids, mask, scale)
    logits = 10.0 * torch.eye(3)
    targets = torch.tensor([[0.5, 0.5, 0], [0.5, 0.5, 0], [0, 0, 1.0]])
    expected = F.cross_entropy(logits, targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    aligned = L.contrastive_loss(v, v, torch.tensor([[1], [2], [3]]), mask[:, :1], scale)
    shuffled = L.contrastive_loss(v, v.roll(1, 0), torch.tensor([[1], [2], [3]]), mask[:, :1], scale)
    assert aligned < shuffled


def test_language_loss_matches_cross_entropy():
    logits = torch.randn(2, 4, 11)
    targets = torch.randint(0, 11, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    ref = F.cross_entropy(logits[mask], targets[mask])
    assert L.language_loss(logits, targets, mask).item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize("method", ["static", "uncertainty", "dwa", "gradnorm"])
def test_each_weighting_method_trains_with_finite_logged_weights(tmp_path, method):
    learned = {"weighting_lr": 0.1} if method in ("uncertainty", "gradnorm") else {}  # the learned weights' lr
    cfg = tiny_config(tmp_path, loss={"weighting": method, **learned}, train={"steps": 4})
    train(cfg)
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        for term in ("contrastive", "language", "action"):
            assert math.isfinite(row[f"weight/{term}"]) and row[f"weight/{term}"] > 0
            assert math.isfinite(row[f"loss/{term}"])
    first, last = rows[0], rows[-1]
    if method == "static":
        assert [last[f"weight/{t}"] for t in ("contrastive", "language", "action")] == pytest.approx([0.1, 0.2, 1.0])
        assert last["loss/weighted"] == pytest.approx(last["loss/total"])
    else:
        assert any(first[f"weight/{t}"] != last[f"weight/{t}"] for t in ("contrastive", "language", "action"))
    if method in ("dwa", "gradnorm"):
        assert sum(last[f"weight/{t}"] for t in ("contrastive", "language", "action")) == pytest.approx(3.0)


def test_dwa_weights_follow_relative_descent():
    w = build_weighting("dwa", ["a", "b"], LossConfig())
    for la, lb in [(1.0, 1.0), (0.5, 1.0)]:  # a halves, b stays
        w({"a": torch.tensor(la), "b": torch.tensor(lb)})
        w.end_step()
    _, weights = w({"a": torch.tensor(0.5), "b": torch.tensor(1.0)})
    ratio_a, ratio_b = 0.5, 1.0
    expected_a = 2 * math.exp(ratio_a / 2) / (math.exp(ratio_a / 2) + math.exp(ratio_b / 2))
    assert weights["a"].item() == pytest.approx(expected_a, rel=1e-5)
    assert weights["b"] > weights["a"]  # the slower-improving term gets more weight


def test_gradnorm_raises_weight_of_term_with_small_gradients():
    shared = torch.nn.Parameter(torch.ones(4))
    w = build_weighting("gradnorm", ["big", "small"], LossConfig(gradnorm_alpha=0.0), shared=lambda: [shared])
    opt = torch.optim.SGD(w.parameters(), lr=0.05)
    for _ in range(30):
        terms = {"big": (10.0 * shared).sum(), "small": (0.1 * shared).sum()}
        total, weights = w(terms)
        opt.zero_grad()
        total.backward()
        opt.step()
    assert weights["small"] > 1.5 > weights["big"]


def test_uncertainty_weighting_formula():
    w = build_weighting("uncertainty", ["a", "b"], LossConfig())
    with torch.no_grad():
        w.log_vars.copy_(torch.tensor([0.0, math.log(4.0)]))
    total, weights = w({"a": torch.tensor(2.0), "b": torch.tensor(8.0)})
    assert total.item() == pytest.approx(2.0 + 8.0 / 4 + math.log(4.0))
    assert weights["b"].item() == pytest.approx(0.25)
