"""A diagnosis finding: what was seen, over which steps, the evidence, likely causes and the fixes to try."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITY = {"critical": 3, "warning": 2, "info": 1}


@dataclass
class Finding:
    kind: str  # spike, divergence, non_finite, stuck, oscillation, lr_ratio, dominant_term, underflow, ...
    severity: str  # critical | warning | info
    title: str  # one line, with the numbers
    steps: tuple[int, int] | None  # first and last step it covers
    evidence: dict[str, Any] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    subject: str | None = None  # the loss term, component or rank it is about
    score: float = 0.0  # ranks findings of one severity (larger first)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = list(self.steps) if self.steps else None
        return d


def ranked(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-SEVERITY[f.severity], -f.score, f.steps[0] if f.steps else 0))


def checklist(findings: list[Finding], n: int = 3) -> list[str]:
    """The first things to try: each finding's first fix in rank order, then their second fixes, ..., without
    repeats, at most `n`."""
    out: list[str] = []
    order = ranked(findings)
    for i in range(max((len(f.fixes) for f in order), default=0)):
        for f in order:
            if i < len(f.fixes) and f.fixes[i] not in out:
                out.append(f.fixes[i])
            if len(out) == n:
                return out
    return out
