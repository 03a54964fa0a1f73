"""LeRobot 0.6.1's `cosine_decay_with_warmup` learning rates, as `lerobot-train` steps them: for each case, its
scheduler config built over torch's AdamW (one parameter per group, at the case's group lrs) for `steps` training
steps. Prints, as JSON, per case every group's lr at each optimizer step 0..steps (the lr that step uses: LeRobot
calls scheduler.step() after each optimizer step).

usage: PYTHONPATH=SITE python tests/lerobot_env061/schedule.py CASES
CASES: a JSON list of {"steps", "warmup", "decay", "peak_lr", "decay_lr", "group_lrs"}
"""

import json
import sys

import torch
from lerobot.optim.schedulers import CosineDecayWithWarmupSchedulerConfig


def lrs(steps: int, warmup: int, decay: int, peak_lr: float, decay_lr: float, group_lrs: list[float]
        ) -> list[list[float]]:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in group_lrs]
    optimizer = torch.optim.AdamW(groups)
    config = CosineDecayWithWarmupSchedulerConfig(num_warmup_steps=warmup, num_decay_steps=decay, peak_lr=peak_lr,
                                                  decay_lr=decay_lr)
    scheduler = config.build(optimizer, steps)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()  # (no gradients: nothing changes; stepped so torch sees the usual order)
        scheduler.step()
    out.append([g["lr"] for g in optimizer.param_groups])
    return out


print(json.dumps([lrs(**case) for case in json.loads(sys.argv[1])]))
