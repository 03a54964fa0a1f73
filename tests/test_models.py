import json

import pytest
import torch

from vlaforge import COMPONENTS
from vlaforge.config import load_config
from vlaforge.config.flavors import FLAVORS
from vlaforge.errors import VlaforgeError
from vlaforge.models.build import build_vla, parameter_counts

from conftest import fit, make_batch, run_cli, tiny_config


@pytest.mark.parametrize("head", ["regression", "flow_matching"])
def test_shapes_and_loss_for_every_action_head(tmp_path, head):
    flow = {"flow_steps": 3} if head == "flow_matching" else {}
    cfg = tiny_config(tmp_path, model={"action_head": {"kind": head, **flow}, "frames": 2})
    model = build_vla(cfg.model, cfg.loss)
    assert [n for n, _ in model.named_children()] == list(COMPONENTS)
    batch = make_batch(cfg, model, size=3).validate()
    f = cfg.model.frames_per_sample
    assert batch.images.shape == (3, f, 3, 64, 64)
    loss, metrics = model.compute_loss(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"loss/action", "loss/contrastive", "loss/language", "loss/total"} <= set(metrics)
    loss.backward()
    for name in COMPONENTS:
        grads = [p.grad for p in getattr(model, name).parameters() if p.requires_grad]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), name
    model.eval()
    batched = model.predict_actions(batch)
    assert batched.shape == (3, cfg.model.action_chunk, cfg.model.action_dim)
    single = model.predict_actions(type(batch)(batch.images[0], batch.state[0], batch.instruction_ids[0],
                                               batch.instruction_mask[0]))
    assert single.shape == (cfg.model.action_chunk, cfg.model.action_dim)


def test_text_targets_do_not_change_action_queries(tmp_path):
    """Language targets sit after the action queries: under causal attention the actions are unchanged."""
    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss).eval()
    batch = make_batch(cfg, model, size=2)
    with torch.no_grad():
        with_text = model.run_llm(batch, with_text=True)["action_hidden"]
        without = model.run_llm(batch, with_text=False)["action_hidden"]
    torch.testing.assert_close(with_text, without, atol=1e-5, rtol=1e-5)


def test_compute_loss_decreases_on_fixed_batch(tmp_path):
    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    losses = fit(model, make_batch(cfg, model, size=8), steps=50)
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def _tiny_hf_folders(tmp_path, vision_head: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(1)
    vision = SiglipVisionModel(SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                                  num_attention_heads=4, image_size=32, patch_size=8,
                                                  vision_use_head=vision_head)).eval()
    llm = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=300)).eval()
    vision.save_pretrained(tmp_path / "siglip")
    llm.save_pretrained(tmp_path / "llama")
    return vision, llm


@pytest.mark.parametrize("vision_head", [False, True])
def test_pretrained_folders_match_transformers(tmp_path, vision_head):
    ref_vision, ref_llm = _tiny_hf_folders(tmp_path, vision_head)
    cfg = tiny_config(tmp_path, model={"vision": {"pretrained": str(tmp_path / "siglip")},
                                       "llm": {"pretrained": str(tmp_path / "llama")}})
    model = build_vla(cfg.model, cfg.loss).eval()
    assert model.layout.image_size == 32 and model.layout.patches_per_frame == 16
    pixels = torch.randn(2, 1, 3, 32, 32)
    ids = torch.randint(0, 300, (2, 7))
    seen = {}
    model.projector.register_forward_hook(lambda m, args, out: seen.update(features=args[0]))
    with torch.no_grad():
        model.embed_images(pixels)
        expected = ref_vision(pixel_values=pixels[:, 0]).last_hidden_state
        torch.testing.assert_close(seen["features"], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.llm(input_ids=ids).logits, ref_llm(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert not any(n.startswith("vision.head") for n, _ in model.named_parameters())
    loss, _ = model.compute_loss(make_batch(cfg, model, size=2))
    assert torch.isfinite(loss)


def test_missing_and_malformed_pretrained_folders(tmp_path):
    cfg = tiny_config(tmp_path, model={"llm": {"pretrained": str(tmp_path / "nope")}})
    with pytest.raises(VlaforgeError, match="model.llm.pretrained: .* is not a folder"):
        build_vla(cfg.model)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    cfg = tiny_config(tmp_path, model={"vision": {"pretrained": str(bad)}})
    with pytest.raises(VlaforgeError, match="not valid JSON"):
        build_vla(cfg.model)
    (bad / "config.json").write_text("{}")
    with pytest.raises(VlaforgeError, match="no weight files"):
        build_vla(cfg.model)


@pytest.mark.parametrize("flavor", FLAVORS.names())
def test_every_flavor_builds_under_fake_tensors(flavor):
    from torch._subclasses.fake_tensor import FakeTensor

    cfg = load_config(None, {"model": {"flavor": flavor}})
    model = build_vla(cfg.model, fake=True)
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    counts = parameter_counts(model)
    for component, nominal in FLAVORS.get(flavor).nominal_params.items():
        assert abs(counts[component] - nominal) / nominal < 0.02, (component, counts[component], nominal)


def test_model_summary_cli_vla_70b():
    proc = run_cli("model", "summary", "vla-70b", "--json", fresh=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    rows = summary["components"]
    assert abs(rows["llm"]["params"] / 70e9 - 1) < 0.02
    assert abs(rows["vision"]["params"] / 3e9 - 1) < 0.02
    assert rows["total"]["params"] == sum(rows[c]["params"] for c in COMPONENTS)
    assert rows["total"]["bf16_bytes"] == 2 * rows["total"]["params"]


@pytest.mark.parametrize("flavor, components, lerobot_total", [
    ("pi0", {"vision": 412_442_352, "projector": 2_361_344, "llm": 2_508_531_712, "action_head": 314_713_120},
     3_501_372_176),  # + the action expert's LM head (257,152 x 1,024), which LeRobot builds and never calls
    # pi0.5: pi0's VLM; the expert's norms are adaRMS (a width -> 3 x width dense each, no weight), no state
    # projection, one time MLP (width -> width twice) in place of pi0's action-time MLP
    ("pi05", {"vision": 412_442_352, "projector": 2_361_344, "llm": 2_508_531_712, "action_head": 430_098_464},
     3_616_757_520),
    ("smolvla", {"vision": 86_433_024, "projector": 11_796_480, "llm": 251_935_680, "action_head": 99_880_992}, None),
])
def test_lerobot_policy_flavors_are_the_policies_at_their_published_sizes(flavor, components, lerobot_total):
    """`pi0`, `pi05` and `smolvla` are LeRobot's architectures (VLM + action expert) at LeRobot 0.6.1's defaults,
    built under fake tensors: pi0 3,238,048,528 parameters (3,501,372,176 in LeRobot), pi0.5 3,353,433,872
    (3,616,757,520 in LeRobot), SmolVLA 450,046,176 (LeRobot's module built from the same configs on the meta device
    counts the same, PaliGemma's LM head counted once with the embeddings it is tied to in vlaforge)."""
    from vlaforge.models.policies.model import PolicyVLA

    model = build_vla(load_config(None, {"model": {"flavor": flavor}}).model, fake=True)
    assert isinstance(model, PolicyVLA) and model.spec.family == flavor
    proc = run_cli("model", "summary", flavor, "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["policy"] == flavor and summary["description"].startswith("LeRobot's")
    assert {c: summary["components"][c]["params"] for c in COMPONENTS} == components
    assert summary["components"]["total"]["params"] == sum(components.values())
    assert summary.get("lerobot", {}).get("total") == lerobot_total
    if lerobot_total:
        from vlaforge.models.summary import render_summary

        assert f"{lerobot_total:,} parameters in LeRobot" in render_summary(summary)


@pytest.mark.parametrize("args, flavor", [  # (`vlaforge plan` plans them: tests/test_lerobot_policy_techniques.py)
    (("profile", "--fake", "--model.flavor=pi0"), "pi0"),
    (("train", "recipes/tiny_synthetic.toml", "--model.flavor=smolvla"), "smolvla"),
    (("profile", "--fake", "--model.flavor=pi05"), "pi05"),
    (("train", "recipes/tiny_synthetic.toml", "--model.flavor=pi05"), "pi05"),
], ids=["profile", "train", "profile-pi05", "train-pi05"])
def test_what_cannot_handle_a_policy_flavor_refuses_it_naming_the_vlm_flavor(args, flavor, tmp_path):
    proc = run_cli(*args, f"--train.output_dir={tmp_path / 'run'}" if args[0] == "train" else "--json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    vlm = FLAVORS.get(flavor).vlm_flavor  # pi0.5's VLM is pi0's: pi0_vlm
    assert "\n" not in line and f"'{flavor}' is LeRobot's" in line and vlm in line, line
    assert not (tmp_path / "run").exists()


def test_prediction_path_equals_the_training_forward(tmp_path):
    """`predict_actions` (vision tokens -> LLM body -> head; padding trimmed, no logits) gives the actions the
    training forward's LLM pass gives to the head, with and without instruction padding."""
    cfg = tiny_config(tmp_path, model={"frames": 2})
    model = build_vla(cfg.model, cfg.loss).eval()
    batch = make_batch(cfg, model, size=3)
    batch.instruction_mask[1, 5:] = 0  # one row padded
    with torch.no_grad():
        want = model.action_head(model.run_llm(batch, with_text=False)["action_hidden"], batch.state)
        torch.testing.assert_close(model.predict_actions(batch), want, atol=1e-5, rtol=1e-5)
        full = batch.instruction_mask.clone().fill_(1)
        tokens = model.embed_images(batch.images)
        no_mask = model.actions_from_tokens(tokens, batch.instruction_ids, None, batch.state)
        torch.testing.assert_close(no_mask, model.actions_from_tokens(tokens, batch.instruction_ids, full,
                                                                      batch.state), atol=1e-5, rtol=1e-5)


def test_a_conv_stem_replaces_only_the_patch_embedding_and_ends_on_the_same_grid():
    from vlaforge.models.vision import ConvStem

    patch, conv = (build_vla(tiny_config(model={"vision_stem": s}).model) for s in ("patch", "conv"))
    stem = conv.vision.embeddings.patch_embedding
    assert isinstance(stem, ConvStem) and len([m for m in stem.stages if isinstance(m, torch.nn.Conv2d)]) == 4
    names = lambda m: {n for n, _ in m.vision.named_parameters() if "patch_embedding" not in n}
    assert names(patch) == names(conv)  # the SigLIP tower's names, loading and FSDP units are unchanged
    pixels = torch.rand(3, 3, patch.layout.image_size, patch.layout.image_size)
    a, b = patch.encode_frames(pixels), conv.encode_frames(pixels)
    assert a.shape == b.shape and conv.layout.patches_per_frame == patch.layout.patches_per_frame
    b.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in stem.parameters())
    counts = parameter_counts(conv)["vision"] - parameter_counts(patch)["vision"]
    assert counts == sum(p.numel() for p in stem.parameters()) - sum(
        p.numel() for p in patch.vision.embeddings.patch_embedding.parameters())


def test_a_conv_stem_is_refused_where_it_cannot_apply():
    from vlaforge.errors import ConfigError

    with pytest.raises(ConfigError, match="a pretrained tower keeps its own"):
        load_config(None, ["--model.vision_stem=conv", "--model.vision.pretrained=/a"])
    with pytest.raises(ConfigError, match="power of 2, not 12"):
        load_config(None, ["--model.vision_stem=conv", "--model.image_size=48", "--model.patch_size=12"])


@pytest.mark.parametrize("head", ["regression", "flow_matching"])
def test_state_dropout_zeroes_the_state_of_drawn_training_samples_and_one_removes_it(tmp_path, head):
    """state_dropout p: in training each sample's state is zeroed with probability p (a dropped row embeds as a
    zero state, a kept row as its own state); at inference the state is read unless p = 1."""
    def actions(model, state):
        hidden = torch.randn(state.shape[0], model.action_head.chunk, model.action_head.queries.shape[-1],
                             generator=torch.Generator().manual_seed(0))
        torch.manual_seed(1)  # the flow head's noise
        return model.action_head(hidden, state)

    flow = {"flow_steps": 2} if head == "flow_matching" else {}
    cfg = tiny_config(tmp_path, model={"action_head": {"kind": head, **flow, "state_dropout": 0.5}})
    model = build_vla(cfg.model, cfg.loss).eval()
    head_ = model.action_head
    state = torch.randn(64, cfg.model.state_dim) * 3
    zero = torch.zeros_like(state)
    with torch.no_grad():
        assert not torch.allclose(actions(model, state), actions(model, zero))  # inference reads the state
        model.train()
        torch.manual_seed(2)
        kept = (torch.rand(64, 1) >= 0.5).squeeze(1)  # the draw embed_state makes
        torch.manual_seed(2)
        emb = head_.embed_state(state)
        assert 10 < int(kept.sum()) < 54
        torch.testing.assert_close(emb[kept], head_.state_proj(state)[kept])
        torch.testing.assert_close(emb[~kept], head_.state_proj(zero)[~kept])
    cfg = tiny_config(tmp_path, model={"action_head": {"kind": head, **flow, "state_dropout": 1.0}})
    model = build_vla(cfg.model, cfg.loss)
    with torch.no_grad():
        for training in (True, False):
            model.train(training)
            torch.testing.assert_close(actions(model, state), actions(model, zero))
