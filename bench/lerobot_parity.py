"""vlaforge's SmolVLA / pi0 against LeRobot 0.6.1 on LeRobot-made tiny folders (tests/lerobot061.py builds them and
runs LeRobot in its test site): the largest differences of every quantity the parity tests check, in fp32, and the
same for vlaforge in bf16 against LeRobot's fp32 (what bf16 costs). Prints JSON, one row per family.

    python bench/lerobot_parity.py [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import lerobot061 as ref061

from vlaforge.checkpoints.load import load_policy_model
from vlaforge.models.policies.families import family_of


def measure(kind: str, root: Path) -> dict:
    out = ref061.policy_folder(kind, root)
    options = {"sizes": str(out / "sizes.json")} if (out / "sizes.json").is_file() else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = load_policy_model(out / "policy", lerobot=options)
    inputs, tasks = ref061.sample_inputs()
    theirs, meta = ref061.reference(kind, root, inputs, tasks)
    pre, post = model.pipelines
    raw = {k: v for k, v in inputs.items() if k not in ("noise", "time", "action_is_pad")}
    mine_pre = pre({**raw, "task": list(tasks)})
    row = {"family": kind, "pipeline_max_abs": max(float((mine_pre[k[4:]].float() - v.float()).abs().max())
                                                    for k, v in theirs.items() if k.startswith("pre."))}
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}
    model.train()
    x = model.prepare(batch)
    row["losses_max_abs"] = float((model.losses(x, inputs["noise"], inputs["time"]) - theirs["losses"]).abs().max())
    loss = model.loss(x, inputs["noise"], inputs["time"])
    row["loss_abs"] = abs(loss.item() - meta["loss"])
    loss.backward()
    fam, params = family_of(kind.replace("_half", ""), "bench"), dict(model.named_parameters())
    grads = {k[5:]: v for k, v in theirs.items() if k.startswith("grad.")}
    floor = 1e-3 * max(float(g.abs().max()) for g in grads.values())
    rel = [float((params["{}.{}".format(*fam.key(n))].grad - g).abs().max() / max(float(g.abs().max()), floor))
           for n, g in grads.items()]
    row.update(gradients=len(rel), gradient_max_rel=max(rel))
    model.eval()
    sample = model.sample_actions(model.prepare(batch, with_actions=False), inputs["noise"])
    row["sample_max_abs"] = float((sample - theirs["sample"]).abs().max())
    row["post_max_abs"] = float((post(sample[:, :, :model.spec.action_dim]) - theirs["post"]).abs().max())
    model.to(torch.bfloat16)
    xb = model.prepare({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()})
    with torch.no_grad():
        lb = model.losses(xb, inputs["noise"].bfloat16(), inputs["time"])
        sb = model.sample_actions(model.prepare(batch, with_actions=False), inputs["noise"].bfloat16())
    row["bf16_losses_max_abs"] = float((lb.float() - theirs["losses"]).abs().max())
    row["bf16_losses_scale"] = float(theirs["losses"].abs().max())
    row["bf16_sample_max_abs"] = float((sb.float() - theirs["sample"]).abs().max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/vlaforge_lerobot061"))
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for kind in ("smolvla", "smolvla_half", "pi0", "pi05"):
        print(json.dumps(measure(kind, args.root)), flush=True)


if __name__ == "__main__":
    main()
