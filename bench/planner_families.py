"""The planner's LLM activation bytes against the fake-tensor accounting, per LLM family (the tiny folders of
tests/families.py) and checkpointing strategy: prints JSON {family: {strategy: planned / measured}}.

    python bench/planner_families.py [--precision bf16] [--out DIR]

A ratio of 1.0 is exact; the planner refuses (one line) the families whose blocks it does not count yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def measure(folder: Path, precision: str, strategy: str) -> float | str:
    from vlaforge import COMPONENTS
    from vlaforge.errors import VlaforgeError
    from vlaforge.planner.measure import side_by_side
    from vlaforge.planner.types import PlanModel

    from conftest import tiny_config

    comps = {c: {"precision": precision} for c in COMPONENTS}
    for c in ("vision", "llm"):
        comps[c]["checkpointing"] = strategy
    cfg = tiny_config(model={"llm": {"pretrained": str(folder)}}, components=comps)
    try:
        PlanModel(cfg)
        refused = None
    except VlaforgeError as exc:
        refused = f"refused: {exc}"
    try:  # measured also where the planner refuses: the ratio says why
        llm = side_by_side(cfg, 2)["by_component"]["llm"]
    except RuntimeError as exc:  # e.g. Qwen3-MoE's grouped matmul under autocast on CPU
        return f"not measured: {str(exc).splitlines()[0]}" + (f"; {refused}" if refused else "")
    ratio = round(llm["ratio"], 4)
    return ratio if refused is None else f"{ratio} ({refused})"


def main() -> None:
    from families import FAMILIES, family_folder

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="bf16")
    p.add_argument("--out", default=None, help="where the family folders are built (a temporary folder)")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="families_"))
    with contextlib.redirect_stdout(sys.stderr):  # the loaders' notices (Gemma2's eager attention): JSON alone
        out = {name: {s: measure(family_folder(name, root), args.precision, s) for s in ("none", "full", "selective")}
               for name in FAMILIES}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
