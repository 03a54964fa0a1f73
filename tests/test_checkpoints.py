"""Checkpoint loading (checkpoints/): the one resolver (`resolve_run`) and refusals at load, before any step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_RECIPE, run_cli
from test_safety import hashes, one_line


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run with one checkpoint."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    done = run_cli("train", str(TINY_RECIPE), "--train.steps=2", "--train.progress=false",
                   "--train.tensorboard=false", f"--train.output_dir={out}")
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_resolve_run_gives_the_checkpoint_and_its_config(run):
    from vlaforge.checkpoints.layout import resolve_run

    ckpt, cfg = resolve_run(run)
    assert ckpt == run / "checkpoints" / "step_00000002" and cfg.train.steps == 2
    assert resolve_run(ckpt)[0] == ckpt


def test_non_finite_weights_are_named_at_load(run, tmp_path):
    """NaN weights are refused where they are read - resume, init_from, eval's runtime, export - naming the tensor,
    not reported later as "non-finite gradients at step 3"; the poisoned run's files stay as they were."""
    import shutil

    poisoned = tmp_path / "run"
    shutil.copytree(run, poisoned)
    ckpt = poisoned / "checkpoints" / "step_00000002"
    state = load_file(str(ckpt / "model.safetensors"))
    name = next(k for k in sorted(state) if k.startswith("llm.") and state[k].is_floating_point())
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(ckpt / "model.safetensors"))
    before = hashes(poisoned)
    one_line(run_cli("train", "--resume", str(poisoned), "--train.steps=3"), "non-finite weights", name)
    one_line(run_cli("train", str(TINY_RECIPE), f"--train.init_from={ckpt}", "--train.steps=1",
                     f"--train.output_dir={tmp_path / 'new'}"), "non-finite weights", name)
    one_line(run_cli("export", str(ckpt), f"--out={tmp_path / 'w.safetensors'}"), "non-finite weights")
    assert hashes(poisoned) == before and not (tmp_path / "w.safetensors").exists()
    from vlaforge.errors import VlaforgeError
    from vlaforge.inference.runtime import PolicyRuntime

    with pytest.raises(VlaforgeError, match="non-finite weights"):
        PolicyRuntime.load(poisoned, device="cpu")
    assert torch.isnan(load_file(str(ckpt / "model.safetensors"))[name]).any()


def test_export_options_the_format_does_not_read_are_refused(run, tmp_path):
    out = tmp_path / "w.safetensors"
    one_line(run_cli("export", str(run), f"--out={out}", "--frames=5"), "--frames", "--format onnx")
    one_line(run_cli("export", str(run), "--format=onnx", f"--out={tmp_path / 'pkg'}", "--calibrate=8"),
             "--calibrate", "--quantized")
    assert not out.exists() and not (tmp_path / "pkg").exists()


def test_a_saved_config_with_a_value_nothing_reads_still_loads(run, tmp_path):
    """A run saved before a rule of config/unused.py existed may hold a value its configuration does not read; its
    saved config.toml is a record, so eval / serve / resume drop that value instead of refusing the run (a recipe or
    an override that sets it is still refused)."""
    import shutil

    from vlaforge.checkpoints.layout import resolve_run
    from vlaforge.config.loading import load_config
    from vlaforge.errors import ConfigError

    old = tmp_path / "run"
    shutil.copytree(run, old)
    ckpt = old / "checkpoints" / "step_00000002"
    text = (ckpt / "config.toml").read_text()
    assert "[data]" in text
    (ckpt / "config.toml").write_text(text.replace("[data]\n", "[data]\npath = \"/somewhere/else\"\n", 1))
    assert resolve_run(old)[1].data.path in ("", None)
    with pytest.raises(ConfigError, match="data.path"):
        load_config(ckpt / "config.toml")
    done = run_cli("train", "--resume", str(old), "--train.steps=3", "--train.progress=false")
    assert done.returncode == 0, done.stderr[-2000:]
    one_line(run_cli("train", "--resume", str(old), "--train.steps=4", "--data.path=/x"), "data.path")
