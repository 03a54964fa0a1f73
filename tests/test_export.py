"""`vlaforge export --format onnx`: a package predicts what its checkpoint predicts through `PolicyRuntime` (both
action heads, frame histories 1 and 4, dynamic batch, a committed prefix), fp16 and int8 packages report their
error, a package that does not match its manifest is refused in one line, and `vlaforge serve` answers the openpi
client from a package."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from vlaforge.errors import VlaforgeError
from vlaforge.inference.runtime import Observation, PolicyRuntime

from conftest import run_cli, served, train_on_dataset
from fake_lerobot import SIZE, write_dataset

pytest.importorskip("onnxruntime")
TOL = 1e-4  # normalized action units (the parity bar for fp32)
CAMS = ["corner", "topview"]  # Meta-World's, so the simulator can evaluate the runs


def _train(tmp, name, *overrides):
    return train_on_dataset(tmp, name, *overrides, steps=3, cams=CAMS)


def _export(run, out, *extra):
    done = run_cli("export", str(run), "--format=onnx", f"--out={out}", "--frames=6", *extra, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {out}" in done.stdout
    return json.loads((out / "export.json").read_text())


# NOTE: one velocity layer (the default 2 doubles the denoise graph): ExecuTorch lowers each XNNPACK partition apart,
# ~25 partitions a graph, most of the ExecuTorch test's time
HEADS = {"regression-1": ("--model.frames=1",),
         "flow_matching-4": ("--model.frames=4", "--model.action_head.kind=flow_matching",
                             "--model.action_head.flow_steps=4", "--model.action_head.layers=1")}


class _Built(dict):
    """head name -> (run, package, export report), each trained and exported on first use: the test that first
    needs a head pays for it, not the module's first test for both."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp

    def __missing__(self, name):
        run = _train(self.tmp, name, *HEADS[name])
        self[name] = (run, self.tmp / f"{name}.onnx", _export(run, self.tmp / f"{name}.onnx"))
        return self[name]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    write_dataset(tmp / "ds", cams=CAMS)
    return tmp, _Built(tmp)


def _episode(n=6, seed=0):
    g = np.random.default_rng(seed)
    return [Observation({c: g.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for c in CAMS},
                        g.normal(size=4).astype(np.float32), "open the door" if seed % 2 else "close the drawer")
            for _ in range(n)]


def _predict(rt, observations, session="s", prefix=False):
    out = []
    for i, obs in enumerate(observations):
        torch.manual_seed(i)  # a flow-matching head draws the same noise in both runtimes
        if prefix and i:
            committed = out[-1][2:]
            out.append(rt.predict(obs, session, prefix=committed, prefix_weight=np.ones(len(committed))).actions)
        else:
            out.append(rt.predict(obs, session).actions)
    return np.stack(out)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_package_predicts_what_its_checkpoint_predicts(packages, name):
    _, found = packages
    run, package, report = found[name]
    assert report["action_error"]["max_abs_normalized"] <= TOL, report["action_error"]
    manifest = json.loads((package / "manifest.json").read_text())
    want = {"vision", "policy"} if name.startswith("regression") else {"vision", "encoder", "denoise"}
    assert set(manifest["graphs"]) == want and manifest["observation"]["frames"] == int(name[-1])
    torch_rt = PolicyRuntime.load(run, device="cpu")
    onnx_rt = PolicyRuntime.load(package)  # auto: a package runs in ONNX Runtime
    assert onnx_rt.backend == "onnx" and onnx_rt.describe()["package"]["providers"] == ["CPUExecutionProvider"]
    std = np.asarray(torch_rt.spec.action_std)
    episode = _episode()
    a, b = _predict(torch_rt, episode), _predict(onnx_rt, episode)  # a frame history builds up over the episode
    assert np.abs((a - b) / std).max() <= TOL
    if onnx_rt.supports_prefix:  # real-time chunking's committed prefix goes through the exported graphs too
        a, b = _predict(torch_rt, episode, "p", prefix=True), _predict(onnx_rt, episode, "p", prefix=True)
        assert np.abs((a - b) / std).max() <= TOL
    # the batch dimension is dynamic: three sessions in one forward of each graph
    batch = [_episode(2, seed)[-1] for seed in range(3)]
    sessions = [f"b{i}" for i in range(3)]
    torch.manual_seed(0)
    a = np.stack([p.actions for p in torch_rt.predict_batch(batch, sessions)])
    torch.manual_seed(0)
    b = np.stack([p.actions for p in onnx_rt.predict_batch(batch, sessions)])
    assert np.abs((a - b) / std).max() <= TOL


def test_an_fp16_package_replaces_the_package_export_wrote_and_measures_its_error(packages, tmp_path):
    """A second export into the same --out (a copy of the fp32 package) replaces the package, here with its fp16
    graphs."""
    from vlaforge.outputs import OWNER_FILE

    _, found = packages
    run, fp32, full = found["regression-1"]
    out = tmp_path / "pkg"
    shutil.copytree(fp32, out)
    half = _export(run, out, "--dtype=fp16")  # its own package: replaced
    assert json.loads((out / OWNER_FILE).read_text())["command"] == "vlaforge export"
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "fp16"
    # the graphs of the same policy, fp16 against fp32: about half (graph structure and the rotary tables are a
    # fixed part of a tiny model's bytes, so the bar is the fp32 package's graphs, not the bare parameter count)
    assert half["dtype"] == "fp16" and half["bytes"]["total"] < 0.6 * full["bytes"]["total"], (half, full)
    assert 0 < half["action_error"]["max_abs_normalized"] < 0.05
    with pytest.raises(VlaforgeError, match="exported in fp16"):
        PolicyRuntime.load(out, dtype="fp32")


def test_an_int8_package_measures_its_error(packages):
    tmp, found = packages
    run, fp32, _ = found["regression-1"]
    int8 = _export(run, tmp / "int8", "--quantized", "--calibrate=24")
    assert int8["int8"]["calibration_inputs"] == {"vision": 24, "policy": 24}
    assert 0 < int8["action_error"]["relative_error"] < 0.5
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp / "int8" / "policy.onnx"), load_external_data=False).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # QDQ form, as TensorRT and QNN take it
    assert json.loads((tmp / "int8" / "manifest.json").read_text())["quantization"]["format"] == "QDQ"


def _one_line(done):
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def _eval(path, *extra):
    return run_cli("eval", str(path), "--episodes=1", "--max-steps=2", "--workers=1", "--no-progress",
                   "--no-video", *extra)


def test_a_package_that_does_not_match_its_manifest_is_refused_in_one_line(packages):
    tmp, found = packages
    _, package, _ = found["regression-1"]

    def edited(name, change):
        folder = tmp / f"bad_{name}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(package, folder)
        change(folder)
        return folder

    def manifest_edit(fn):
        def change(folder):
            m = json.loads((folder / "manifest.json").read_text())
            fn(m)
            (folder / "manifest.json").write_text(json.dumps(m))
        return change

    def shape(m):
        m["graphs"]["policy"]["inputs"]["ids"]["shape"] = ["batch", 9]

    def contract(m):
        m["observation"]["instruction_tokens"] = 9

    def append(folder):
        with open(folder / "policy.onnx.data", "ab") as f:
            f.write(b"\0")

    def outside(m):  # the loaded graph named apart from the hashed files, outside the package
        m["graphs"]["policy"]["file"] = "../outside.onnx"

    def unhashed_tokenizer(m):
        del m["tokenizer"]["sha256"]

    def pad_out_of_vocabulary(m):
        m["tokenizer"]["pad_id"] = 10 ** 6

    def set_key(path, value):
        def change(m):
            *parents, last = path
            for key in parents:
                m = m[key]
            m[last] = value
        return change

    cases = {"outside": (manifest_edit(outside), "loads '../outside.onnx', which is not one of the files its sha256"),
             "tokenizer_unhashed": (manifest_edit(unhashed_tokenizer), "tokenizer has no sha256"),
             "pad_id": (manifest_edit(pad_out_of_vocabulary), "tokenizer pad_id 1000000 is not an id of its"),
             "action_head_type": (manifest_edit(set_key(["action_head"], "regression")),
                                  "'action_head' is a JSON str, not an object"),
             "sha256_type": (manifest_edit(set_key(["graphs", "vision", "sha256"], ["vision.onnx"])),
                             "graph vision has no sha256 object"),
             "shape": (manifest_edit(shape), "inputs ids"),
             "contract": (manifest_edit(contract), "instruction_tokens is 9 but the graphs take 8"),
             "missing": (lambda f: (f / "vision.onnx.data").unlink(), "vision.onnx.data (graph vision) is missing"),
             "hash": (append, "sha256 differs"),
             "json": (lambda f: (f / "manifest.json").write_text("{"), "is not JSON")}
    for name, (change, message) in cases.items():
        assert message in _one_line(_eval(edited(name, change))), name
    # the backends are checked against what the folder holds
    run, _, _ = found["regression-1"]
    assert "not an exported policy package" in _one_line(_eval(run, "--backend=onnx"))
    assert "is an exported package, not a checkpoint" in _one_line(_eval(package, "--backend=torch"))
    assert "--compile applies to the torch backend" in _one_line(_eval(package, "--compile=default"))
    assert "choose a new folder" in _one_line(run_cli("export", str(run), "--format=onnx", f"--out={tmp / 'ds'}"))
    assert (tmp / "outside.onnx").exists() is False  # nothing was written or read outside


def test_export_replaces_only_a_package_it_wrote_unchanged(packages, tmp_path):
    """A folder that merely holds a manifest.json, a package with a file added or changed, or one without the
    ownership stamp is refused in one line, untouched (that export replaces its own package unchanged: the fp16
    test)."""
    _, found = packages
    run, package, _ = found["regression-1"]
    out = tmp_path / "pkg"
    shutil.copytree(package, out)

    def refused(folder, message):
        before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert message in _one_line(run_cli("export", str(run), "--format=onnx", f"--out={folder}"))
        assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text("{}")
    (mine / "thesis.tex").write_text("years of work")
    refused(mine, "was not written by `vlaforge export`")
    (out / "notes.txt").write_text("mine")
    refused(out, "holds notes.txt, which `vlaforge export` did not write")
    (out / "notes.txt").unlink()
    (out / "export.json").write_text("{}")
    refused(out, "export.json changed since `vlaforge export` wrote it")


def test_a_package_is_evaluated_and_served_like_its_checkpoint(packages, tmp_path):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from vlaforge.serving.client import wire_observation

    _, found = packages
    run, package, _ = found["regression-1"]
    done = _eval(package, "--tasks=reach-v3", f"--out={tmp_path / 'eval'}")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["inference"]["options"]["backend"] == "auto" and report["tasks"]["reach-v3"]["episodes"] == 1
    with served(package, "--backend=onnx", "--http-port=0") as uri:
        host, port = uri.removeprefix("ws://").split(":")
        client = WebsocketClientPolicy(host, int(port))
        assert client.get_server_metadata()["backend"] == "onnx"
        reference = PolicyRuntime.load(run, device="cpu")
        std = np.asarray(reference.spec.action_std)
        for obs in _episode(3, seed=5):
            reply = client.infer(wire_observation(obs))
            assert np.abs((reply["actions"] - reference.predict(obs).actions) / std).max() <= TOL


@pytest.mark.over_budget("ExecuTorch lowers three graphs through XNNPACK (~100 s of the test)")
def test_an_executorch_package_predicts_what_its_checkpoint_predicts(packages):
    pytest.importorskip("executorch")
    tmp, found = packages
    run, _, _ = found["flow_matching-4"]
    report = _export(run, tmp / "pte", "--format=executorch")
    manifest = json.loads((tmp / "pte" / "manifest.json").read_text())
    assert manifest["runtime"] == "executorch" and {g["file"] for g in manifest["graphs"].values()} == {
        "vision.pte", "encoder.pte", "denoise.pte"}
    # XNNPACK's kernels are not bit-faithful to PyTorch's (the vision tower's GELU and softmax): 1e-3, not 1e-4
    assert report["action_error"]["max_abs_normalized"] <= 1e-3, report["action_error"]
    torch_rt, pte_rt = PolicyRuntime.load(run, device="cpu"), PolicyRuntime.load(tmp / "pte")
    assert pte_rt.backend == "executorch"
    std = np.asarray(torch_rt.spec.action_std)
    episode = _episode(4, seed=3)
    assert np.abs((_predict(torch_rt, episode) - _predict(pte_rt, episode)) / std).max() <= 1e-3
    assert "executorch package" in _one_line(_eval(tmp / "pte", "--backend=onnx"))
