"""LeRobot 0.6.1's optimizer and schedule, reproduced: `train.lr_schedule = "cosine_decay_with_warmup"` (with
`train.decay_steps`) against LeRobot's own `CosineDecayWithWarmupSchedulerConfig`, and `train.decay_all` against
torch's AdamW over every parameter (LeRobot's `policy.get_optim_params()`, no no-decay group)."""

import json
import shutil

import lerobot061 as ref061
import pytest
import torch

from vlaforge import COMPONENTS
from vlaforge.config import load_config
from vlaforge.errors import ConfigError
from vlaforge.models.build import build_vla
from vlaforge.training.optim import StepSchedule, build_optimizer, build_param_groups, build_scheduler

from conftest import TINY_RECIPE, run_cli, tiny_config

LRS = {"vision": 1e-5, "projector": 2.5e-5, "llm": 1e-4, "action_head": 3e-4}
PEAK, RATIO = 2.5e-5, 0.1  # pi0's optimizer_lr and scheduler_decay_lr / optimizer_lr
# (steps, warmup, decay): shorter than decay (LeRobot scales warmup to int(10 * 30 / 100) = 3, decays over 30) and
# longer (the floor after step 100)
CASES = ((30, 10, 100), (120, 10, 100))


def _cfg(tmp_path, **train):
    return tiny_config(tmp_path, components={c: {"lr": lr, "weight_decay": 0.01} for c, lr in LRS.items()},
                       train={"lr_schedule": "cosine_decay_with_warmup", "min_lr_ratio": RATIO, **train})


def _stepped(optimizer, scheduler, steps: int) -> tuple[list[list[float]], list[list[torch.Tensor]]]:
    """Each group's scheduled lr (float) and the lr the optimizer holds, at optimizer steps 0..steps."""
    scheduled, held = [], []
    for step in range(steps + 1):
        scheduled.append(scheduler.get_last_lr())
        held.append([g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups])
        if step < steps:
            optimizer.step()  # no gradients: nothing moves
            scheduler.step()
    return scheduled, held


@pytest.fixture(scope="module")
def lerobot_lrs():
    """LeRobot's lrs per case: [step][group], the groups at LRS's lrs in vlaforge's group order."""
    cfg = _cfg(None)
    names = [g["component"] for g in build_param_groups(build_vla(cfg.model, cfg.loss), cfg.components)]
    cases = [{"steps": s, "warmup": w, "decay": d, "peak_lr": PEAK, "decay_lr": PEAK * RATIO,
              "group_lrs": [LRS[n] for n in names]} for s, w, d in CASES]
    return dict(zip(CASES, json.loads(ref061.run("schedule.py", json.dumps(cases)))))


@pytest.mark.parametrize("case", CASES, ids=["scaled", "clamped"])
def test_schedule_is_lerobots(tmp_path, lerobot_lrs, case):
    steps, warmup, decay = case
    reference = lerobot_lrs[case]
    cfg = _cfg(tmp_path, steps=steps, warmup_steps=warmup, decay_steps=decay)
    model = build_vla(cfg.model, cfg.loss)
    # the trainer's: fused AdamW, its lrs device tensors set by `StepSchedule`
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.train)
    assert isinstance(scheduler, StepSchedule)
    scheduled, held = _stepped(optimizer, scheduler, steps)
    assert [g["component"] for g in optimizer.param_groups] == [g["component"] for g in build_param_groups(
        model, cfg.components)]
    for step, (ours, theirs, tensors) in enumerate(zip(scheduled, reference, held)):
        assert ours == pytest.approx(theirs, rel=1e-12, abs=0), step
        # what the fused kernel reads: LeRobot's lr rounded to float32
        assert torch.equal(torch.stack(tensors), torch.tensor(theirs, dtype=torch.float32)), step
    # DeepSpeed's: torch's AdamW over the same groups, the schedule a LambdaLR
    foreach = torch.optim.AdamW(build_param_groups(model, cfg.components), foreach=True)
    scheduler = build_scheduler(foreach, cfg.train)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    scheduled, _ = _stepped(foreach, scheduler, steps)
    for step, (ours, theirs) in enumerate(zip(scheduled, reference)):
        assert ours == pytest.approx(theirs, rel=1e-12, abs=0), step
    # the schedule's shape: the (scaled) warmup from lr / (warmup + 1) up to its last step, the floor from decay on
    scaled_warmup = int(warmup * steps / decay) if steps < decay else warmup
    first = [lrs[0] for lrs in scheduled]
    assert first[0] == pytest.approx(optimizer.param_groups[0]["initial_lr"] / (scaled_warmup + 1), rel=1e-12)
    assert max(first) == first[scaled_warmup] < optimizer.param_groups[0]["initial_lr"]  # cosine from step 0
    if steps > decay:
        assert all(lrs == pytest.approx([LRS[g["component"]] * RATIO for g in optimizer.param_groups], rel=1e-12)
                   for lrs in scheduled[decay:])


def _one_step(model, groups_or_optimizer, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    groups_or_optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("decay_all", [True, False])
def test_decay_all_decays_norms_and_biases_as_torch_adamw(tmp_path, decay_all):
    wd = 0.05
    cfg = tiny_config(tmp_path, components={c: {"lr": 1e-3, "weight_decay": wd} for c in COMPONENTS},
                      train={"lr_schedule": "constant", "decay_all": decay_all, "betas": [0.9, 0.999]})
    torch.manual_seed(0)
    model = build_vla(cfg.model, cfg.loss)
    with torch.no_grad():  # (biases start at zero, which no decay moves)
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = [torch.randn_like(p) for p in model.parameters()]
    optimizer = build_optimizer(model, cfg)
    names = [g["name"] for g in optimizer.param_groups]
    assert any(n.endswith(".no_decay") for n in names) != decay_all
    ours = _one_step(model, optimizer, grads)

    # the reference: torch's AdamW over all parameters, one group (LeRobot's optimizer), from the same weights
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    reference = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=cfg.train.eps,
                                  weight_decay=wd)
    theirs = _one_step(model, reference, grads)
    norm = next(n for n in ours if "norm" in n and n.endswith(".weight") and start[n].ndim == 1)
    bias = next(n for n in ours if n.endswith(".bias"))
    for name in (norm, bias):
        if decay_all:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-9)
        else:  # no decay: the reference's update plus the decay it applied
            torch.testing.assert_close(ours[name], theirs[name] + 1e-3 * wd * start[name], rtol=1e-6, atol=1e-9)
            assert not torch.allclose(ours[name], theirs[name], rtol=0, atol=1e-9)
    matrix = next(n for n in ours if start[n].ndim == 2)  # decayed either way
    torch.testing.assert_close(ours[matrix], theirs[matrix], rtol=1e-6, atol=1e-9)


def test_decay_steps_needs_the_lerobot_schedule():
    with pytest.raises(ConfigError) as err:
        load_config(TINY_RECIPE, {"train": {"lr_schedule": "cosine", "decay_steps": 100}})
    message = str(err.value)
    assert "\n" not in message and "train.decay_steps = 100 is set but train.lr_schedule = 'cosine'" in message
    assert "cosine_decay_with_warmup" in message
    load_config(TINY_RECIPE, {"train": {"lr_schedule": "cosine_decay_with_warmup", "decay_steps": 100,
                                        "min_lr_ratio": 0.2}})  # read: accepted
    with pytest.raises(ConfigError, match="train.min_lr_ratio = 0.2 is set but train.lr_schedule = 'constant'"):
        load_config(TINY_RECIPE, {"train": {"lr_schedule": "constant", "min_lr_ratio": 0.2}})
    load_config(TINY_RECIPE, {"train": {"decay_all": True}, "parallel": {"backend": "deepspeed"}})  # its groups too


def test_cli_train_with_lerobot_schedule_resumes_bit_exactly(tmp_path):
    common = ("--data.num_samples=32", "--train.batch_size=4", "--train.progress=false", "--train.tensorboard=false",
              "--train.lr_schedule=cosine_decay_with_warmup", "--train.warmup_steps=6", "--train.decay_steps=8",
              "--train.decay_all=true", "--train.steps=4")
    full = tmp_path / "full"
    done = run_cli("train", str(TINY_RECIPE), *common, f"--train.output_dir={full}", "--train.checkpoint_every=2",
                   "--train.keep_checkpoints=3")
    assert done.returncode == 0, done.stderr
    # a run that stopped at step 2: a copy of the full run's step-2 checkpoint, resumed to step 4
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000002", resumed / "ckpt")
    done = run_cli("train", str(TINY_RECIPE), *common, f"--train.output_dir={resumed}",
                   f"--train.resume={resumed / 'ckpt'}")
    assert done.returncode == 0, done.stderr
    a, b = ref061.trained(full, 4), ref061.trained(resumed, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
