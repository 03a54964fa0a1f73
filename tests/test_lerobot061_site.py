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
    # pi0.5: no state_proj (the state is in the prompt); the expert's adaRMS norms are `dense` layers of the time
    # embedding, zero-initialized by LeRobot
    "pi05": ("model.paligemma_with_expert.gemma_expert.model.layers.",
             "model.paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.",
             "model.paligemma_with_expert.gemma_expert.model.layers.1.post_attention_layernorm.dense.",
             "model.paligemma_with_expert.gemma_expert.model.norm.dense.",
             "model.paligemma_with_expert.paligemma.model.language_model.layers.",
             "model.paligemma_with_expert.paligemma.model.vision_tower.",
             "model.paligemma_with_expert.paligemma.model.multi_modal_projector.", "model.action_in_proj.",
             "model.action_out_proj.", "model.time_mlp_in.", "model.time_mlp_out."),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return session_root(tmp_path_factory)


@pytest.mark.parametrize("kind", ["smolvla", "smolvla_half", "pi0", "pi05"])
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
    if kind == "pi05":  # QUANTILES (LeRobot: x -> 2 (x - q01) / (q99 - q01) - 1)
        scale, shift = (stats["q99"] - stats["q01"]) / 2, stats["q01"] + (stats["q99"] - stats["q01"]) / 2
    else:  # MEAN_STD
        scale, shift = stats["std"], stats["mean"]
    torch.testing.assert_close(out["post"], out["actions"] * scale + shift, rtol=0, atol=1e-5)

    # the preprocessor's batch: images as given, state / action normalized, the tasks tokenized
    torch.testing.assert_close(out["pre.action"], (inputs["action"] - shift) / scale, rtol=1e-5, atol=1e-5)
    mask = out["pre.observation.language.attention_mask"]
    assert out["pre.observation.language.tokens"].shape == mask.shape and mask.dtype == torch.bool
    assert mask.sum(1)[0] != mask.sum(1)[1] and not mask.all(), "the two tasks should tokenize to different lengths"
    assert "tokenizer_processor" in meta["pre_steps"] and meta["post_steps"][0] == "unnormalizer_processor"
    if kind == "pi05":
        _check_pi05_prompt(folder, out, tasks)


def _check_pi05_prompt(folder, out, tasks):
    """pi0.5 tokenizes "Task: {task}, State: {bins};\\nAction: " (bins: the normalized state's 256-bin indices, -1 and
    255 outside [-1, 1]), padded on the right to tokenizer_max_length; the adaRMS layers are non-trivial."""
    import numpy as np
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer" / "tokenizer.json"))
    config = json.loads((folder / "policy" / "config.json").read_text())
    tokens, mask = out["pre.observation.language.tokens"], out["pre.observation.language.attention_mask"]
    assert tokens.shape[1] == config["tokenizer_max_length"] and not mask[:, -1].any(), "truncated or not padded"
    bins = np.digitize(out["pre.observation.state"].numpy(), np.linspace(-1, 1, 256 + 1)[:-1]) - 1  # as LeRobot
    for i, task in enumerate(tasks):
        prompt = f"Task: {task}, State: {' '.join(str(int(b)) for b in bins[i])};\nAction: "
        assert tokens[i][mask[i]].tolist() == tokenizer.encode(prompt).ids, prompt
        assert mask[i].sum() == mask[i][: mask[i].sum()].sum(), "padding on the right"
    weights = load_file(folder / "policy" / "model.safetensors")
    dense = [k for k in weights if ".dense." in k]
    assert len(dense) == 10 and all(weights[k].abs().min() > 0 for k in dense), dense
