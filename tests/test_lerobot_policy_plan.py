"""The planner on LeRobot's pretrained policies (issue 60): every part measured under fake tensors and planned within
2 % of the fake-tensor count (fp32, checkpointed, bf16 with LoRA / QLoRA), pi0.5 planned at its published size, and
recipes/pi05_24gb.toml - the planner's full fine-tune of pi0.5 on one 24 GB GPU - held to its choice and trained on
a tiny folder LeRobot wrote."""

from __future__ import annotations

from pathlib import Path

import lerobot061 as ref061
import pytest

from conftest import run_cli

KINDS = ("smolvla", "pi0", "pi05")


@pytest.fixture
def session_root(tmp_path_factory) -> Path:
    """The folder the session's workers share (tests/lerobot061.py: the LeRobot-made folders are built once)."""
    return ref061.session_root(tmp_path_factory)


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_counts_a_policy_from_its_measured_joint_layers(kind, session_root):
    """`vlaforge plan` on a LeRobot folder: every part of the policy measured under fake tensors at 2 and 4 samples
    (its joint layers as the LLM's blocks), planned at 6 samples within 2 % of the fake-tensor count there: fp32 with
    the joint layers checkpointed or not, and bf16 with QLoRA on the VLM and LeRobot's LoRA targets on the expert
    (the adapters in place when measured; their optimizer state counted from the policy's own linears)."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.measure import side_by_side
    from vlaforge.planner.types import PlanModel

    out = ref061.policy_folder(kind, session_root)
    lerobot = {"pretrained": str(out / "policy"), **ref061.folder_options(out)}
    frozen = {"trainable": False}
    adapted = {"llm": {"checkpointing": "full", "precision": "bf16", "lora": {"rank": 4, "base": "nf4"}},
               "action_head": {"precision": "bf16", "lora": {"rank": 4, "targets": "lerobot"}},
               "vision": frozen, "projector": frozen}
    for name, comps in (("none", {}), ("full", {"llm": {"checkpointing": "full"}}), ("lora", adapted)):
        pm = PlanModel(load_config(None, {"model": {"lerobot": lerobot}, "components": comps}))
        assert pm.measured.policy and pm.seq.chunk == pm.model.spec.chunk
        rows = side_by_side(pm.cfg, 6)
        assert abs(rows["activations"]["ratio"] - 1.0) <= 0.02, (kind, name, rows["activations"])
    # the expert's adapters as planned: the gradients of the ones `apply_lora` makes on the real policy (fp32)
    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.config.components import ComponentConfig
    from vlaforge.config.lora import LoraConfig
    from vlaforge.techniques.lora import apply_lora

    model, _, _ = load_policy_model(out / "policy", lerobot=ref061.folder_options(out))
    policies = {c: ComponentConfig() for c in ("vision", "projector", "llm")}
    policies["action_head"] = ComponentConfig(lora=LoraConfig(rank=4, targets="lerobot"))
    real = apply_lora(model, policies)["action_head"].adapter_params
    planned = pm.state(dict(pm.cfg.components.items()), "fp32").by_component["action_head"]
    assert planned.grads == 4 * real, (planned.grads, real)


@pytest.fixture(scope="module")
def pi05_plan():
    """The planner's model of the `pi05` flavor, shared by this module's two searches: its fake-tensor measurement of
    the whole policy at its published size (~35 s here) is made once, on the first search, and kept in it."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.types import PlanModel

    return PlanModel(load_config(None, {"model": {"flavor": "pi05"}}))


def test_the_planner_plans_pi05_at_its_published_size(pi05_plan):
    """The `pi05` flavor (LeRobot's defaults): 3,353,433,872 parameters planned (3,616,757,520 with the expert's
    LM head LeRobot builds and never calls); on 8 x h100-80 a configuration fits, in bf16 over fp32 masters."""
    from vlaforge.planner.hardware import CATALOG
    from vlaforge.planner.search import search
    from vlaforge.planner.types import Cluster

    pm = pi05_plan
    assert pm.state(dict(pm.cfg.components.items()), "fp32").total.numel == 3_353_433_872
    plan = search(pm, Cluster(CATALOG["h100-80"], gpus_per_node=8), 32)
    assert plan.best is not None and plan.best.fits
    assert all(p.precision == "bf16" for _, p in plan.best.config.components.items())
    assert plan.best.config.train.precision_master == "fp32"


@pytest.mark.slow
def test_the_24gb_recipe_is_the_planners_choice(pi05_plan):
    """recipes/pi05_24gb.toml: what `vlaforge plan` picks for a full fine-tune of pi0.5 on one 24 GB GPU given
    DeepSpeed ZeRO-3 with CPU offload (nothing fits without it), setting for setting."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.hardware import CATALOG
    from vlaforge.planner.search import search
    from vlaforge.planner.types import Cluster

    recipe = load_config("recipes/pi05_24gb.toml")
    pm = pi05_plan
    card = Cluster(CATALOG["rtx-4090"], gpus_per_node=1)
    assert search(pm, card, 32, alternatives=False).best is None
    pins = {"parallel.backend": "deepspeed", "parallel.zero_stage": 3, "parallel.offload_optimizer": "cpu",
            "parallel.offload_param": "cpu"}
    best = search(pm, card, 32, pins, keep=1).best
    assert best is not None and best.fits and best.memory["total"] <= 20.7
    for c in ("vision", "projector", "llm", "action_head"):
        mine, theirs = getattr(recipe.components, c), getattr(best.config.components, c)
        assert (mine.precision, mine.checkpointing) == (theirs.precision, theirs.checkpointing), c
    for section in ("parallel", "train"):
        for key in ("backend", "zero_stage", "offload_optimizer", "offload_param", "batch_size", "grad_accum",
                    "precision_master"):
            if hasattr(getattr(recipe, section), key):
                assert getattr(getattr(recipe, section), key) == getattr(getattr(best.config, section), key), key


@pytest.mark.slow
@pytest.mark.over_budget("the first DeepSpeed run on a machine JIT-compiles its CPU ops")
def test_the_24gb_recipe_trains_a_pi05_folder(session_root, tmp_path):
    """recipes/pi05_24gb.toml (DeepSpeed ZeRO-3, CPU offload, bf16, joint layers checkpointed) trains a tiny pi0.5
    folder LeRobot wrote for a step."""
    pytest.importorskip("deepspeed")
    args = ref061.train_args("pi05", session_root, tmp_path / "ds", recipe="recipes/pi05_24gb.toml")
    done = run_cli(*args, "--train.batch_size=2", "--train.steps=1", f"--train.output_dir={tmp_path / 'run'}",
                   timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "model.safetensors").is_file()
