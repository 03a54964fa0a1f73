"""Every value of a LeRobot policy folder checked before anything is allocated or run (models/policies/checks.py;
issue 71 item 1): the tiny SmolVLA folder LeRobot 0.6.1 writes, copied per test, one file changed, then
`PolicyRuntime.load` refuses it in one line naming the field, the value and the accepted range. Each case once loaded
(or hung, or aborted the process at the first prediction) before these checks; none allocates a model now."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lerobot061 as ref061
import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaforge.errors import VlaforgeError

pytestmark = pytest.mark.xdist_group("lerobot061")

PRE, POST = "policy_preprocessor.json", "policy_postprocessor.json"
STATE = "observation.state"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return ref061.policy_folder("smolvla", ref061.session_root(tmp_path_factory)) / "policy"


@pytest.fixture
def folder(source, tmp_path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "policy"))


def _config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))


def _step(folder: Path, file: str, name: str, **changes) -> dict:
    """Edit the step `name` of pipeline `file` (its config's options, or the entry's own keys where given as
    `entry`); returns the entry."""
    data = json.loads((folder / file).read_text())
    entry = next(s for s in data["steps"] if s["registry_name"] == name)
    entry.update(changes.pop("entry", {}))
    entry["config"].update(changes)
    (folder / file).write_text(json.dumps(data))
    return entry


def _stats(folder: Path, change) -> None:
    """Replace the pre-processor normalizer's statistics by `change(stats)`."""
    path = folder / _step(folder, PRE, "normalizer_processor")["state_file"]
    stats = load_file(str(path))
    change(stats)
    save_file(stats, str(path))


def _refused(folder: Path, *fragments: str, **lerobot) -> str:
    from vlaforge.inference.runtime import PolicyRuntime

    with pytest.raises(VlaforgeError) as err:
        PolicyRuntime.load(folder, device="cpu", lerobot=lerobot or None)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


CONFIG_CASES = {  # config.json field -> value, what the refusal says
    "num_steps negative": ({"num_steps": -3}, ["num_steps = -3", "an integer from 1 to 1000"]),
    "num_steps huge": ({"num_steps": 1_000_000_000}, ["num_steps = 1000000000", "from 1 to 1000"]),
    "num_steps not an integer": ({"num_steps": "10"}, ['num_steps = "10"', "an integer"]),
    "max_state_dim huge": ({"max_state_dim": 1_000_000_000}, ["max_state_dim = 1000000000", "from 1 to 4096"]),
    "chunk_size huge": ({"chunk_size": 100_000_000}, ["chunk_size = 100000000", "from 1 to 4096"]),
    "n_action_steps over chunk_size": ({"n_action_steps": 50}, ["n_action_steps = 50 is over chunk_size = 5",
                                                                "at most 5"]),
    "min_period zero": ({"min_period": 0}, ["min_period = 0", "above 0"]),
    "image size huge": ({"resize_imgs_with_padding": [100_000, 32]}, ["resize_imgs_with_padding", "100000",
                                                                      "4096"]),
    "expert width huge": ({"expert_width_multiplier": 1000.0}, ["expert_width_multiplier = 1000.0", "at most 8"]),
    "state over its pad": ({"input_features": {"observation.images.top": {"type": "VISUAL", "shape": [3, 24, 32]},
                                               STATE: {"type": "STATE", "shape": [9]}}},
                           ["observation.state has shape [9], over max_state_dim = 8"]),
    "tokenizer_max_length huge": ({"tokenizer_max_length": 10**9}, ["tokenizer_max_length", "65536"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_values_are_bounded(folder, case):
    fields, says = CONFIG_CASES[case]
    _config(folder, **fields)
    _refused(folder, "config.json's", *says)


def test_an_override_is_checked_after_it_is_applied(folder):
    """model.lerobot.config's n_action_steps = 50 over the folder's chunk_size 5 (LeRobot's config refuses it)."""
    _refused(folder, "model.lerobot.config.n_action_steps = 50 is over chunk_size = 5", config={"n_action_steps": 50})


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_pi0_steps_are_num_inference_steps(tmp_path, kind):
    """pi0 / pi0.5 read num_inference_steps (LeRobot's defaults config.json, no weights read: the check comes first)."""
    from vlaforge.models.policies.defaults import DEFAULT_POLICIES
    from vlaforge.models.policies.reader import read_policy_config

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({**DEFAULT_POLICIES[kind].config, "num_inference_steps": 0}))
    with pytest.raises(VlaforgeError, match="num_inference_steps = 0 is not an integer from 1 to 1000"):
        read_policy_config(tmp_path)
    read_policy_config(tmp_path, {"num_inference_steps": 10})  # the override checked, not the file's value


def test_tokenizer_max_length_is_bounded(folder):
    """max_length = 1e9 with padding = max_length aborted the process at the first prediction (exit 134)."""
    _step(folder, PRE, "tokenizer_processor", max_length=1_000_000_000, padding="max_length")
    _refused(folder, PRE, "tokenizer_processor", "'max_length' = 1000000000", "from 1 to 65536")


def test_nan_statistics_are_refused(folder):
    """NaN standard deviations made every predicted action NaN."""
    _stats(folder, lambda s: s.update({f"{STATE}.std": torch.full_like(s[f"{STATE}.std"], float("nan"))}))
    _refused(folder, PRE, "'observation.state'", "std holds 6 NaN or infinite values of 6")


def test_statistics_shaped_as_another_feature_are_refused(folder):
    """A state statistic of 7 numbers for the 6-number state feature: every prediction was refused later."""
    _stats(folder, lambda s: s.update({f"{STATE}.mean": torch.zeros(7)}))
    _refused(folder, PRE, "'observation.state'", "mean has shape (7,) and the feature (6,)")


@pytest.mark.parametrize("option, value, says", [
    ("eps", 0.0, "'eps' = 0.0 is not a number above 0"),
    ("features", {STATE: {"type": "STATE", "shape": [-6]}}, "shape entry = -6"),
    ("norm_map", ["MEAN_STD"], "option 'norm_map' = [\"MEAN_STD\"] is not a dict"),
])
def test_normalizer_options_are_checked(folder, option, value, says):
    _step(folder, PRE, "normalizer_processor", **{option: value})
    _refused(folder, PRE, says)


def test_config_json_that_does_not_parse_is_named_with_line_and_column(folder):
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace('"chunk_size": 5', '"chunk_size": 5,,', 1))
    line = next(i for i, t in enumerate(text.splitlines(), 1) if '"chunk_size"' in t)
    _refused(folder, "config.json is not valid JSON", f"at line {line}, column")


def test_a_pipeline_that_does_not_parse_is_named_with_line_and_column(folder):
    (folder / POST).write_text('{"steps": [\n  {"registry_name": }\n]}')
    _refused(folder, f"{POST} is not valid JSON", "at line 2, column 21")


def test_pickled_weights_are_never_loaded_and_the_fix_is_named(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    _refused(folder, "pytorch_model.bin", "never unpickles", "safetensors.torch.save_file as model.safetensors",
             "save_pretrained")


def test_a_state_file_leaving_the_folder_is_refused(folder):
    """A valid safetensors file beside the folder, named with '..': refused, not read."""
    entry = _step(folder, PRE, "normalizer_processor")
    shutil.copy(folder / entry["state_file"], folder.parent / "outside.safetensors")
    _step(folder, PRE, "normalizer_processor", entry={"state_file": "../outside.safetensors"})
    _refused(folder, "names state file \"../outside.safetensors\", which is not a file inside the folder")


KEPT = {  # refused before these checks, and still
    "python callable": lambda f: _step(f, PRE, "to_batch_processor", entry={"registry_name": "os.system"}),
    "lying header": lambda f: _lie_about_offsets(f / "model.safetensors"),
    "unknown type": lambda f: _config(f, type="act"),
}


def _lie_about_offsets(path: Path) -> None:
    """The first tensor's end offset pointed past the file."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 1 << 30
    new = json.dumps(header).encode()
    new = new.ljust(-(-len(new) // 8) * 8)  # (the 8-byte alignment safetensors writes)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + size:])


@pytest.mark.parametrize("case", list(KEPT))
def test_refusals_from_before_are_kept(folder, case):
    KEPT[case](folder)
    _refused(folder, {"python callable": "(os.system) is not a step vlaforge runs",
                      "lying header": "model.safetensors cannot be read",
                      "unknown type": "'act' policy; vlaforge reads these types"}[case])


def test_refusals_through_the_cli_exit_2_in_one_line(source, tmp_path):
    from conftest import run_cli

    broken = Path(shutil.copytree(source, tmp_path / "json"))
    (broken / "config.json").write_text("{\"type\": \"smolvla\",\n  \"chunk_size\": }")
    pickled = Path(shutil.copytree(source, tmp_path / "pickled"))
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    for path, fragment in ((broken, "config.json is not valid JSON: Expecting value at line 2, column 17"),
                           (pickled, "never unpickles")):
        done = run_cli("serve", str(path), "--port=0", timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and fragment in lines[0], done.stderr[-1500:]
