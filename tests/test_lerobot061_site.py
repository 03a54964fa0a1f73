"""The LeRobot 0.6.1 reference site (tests/lerobot061.py) works: each tiny policy folder builds, and LeRobot's own
loss, gradients, sampled and postprocessed actions come back consistent with each other."""

from __future__ import annotations

import json

import pytest
import torch
from lerobot061 import (
    ACTION_DIM,
    CHUNK,
    MAX_ACTION_DIM,
    action_stats,
    policy_folder,
    reference,
    sample_inputs,
    session_root,
)

# the parameters each policy's expert and VLM must have gradients for (LeRobot freezes the last VLM layer(s), the
# LM heads and the VLM's final norm, and trains all else with train_expert_only=False, freeze_vision_encoder=False)
GRAD_PREFIXES = {
    "smolvla": ("model.vlm_with_expert.lm_expert.layers.", "model.vlm_with_expert.vlm.model.text_model.layers.0.",
                "model.vlm_with_expert.vlm.model.vision_model.", "model.vlm_with_expert.vlm.model.connector.",
                "model.action_out_proj.", "model.state_proj."),
    "pi0": ("model.paligemma_with_expert.gemma_expert.model.layers.",
            "model.paligemma_with_expert.paligemma.model.language_model.layers.",
            "model.paligemma_with_expert.paligemma.model.vision_tower.",
            "model.paligemma_with_expert.paligemma.model.multi_modal_projector.", "model.action_out_proj.",
            "model.state_proj."),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return session_root(tmp_path_factory)


@pytest.mark.parametrize("kind", ["smolvla", "smolvla_half", "pi0"])
def test_lerobot061_reference_is_self_consistent(root, kind):
    inputs, tasks = sample_inputs()
    out, meta = reference(kind, root, inputs, tasks)
    folder = policy_folder(kind, root)
    info = json.loads((folder / "info.json").read_text())
    assert info["lerobot"] == "0.6.1" and info["transformers"] == "5.5.4" and info["kind"] == kind
    assert {p.name for p in (folder / "policy").iterdir()} >= {
        "config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json"}

    loss = out["loss"]
    assert torch.isfinite(loss) and abs(loss.item() - meta["loss"]) < 1e-6
    assert out["losses"].shape == (2, CHUNK, MAX_ACTION_DIM)
    torch.testing.assert_close(loss, out["losses"][..., :ACTION_DIM].mean(), rtol=0, atol=1e-6)

    grads = [k.removeprefix("grad.") for k in out if k.startswith("grad.")]
    for prefix in GRAD_PREFIXES[kind.split("_")[0]]:
        assert any(g.startswith(prefix) for g in grads), f"no gradient under {prefix}"
    assert all(torch.isfinite(out[f"grad.{g}"]).all() for g in grads)

    assert out["sample"].shape == (2, CHUNK, MAX_ACTION_DIM)
    assert out["actions"].shape == out["post"].shape == (2, CHUNK, ACTION_DIM)
    torch.testing.assert_close(out["actions"], out["sample"][..., :ACTION_DIM], rtol=0, atol=1e-6)
    stats = action_stats(folder)
    torch.testing.assert_close(out["post"], out["actions"] * stats["std"] + stats["mean"], rtol=0, atol=1e-5)

    # the preprocessor's batch: images as given, state / action normalized (MEAN_STD), the tasks tokenized
    torch.testing.assert_close(out["pre.action"], (inputs["action"] - stats["mean"]) / stats["std"], rtol=1e-5,
                               atol=1e-5)
    mask = out["pre.observation.language.attention_mask"]
    assert out["pre.observation.language.tokens"].shape == mask.shape and mask.dtype == torch.bool
    assert mask.sum(1)[0] != mask.sum(1)[1] and not mask.all(), "the two tasks should tokenize to different lengths"
    assert "tokenizer_processor" in meta["pre_steps"] and meta["post_steps"][0] == "unnormalizer_processor"
