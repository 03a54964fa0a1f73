"""Pretrained backbones of every LLM family (tests/families.py): each loads into the VLA exactly as transformers
loads it and trains; a folder whose weights would not all load is refused in one line (never a random tower in its
place); a checkpoint carries its backbones' configs and tokenizer and predicts after the folders are gone; the
techniques that do not cover a family's feature say so (context parallel and sliding windows, fp8 / quantization
and MoE experts); planning builds never read a folder's weights."""

import json
import shutil

import numpy as np
import pytest
import torch

from vlaforge.config.loading import load_config
from vlaforge.errors import VlaforgeError
from vlaforge.models.build import build_vla

from conftest import TINY_RECIPE, fit, make_batch, run_cli, tiny_config
from families import FAMILIES, family_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("backbones")


def _cfg(root, name):
    return tiny_config(model={"llm": {"pretrained": str(family_folder(name, root))}})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_loads_as_transformers_loads_it_and_trains(root, name):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(root, name)
    model = build_vla(cfg.model, cfg.loss)
    folder = family_folder(name, root)
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager" if name == "gemma2" else "sdpa")
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.llm.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    model.train()
    losses = fit(model, make_batch(cfg, model, size=2), steps=3)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def _save_tower(out, head=False):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=32, patch_size=8,
                                         vision_use_head=head)).save_pretrained(out)
    return out


def test_a_folder_that_would_not_load_is_refused_in_one_line(tmp_path):
    """A folder whose config names another family than its weights (a DINOv2 relabelled CLIP), a folder missing
    weights, a config edited away from its weights: each one line naming the problem, never a randomly initialised
    module trained in its place."""
    from safetensors.torch import load_file, save_file

    from families import tower_folder

    relabelled = shutil.copytree(tower_folder("dinov2", tmp_path), tmp_path / "relabelled")
    config = json.loads((relabelled / "config.json").read_text())
    (relabelled / "config.json").write_text(json.dumps({**config, "model_type": "clip_vision_model"}))
    cases = {"relabelled": "of the .* weights of the CLIPVisionModel .* are not in its files"}
    partial = _save_tower(tmp_path / "partial")
    weights = load_file(partial / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.0.mlp" not in k}, partial / "model.safetensors",
              metadata={"format": "pt"})
    cases["partial"] = "4 of the .* are not in its files .*encoder.layers.0.mlp"
    edited = _save_tower(tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    cases["edited"] = "do not match the shapes its config.json gives"
    for folder, message in cases.items():
        cfg = tiny_config(model={"vision": {"pretrained": str(tmp_path / folder)}})
        with pytest.raises(VlaforgeError, match=f"^model.vision.pretrained: [^\n]*{message}[^\n]*$"):
            build_vla(cfg.model, cfg.loss)
    llm = family_folder("llama", tmp_path)  # an LLM folder where the vision tower is asked for
    cfg = tiny_config(model={"vision": {"pretrained": str(llm)}})
    with pytest.raises(VlaforgeError, match="^model.vision.pretrained: .* is a 'llama' folder, not a vision tower"):
        build_vla(cfg.model, cfg.loss)


def test_a_family_without_sdpa_gets_eager_attention_with_a_notice(root, capsys):
    cfg = _cfg(root, "gemma2")
    model = build_vla(cfg.model, cfg.loss)
    assert model.llm.config._attn_implementation == "eager"
    assert "gemma2 has no SDPA attention in transformers: using eager attention" in capsys.readouterr().out


def test_planning_builds_never_read_a_folders_weights(root, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor

    import vlaforge.models.llm
    import vlaforge.models.vision
    from vlaforge.planner.types import PlanModel

    from families import tower_folder

    for module in (vlaforge.models.llm, vlaforge.models.vision):  # where the builders call it
        monkeypatch.setattr(module, "load_pretrained", lambda *a, **k: pytest.fail("weights read in a fake build"))
    for name in ("qwen3", "phi"):
        cfg = _cfg(root, name)
        model = build_vla(cfg.model, cfg.loss, fake=True)
        assert all(isinstance(p, FakeTensor) for p in model.parameters())
        assert model.llm.config.model_type == name
    cfg = tiny_config(model={"llm": {"pretrained": str(family_folder("mistral", root))},
                             "vision": {"pretrained": str(tower_folder("siglip", root))}})
    assert PlanModel(cfg).model.llm.config.model_type == "mistral"  # `vlaforge plan`'s build


def test_converters_name_the_mixture_of_experts_weights_they_skip(root):
    from vlaforge.techniques.fp8 import convert_fp8
    from vlaforge.techniques.quantize import QuantPolicy, layer_plan

    cfg = _cfg(root, "qwen3_moe")
    model = build_vla(cfg.model, cfg.loss)
    experts = {f"llm.model.layers.{i}.mlp.experts" for i in range(2)}
    _, skipped = layer_plan(model, "llm", QuantPolicy("int8"))
    assert experts <= set(skipped) and "mixture-of-experts" in skipped[min(experts)]
    report = convert_fp8(model.llm, "tensorwise")
    assert {e.removeprefix("llm.") for e in experts} <= set(report.skipped)


def test_a_layout_the_family_cannot_run_is_refused_before_any_process_group(root):
    from vlaforge.distributed.parallel_dims import World, check_layout

    folder = family_folder("qwen3_moe", root)
    for args, message in ((["--parallel.tp=2"], "tensor parallel does not run; use tp = 1"),
                          (["--parallel.cp=2"], None)):
        cfg = load_config(TINY_RECIPE, [f"--model.llm.pretrained={folder}", *args])
        if message is None:
            check_layout(cfg, World(0, 0, 2))  # context parallel splits the sequence: no head count stops it
        else:
            with pytest.raises(VlaforgeError, match=message):
                check_layout(cfg, World(0, 0, 2))
    gemma2 = family_folder("gemma2", root)  # soft-cap and window: every cp kernel computes them (test_families.py)
    for method in ("ring", "allgather", "ulysses"):
        check_layout(load_config(TINY_RECIPE, [f"--model.llm.pretrained={gemma2}", "--parallel.cp=2",
                                               f"--parallel.cp_method={method}"]), World(0, 0, 2))


def test_tensor_parallel_plans_come_from_the_family(root):
    from transformers import AutoConfig

    from vlaforge.models.families import tp_plan

    plans = {n: tp_plan(AutoConfig.from_pretrained(family_folder(n, root))) for n in ("qwen3", "phi3", "gpt_neox")}
    assert plans["qwen3"]["self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert plans["phi3"] == {"self_attn.qkv_proj": "colwise_gather_output", "self_attn.o_proj": "rowwise_split_input",
                             "mlp.gate_up_proj": "colwise_gather_output", "mlp.down_proj": "rowwise_split_input"}
    assert "embed_in" not in plans["gpt_neox"] and plans["gpt_neox"]["attention.query_key_value"] == "colwise"
    with pytest.raises(VlaforgeError, match="mixture-of-experts"):
        tp_plan(AutoConfig.from_pretrained(family_folder("qwen3_moe", root)))


def _train_on_robot_data(tmp_path, folder, name="run", *extra):
    from fake_lerobot import write_dataset

    if not (tmp_path / "ds").is_dir():
        write_dataset(tmp_path / "ds")
    run = tmp_path / name
    done = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={tmp_path / 'ds'}",
                   "--model.image_size=32", "--data.max_instruction_tokens=8", "--train.steps=2",
                   "--train.batch_size=2", "--train.progress=false", "--train.tensorboard=false",
                   f"--model.llm.pretrained={folder}", f"--train.output_dir={run}", *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


def test_a_checkpoint_predicts_after_its_pretrained_folders_are_deleted(root, tmp_path):
    """The run saves the LLM's tokenizer and both towers' configs (backbones.json) with its weights."""
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    from families import tower_folder

    folder = shutil.copytree(family_folder("gemma", root), tmp_path / "gemma")  # tied embeddings
    tower = shutil.copytree(tower_folder("dinov2_with_registers", root), tmp_path / "dinov2")  # CLS + registers
    run = _train_on_robot_data(tmp_path, folder, "run", f"--model.vision.pretrained={tower}")
    ckpt = run / "checkpoints" / "step_00000002"
    saved = json.loads((ckpt / "backbones.json").read_text())
    assert (saved["llm"]["model_type"], saved["vision"]["model_type"]) == ("gemma", "dinov2_with_registers")
    rt = PolicyRuntime.load(run, device="cpu")
    spec = rt.spec
    cams = [c.removeprefix("observation.images.") for c in spec.cameras]
    g = np.random.default_rng(0)
    obs = Observation({c: g.integers(0, 256, (spec.render_size, spec.render_size, 3), dtype=np.uint8) for c in cams},
                      np.zeros(len(spec.state_mean), np.float32), "open the door")
    before = rt.predict(obs, "s").actions
    shutil.rmtree(folder)
    shutil.rmtree(tower)
    after = PolicyRuntime.load(run, device="cpu").predict(obs, "s").actions
    np.testing.assert_array_equal(before, after)


def test_an_onnx_package_of_a_sliding_window_model_is_exact_or_refused(root, tmp_path):
    """Mistral attends through an 8-token window on a longer sequence: the package either reproduces it or the
    export fails with one line and writes nothing."""
    run = _train_on_robot_data(tmp_path, family_folder("mistral", root))
    out = tmp_path / "package"
    done = run_cli("export", str(run), "--format=onnx", f"--out={out}", "--frames=4")
    if done.returncode == 0:
        report = json.loads((out / "export.json").read_text())
        assert report["action_error"]["max_abs_normalized"] <= 1e-3, report["action_error"]
    else:
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "actions are not the checkpoint's" in done.stderr and not out.exists()


def test_the_planner_counts_llama_shaped_families_exactly(root):
    """Mistral's, Qwen2's and Qwen3's blocks are Llama's (a window, biases, per-head q/k norms): the planner's
    formula counts them (no measured rows) and its activation bytes equal the fake-tensor count. The other families
    plan from measured rows (tests/test_planner_families.py)."""
    from vlaforge import COMPONENTS
    from vlaforge.planner.measure import side_by_side
    from vlaforge.planner.types import PlanModel

    for name in ("mistral", "qwen2", "qwen3"):
        for strategy in ("none", "selective"):
            comps = {c: {"precision": "bf16"} | ({"checkpointing": strategy} if c in ("vision", "llm") else {})
                     for c in COMPONENTS}
            cfg = tiny_config(model={"llm": {"pretrained": str(family_folder(name, root))}}, components=comps)
            assert PlanModel(cfg).measured is None
            llm = side_by_side(cfg, 2)["by_component"]["llm"]  # `vlaforge plan --measure`'s comparison
            assert llm["analytic"] == llm["measured"], (name, strategy, llm)


def test_model_attn_implementation_picks_the_kernel_of_both_towers(root):
    """eager gives the same logits and patch tokens as sdpa (float noise), on a pretrained folder and on a checkpoint's
    rebuild from its saved configs."""
    from vlaforge.models.build import backbone_configs
    from vlaforge.models.llm import SDPA_NO_HOST_READ

    from families import tower_folder

    models = {}
    for attn in ("sdpa", "eager"):
        cfg = tiny_config(model={"llm": {"pretrained": str(family_folder("qwen2", root))},
                                 "vision": {"pretrained": str(tower_folder("clip", root))},
                                 "attn_implementation": attn})
        models[attn] = build_vla(cfg.model, cfg.loss).eval()
        rebuilt = build_vla(cfg.model, cfg.loss, backbones=backbone_configs(models[attn], cfg.model))
        for model in (models[attn], rebuilt):  # the LLM's SDPA under vlaforge's name (no host read of its mask)
            assert model.llm.config._attn_implementation == {"sdpa": SDPA_NO_HOST_READ}.get(attn, attn)
            assert model.vision.config._attn_implementation == attn
    from vlaforge.models.vision import tower_features

    ids, pixels = torch.randint(3, 300, (2, 9)), torch.randn(2, 3, 32, 32)
    eager, sdpa = models["eager"], models["sdpa"]
    with torch.no_grad():
        torch.testing.assert_close(eager.llm(input_ids=ids).logits, sdpa.llm(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tower_features(eager.vision, pixels, False),
                                   tower_features(sdpa.vision, pixels, False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_fake_measurement_of_a_pretrained_folder_counts_what_the_planner_counts(root, monkeypatch, precision):
    """`plan --measure` / `profile --fake` build under their own fake-tensor mode: a pretrained LLM is built from its
    config (its files are not read: weights loaded into fake tensors were not the parameters the forward saw, and
    fp32 runs counted every linear weight as an activation: 0.73 of the planner before), so the planner's LLM bytes
    equal the fake-tensor count."""
    import vlaforge.models.llm as llm_module
    from vlaforge.planner.measure import side_by_side

    monkeypatch.setattr(llm_module, "load_pretrained", lambda *a, **k: pytest.fail("weights read in a fake build"))
    comps = {c: {"precision": precision} for c in ("vision", "projector", "llm", "action_head")}
    cfg = tiny_config(model={"llm": {"pretrained": str(family_folder("llama", root))}}, components=comps)
    rows = side_by_side(cfg, 2)["by_component"]
    assert rows["llm"]["analytic"] == rows["llm"]["measured"]
