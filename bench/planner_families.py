"""The planner's activation bytes against the fake-tensor accounting of a real step, for every family vlaforge
trains: each LLM family of tests/families.py (6 blocks; Gemma3 with a full-attention block after two sliding ones, so
the measured model is cut shorter than the planned one) on the tiny flavor's tower, and each vision tower family (4
blocks; the fused DINOv2-with-registers + SigLIP tower) on the tiny flavor's LLM. Each LLM is its family's plain
`transformers` config class given that family's own fields only (`families.family_config`: GPT-NeoX's folder has no
`num_key_value_heads`, as a user's has not), so the planner sees what users' folders hold. Prints JSON, one row per
family:

    {"llm": {family: {"how": "formula" | "measured", "ratios": {strategy: {instruction tokens: planned / counted}},
                      "plan_s": seconds of a `vlaforge plan` search on 1 x h100-80, its model build included}},
     "vision": {...}, "worst": the ratio furthest from 1.0}

    python bench/planner_families.py [--precision bf16] [--out DIR]

The planner's rows are made once per family at the recipe's instruction length (`PlanModel`) and compared at two
other ones (48 and 160 instruction tokens: 2 samples of 113 and 225 LLM tokens), each against a fake-tensor count
of the whole model built at that length (`planner.measure.side_by_side`'s measured side).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

STRATEGIES = ("none", "full", "selective", "selective_attn", "selective_ffn")
LENGTHS = (48, 160)
LLM_LAYERS = 6
TOWER_LAYERS = 4
# fields of those families' own config classes (`families.family_config` refuses any other)
OVERRIDES = {"gemma3_text": {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2},
             "gemma2": {"layer_types": ["sliding_attention", "full_attention"] * 3}}


def ratios(model_section: dict, comp: str, precision: str) -> tuple[str, dict, float]:
    """(how the planner counts `comp`, {strategy: {length: ratio}}, seconds of one plan search)."""
    from vlaforge import COMPONENTS
    from vlaforge.planner.activations import model_activation_bytes
    from vlaforge.planner.hardware import CATALOG
    from vlaforge.planner.measure import side_by_side
    from vlaforge.planner.search import search
    from vlaforge.planner.types import Cluster, PlanModel

    from conftest import tiny_config

    def config(strategy: str, length: int | None = None):
        comps = {c: {"precision": precision} for c in COMPONENTS}
        comps[comp]["checkpointing"] = strategy
        data = {"max_instruction_tokens": length} if length else {}
        return tiny_config(model=model_section, components=comps, data=data)

    start = time.perf_counter()
    pm = PlanModel(config("none"))
    search(pm, Cluster(CATALOG["h100-80"], gpus_per_node=1), 8)
    plan_s = time.perf_counter() - start
    out = {}
    for strategy in STRATEGIES:
        cfg = config(strategy)
        row = {}
        for length in LENGTHS:
            counted = side_by_side(config(strategy, length), 2)["by_component"][comp]["measured"]
            seq = replace(pm.seq, batch=2, instruction=length)
            planned = model_activation_bytes(pm.model, seq, dict(cfg.components.items()), pm.contrastive,
                                             cfg.train.precision_master, measured=pm.measured)[comp]
            row[str(length)] = round(planned / counted, 4)
        out[strategy] = row
    return ("measured" if comp in pm.measured_components else "formula"), out, round(plan_s, 2)


def main() -> None:
    from families import FAMILIES, VISION_FAMILIES, build_family, build_tower

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="bf16")
    p.add_argument("--out", default=None, help="where the family folders are built (a temporary folder)")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="families_"))
    result: dict = {"precision": args.precision, "llm": {}, "vision": {}}
    with contextlib.redirect_stdout(sys.stderr):  # the loaders' notices (Gemma2's eager attention): JSON alone
        for name in FAMILIES:
            folder = build_family(name, root / f"{name}_{LLM_LAYERS}",
                                  num_hidden_layers=LLM_LAYERS, **OVERRIDES.get(name, {}))
            how, rows, plan_s = ratios({"llm": {"pretrained": str(folder)}}, "llm", args.precision)
            result["llm"][name] = {"how": how, "ratios": rows, "plan_s": plan_s}
        towers = {name: build_tower(name, root / f"vision_{name}_{TOWER_LAYERS}", num_hidden_layers=TOWER_LAYERS)
                  for name in VISION_FAMILIES}
        sections = {name: {"vision": {"pretrained": str(folder)}} for name, folder in towers.items()}
        sections["fused"] = {"vision": {"pretrained": str(towers["dinov2_with_registers"]),
                                        "fused": str(towers["siglip"])}}
        for name, section in sections.items():
            how, rows, plan_s = ratios(section, "vision", args.precision)
            result["vision"][name] = {"how": how, "ratios": rows, "plan_s": plan_s}
    every = [r for part in ("llm", "vision") for fam in result[part].values()
             for row in fam["ratios"].values() for r in row.values()]
    result["worst"] = max(every, key=lambda r: abs(r - 1.0))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
