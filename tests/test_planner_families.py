"""The planner plans every family vlaforge trains (issue 59): each LLM family of tests/families.py and each vision
tower family (the fused tower too) plans from a tiny `save_pretrained` folder, its activation bytes taken from
measured rows (`planner/measured.py`) where no formula counts its blocks exactly, and equal to a fake-tensor count of
a real step at another sequence length than the one the rows were measured at (bench/planner_families.py runs every
checkpointing strategy at two lengths and deeper models). Every folder holds its family's own config fields only
(`families.family_config`), and the LLM's dimensions are read through its family's (`models.families.llm_dims`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError

from conftest import TINY_RECIPE, run_cli, tiny_config
from families import FAMILIES, VISION_FAMILIES, family_folder, save_causal_lm, tower_folder

MEASURED_LLMS = sorted(set(FAMILIES) - {"llama", "qwen2", "qwen3", "mistral"})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("planner_families")


def _config(section: dict, comp: str, strategy: str, length: int | None = None):
    comps = {c: {"precision": "bf16"} for c in COMPONENTS}
    comps[comp]["checkpointing"] = strategy
    return tiny_config(model=section, components=comps,
                       data={"max_instruction_tokens": length} if length else {})


def _counted(cfg, comp: str) -> int:
    """What a real step of `cfg`'s model keeps for backward in `comp`, counted under fake tensors at batch 2: the
    measured side of `vlaforge plan --measure` (planner/measure.py `side_by_side`, whose analytic side would measure
    rows of its own at this length)."""
    import torch

    from vlaforge.models.build import synthetic_batch
    from vlaforge.models.fake import fake_build
    from vlaforge.techniques import accounting as memory
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.training.trainer import build_model

    with fake_build():
        model, _ = build_model(cfg, torch.device("cpu"))
        apply_freezing(model, dict(cfg.components.items()), 0)
        batch = synthetic_batch(cfg, model, 2)
        with memory.count_saved(model) as acc:
            model.compute_loss(batch)
    return sum(acc.per_component(place).get(comp, 0) for place in (memory.DEVICE, memory.CPU, memory.NVME))


def _planned_over_counted(pm, section: dict, comp: str, strategy: str) -> float:
    """Planned / fake-tensor-counted activation bytes of `comp` under `strategy` at 40 instruction tokens, the plan
    model `pm`'s rows measured at the recipe's instruction length (one PlanModel serves every strategy: its rows are
    measured per strategy on first use, as a search asks them)."""
    from vlaforge.planner.activations import model_activation_bytes

    cfg = _config(section, comp, strategy, 40)
    planned = model_activation_bytes(pm.model, replace(pm.seq, batch=2, instruction=40),
                                     dict(cfg.components.items()), pm.contrastive, "fp32", measured=pm.measured)
    return planned[comp] / _counted(cfg, comp)


@pytest.mark.parametrize("name", MEASURED_LLMS)
def test_every_llm_family_plans_from_measured_blocks(root, name):
    """OLMo2, Gemma / Gemma2 / Gemma3, Phi3, Phi, GPT-NeoX and Qwen3-MoE (its routed experts through transformers'
    grouped-matmul fallback under fake tensors): measured rows equal the count at another length, none and
    selective; a plan on one GPU recommends a configuration."""
    from vlaforge.planner.hardware import CATALOG
    from vlaforge.planner.search import search
    from vlaforge.planner.types import Cluster, PlanModel

    section = {"llm": {"pretrained": str(family_folder(name, root))}}
    pm = PlanModel(_config(section, "llm", "none"))
    assert pm.measured_components == ("llm",)
    for strategy in ("none", "selective"):
        ratio = _planned_over_counted(pm, section, "llm", strategy)
        assert abs(ratio - 1.0) <= 0.02, (name, strategy, ratio)
    plan = search(pm, Cluster(CATALOG["h100-80"], gpus_per_node=1), 8)
    assert plan.best is not None and plan.best.fits


@pytest.mark.parametrize("name", [*sorted(set(VISION_FAMILIES) - {"siglip"}), "fused"])
def test_every_vision_tower_plans_from_measured_blocks(root, name):
    """CLIP, DINOv2 (with registers), SigLIP2 (its position resize with transformers' value checks off under fake
    tensors) and the fused DINOv2-with-registers + SigLIP tower: measured rows equal the count, none and full."""
    from vlaforge.planner.types import PlanModel

    if name == "fused":
        section = {"vision": {"pretrained": str(tower_folder("dinov2_with_registers", root)),
                              "fused": str(tower_folder("siglip", root))}}
    else:
        section = {"vision": {"pretrained": str(tower_folder(name, root))}}
    pm = PlanModel(_config(section, "vision", "none"))
    assert pm.measured_components == ("vision",)
    for strategy in ("none", "full"):
        ratio = _planned_over_counted(pm, section, "vision", strategy)
        assert abs(ratio - 1.0) <= 0.02, (name, strategy, ratio)


def test_a_measured_llm_refuses_sharded_layouts_and_plans_the_rest(root, tmp_path):
    """`vlaforge plan` on a Gemma3 folder exits 0 with a plan; pinning tensor parallel, which the measured rows do
    not divide, is refused in one line naming it."""
    recipe = tmp_path / "gemma3.toml"
    recipe.write_text(f'[model.llm]\npretrained = "{family_folder("gemma3_text", root)}"\n')
    done = run_cli("plan", f"--model={recipe}", "--gpu=h100-80", "--gpus-per-node=2", "--global-batch=8")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "best:" in done.stdout
    done = run_cli("plan", f"--model={recipe}", "--gpu=h100-80", "--gpus-per-node=2", "--global-batch=8",
                   "--fix", "parallel.tp=2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "measures this LLM's blocks whole and does not divide them for tensor parallel" in done.stderr


def test_llm_dims_read_only_the_familys_own_fields():
    """GPT-NeoX declares no kv heads (multi-head) and no head dim; a stray key in its config.json changes nothing in
    the model transformers builds, so nothing in the plan; a dimension a family lacks is refused in one line."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    from vlaforge.models.families import llm_dims

    neox = llm_dims(GPTNeoXConfig(hidden_size=128, num_attention_heads=4, intermediate_size=512))
    assert (neox.heads, neox.kv_heads, neox.head_dim) == (4, 4, 32)
    assert llm_dims(GPTNeoXConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)).kv_heads == 4
    llama = llm_dims(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    assert (llama.kv_heads, llama.head_dim) == (2, 32)
    with pytest.raises(VlaforgeError, match="^the llm's gpt2 config .* has no intermediate_size"):
        llm_dims(GPT2Config())


def test_plan_on_a_gpt_neox_folder_saved_by_transformers(tmp_path):
    """Issue 76: a GPT-NeoX folder as `GPTNeoXForCausalLM.save_pretrained` writes it (2 layers, width 128, 4 heads,
    parallel residual, rotary on a quarter of each head: transformers 5's `partial_rotary_factor`) as
    model.llm.pretrained over the tiny recipe's SigLIP tower: `vlaforge plan` exits 0 with a plan (its config has no
    num_key_value_heads, which the planner used to read: an AttributeError traceback)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                           vocab_size=320, use_parallel_residual=True, rope_parameters={
                               "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    folder = save_causal_lm(GPTNeoXForCausalLM(config), tmp_path / "neox")
    assert "num_key_value_heads" not in (folder / "config.json").read_text()
    recipe = tmp_path / "neox.toml"
    recipe.write_text(f'base = "{TINY_RECIPE}"\n[model.llm]\npretrained = "{folder}"\n')
    done = run_cli("plan", f"--model={recipe}", "--gpu=h100-80", "--gpus-per-node=1", "--global-batch=8")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "best:" in done.stdout


def test_a_block_the_planner_cannot_measure_is_refused_naming_its_type(root, monkeypatch):
    """A module whose forward fake tensors cannot run (here: one that reads a value) is refused in one line naming
    the block type, never a traceback or a zero row."""
    import transformers.models.phi.modeling_phi as phi

    from vlaforge.planner.types import PlanModel

    def reads_a_value(self, hidden_states, *args, **kwargs):
        return hidden_states * float(hidden_states.sum())  # a host read: no value under fake tensors

    monkeypatch.setattr(phi.PhiMLP, "forward", reads_a_value)
    pm = PlanModel(_config({"llm": {"pretrained": str(family_folder("phi", root))}}, "llm", "none"))
    with pytest.raises(VlaforgeError, match="^the planner could not measure the PhiDecoderLayer blocks under fake "
                                            "tensors"):
        pm.measured.rows("llm", "none", "bf16", "fp32")
