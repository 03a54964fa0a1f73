"""Multi-task loss weighting: static, uncertainty (Kendall et al. 2018), DWA (Liu et al. 2019),
GradNorm (Chen et al. 2018). Each maps the dict of loss terms to (total loss, weight per term).

Learned weights are parameters of the weighting module, not of the VLA; the optimizer gives them their own
group ("loss_weighting"). Dynamic methods use the static weights only to choose which terms are active.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vlaforge.registry import Registry

Terms = dict[str, torch.Tensor]


class LossWeighting(nn.Module):
    """Base: `forward(terms) -> (total, weights)`; `end_step(reducer)` after every optimizer step (`reducer`: the
    data-parallel statistics helper, None in one process)."""

    def __init__(self, terms: list[str], **_: object):
        super().__init__()
        self.terms = list(terms)

    def end_step(self, reducer=None) -> None:
        pass


WEIGHTINGS: Registry[type[LossWeighting]] = Registry("loss weighting")


@WEIGHTINGS.register("static")
class StaticWeighting(LossWeighting):
    def __init__(self, terms: list[str], weights: dict[str, float], **_: object):
        super().__init__(terms)
        self.weights = dict(weights)

    def forward(self, terms: Terms):
        weights = {k: self.weights[k] for k in terms}
        return sum(weights[k] * v for k, v in terms.items()), weights


@WEIGHTINGS.register("uncertainty")
class UncertaintyWeighting(LossWeighting):
    """total = sum_k exp(-s_k) L_k + s_k with learned log-variances s_k (homoscedastic uncertainty)."""

    def __init__(self, terms: list[str], **_: object):
        super().__init__(terms)
        self.log_vars = nn.Parameter(torch.zeros(len(terms)))

    def forward(self, terms: Terms):
        total, weights = 0.0, {}
        for i, k in enumerate(self.terms):
            if k in terms:
                s = self.log_vars[i]
                total = total + torch.exp(-s) * terms[k] + s
                weights[k] = torch.exp(-s).detach()
        return total, weights


@WEIGHTINGS.register("dwa")
class DynamicWeightAverage(LossWeighting):
    """w_k = K softmax_k(r_k / T), r_k = L_k(t-1) / L_k(t-2), from per-step mean losses; w = 1 for two steps."""

    def __init__(self, terms: list[str], temperature: float = 2.0, **_: object):
        super().__init__(terms)
        self.temperature = temperature
        n = len(terms)
        self.register_buffer("history", torch.zeros(2, n))  # [L(t-2), L(t-1)]
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))  # completed steps
        self.register_buffer("acc", torch.zeros(n))
        self.register_buffer("count", torch.zeros(n))

    def current_weights(self) -> torch.Tensor:
        n = len(self.terms)
        if self.seen < 2:
            return torch.ones(n, device=self.history.device)
        ratio = self.history[1] / self.history[0].clamp_min(1e-12)
        return n * torch.softmax(ratio / self.temperature, dim=0)

    def forward(self, terms: Terms):
        w = self.current_weights()
        total, weights = 0.0, {}
        for i, k in enumerate(self.terms):
            if k in terms:
                total = total + w[i] * terms[k]
                weights[k] = w[i]
                self.acc[i] += terms[k].detach().float()
                self.count[i] += 1
        return total, weights

    def end_step(self, reducer=None) -> None:
        if reducer is not None:  # every rank's losses: the weights stay global (and equal on all ranks)
            reducer.sum_over_ranks(self.acc)
            reducer.sum_over_ranks(self.count)
        mean = torch.where(self.count > 0, self.acc / self.count.clamp_min(1), self.history[1])
        self.history.copy_(torch.stack([self.history[1], mean]))
        self.seen += 1
        self.acc.zero_()
        self.count.zero_()


@WEIGHTINGS.register("gradnorm")
class GradNorm(LossWeighting):
    """Learned weights w (positive, summing to K) trained so that each term's gradient norm on the shared
    parameters, G_k = w_k ||dL_k/dW||, tracks mean(G) * r_k^alpha, r_k the term's relative inverse training
    rate L_k/L_k(0) over its mean. The model receives sum_k w_k L_k; only w receives the GradNorm loss.
    """

    def __init__(self, terms: list[str], alpha: float = 1.5,
                 shared: Callable[[], list[torch.Tensor]] | None = None, **_: object):
        super().__init__(terms)
        self.alpha = alpha
        self.shared = shared or (lambda: [])
        self.logits = nn.Parameter(torch.zeros(len(terms)))
        self.register_buffer("initial", torch.zeros(len(terms)))

    def forward(self, terms: Terms):
        names = [k for k in self.terms if k in terms]
        idx = torch.tensor([self.terms.index(k) for k in names], device=self.logits.device)
        w = len(names) * torch.softmax(self.logits[idx], dim=0)
        losses = torch.stack([terms[k].float() for k in names])
        total = (w.detach() * losses).sum()
        shared = [p for p in self.shared() if p.requires_grad]
        if shared and torch.is_grad_enabled() and len(names) > 1:
            total = total + self._balance_loss(w, losses, idx, shared)
        return total, {k: w[i].detach() for i, k in enumerate(names)}

    def _balance_loss(self, w, losses, idx, shared) -> torch.Tensor:
        with torch.no_grad():
            init = self.initial[idx]
            fresh = init == 0
            self.initial[idx] = torch.where(fresh, losses.detach(), init)
        norms = []
        for loss in losses:
            grads = torch.autograd.grad(loss, shared, retain_graph=True, allow_unused=True)
            present = [g for g in grads if g is not None]
            norms.append(torch.nn.utils.get_total_norm(present) if present else torch.zeros((), device=loss.device))
        big_g = w * torch.stack(norms).detach()  # G_k = w_k ||dL_k/dW||, differentiable in w only
        rel = losses.detach() / self.initial[idx].clamp_min(1e-12)
        target = (big_g.mean() * (rel / rel.mean()) ** self.alpha).detach()
        return (big_g - target).abs().sum()


def build_weighting(kind: str, terms: list[str], loss_cfg, shared=None) -> LossWeighting:
    return WEIGHTINGS.get(kind)(terms, weights=dict(loss_cfg.weights), temperature=loss_cfg.dwa_temperature,
                                alpha=loss_cfg.gradnorm_alpha, shared=shared)
