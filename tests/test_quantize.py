"""Per-component quantization: each component's config hits exactly its layers, a quantized checkpoint round-trips
through safetensors (bit-packed) into PolicyRuntime with the same actions, a file that is not our safetensors is
refused in one line without running anything, and QAT trains, resumes and converts to the forward it trained."""

from __future__ import annotations

import copy
import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from shared_runs import base_run, link_dataset, shared_folder
from torch import nn

from vlaforge.errors import VlaforgeError
from vlaforge.inference.runtime import Observation, PolicyRuntime
from vlaforge.models.build import build_vla
from vlaforge.techniques.quantize import QuantPolicy, apply_quantization, prepare_qat
from vlaforge.techniques.quantized_format import _pack, _unpack

from conftest import TINY_RECIPE, run_cli, tiny_config, train_on_dataset
from fake_lerobot import CAMS, SIZE

COMPONENTS = ("vision", "projector", "llm", "action_head")


def _quantized_layers(model: nn.Module) -> set[str]:
    from torchao.utils import TorchAOBaseTensor

    return {n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), TorchAOBaseTensor)}


@pytest.mark.parametrize("component,mode", [("vision", "int8"), ("projector", "int8_dynamic"), ("llm", "int4"),
                                            ("action_head", "int2")])
def test_each_component_config_hits_exactly_its_layers(component, mode):
    cfg = tiny_config()
    model = build_vla(cfg.model, cfg.loss)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = apply_quantization(model, {component: mode}, allow_action_head=True)
    entry = report.components[component]
    assert _quantized_layers(model) == set(entry.quantized) and entry.quantized
    assert all(name.split(".")[0] == component for name in entry.quantized)
    for k, v in model.state_dict().items():  # every other component is untouched, bit for bit
        if k.split(".")[0] != component:
            assert torch.equal(v, before[k]), k
    if component == "vision":
        assert "convolution" in entry.skipped["vision.embeddings.patch_embedding"]
        assert "position table" in entry.skipped["vision.embeddings.position_embedding"]
    if component == "llm":  # the token table is quantized with the linears
        assert entry.quantized["llm.model.embed_tokens"] == "embedding"
    if component == "action_head":  # a 4-wide input does not hold a group of 32
        assert "group size 32" in entry.skipped["action_head.state_proj"]


def test_the_action_head_needs_the_explicit_flag_and_modes_are_checked():
    model = build_vla(tiny_config().model, tiny_config().loss)
    with pytest.raises(VlaforgeError, match="--allow-action-head"):
        apply_quantization(model, {"action_head": "int8"})
    with pytest.raises(VlaforgeError, match="not one of"):
        QuantPolicy("int5")
    with pytest.raises(VlaforgeError, match="power of two"):
        QuantPolicy("int4", group_size=24)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bit_packing_round_trips_and_takes_the_bit_width(bits):
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (37, 19), dtype=torch.int8)
    parts = _pack(values, bits)
    assert sum(p.numel() for p in parts) == pytest.approx(values.numel() * bits / 8, abs=bits)
    assert torch.equal(_unpack(list(parts), bits, list(values.shape)), values)


def test_mixed_components_compute_in_their_own_dtypes():
    """fp16 projector between an int8 vision tower and an fp32 LLM: the boundaries cast both ways, and the chunk
    stays close to the float model's."""
    cfg = tiny_config()
    model = build_vla(cfg.model, cfg.loss).eval()
    quant = copy.deepcopy(model)
    apply_quantization(quant, {"vision": "int8", "projector": "fp16", "llm": "int8_dynamic"})
    assert quant.projector.mlp[0].weight.dtype == torch.float16
    size = model.layout.image_size
    pixels = torch.rand(2, 3, size, size)
    with torch.no_grad():
        a, b = model.encode_frames(pixels), quant.encode_frames(pixels)
    assert b.dtype == torch.float32  # handed back in the caller's dtype
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


# ---- checkpoints through the CLI --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The session's full run on the fake LeRobot dataset (tests/shared_runs.py)."""
    return base_run(tmp_path_factory)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, trained):
    """The run quantized (int8 vision, fp16 projector, int3 LLM, calibrated) by a fresh `vlaforge quantize` process
    (the verb's entry point), once per session; tests read it, or damage a copy."""
    def build(out):
        done = run_cli("quantize", str(trained), f"--out={out}", "--vision=int8", "--projector=fp16", "--llm=int3",
                       "--frames=4", "--calibrate=2", "--no-progress", fresh=True)
        assert done.returncode == 0, done.stderr[-2000:]

    return shared_folder(tmp_path_factory, "quantized", build)


def _observations(n=3):
    g = np.random.default_rng(0)
    return [Observation({c: g.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for c in CAMS},
                        g.normal(size=4).astype(np.float32), "open the door") for _ in range(n)]


def _actions(runtime):
    return np.stack([runtime.predict(o, f"s{i}").actions for i, o in enumerate(_observations())])


def test_a_quantized_checkpoint_round_trips_and_loads_like_any_other(trained, quantized, tmp_path):
    run, out = trained, quantized
    report = json.loads((out / "quantize.json").read_text())
    assert report["layout"]["components"]["llm"]["policy"]["mode"] == "int3"
    assert set(report["calibration"]["llm"]["mse_normalized"]) == {"affine", "hqq"}
    assert report["bytes"]["total"]["disk"] < 0.5 * report["bytes"]["total"]["fp32"]
    assert report["bytes"]["per_component"]["llm"]["disk"] < report["bytes"]["per_component"]["llm"]["memory"]
    assert report["action_error"]["cosine_mean"] > 0.9
    # the file gives the actions of the model quantized in memory with the same layout
    float_rt = PolicyRuntime.load(run, cache="none")
    model = copy.deepcopy(float_rt.model)
    layout = {c: QuantPolicy(**report["layout"]["components"][c]["policy"]) for c in COMPONENTS}
    apply_quantization(model, layout)
    in_memory = PolicyRuntime(model, float_rt.spec, float_rt.tokenizer, cache="none")
    loaded = PolicyRuntime.load(out, cache="none")
    assert loaded.describe()["quantization"].startswith("vision=int8")
    np.testing.assert_array_equal(_actions(loaded), _actions(in_memory))
    assert not np.array_equal(_actions(loaded), _actions(float_rt))  # it is quantized
    # training refuses it in one line
    proc = run_cli("train", str(TINY_RECIPE), f"--train.init_from={out}", f"--train.output_dir={tmp_path / 'x'}")
    assert proc.returncode == 2 and "quantized" in proc.stderr and "Traceback" not in proc.stderr


class _Payload:
    def __reduce__(self):
        import os

        return os.system, ("touch pwned",)


@pytest.mark.parametrize("attack", ["pickle", "foreign_class"])
def test_a_malicious_weights_file_is_refused_in_one_line(quantized, tmp_path, attack):
    out = tmp_path / "q"
    shutil.copytree(quantized, out)  # a quantized checkpoint, its weights file replaced below
    weights = out / "model.safetensors"
    if attack == "pickle":
        weights.write_bytes(pickle.dumps({"llm": _Payload()}))
    else:  # valid safetensors whose layout names a class outside torchao's allow-list
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(weights), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        name = next(k for k, v in meta.items() if "IntxUnpackedToInt8Tensor" in v)
        meta[name] = meta[name].replace("IntxUnpackedToInt8Tensor", "os.system")
        save_file(tensors, str(weights), metadata=meta)
    proc = run_cli("eval", str(out), "--episodes=1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "re-run `vlaforge quantize`" in proc.stderr
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_qat_trains_resumes_and_converts_to_the_forward_it_trained(trained, tmp_path):
    """QAT prepare -> train 3 steps (grad accumulation) -> convert -> predict; a run resumed from the straight run's
    step-2 checkpoint (into an empty folder) equals it at step 3; the converted checkpoint's actions equal the
    fake-quantized model's."""
    tmp = link_dataset(tmp_path, trained)
    qat = ("--components.llm.qat=int2", "--components.vision.qat=int4", "--train.grad_accum=2")
    straight = train_on_dataset(tmp, "qat", *qat, "--train.checkpoint_every=2", steps=3)
    resumed = train_on_dataset(tmp, "qat_resumed", *qat,
                               f"--train.resume={straight / 'checkpoints' / 'step_00000002'}", steps=3)
    from safetensors.torch import load_file

    a = load_file(str(straight / "checkpoints" / "step_00000003" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = tmp / "qat_q"
    done = run_cli("quantize", str(straight), f"--out={out}", "--frames=2", "--no-progress")  # modes from the run
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "quantize.json").read_text())
    assert report["qat_trained"] == ["llm", "vision"]
    assert report["layout"]["components"]["llm"]["policy"]["mode"] == "int2"
    # the fake-quantized model (as training ran it) and the converted checkpoint predict the same chunk
    float_rt = PolicyRuntime.load(straight, cache="none")
    fake = copy.deepcopy(float_rt.model)
    prepare_qat(fake, dict(tiny_config(components={"llm": {"qat": "int2"}, "vision": {"qat": "int4"}})
                            .components.items()))
    fake.load_state_dict(float_rt.model.state_dict())
    fake_rt = PolicyRuntime(fake, float_rt.spec, float_rt.tokenizer, cache="none")
    np.testing.assert_allclose(_actions(PolicyRuntime.load(out, cache="none")), _actions(fake_rt), atol=1e-5)
