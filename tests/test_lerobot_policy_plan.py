"""The planner on LeRobot's pretrained policies (issue 60): every part measured under fake tensors and planned within
2 % of the fake-tensor count (fp32, checkpointed, bf16 with LoRA / QLoRA), pi0.5 planned at its published size, and
recipes/pi05_24gb.toml - the planner's full fine-tune of pi0.5 on one 24 GB GPU, its optimizer on the GPU - held to its
choice, trained on a tiny folder LeRobot wrote and resumed bit for bit."""

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
    (the adapters in place when measured; their optimizer state counted from the policy's own linears), and (SmolVLA)
    with only the expert trained, its default."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.measure import side_by_side
    from vlaforge.planner.types import PlanModel

    out = ref061.policy_folder(kind, session_root)
    lerobot = {"pretrained": str(out / "policy"), **ref061.folder_options(out)}
    frozen = {"trainable": False}
    adapted = {"llm": {"checkpointing": "full", "precision": "bf16", "lora": {"rank": 4, "base": "nf4"}},
               "action_head": {"precision": "bf16", "lora": {"rank": 4, "targets": "lerobot"}},
               "vision": frozen, "projector": frozen}
    expert_only = {"vision": frozen, "projector": frozen, "llm": frozen}  # the prefix's context without autograd
    cases = [("none", {}), ("full", {"llm": {"checkpointing": "full"}}), ("lora", adapted)]
    if kind == "smolvla":  # its default; one kind is enough for what it checks (the fake tensors' whole graph)
        cases.insert(2, ("expert only", expert_only))
    for name, comps in cases:  # the LoRA plan last: read below
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
    """recipes/pi05_24gb.toml: what `vlaforge plan` chooses for a full fine-tune of pi0.5 on one 24 GB GPU, setting for
    setting. Nothing fits as searched; the fastest alternative that fits keeps the optimizer on the GPU (bf16 weights
    with stochastic rounding, 8-bit moments, the step inside backward): under 22 GB, no host memory, and faster than
    DeepSpeed ZeRO-3 with its CPU optimizer (the recipe before), which the planner still offers."""
    from vlaforge.config.loading import load_config
    from vlaforge.planner.hardware import CATALOG
    from vlaforge.planner.report import OFFLOAD
    from vlaforge.planner.search import GPU_OPTIMIZER, search
    from vlaforge.planner.types import Cluster

    recipe = load_config("recipes/pi05_24gb.toml")
    pm = pi05_plan
    plan = search(pm, Cluster(CATALOG["rtx-4090"], gpus_per_node=1), 32)
    assert plan.best is None and plan.best_misfit.memory["total"] > 40  # fp32 masters + AdamW: 16 bytes a parameter
    name, best = plan.fallback
    offload = plan.alternatives[OFFLOAD]
    assert name == GPU_OPTIMIZER and best.fits and best.memory["total"] <= 20.7 and best.memory["cpu"] == 0
    assert best.memory["grads_held"] < 0.25 * best.memory["grads"]  # one part's gradients at a time
    assert offload.fits and best.step_time_s < 0.5 * offload.step_time_s, (best.step_time_s, offload.step_time_s)
    for c in ("vision", "projector", "llm", "action_head"):
        mine, theirs = getattr(recipe.components, c), getattr(best.config.components, c)
        for key in ("precision", "checkpointing", "optim_state", "stochastic_rounding"):
            assert getattr(mine, key) == getattr(theirs, key), (c, key)
    for section, keys in (("parallel", ("backend", "zero_stage", "offload_optimizer", "offload_param")),
                          ("train", ("batch_size", "grad_accum", "precision_master", "step_in_backward",
                                     "grad_clip"))):
        for key in keys:
            assert getattr(getattr(recipe, section), key) == getattr(getattr(best.config, section), key), key


@pytest.mark.slow
@pytest.mark.over_budget("torchao compiles its 8-bit / stochastic-rounding step once per parameter shape")
def test_the_24gb_recipe_trains_a_pi05_folder(session_root, tmp_path):
    """recipes/pi05_24gb.toml (bf16 weights with stochastic rounding, 8-bit moments, the step inside backward, the
    joint layers checkpointed) trains a tiny pi0.5 folder LeRobot wrote for two steps: every weight bf16, the second
    step (from the saved moments) moves most of them, the moments of its large tensors saved as 8-bit codes
    (bit-exact resume of these optimizers: tests/test_optimizer_state.py)."""
    import torch

    args = ref061.train_args("pi05", session_root, tmp_path / "ds", recipe="recipes/pi05_24gb.toml")
    done = run_cli(*args, "--train.batch_size=2", "--train.steps=2", "--train.checkpoint_every=1",
                   f"--train.output_dir={tmp_path / 'run'}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    start, trained = ref061.trained(tmp_path / "run", 1), ref061.trained(tmp_path / "run", 2)
    assert {t.dtype for t in trained.values()} == {torch.bfloat16}
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=True)
    assert any(isinstance(v.get("exp_avg"), dict) for v in state["optimizer"]["state"].values())  # 8-bit codes
    moved = [k for k, v in trained.items() if not torch.equal(v, start[k])]  # the second step moved them
    assert len(moved) > len(trained) // 2, (len(moved), len(trained))
