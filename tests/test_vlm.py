"""Whole VLM folders (`model.vlm.pretrained`, models/vlm.py) mapped onto the components: a tiny random-init LLaVA
(CLIP tower read at layer -2, GELU connector, Llama) written by transformers with its tokenizer and a processor file
of its own mean / std. The VLA holds exactly the folder's weights, computes the image features and logits
transformers' LLaVA computes, trains, carries everything in its checkpoint, and refuses what it does not map in one
line."""

import json
import shutil

import numpy as np
import pytest
import torch

from vlaforge.errors import VlaforgeError
from vlaforge.models.build import build_vla
from vlaforge.models.vision import vision_blocks

from conftest import TINY_RECIPE, fit, make_batch, policy_grads, run_cli, tiny_config
from families import VLM_STATS, vlm_folder


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    return lambda name: vlm_folder(name, root)


@pytest.fixture(scope="module")
def llava(vlms):
    return vlms("llava")


def _cfg(folder, **model):
    return tiny_config(model={"vlm": {"pretrained": str(folder)}, **model})


def _reference(name, folder):
    import transformers

    cls = {"llava": "LlavaForConditionalGeneration", "paligemma": "PaliGemmaForConditionalGeneration",
           "idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration",
           "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[name]
    return getattr(transformers, cls).from_pretrained(folder).eval()


def _image_features(name, ref, images):
    """transformers' projected image features of (B, 3, H, W) images in [0, 255], as the VLM's own image processor
    and forward compute them."""
    if name in ("qwen2_vl", "qwen2_5_vl"):  # its processor's flattened 3-D patches and grid
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = ref.config.vision_config
        proc = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                        temporal_patch_size=vision.temporal_patch_size, do_resize=False,
                                        image_mean=VLM_STATS[0], image_std=VLM_STATS[1])
        given = proc(images=[im.permute(1, 2, 0).numpy().astype(np.uint8) for im in images], return_tensors="pt")
        out = ref.model.get_image_features(pixel_values=given["pixel_values"], image_grid_thw=given["image_grid_thw"])
        return torch.stack(list(out.pooler_output))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in VLM_STATS)
    pixels = (images / 255 - mean) / std
    if name == "llava":
        out = ref.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                           vision_feature_select_strategy="default", output_hidden_states=True)
        return torch.stack(list(out.pooler_output))
    if name in ("idefics3", "smolvlm"):  # one image per sample: (B, images, C, H, W)
        return torch.stack(list(ref.model.get_image_features(pixel_values=pixels[:, None]).pooler_output))
    return ref.model.get_image_features(pixel_values=pixels).pooler_output


CONNECTORS = {"llava": {"linear_1": "mlp.0", "linear_2": "mlp.2"}, "paligemma": {"linear": "mlp.0"},
              "idefics3": {"modality_projection.proj": "mlp.0"}, "smolvlm": {"modality_projection.proj": "mlp.0"},
              "qwen2_vl": {"ln_q": "norm"}, "qwen2_5_vl": {"ln_q": "norm"}}
TOWER = {"idefics3": "vision_model", "smolvlm": "vision_model", "qwen2_vl": "visual",
         "qwen2_5_vl": "visual"}  # the others' `vision_tower`
LANGUAGE = {"idefics3": "text_model", "smolvlm": "text_model"}  # the others' `language_model`
CONNECTOR = {"idefics3": "connector", "smolvlm": "connector", "qwen2_vl": "visual.merger",
             "qwen2_5_vl": "visual.merger"}  # the others' `multi_modal_projector`
# LLM tokens per 32-px frame: 4 x 4 patches (LLaVA, PaliGemma), merged 2 x 2 (Idefics3, SmolVLM, Qwen2-VL); Qwen2.5-VL
# has 4-px patches (8 x 8, merged to 16)
TOKENS = {"llava": 16, "paligemma": 16, "idefics3": 4, "smolvlm": 4, "qwen2_vl": 4, "qwen2_5_vl": 16}
VLMS = list(TOKENS)


@pytest.mark.parametrize("name", VLMS)
def test_a_vlm_folder_becomes_the_components_with_its_own_weights(vlms, name):
    folder = vlms(name)
    cfg = _cfg(folder, image_size=32)  # Qwen-VL towers have no native size
    model = build_vla(cfg.model, cfg.loss).eval()
    ref = _reference(name, folder)

    def connector(key):
        for theirs, ours in CONNECTORS[name].items():
            key = key.replace(f"{theirs}.", f"{ours}.")
        return key

    parts = {c: ref.model.get_submodule(table.get(name, default)) for c, table, default in
             (("vision", TOWER, "vision_tower"), ("llm", LANGUAGE, "language_model"),
              ("projector", CONNECTOR, "multi_modal_projector"))}
    language = {f"model.{k}": v for k, v in parts["llm"].state_dict().items()}
    folder_state = {"vision": parts["vision"].state_dict(), "llm": {**language, "lm_head.weight": ref.lm_head.weight},
                    "projector": {connector(k): v for k, v in parts["projector"].state_dict().items()}}
    for comp, want in folder_state.items():
        got = getattr(model, comp).state_dict()
        for k in (k for k in got if k != "logit_scale"):  # the contrastive temperature is vlaforge's
            assert torch.equal(got[k], want[k]), (comp, k)
    # LLaVA reads its 3-block tower at layer -2: the last block is not built
    assert len(vision_blocks(model.vision)) == 2
    assert model.layout.patches_per_frame == TOKENS[name]
    assert len(model.projector.mlp) == (3 if name in ("llava", "qwen2_vl", "qwen2_5_vl") else 1)

    images = torch.randint(0, 256, (2, 3, 32, 32)).float()
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        ours = model.encode_frames(images / 127.5 - 1)  # vlaforge's [-1, 1] input
        torch.testing.assert_close(ours, _image_features(name, ref, images), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.llm(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    model.train()
    losses = fit(model, make_batch(cfg, model, size=2), steps=3)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# what a checkpoint's backbones.json holds: the tower's blocks, the connector's shape, the language model's type
SAVED = {"llava": (2, {"hidden": 64, "layers": 2, "merge": 1, "bias": True, "norm": None, "order": "shuffle"}, "llama"),
         "qwen2_5_vl": (2, {"hidden": 128, "layers": 2, "merge": 2, "bias": True, "norm": "rms", "order": "units"},
                        "qwen2_5_vl_text")}


@pytest.mark.parametrize("name", list(SAVED))
def test_a_run_on_a_vlm_carries_its_tokenizer_and_configs_and_predicts_without_the_folder(vlms, name, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from vlaforge.inference.runtime import Observation, PolicyRuntime

    from fake_lerobot import write_dataset

    folder = shutil.copytree(vlms(name), tmp_path / name)
    write_dataset(tmp_path / "ds")
    run = tmp_path / "run"
    done = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={tmp_path / 'ds'}",
                   "--model.image_size=32", "--data.max_instruction_tokens=8", "--train.steps=2",
                   "--train.batch_size=2", "--train.progress=false", "--train.tensorboard=false",
                   f"--model.vlm.pretrained={folder}", f"--train.output_dir={run}")
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = run / "checkpoints" / "step_00000002"
    saved = json.loads((ckpt / "backbones.json").read_text())
    blocks, projector, lm = SAVED[name]
    tower = AutoConfig.for_model(**saved["vision"])
    assert tower.num_hidden_layers == blocks and saved["vision"]["image_mean"] == VLM_STATS[0]
    assert saved["projector"] == projector and saved["llm"]["model_type"] == lm
    assert AutoTokenizer.from_pretrained(ckpt / "tokenizer").get_vocab() == \
        AutoTokenizer.from_pretrained(folder).get_vocab()
    rt = PolicyRuntime.load(run, device="cpu")
    cams = [c.removeprefix("observation.images.") for c in rt.spec.cameras]
    g = np.random.default_rng(0)
    obs = Observation({c: g.integers(0, 256, (rt.spec.render_size, rt.spec.render_size, 3), dtype=np.uint8)
                       for c in cams}, np.zeros(len(rt.spec.state_mean), np.float32), "open the door")
    before = rt.predict(obs, "s").actions
    shutil.rmtree(folder)
    np.testing.assert_array_equal(PolicyRuntime.load(run, device="cpu").predict(obs, "s").actions, before)
    if name == "llava":  # a quantized copy carries the backbones' configs too (it loads without the folder)
        done = run_cli("quantize", str(run), "--out", str(tmp_path / "q"), "--frames", "8")
        assert done.returncode == 0, done.stderr[-2000:]
    if name == "qwen2_5_vl":  # its tower's windows follow its grid's values: no graph export, one line, exit 2
        done = run_cli("export", str(run), "--format", "onnx", "--out", str(tmp_path / "pkg"))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "qwen2_5_vl vision tower sizes its attention windows" in done.stderr
        assert not (tmp_path / "pkg").exists()


def test_checkpointing_a_qwen_vl_tower_and_text_model_gives_the_plain_gradients(vlms):
    """Full and selective checkpointing find the tower's `blocks` and their `attn` sub-layer (Qwen2.5-VL's windowed
    and full-attention blocks take sequence bounds as arguments) and the M-RoPE text model's blocks."""
    model = _cfg(vlms("qwen2_5_vl"), image_size=32).model.model_dump()
    ref = policy_grads(tiny_config(model=model))
    assert any(n.startswith("vision.blocks.") for n in ref) and any(n.startswith("projector.norm") for n in ref)
    for strategy in ("full", "selective"):
        policies = {c: {"checkpointing": strategy} for c in ("vision", "llm")}
        got = policy_grads(tiny_config(model=model, components=policies))
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-6, msg=f"{strategy}: {n}")


def test_qwen_vl_frames_get_the_multimodal_rope_positions_transformers_gives_consecutive_images(vlms):
    """Two frames of 2 x 2 merged tokens, an instruction padded in one row, three action queries: at every real
    token, the VLA's (temporal, height, width) positions equal Qwen2-VL's `get_rope_index` for the same sequence of
    two images and text; and the LLM's hidden states at the layout equal the VLM's language model given them."""
    import dataclasses

    folder = vlms("qwen2_vl")
    model = build_vla(_cfg(folder, image_size=32).model).eval()
    model.layout = dataclasses.replace(model.layout, frames=2)
    ref = _reference("qwen2_vl", folder)
    vision, text = 2 * 4, 5 + 3
    mask = torch.ones(2, vision + text, dtype=torch.bool)
    mask[1, vision + 3:vision + 5] = False  # the second row's instruction is 3 tokens
    ours = model.llm_positions(mask)
    ids = torch.randint(3, 300, mask.shape)
    ids[:, :vision] = ref.config.image_token_id
    # NOTE: get_rope_index reads a run of same-type tokens as one image; the second frame is typed a one-step
    # video, whose positions Qwen2-VL computes by the same rule (get_vision_position_ids), so the runs stay apart
    kinds = torch.zeros_like(ids)
    kinds[:, :4], kinds[:, 4:vision] = 1, 2
    grid = torch.tensor([[1, 4, 4]] * 2)  # a 4 x 4 patch grid per frame (2 x 2 tokens after the merger)
    theirs, _ = ref.model.get_rope_index(ids, kinds, image_grid_thw=grid, video_grid_thw=grid,
                                         attention_mask=mask.long())
    assert ours.shape == (3, 2, vision + text)
    assert torch.equal(ours[:, mask], theirs[:, mask])
    assert ours[:, 0, vision:].tolist() == [list(range(4, 12))] * 3  # frames' sides: 2 + 2, then 1-D text
    embeds = torch.randn(2, vision + text, 64)
    with torch.no_grad():
        got = model.llm.model(inputs_embeds=embeds, attention_mask=mask.long(), position_ids=ours).last_hidden_state
        want = ref.model.language_model(inputs_embeds=embeds, attention_mask=mask.long(),
                                        position_ids=theirs).last_hidden_state
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_what_a_vlm_folder_cannot_give_is_refused_in_one_line(llava, vlms, tmp_path):
    from families import family_folder

    with pytest.raises(VlaforgeError, match="model.vlm.pretrained gives the vision tower and the LLM both"):
        tiny_config(model={"vlm": {"pretrained": str(llava)}, "llm": {"pretrained": str(llava)}})
    lm = family_folder("llama", tmp_path)
    with pytest.raises(VlaforgeError, match="is a 'llama' folder; vlaforge maps these VLM families: llava"):
        build_vla(_cfg(lm).model)
    full = shutil.copytree(llava, tmp_path / "full")
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "vision_feature_select_strategy": "full"}))
    with pytest.raises(VlaforgeError, match="keeps the CLS token"):
        build_vla(_cfg(full).model)
    partial = shutil.copytree(llava, tmp_path / "partial")
    from safetensors.torch import load_file, save_file

    weights = load_file(partial / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "multi_modal_projector.linear_2" not in k},
              partial / "model.safetensors", metadata={"format": "pt"})
    missing = r"2 weights of the projector component are not in .* files \(mlp.2.bias, mlp.2.weight\)"
    with pytest.raises(VlaforgeError, match=missing):
        build_vla(_cfg(partial).model)
    qwen3 = shutil.copytree(vlms("qwen2_vl"), tmp_path / "qwen3")
    config = json.loads((qwen3 / "config.json").read_text())
    (qwen3 / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl"}))
    with pytest.raises(VlaforgeError, match="'qwen3_vl' folder, which vlaforge does not map: its DeepStack"):
        build_vla(_cfg(qwen3).model)
    with pytest.raises(VlaforgeError, match="model.image_size = 40 is not a multiple of .* use a multiple of 16"):
        build_vla(_cfg(vlms("qwen2_vl"), image_size=40).model)


def test_model_summary_of_a_vlm_folder_counts_its_components_from_the_config(llava, monkeypatch):
    import vlaforge.models.build as build
    from vlaforge.models.build import parameter_counts

    cfg = _cfg(llava)
    want = parameter_counts(build_vla(cfg.model, cfg.loss))
    done = run_cli("model", "summary", "--vlm", str(llava), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["components"]
    assert {c: rows[c]["params"] for c in want} == want
    monkeypatch.setattr(build, "load_weights", lambda *a, **k: pytest.fail("weights read in a fake build"))
    fake = build_vla(cfg.model, cfg.loss, fake=True)
    assert parameter_counts(fake) == want


# (family, image side, tower patches, LLM tokens per frame): SmolVLM's 8-px patches merged 2 x 2; Qwen2.5-VL's 4-px
# patches at 40 px, 5 x 5 merge units in 2 x 2-unit windows (the far ones smaller)
PLANNED = [("smolvlm", 64, 64, 16), ("qwen2_5_vl", 40, 100, 25)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["none", "full", "selective"])
@pytest.mark.parametrize("name, side, patches, tokens", PLANNED, ids=[p[0] for p in PLANNED])
def test_the_planner_counts_a_vlms_tower_and_merging_connector_exactly(vlms, name, side, patches, tokens, strategy,
                                                                       precision):
    """The planner's tower formulas (SigLIP's on SmolVLM's tower, over its patches with position ids per image;
    Qwen2.5-VL's windowed blocks with their RMSNorms, fused qkv, rotary and sequence bounds) and the connectors (one
    linear after the pixel shuffle; the RMSNorm + MLP merger) equal what a real step keeps for backward (real
    tensors: under fake ones Idefics3's tower builds an all-true patch mask a real run skips, and Qwen's tower reads
    its grid's values)."""
    from vlaforge.planner.activations import model_activation_bytes, sequence_of
    from vlaforge.techniques import accounting as memory
    from vlaforge.training.trainer import build_model

    comps = {c: {"checkpointing": strategy if c in ("vision", "llm") else "none", "precision": precision}
             for c in ("vision", "projector", "llm", "action_head")}
    cfg = tiny_config(model={"vlm": {"pretrained": str(vlms(name))}, "image_size": side}, components=comps)
    model, _ = build_model(cfg, torch.device("cpu"))
    batch = make_batch(cfg, model, size=2)
    with memory.count_saved(model) as acc:
        model.compute_loss(batch)
    want = model_activation_bytes(model, sequence_of(model, batch), dict(cfg.components.items()))
    got = acc.per_component(memory.DEVICE)
    assert sequence_of(model, batch).tower_patches == patches and model.layout.patches_per_frame == tokens
    assert (want["vision"], want["projector"]) == (got["vision"], got["projector"])


@pytest.mark.parametrize("policy", [{"checkpointing": "none"}, {"checkpointing": "full"},
                                    {"checkpointing": "selective"}, {"trainable": False}],
                         ids=["none", "full", "selective", "frozen"])
def test_the_planners_flops_of_a_qwen_vl_step_equal_the_flop_counter(vlms, policy):
    """Qwen2.5-VL's tower (a Conv3d over the repeated frame, SwiGLU, attention within windows - edge windows
    smaller - and full attention in `fullatt_block_indexes`) and its merger: forward and backward (recomputation
    included) matmul FLOPs equal torch's FlopCounterMode on the real modules."""
    from torch.utils.flop_counter import FlopCounterMode

    from vlaforge.planner.activations import sequence_of
    from vlaforge.planner.throughput import step_flops
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.training.trainer import build_model

    cfg = tiny_config(model={"vlm": {"pretrained": str(vlms("qwen2_5_vl"))}, "image_size": 40},
                      components={"vision": policy})
    model, _ = build_model(cfg, torch.device("cpu"))
    apply_freezing(model, dict(cfg.components.items()), 0)
    batch = make_batch(cfg, model, size=2)
    with FlopCounterMode(display=False) as forward:
        loss, _ = model.compute_loss(batch)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    flops = step_flops(model, sequence_of(model, batch), dict(cfg.components.items()),
                       model.objective.active("contrastive"))
    assert sum(flops.forward.values()) == forward.get_total_flops()
    assert sum(flops.backward.values()) + sum(flops.recompute.values()) == backward.get_total_flops()
