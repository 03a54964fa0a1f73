"""A folder `vlaforge export --format lerobot` wrote, loaded by LeRobot 0.6.1 itself: the keys its `from_pretrained`
finds missing or unexpected, then (when there are none) reference.py's outputs for INPUTS on that folder.

usage: PYTHONPATH=.venv/lerobot061:tests/lerobot_env061 python tests/lerobot_env061/export_check.py DIR INPUTS OUT

DIR: a policy folder as reference.py takes it (pi0 / pi05: sizes.json beside it); INPUTS and OUT as reference.py's
(any camera names: the folder's input features). Prints, last, one JSON line:
  missing     the policy's state_dict keys model.safetensors does not give (tied ones included)
  unexpected  model.safetensors keys the policy does not have
  differ      keys whose loaded value differs from the file's (LeRobot's loaders never raise on a failed load)
  tensors     how many keys the policy has
OUT is written only when all three lists are empty; OUT "-": the load check alone (a folder whose config.json asks
for dtype bfloat16 loads cast to bf16, so reference.py's fp32 comparison with the file does not apply).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from safetensors.torch import load_file


def strict_check(policy_dir: Path) -> dict:
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class

    config = PreTrainedConfig.from_pretrained(policy_dir)
    if config.type in ("pi0", "pi05"):
        import tiny_pi0

        tiny_pi0.apply(json.loads((policy_dir.parent / "sizes.json").read_text()))
    policy = get_policy_class(config.type).from_pretrained(policy_dir)
    state = policy.state_dict()
    saved = load_file(policy_dir / "model.safetensors")
    return {"missing": sorted(set(state) - set(saved)), "unexpected": sorted(set(saved) - set(state)),
            "differ": sorted(k for k in state if k in saved and not torch.equal(state[k], saved[k].to(state[k].dtype))),
            "tensors": len(state)}


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    import reference

    folder = Path(sys.argv[1]).resolve()
    torch.manual_seed(0)
    check = strict_check(folder)
    if not (check["missing"] or check["unexpected"] or check["differ"]) and sys.argv[3] != "-":
        reference.run(folder, Path(sys.argv[2]), Path(sys.argv[3]))
    print(json.dumps(check))
