"""vlaforge's techniques on LeRobot's pretrained policies (issue 60), each exact against the plain policy in fp32 or
refused in one line (test_lerobot_policies.py holds the refusals): activation checkpointing with the joint layer as
the unit (the VLM block and the expert block it meets, recomputed together; LeRobot 0.6.1 has no checkpointing for
SmolVLA, PR 4150), on folders LeRobot's own `save_pretrained` wrote."""

from __future__ import annotations

from pathlib import Path

import lerobot061 as ref061
import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.xdist_group("lerobot061")

KINDS = ("smolvla", "pi0", "pi05")


@pytest.fixture(scope="module")
def session_root(tmp_path_factory) -> Path:
    return ref061.session_root(tmp_path_factory)


def _options(out: Path) -> dict:
    """The folder's `model.lerobot` settings beside it: pi0's declared sizes and its local tokenizer."""
    files = {"sizes": out / "sizes.json", "tokenizer": out / "tokenizer"}
    return {k: str(v) for k, v in files.items() if v.exists()}


def _step(kind: str, root: Path, strategies: dict[str, str]) -> tuple[float, dict, int]:
    """(loss, gradients, bytes kept for backward) of one training forward at LeRobot's reference inputs (fixed noise
    and time), with each component's checkpointing strategy applied by the trainer's own `apply_checkpointing`."""
    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.config.components import ComponentConfig
    from vlaforge.techniques import accounting
    from vlaforge.techniques.checkpointing import apply_checkpointing

    out = ref061.policy_folder(kind, root)
    inputs, tasks = ref061.sample_inputs()
    theirs, _ = ref061.reference(kind, root, inputs, tasks)
    model, _, _ = load_policy_model(out / "policy", lerobot=_options(out))
    policies = {c: ComponentConfig(checkpointing=strategies.get(c, "none"))
                for c in ("vision", "projector", "llm", "action_head")}
    apply_checkpointing(model, policies)
    model.train()
    x = model.prepare({k[4:]: v for k, v in theirs.items() if k.startswith("pre.")})
    with accounting.count_saved(model) as acc:
        loss = model.loss(x, inputs["noise"], inputs["time"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    saved = sum(acc.total(place) for place in (accounting.DEVICE,))
    return loss.item(), grads, saved


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointed_joint_layers_give_the_plain_gradients_and_keep_less(kind, session_root):
    """`components.llm.checkpointing = 'full'` recomputes each joint layer (both streams) in backward, and the
    tower's blocks with `components.vision.checkpointing`: the loss and every gradient equal the plain policy's
    (fp32; recomputation is the same arithmetic), and what the forward keeps for backward shrinks."""
    plain_loss, plain, plain_saved = _step(kind, session_root, {})
    for strategies in ({"llm": "full"}, {"llm": "every_nth", "vision": "full", "projector": "full"}):
        loss, grads, saved = _step(kind, session_root, strategies)
        assert loss == plain_loss, strategies
        assert grads.keys() == plain.keys() and len(grads) > 20
        worst = max(float((grads[n] - plain[n]).abs().max()) for n in plain)
        assert worst <= 1e-6, (strategies, worst)
        assert saved < plain_saved, (strategies, saved, plain_saved)
    _, _, full_saved = _step(kind, session_root, {"llm": "full", "vision": "full"})
    assert full_saved < 0.6 * plain_saved, (full_saved, plain_saved)


def test_a_checkpointed_policy_trains_to_the_same_weights(session_root, tmp_path):
    """Through the trainer: two steps of SmolVLA with its joint layers and tower checkpointed end on the same weights
    as without (fp32, the same seed: the same noise, times and batches)."""
    from safetensors.torch import load_file

    from fake_lerobot import write_dataset

    out = ref061.policy_folder("smolvla", session_root)
    write_dataset(tmp_path / "ds")
    base = ["train", "recipes/smolvla.toml", f"--model.lerobot.pretrained={out / 'policy'}",
            f"--data.path={tmp_path / 'ds'}", "--train.batch_size=2", "--train.warmup_steps=0",
            "--train.progress=false", "--train.tensorboard=false", "--components.llm.trainable=true", "--train.steps=2",
            "--train.checkpoint_every=2"]
    weights = {}
    for name, extra in (("plain", []), ("checkpointed", ["--components.llm.checkpointing=full",
                                                         "--components.vision.checkpointing=full"])):
        done = run_cli(*base, *extra, f"--train.output_dir={tmp_path / name}", timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[name] = load_file(str(tmp_path / name / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert weights["plain"].keys() == weights["checkpointed"].keys()
    worst = max(float((weights["plain"][k] - weights["checkpointed"][k]).abs().max()) for k in weights["plain"])
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("kind", ("smolvla", "pi0"))
def test_accumulated_micro_batches_give_the_large_batch_step(kind, session_root, tmp_path):
    """One step of 4 samples equals one of 2 x 2 accumulated (and with the joint layers checkpointed):
    each sample's noise and flow time come from the step's seed and its dataset row, so a sample draws the same in
    any micro-batch."""
    from safetensors.torch import load_file

    from fake_lerobot import write_dataset

    out = ref061.policy_folder(kind, session_root)
    write_dataset(tmp_path / "ds")
    base = ["train", f"recipes/{kind}.toml", f"--model.lerobot.pretrained={out / 'policy'}",
            *(f"--model.lerobot.{k}={v}" for k, v in _options(out).items()), f"--data.path={tmp_path / 'ds'}",
            "--train.warmup_steps=0", "--train.progress=false", "--train.tensorboard=false", "--train.steps=2",
            "--train.checkpoint_every=2"]
    weights = {}
    for name, extra in (("large", ["--train.batch_size=4", "--train.grad_accum=1"]),
                        ("accumulated", ["--train.batch_size=2", "--train.grad_accum=2"]),
                        ("checkpointed", ["--train.batch_size=2", "--train.grad_accum=2",
                                          "--components.llm.checkpointing=full"])):
        done = run_cli(*base, *extra, f"--train.output_dir={tmp_path / name}", timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[name] = load_file(str(tmp_path / name / "checkpoints" / "step_00000002" / "model.safetensors"))
    start = load_file(str(out / "policy" / "model.safetensors"))
    assert not torch.equal(weights["large"]["action_head.action_in_proj.weight"],
                           start["model.action_in_proj.weight"])  # it trained
    for name in ("accumulated", "checkpointed"):
        worst = max(float((weights["large"][k] - weights[name][k]).abs().max()) for k in weights["large"])
        assert worst <= 2e-6, (name, worst)


@pytest.mark.distributed
def test_a_policy_over_two_ranks_steps_as_one_process(session_root, tmp_path):
    """SmolVLA over two gloo ranks of 2 samples, FSDP2 (the whole policy one unit: gradients and optimizer states
    sharded) and DDP, end two steps on the weights of one process of 4 samples: each rank draws its samples' noise
    and times from the same step seed (every rank's generator starts from `train.seed`)."""
    from safetensors.torch import load_file

    from fake_lerobot import write_dataset
    from launch import torchrun

    out = ref061.policy_folder("smolvla", session_root)
    write_dataset(tmp_path / "ds")
    base = ["train", "recipes/smolvla.toml", f"--model.lerobot.pretrained={out / 'policy'}",
            f"--data.path={tmp_path / 'ds'}", "--train.warmup_steps=0", "--train.progress=false",
            "--train.tensorboard=false", "--components.llm.trainable=true", "--train.steps=2",
            "--train.checkpoint_every=2"]
    done = run_cli(*base, "--train.batch_size=4", f"--train.output_dir={tmp_path / 'one'}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step_00000002" / "model.safetensors"))
    ddp = ["--parallel.backend=ddp", "--parallel.dp_replicate=2", "--parallel.dp_shard=1"]
    for name, extra in (("fsdp2", []), ("ddp", ddp)):
        done = torchrun(*base, "--train.batch_size=2", *extra, f"--train.output_dir={tmp_path / name}")
        assert done.returncode == 0, done.stderr[-3000:]
        two = load_file(str(tmp_path / name / "checkpoints" / "step_00000002" / "model.safetensors"))
        assert two.keys() == one.keys()
        diffs = sorted(((float((two[k] - one[k]).abs().max()), k) for k in one), reverse=True)
        assert diffs[0][0] <= 2e-6, (name, diffs[:6])


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_counts_a_policy_from_its_measured_joint_layers(kind, session_root):
    """`vlaforge plan` on a LeRobot folder: every part of the policy measured under fake tensors at 2 and 4 samples
    (its joint layers as the LLM's blocks), planned at 6 samples within 2 % of the fake-tensor count there, joint
    layers checkpointed or not."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.measure import side_by_side
    from vlaforge.planner.types import PlanModel

    out = ref061.policy_folder(kind, session_root)
    lerobot = {"pretrained": str(out / "policy"), **_options(out)}
    for strategy in ("none", "full"):
        cfg = load_config(None, {"model": {"lerobot": lerobot}, "components": {"llm": {"checkpointing": strategy}}})
        pm = PlanModel(cfg)
        assert pm.measured.policy and pm.seq.chunk == pm.model.spec.chunk
        rows = side_by_side(pm.cfg, 6)
        assert abs(rows["activations"]["ratio"] - 1.0) <= 0.02, (kind, strategy, rows["activations"])


def test_the_planner_plans_pi05_at_its_published_size():
    """The `pi05` flavor (LeRobot's defaults): 3,353,433,872 parameters planned (3,616,757,520 with the expert's
    LM head LeRobot builds and never calls); on 8 x h100-80 a configuration fits, in fp32 as a policy trains."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.hardware import CATALOG
    from vlaforge.planner.search import search
    from vlaforge.planner.types import Cluster, PlanModel

    pm = PlanModel(load_config(None, {"model": {"flavor": "pi05"}}))
    assert pm.state(dict(pm.cfg.components.items()), "fp32").total.numel == 3_353_433_872
    plan = search(pm, Cluster(CATALOG["h100-80"], gpus_per_node=8), 32)
    assert plan.best is not None and plan.best.fits
    assert all(p.precision == "fp32" for _, p in plan.best.config.components.items())
