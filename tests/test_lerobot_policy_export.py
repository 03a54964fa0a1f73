"""`vlaforge export --format onnx` of runs fine-tuned from LeRobot's SmolVLA, pi0 and pi0.5 (issue 60, item 5): the
package (a vision graph, a prefix graph returning every joint layer's keys and values, a denoising graph taking them)
predicts through `PolicyRuntime`'s ONNX backend what the run predicts through PyTorch, within 1e-5 on the same
noise, and tokenizes as the run does (the folder's newline and BOS, pi0.5's state prompt); what is not built is
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import lerobot061 as ref061
import numpy as np
import pytest
import torch

from conftest import run_cli

pytest.importorskip("onnxruntime")
TOL = 1e-5  # normalized action units (the bar; measured 6e-7 to 2.2e-6)


@pytest.fixture
def session_root(tmp_path_factory) -> Path:
    return ref061.session_root(tmp_path_factory)


def _fine_tune(kind: str, root: Path) -> Path:
    """One step of the kind's recipe on its folder: the session's shared run (tests/lerobot061.py `trained_run`; the
    pi0.5 one is test_lerobot_policy_techniques.py's state-prompt run too)."""
    return ref061.trained_run(kind, ref061.ONE_STEP, root)


@pytest.mark.parametrize("kind", ("smolvla", "pi0", "pi05"))
def test_a_fine_tuned_policys_onnx_package_predicts_its_actions(kind, session_root, tmp_path):
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    run = _fine_tune(kind, session_root)
    pkg = tmp_path / "pkg"
    done = run_cli("export", str(run), "--format=onnx", f"--out={pkg}", "--frames=4", "--data=none", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((pkg / "export.json").read_text())
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert report["head"] == "flow_matching_kv" and report["action_error"]["max_abs_normalized"] <= TOL
    assert sorted(manifest["graphs"]) == ["denoise", "prefix", "vision"]
    assert manifest["graphs"]["prefix"]["outputs"]["prefix_kv"]["shape"][0] == "batch"

    torch_rt = PolicyRuntime.load(run, device="cpu", cache="none")
    onnx_rt = PolicyRuntime.load(pkg, cache="none")
    assert onnx_rt.backend == "onnx"
    spec = torch_rt.spec
    g = np.random.default_rng(0)
    for i, task in enumerate(("press the button", "open the top drawer and then close it")):
        images = {c: g.integers(0, 256, (32, 32, 3), dtype=np.uint8) for c in torch_rt.cameras}
        state = np.asarray(spec.state_mean, np.float32) + np.asarray(spec.state_std, np.float32) * (i - 0.5)
        got = {}
        for name, rt in (("torch", torch_rt), ("onnx", onnx_rt)):
            torch.manual_seed(i)
            got[name] = rt.predict(Observation(images, state, task)).actions
        ids = [rt.session("default").tokens for rt in (torch_rt, onnx_rt)]
        assert torch.equal(ids[0][0][ids[0][1]], ids[1][0][ids[1][1]]), (kind, task)  # the same prompt tokens
        assert got["torch"].shape == (ref061.CHUNK, len(spec.action_mean))
        assert np.abs(got["torch"] - got["onnx"]).max() <= TOL * max(1.0, float(np.abs(got["torch"]).max()))
    # a batch of two observations in one call: the dynamic batch
    obs = [Observation({c: np.zeros((32, 32, 3), np.uint8) for c in torch_rt.cameras},
                       np.asarray(spec.state_mean, np.float32), t)
           for t in ("press the button", "push the green block left")]
    torch.manual_seed(3)
    a = np.stack([p.actions for p in torch_rt.predict_batch(obs, ["a", "b"])])
    torch.manual_seed(3)
    b = np.stack([p.actions for p in onnx_rt.predict_batch(obs, ["a", "b"])])
    assert np.abs(a - b).max() <= TOL * max(1.0, float(np.abs(a).max()))


def test_what_is_not_built_for_policy_packages_is_refused(session_root, tmp_path):
    """The folder LeRobot wrote (its observations go through LeRobot's pipelines) and an ExecuTorch package of a run:
    exit 2, one line each, nothing written."""
    folder = ref061.policy_folder("pi0", session_root) / "policy"
    cases = [(str(folder), "--format=onnx", "export a run fine-tuned from it")]
    run = _fine_tune("pi0", session_root)
    cases.append((str(run), "--format=executorch", "--format onnx a package of a run"))
    for path, fmt, fragment in cases:
        done = run_cli("export", path, fmt, f"--out={tmp_path / 'pkg'}", "--data=none", timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and fragment in lines[0], done.stderr[-1500:]
        assert not (tmp_path / "pkg").exists()
