"""LeRobot 0.6.1's policy processor pipelines read natively (models/policies/processors.py), on pipelines written here
in exactly the format `DataProcessorPipeline.save_pretrained` writes (`<name>.json` with `registry_name` / `config` /
`state_file` per step, `<name>_step_<i>_<registry_name>.safetensors` holding flat `<feature>.<stat>` tensors):
every normalization mode against its formula, degenerate statistics, the tokenizer's padding and truncation, pi0.5's
state prompt against hand-computed bins, the refusals, the step order read from the JSON, and the image helpers
(models/policies/images.py) against hand-computed resizes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vlaforge.data.tokenizer import state_bins
from vlaforge.errors import VlaforgeError
from vlaforge.models.policies.images import pad_vector, resize_with_pad, resize_with_pad_centered
from vlaforge.models.policies.processors import (
    LANG_MASK,
    LANG_TOKENS,
    DegenerateStatsWarning,
    load_pipelines,
)

from families import _tokenizer

CAM, STATE, ACTION = "observation.images.top", "observation.state", "action"
FEATURES = {CAM: {"type": "VISUAL", "shape": [3, 8, 12]}, STATE: {"type": "STATE", "shape": [3]},
            ACTION: {"type": "ACTION", "shape": [3]}}
EPS = 1e-8
FORMULA = {  # LeRobot 0.6.1 normalize_processor.py, written out by hand
    "MEAN_STD": lambda x, s: (x - s["mean"]) / (s["std"] + EPS),
    "MIN_MAX": lambda x, s: 2 * (x - s["min"]) / (s["max"] - s["min"]) - 1,
    "QUANTILES": lambda x, s: 2 * (x - s["q01"]) / (s["q99"] - s["q01"]) - 1,
    "QUANTILE10": lambda x, s: 2 * (x - s["q10"]) / (s["q90"] - s["q10"]) - 1,
    "IDENTITY": lambda x, s: x,
}


def dataset_stats(dim: int, seed: int) -> dict[str, torch.Tensor]:
    """What LeRobot's compute_stats gives a feature: mean/std/min/max/quantiles/count."""
    g = torch.Generator().manual_seed(seed)
    mean, std = torch.randn(dim, generator=g), torch.rand(dim, generator=g) + 0.5
    spread = {"min": -3.0, "max": 3.0, "q01": -2.3, "q99": 2.3, "q10": -1.3, "q90": 1.3}
    return {"mean": mean, "std": std, **{k: mean + f * std for k, f in spread.items()}, "count": torch.tensor([50.0])}


STATS = {STATE: dataset_stats(3, 0), ACTION: dataset_stats(3, 1),
         CAM: {k: v.reshape(3, 1, 1) for k, v in dataset_stats(3, 2).items() if k != "count"}}


def write_pipeline(folder: Path, name: str, steps: list[tuple[str, dict, dict | None]]) -> None:
    """`name`.json and its state files as LeRobot's save_pretrained writes them."""
    entries = []
    for i, (registry_name, config, state) in enumerate(steps):
        entry = {"registry_name": registry_name, "config": config}
        if state:
            entry["state_file"] = f"{name}_step_{i}_{registry_name}.safetensors"
            flat = {f"{key}.{stat}": t.contiguous() for key, sub in state.items() for stat, t in sub.items()}
            save_file(flat, folder / entry["state_file"])
        entries.append(entry)
    (folder / f"{name}.json").write_text(json.dumps({"name": name, "steps": entries}, indent=2))


def norm_config(norm_map: dict[str, str], features: dict = FEATURES) -> dict:
    return {"eps": EPS, "features": features, "norm_map": norm_map}


def tokenizer_config(tok: Path, padding: str = "max_length", max_length: int = 12) -> dict:
    return {"max_length": max_length, "task_key": "task", "padding_side": "right", "padding": padding,
            "truncation": True, "tokenizer_name": str(tok)}


def smolvla_folder(folder: Path, tok: Path, mode: str = "MEAN_STD", stats: dict = STATS, padding: str = "longest",
                   pre_steps: list | None = None) -> Path:
    """SmolVLA's pair (processor_smolvla.py): rename, batch, newline, tokenizer, device, normalizer / unnormalizer,
    device(cpu)."""
    folder.mkdir(parents=True, exist_ok=True)
    norm_map = {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}
    write_pipeline(folder, "policy_preprocessor", pre_steps or [
        ("rename_observations_processor", {"rename_map": {}}, None), ("to_batch_processor", {}, None),
        ("smolvla_new_line_processor", {}, None), ("tokenizer_processor", tokenizer_config(tok, padding), None),
        ("device_processor", {"device": "cpu", "float_dtype": None}, None),
        ("normalizer_processor", norm_config(norm_map), stats)])
    write_pipeline(folder, "policy_postprocessor", [
        ("unnormalizer_processor", norm_config(norm_map, {ACTION: FEATURES[ACTION]}), stats),
        ("device_processor", {"device": "cpu", "float_dtype": None}, None)])
    return folder


def pi0_folder(folder: Path, tok: Path, relative: dict, float_dtype: str | None = None) -> Path:
    """pi0's pair (processor_pi0.py): ... device, relative actions, normalizer / unnormalizer, absolute, device."""
    folder.mkdir(parents=True, exist_ok=True)
    norm_map = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    write_pipeline(folder, "policy_preprocessor", [
        ("rename_observations_processor", {"rename_map": {}}, None), ("to_batch_processor", {}, None),
        ("pi0_new_line_processor", {}, None), ("tokenizer_processor", tokenizer_config(tok), None),
        ("device_processor", {"device": "cuda", "float_dtype": float_dtype}, None),
        ("relative_actions_processor", relative, None), ("normalizer_processor", norm_config(norm_map), STATS)])
    write_pipeline(folder, "policy_postprocessor", [
        ("unnormalizer_processor", norm_config(norm_map, {ACTION: FEATURES[ACTION]}), STATS),
        ("absolute_actions_processor", {"enabled": relative["enabled"]}, None),
        ("device_processor", {"device": "cpu", "float_dtype": None}, None)])
    return folder


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    _tokenizer().save_pretrained(out)
    return out


def raw_batch(batch: int = 2, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {CAM: torch.rand(batch, 3, 8, 12, generator=g), STATE: torch.randn(batch, 3, generator=g),
            ACTION: torch.randn(batch, 5, 3, generator=g), "task": ["open the door", "pick place"][:batch]}


@pytest.mark.parametrize("mode", list(FORMULA))
def test_every_mode_matches_its_formula_and_round_trips(tmp_path, tok, mode):
    pre, post = load_pipelines(smolvla_folder(tmp_path, tok, mode), None)
    raw = raw_batch()
    out = pre(raw)
    for key in (STATE, ACTION):
        expected = FORMULA[mode](raw[key].double(), {k: v.double() for k, v in STATS[key].items()})
        torch.testing.assert_close(out[key].double(), expected, rtol=1e-5, atol=1e-5)
        assert out[key].dtype == torch.float32
    assert torch.equal(out[CAM], raw[CAM])  # VISUAL -> IDENTITY
    torch.testing.assert_close(post(out[ACTION]), raw[ACTION], rtol=1e-5, atol=1e-5)
    assert pre.features[STATE] == ("STATE", (3,)) and set(pre.stats) == {STATE, ACTION, CAM}
    assert post.step_names == ["unnormalizer_processor", "device_processor"]


def test_image_stats_broadcast_per_channel(tmp_path, tok):
    flat = {k: v.reshape(3) for k, v in STATS[CAM].items()}  # (C,) as RL configs write them: reshaped to (C, 1, 1)
    folder = smolvla_folder(tmp_path, tok, stats={**STATS, CAM: flat})
    pre_cfg = json.loads((folder / "policy_preprocessor.json").read_text())
    pre_cfg["steps"][-1]["config"]["norm_map"]["VISUAL"] = "MIN_MAX"
    (folder / "policy_preprocessor.json").write_text(json.dumps(pre_cfg))
    pre, _ = load_pipelines(folder)
    raw = raw_batch()
    expected = FORMULA["MIN_MAX"](raw[CAM], STATS[CAM])  # (B, 3, H, W) against (3, 1, 1)
    torch.testing.assert_close(pre(raw)[CAM], expected)
    assert pre.stats[CAM]["min"].shape == (3, 1, 1)


@pytest.mark.parametrize("mode, low, high", [("MEAN_STD", "mean", "std"), ("MIN_MAX", "min", "max"),
                                             ("QUANTILES", "q01", "q99"), ("QUANTILE10", "q10", "q90")])
def test_degenerate_stats_warn_once_naming_the_feature(tmp_path, tok, mode, low, high):
    stats = {k: {s: t.clone() for s, t in sub.items()} for k, sub in STATS.items()}
    stats[ACTION][high][1] = 0.0 if mode == "MEAN_STD" else stats[ACTION][low][1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre, post = load_pipelines(smolvla_folder(tmp_path, tok, mode, stats=stats))
    ours = [str(w.message) for w in caught if issubclass(w.category, DegenerateStatsWarning)]
    assert len(ours) == 1, ours  # the pre-processor's normalizer and the post-processor's unnormalizer: one warning
    assert "'action'" in ours[0] and high in ours[0] and "1 of 3" in ours[0]
    raw = raw_batch()
    # LeRobot's eps handling: std + eps for MEAN_STD; a zero range replaced by eps for the others
    expected = (raw[ACTION][..., 1] - stats[ACTION][low][1]) / EPS
    if mode != "MEAN_STD":
        expected = 2 * expected - 1
    torch.testing.assert_close(pre(raw)[ACTION][..., 1], expected)


def test_a_mode_without_its_statistics_is_refused(tmp_path, tok):
    stats = {**STATS, STATE: {k: v for k, v in STATS[STATE].items() if k != "q01"}}
    with pytest.raises(VlaforgeError, match=r"'observation.state' is normalized with QUANTILES .* lack q01"):
        load_pipelines(smolvla_folder(tmp_path, tok, "QUANTILES", stats=stats))


@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_tokenizer_pads_right_to_the_options(tmp_path, tok, padding):
    pre, _ = load_pipelines(smolvla_folder(tmp_path, tok, padding=padding))
    raw = raw_batch()
    out = pre(raw)
    assert out["task"] == ["open the door\n", "pick place\n"] and raw["task"] == ["open the door", "pick place"]
    ids, mask = out[LANG_TOKENS], out[LANG_MASK]
    lengths = [len(pre.tokenizer(t)["input_ids"]) for t in out["task"]]
    width = 12 if padding == "max_length" else max(lengths)
    assert ids.shape == mask.shape == (2, width) and ids.dtype == torch.int64 and mask.dtype == torch.bool
    for row, n in enumerate(lengths):  # right padding: the real tokens first, then the pad id under a False mask
        assert mask[row].tolist() == [True] * n + [False] * (width - n)
        assert ids[row, :n].tolist() == pre.tokenizer(out["task"][row])["input_ids"]
        assert (ids[row, n:] == pre.tokenizer.pad_token_id).all()
    assert pre.max_length == 12


def test_tokenizer_truncates_to_max_length(tmp_path, tok):
    pre, _ = load_pipelines(smolvla_folder(tmp_path, tok, padding="longest"))
    long_task = " ".join(["open the door and close the drawer"] * 4)
    out = pre({**raw_batch(1), "task": long_task})
    assert out[LANG_TOKENS].shape == (1, 12) and out[LANG_MASK].all()
    assert out[LANG_TOKENS][0].tolist() == pre.tokenizer(long_task + "\n")["input_ids"][:12]


def test_an_unbatched_observation_gains_a_batch_dim(tmp_path, tok):
    pre, _ = load_pipelines(smolvla_folder(tmp_path, tok))
    raw = {CAM: torch.rand(3, 8, 12), STATE: torch.randn(3), "task": "open the door", "ignored": 1}
    out = pre(raw)
    assert out[CAM].shape == (1, 3, 8, 12) and out[STATE].shape == (1, 3) and out["task"] == ["open the door\n"]
    assert out[LANG_TOKENS].shape[0] == 1 and "ignored" not in out and ACTION not in out
    assert raw[CAM].shape == (3, 8, 12) and raw["task"] == "open the door"


def test_step_order_follows_the_json(tmp_path, tok):
    """Rename before the normalizer: the renamed state is normalized; after it: it passes through unchanged."""
    rename = ("rename_observations_processor", {"rename_map": {"observation.joints": STATE}}, None)
    norm = ("normalizer_processor", norm_config({"STATE": "MEAN_STD", "ACTION": "MEAN_STD"}), STATS)
    raw = {"observation.joints": torch.randn(2, 3), "task": ["a", "b"]}
    outs = {}
    for order, steps in {"rename_first": [rename, norm], "normalize_first": [norm, rename]}.items():
        pre, _ = load_pipelines(smolvla_folder(tmp_path / order, tok, pre_steps=steps))
        assert pre.step_names == [s[0] for s in steps]
        outs[order] = pre(raw)[STATE]
    torch.testing.assert_close(outs["rename_first"], FORMULA["MEAN_STD"](raw["observation.joints"], STATS[STATE]))
    assert torch.equal(outs["normalize_first"], raw["observation.joints"])


def test_pi0_relative_actions_round_trip_through_the_cached_state(tmp_path, tok):
    relative = {"enabled": True, "exclude_joints": ["gripper"], "action_names": ["j0", "j1", "gripper"]}
    pre, post = load_pipelines(pi0_folder(tmp_path, tok, relative, float_dtype="float64"))
    assert pre.step_names[2] == "pi0_new_line_processor" and pre.step_names[5] == "relative_actions_processor"
    raw = raw_batch()
    out = pre(raw)
    assert out[STATE].dtype == torch.float64 and out[LANG_TOKENS].dtype == torch.int64
    assert out[LANG_TOKENS].shape == (2, 12)  # pi0 pads to max_length
    keep = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)  # the gripper stays absolute
    shifted = raw[ACTION].double() - raw[STATE].double()[:, None, :] * keep
    torch.testing.assert_close(out[ACTION], FORMULA["MEAN_STD"](shifted, STATS[ACTION]))
    torch.testing.assert_close(post(out[ACTION]), raw[ACTION].double())


def test_absolute_actions_need_a_state_first(tmp_path, tok):
    relative = {"enabled": True, "exclude_joints": [], "action_names": None}
    _, post = load_pipelines(pi0_folder(tmp_path, tok, relative))
    with pytest.raises(VlaforgeError, match="run the pre-processor on an observation first"):
        post(torch.zeros(1, 5, 3))


PI05_PROMPT = "pi05_prepare_state_tokenizer_processor_step"
PI05_STEPS = ["rename_observations_processor", "to_batch_processor", "relative_actions_processor",
              "normalizer_processor", PI05_PROMPT, "tokenizer_processor", "device_processor"]
# q01 = -2, q99 = 2: QUANTILES maps the state x to exactly x / 2 (2 (x + 2) / 4 - 1 for these dyadic values)
PI05_STATS = {**STATS, STATE: {**STATS[STATE], "q01": torch.full((3,), -2.0), "q99": torch.full((3,), 2.0)}}


def pi05_folder(folder: Path, tok: Path, relative: dict, prompt: dict | None = None, prompt_first: bool = False
                ) -> Path:
    """pi0.5's pair (processor_pi05.py): rename, batch, relative actions, normalizer (QUANTILES), the state prompt
    step (config {} as LeRobot 0.6.1 saves it), tokenizer, device / unnormalizer, absolute, device(cpu)."""
    folder.mkdir(parents=True, exist_ok=True)
    norm_map = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
    norm, state_prompt = ("normalizer_processor", norm_config(norm_map), PI05_STATS), (PI05_PROMPT, prompt or {}, None)
    middle = [state_prompt, norm] if prompt_first else [norm, state_prompt]
    write_pipeline(folder, "policy_preprocessor", [
        ("rename_observations_processor", {"rename_map": {}}, None), ("to_batch_processor", {}, None),
        ("relative_actions_processor", relative, None), *middle,
        ("tokenizer_processor", tokenizer_config(tok, max_length=48), None),
        ("device_processor", {"device": "cpu", "float_dtype": None}, None)])
    write_pipeline(folder, "policy_postprocessor", [
        ("unnormalizer_processor", norm_config(norm_map, {ACTION: FEATURES[ACTION]}), PI05_STATS),
        ("absolute_actions_processor", {"enabled": relative["enabled"]}, None),
        ("device_processor", {"device": "cpu", "float_dtype": None}, None)])
    return folder


def test_state_bins_hand_computed_edges_and_out_of_range():
    """Bin k is [-1 + k/128, -1 + (k+1)/128): an edge opens its bin; below -1 is -1; 1 - 1/128 and above is 255."""
    below = lambda x: torch.nextafter(torch.tensor(x), torch.tensor(-2.0)).item()  # the float32 just below x
    cases = [(-1.5, -1), (below(-1.0), -1), (-1.0, 0), (-0.9921875, 1), (below(-0.9921875), 0), (-0.25, 96),
             (below(0.0), 127), (0.0, 128), (-0.0, 128), (0.3, 166), (0.5, 192), (below(0.5), 191), (0.99, 254),
             (below(0.9921875), 254), (0.9921875, 255), (1.0, 255), (7.0, 255), (float("nan"), 255)]
    state, bins = torch.tensor([[x for x, _ in cases]]), [[b for _, b in cases]]  # (1, 18) float32
    assert state_bins(state).tolist() == bins and state_bins(state.double()).tolist() == bins


def test_state_bins_match_numpy_digitize_on_float32():
    """LeRobot's exact call on a float32 state (numpy compares it against float64 edges)."""
    g = torch.Generator().manual_seed(0)
    edges = torch.linspace(-1, 1, 257)
    state = torch.cat([torch.randn(4, 257, generator=g), edges[None], torch.nextafter(edges, edges - 1)[None],
                       torch.nextafter(edges, edges + 1)[None]])
    expected = np.digitize(state.numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    assert np.array_equal(state_bins(state), expected)


@pytest.mark.parametrize("prompt_first", [False, True])
def test_pi05_prompt_carries_the_normalized_state_in_json_order(tmp_path, tok, prompt_first):
    relative = {"enabled": True, "exclude_joints": [], "action_names": None}
    pre, post = load_pipelines(pi05_folder(tmp_path, tok, relative, prompt_first=prompt_first))
    order = list(PI05_STEPS)
    if prompt_first:
        order[3:5] = order[4], order[3]
    assert pre.step_names == order
    assert post.step_names == ["unnormalizer_processor", "absolute_actions_processor", "device_processor"]
    raw = {**raw_batch(), STATE: torch.tensor([[-2.0, 0.0, 1.0], [3.0, -3.0, 4.0]]),
           "task": ["pick_up the\ncube\n", "  open_door "]}
    out = pre(raw)
    # normalized [[-1, 0, 0.5], [1.5, -1.5, 2]] -> bins [[0, 128, 192], [255, -1, 255]]; raw: [[-1, 128, 255], ...]
    states = ["-1 128 255", "255 -1 255"] if prompt_first else ["0 128 192", "255 -1 255"]
    assert out["task"] == [f"Task: pick up the cube, State: {states[0]};\nAction: ",
                           f"Task: open door, State: {states[1]};\nAction: "]
    assert raw["task"] == ["pick_up the\ncube\n", "  open_door "]
    torch.testing.assert_close(out[STATE], raw[STATE] / 2)
    enc = pre.tokenizer(out["task"], max_length=48, padding="max_length", truncation=True, return_tensors="pt")
    assert torch.equal(out[LANG_TOKENS], enc["input_ids"]) and torch.equal(out[LANG_MASK], enc["attention_mask"].bool())
    shifted = raw[ACTION] - raw[STATE][:, None, :]  # relative to the raw state, then QUANTILES
    torch.testing.assert_close(out[ACTION], FORMULA["QUANTILES"](shifted, PI05_STATS[ACTION]))
    torch.testing.assert_close(post(out[ACTION]), raw[ACTION])


def test_pi05_prompt_options(tmp_path, tok):
    """max_state_dim is inert (0.6.1 never reads it); task_key names the key the prompt is read from and written to."""
    relative = {"enabled": False, "exclude_joints": [], "action_names": None}
    raw = {**raw_batch(1), STATE: torch.tensor([[0.0, 1.0, -1.0]]), "task": "reach"}
    default, _ = load_pipelines(pi05_folder(tmp_path / "default", tok, relative))
    sized, _ = load_pipelines(pi05_folder(tmp_path / "sized", tok, relative, {"max_state_dim": 8, "task_key": "task"}))
    assert default(raw)["task"] == sized(raw)["task"] == ["Task: reach, State: 128 192 64;\nAction: "]
    other, _ = load_pipelines(pi05_folder(tmp_path / "other", tok, relative, {"task_key": "timestamp"}))
    with pytest.raises(VlaforgeError, match=r"reads raw\['timestamp'\], one str per state row \(1\), and got NoneType"):
        other(raw)


PI05_REFUSALS = {  # raw batch edit -> what the one-line message says
    "no state": (lambda r: r.pop(STATE), ["(B, state_dim) observation.state", "got NoneType"]),
    "a (B, T, D) state": (lambda r: r.update({STATE: torch.zeros(2, 2, 3)}), ["got shape (2, 2, 3)"]),
    "no task": (lambda r: r.pop("task"), ["raw['task']", "got NoneType"]),
    "fewer tasks than states": (lambda r: r.update(task=["reach"]), ["one str per state row (2)", "got list of 1"]),
}


@pytest.mark.parametrize("case", list(PI05_REFUSALS))
def test_pi05_prompt_refusals(tmp_path, tok, case):
    pre, _ = load_pipelines(pi05_folder(tmp_path, tok, {"enabled": False, "exclude_joints": [], "action_names": None}))
    raw = raw_batch()
    edit, says = PI05_REFUSALS[case]
    edit(raw)
    with pytest.raises(VlaforgeError) as err:
        pre(raw)
    message = str(err.value)
    assert "\n" not in message and PI05_PROMPT in message and all(s in message for s in says), message


def test_pi05_prompt_refuses_an_option_it_lacks(tmp_path, tok):
    folder = pi05_folder(tmp_path, tok, {"enabled": False, "exclude_joints": [], "action_names": None},
                         {"max_state_dim": 32, "state_bins": 128})
    with pytest.raises(VlaforgeError, match=rf"step 4 \({PI05_PROMPT}\) sets option 'state_bins' = 128, .* "
                       rf"supported options of {PI05_PROMPT}: task_key"):
        load_pipelines(folder)


def _edit(folder: Path, name: str, fn) -> None:
    path = folder / f"{name}.json"
    config = json.loads(path.read_text())
    fn(config["steps"])
    path.write_text(json.dumps(config))


REFUSALS = {  # case -> (how the folder is broken, what the message must say)
    "unknown step": (lambda f: _edit(f, "policy_preprocessor", lambda s: s.insert(1, {
        "registry_name": "image_crop_processor", "config": {}})),
        ["policy_preprocessor.json", "image_crop_processor", "supported steps", "tokenizer_processor"]),
    "unknown option": (lambda f: _edit(f, "policy_preprocessor", lambda s: s[3]["config"].update(
        add_special_tokens=False)), ["add_special_tokens", "supported options", "max_length", "re-save"]),
    "explicit stats": (lambda f: _edit(f, "policy_postprocessor", lambda s: s[0]["config"].update(
        stats={ACTION: {"mean": [0.0]}})), ["policy_postprocessor.json", "'stats'", "unnormalizer_processor"]),
    "missing state file": (lambda f: (f / "policy_preprocessor_step_5_normalizer_processor.safetensors").unlink(),
                           ["policy_preprocessor_step_5_normalizer_processor.safetensors", "copy it"]),
    "corrupt state file": (lambda f: (f / "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
                           .write_bytes(b"\x00garbage"), ["cannot read its state file", "restore it"]),
    "hub tokenizer": (lambda f: _edit(f, "policy_preprocessor", lambda s: s[3]["config"].update(
        tokenizer_name="google/paligemma-3b-pt-224")), ["not in the Hugging Face cache", "HF_HUB_OFFLINE",
                                                         "hf download google/paligemma-3b-pt-224",
                                                         "model.lerobot.tokenizer"]),
    "missing json": (lambda f: (f / "policy_postprocessor.json").unlink(),
                     ["policy_postprocessor.json not found", "save_pretrained"]),
    "not a pipeline": (lambda f: (f / "policy_preprocessor.json").write_text("{\"type\": \"smolvla\"}"),
                       ["is not a LeRobot processor pipeline", "no 'steps'"]),
    "absolute without relative": (lambda f: _edit(f, "policy_postprocessor", lambda s: s.insert(1, {
        "registry_name": "absolute_actions_processor", "config": {"enabled": True}})),
        ["absolute_actions_processor", "relative_actions_processor"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line_with_the_fix(tmp_path, tok, case):
    folder = smolvla_folder(tmp_path, tok)
    load_pipelines(folder)  # loads before it is broken
    breaks, says = REFUSALS[case]
    breaks(folder)
    with pytest.raises(VlaforgeError) as err:
        load_pipelines(folder)
    message = str(err.value)
    assert "\n" not in message and all(s in message for s in says), message


def test_inert_options_load_and_a_hub_tokenizer_loads_with_the_override(tmp_path, tok):
    folder = smolvla_folder(tmp_path, tok)
    _edit(folder, "policy_preprocessor", lambda s: (s[3]["config"].update(tokenizer_name="HuggingFaceTB/SmolVLM2"),
                                                     s[5]["config"].update(stats=None, device="cuda")))
    pre, _ = load_pipelines(folder, tokenizer_override=str(tok))
    assert pre(raw_batch())[LANG_TOKENS].shape[0] == 2
    with pytest.raises(VlaforgeError, match="model.lerobot.tokenizer = '/nowhere' is neither an existing folder nor"):
        load_pipelines(folder, tokenizer_override="/nowhere")


def test_resize_with_pad_pads_left_and_top_a_hand_computed_case():
    img = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]).reshape(1, 1, 2, 4)
    # ratio max(4/2, 2/2) = 2 -> (1, 2); bilinear (align_corners=False) halving averages each 2x2 block
    out = resize_with_pad(img, 2, 2, pad_value=-1.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, -1.0], [0.35, 0.55]]).reshape(1, 1, 2, 2))
    assert resize_with_pad(img, 2, 4, pad_value=0.0) is img  # already the target size


def quarter(img: torch.Tensor) -> torch.Tensor:
    """Bilinear (align_corners=False) downscaling by exactly 4: source (4i + 1.5) averages pixels 4i+1 and 4i+2."""
    rows = (img[..., 1::4, :] + img[..., 2::4, :]) / 2
    return (rows[..., 1::4] + rows[..., 2::4]) / 2


def test_resize_with_pad_non_square():
    img = torch.rand(2, 3, 32, 64)
    out = resize_with_pad(img, 16, 16, pad_value=0.5)  # ratio 4 -> (8, 16), 8 rows of padding on top
    assert out.shape == (2, 3, 16, 16)
    assert (out[..., :8, :] == 0.5).all()
    torch.testing.assert_close(out[..., 8:, :], quarter(img))
    tall = resize_with_pad(torch.rand(1, 3, 64, 32), 16, 16, pad_value=0.0)  # -> (16, 8), 8 columns on the left
    assert tall.shape == (1, 3, 16, 16) and (tall[..., :8] == 0).all()


def test_resize_with_pad_centered_channels_first_and_last():
    img = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]).reshape(1, 2, 4, 1)  # (B, H, W, C)
    out = resize_with_pad_centered(img, 2, 2)  # (1, 2) resized, the odd row of padding at the bottom
    torch.testing.assert_close(out, torch.tensor([[0.35, 0.55], [0.0, 0.0]]).reshape(1, 2, 2, 1))
    big = torch.rand(2, 3, 32, 64) * 1.5 - 0.25  # clamped to [0, 1] after the resize
    first = resize_with_pad_centered(big, 16, 16)
    assert first.shape == (2, 3, 16, 16)
    assert (first[..., :4, :] == 0).all() and (first[..., 12:, :] == 0).all()
    torch.testing.assert_close(first[..., 4:12, :], quarter(big).clamp(0, 1))
    last = resize_with_pad_centered(big.permute(0, 2, 3, 1), 16, 16)
    assert torch.equal(last, first.permute(0, 2, 3, 1))
    assert resize_with_pad_centered(big[0], 16, 16).shape == (1, 3, 16, 16)  # a 3-D input keeps the batch dim


def test_pad_vector():
    x = torch.randn(2, 5, 3)
    out = pad_vector(x, 8)
    assert out.shape == (2, 5, 8) and torch.equal(out[..., :3], x) and (out[..., 3:] == 0).all()
    assert pad_vector(x, 2) is x and pad_vector(x, 3) is x
