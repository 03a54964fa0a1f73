"""
`vlaforge export --format onnx|executorch`: a trained policy as a package that ONNX Runtime (or ExecuTorch, see
`export/executorch.py`) runs without vlaforge's model code (`inference/packages.py`), and TensorRT / QNN start from.

Package (a folder):
- `manifest.json`: format and version, the observation contract (cameras, image and render size, frame history,
  instruction length, action chunk, normalization statistics), the tokenizer's pad / eos ids, the action head and how
  to integrate it, every graph with its files, sha256, inputs and outputs (dtype, shape; `batch` is the one dynamic
  dimension), opset, dtype, quantization, the source checkpoint and the sha256 of its weights, vlaforge's version;
- `tokenizer.json` (Hugging Face `tokenizers` format), `config.toml` (the source run's, for `vlaforge eval`'s
  defaults and provenance; nothing is built from it);
- the graphs, split where a runtime benefits: `vision.onnx` (model-space pixels (N, 3, S, S) -> projected tokens
  (N, P, D), one frame per row, so the frame-feature cache works as with a checkpoint) and, for a regression head,
  `policy.onnx` (tokens (B, F*V*P, D), instruction ids and mask (B, L), normalized state (B, S) -> normalized action
  chunk (B, T, A)); for a flow-matching head the prefix and the denoising step apart: `encoder.onnx` (same inputs ->
  the velocity network's condition (B, T, H)) and `denoise.onnx` (x_t (B, T, A), t (B,), condition -> velocity),
  integrated by the runtime with `flow_steps` Euler steps (`models.action_heads.euler_sample`); for a LeRobot
  policy fine-tuned by vlaforge, `prefix.onnx` (-> every joint layer's keys and values) and `denoise.onnx` taking
  them (`export/policy.py`). Weights sit in
  `<graph>.onnx.data` beside each graph (ONNX external data: no 2 GB protobuf limit).

The instruction is always `instruction_tokens` long (padded, mask 0): only the batch dimension is dynamic, and it is
traced at 2 (a dynamic dimension traced at 0 or 1 is specialized away by torch.export).

int8 (`--quantized`): ONNX Runtime's static quantization in QDQ form (QuantizeLinear / DequantizeLinear pairs around
MatMul, Gemm and Conv; weights int8 symmetric per channel, activations int8 symmetric per tensor, MinMax ranges from
calibration inputs). QDQ is what TensorRT's explicit-precision int8 and ORT's QNN execution provider consume. It
starts from the float graphs, not from a `vlaforge quantize` checkpoint: torchao's weight-only tensor subclasses do
not trace to ONNX QDQ, and their int4 / int2 layouts have no standard ONNX form. The calibration inputs are recorded
from the float package itself running on dataset frames, so they are exactly what the runtime feeds each graph.
The ONNX backend and its int8 quantization are in `export/onnx.py`, the ExecuTorch backend in `export/executorch.py`;
both share `export/common.py`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlaforge.errors import VlaforgeError
from vlaforge.export import executorch, onnx
from vlaforge.export import policy as lerobot_policy
from vlaforge.export.common import Region, graph_entry, write_manifest
from vlaforge.inference.packages import FORMAT, FORMAT_VERSION, GRAPHS, file_sha256, read_manifest
from vlaforge.outputs import check_replaceable, replace_folder, stamp, write_atomic

REPORT = "export.json"
OWNER = "vlaforge export"  # the command named in the folder's ownership stamp (vlaforge/outputs.py)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TRACE_BATCH = 2


def _regions(model: torch.nn.Module) -> dict[str, Any]:
    head = model.action_head
    mask = lambda m: m.bool()
    out = {"vision": lambda m, pixels: m.encode_frames(pixels)}
    if getattr(head, "supports_prefix", False):
        out["encoder"] = lambda m, tokens, ids, msk, state: m.action_head.condition(
            m.query_states(tokens, ids, mask(msk)), state)
        out["denoise"] = lambda m, x_t, t, cond: m.action_head.velocity(x_t, t, cond)
    else:
        out["policy"] = lambda m, tokens, ids, msk, state: m.actions_from_tokens(tokens, ids, mask(msk), state)
    return out


def example_inputs(model, spec, dtype: torch.dtype, batch: int = TRACE_BATCH) -> dict[str, torch.Tensor]:
    """Inputs of every graph at batch `batch` (random values; only shapes and dtypes matter to the trace)."""
    g = torch.Generator().manual_seed(0)
    s = spec.image_size
    pixels = torch.rand(batch, 3, s, s, generator=g).mul(2).sub(1).to(dtype)
    with torch.inference_mode():
        per_frame = model.encode_frames(pixels[:1])
    n = len(spec.cameras) * spec.frames * per_frame.shape[1]
    length = spec.instruction_tokens
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2:] = 0  # one padded row, so the traced graph is the masked one
    head = model.action_head
    t, a = head.chunk, head.action_dim
    hidden = head.cond_proj.out_features if hasattr(head, "cond_proj") else 0
    return {"pixels": pixels, "tokens": torch.randn(batch, n, per_frame.shape[2], generator=g).to(dtype),
            "ids": torch.randint(1, 8, (batch, length), generator=g), "mask": mask,
            "state": torch.randn(batch, len(spec.state_mean), generator=g).to(dtype),
            "x_t": torch.randn(batch, t, a, generator=g).to(dtype), "t": torch.full((batch,), 0.5, dtype=dtype),
            "condition": torch.randn(batch, t, hidden, generator=g).to(dtype)}


def checkpoint_digest(ckpt: Path) -> str:
    """sha256 of the checkpoint's weights file (the consolidated safetensors; a sharded checkpoint's shards, in
    name order)."""
    from vlaforge.checkpoints.layout import DCP_DIR, MODEL_FILE

    files = [ckpt / MODEL_FILE] if (ckpt / MODEL_FILE).is_file() else sorted((ckpt / DCP_DIR).rglob("*"))
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(file_sha256(f).encode())
    return h.hexdigest()


FORMATS = {"onnx": "onnxruntime", "executorch": "executorch"}  # --format -> the package's runtime


def export_package(checkpoint: str | Path, out: str | Path, *, format: str = "onnx", dtype: str = "fp32",
                   int8: bool = False, calibrate: int = 256, frames: int = 32, data: str | None = None,
                   seed: int = 0) -> dict[str, Any]:
    """Write the package `out` from a checkpoint and measure it against the checkpoint through `PolicyRuntime`:
    returns the report (also `out/export.json`): export seconds, bytes per graph, and on `frames` dataset frames the
    action error of the package against the PyTorch policy (normalized units) and both latencies. Written into a
    temporary folder beside `out` and renamed when complete; a failure leaves `out` as it was."""
    from vlaforge.checkpoints.layout import resolve_checkpoint
    from vlaforge.inference.runtime import PolicyRuntime
    from vlaforge.models.blocks import is_policy

    if format not in FORMATS:
        raise VlaforgeError(f"--format {format!r} is not one of safetensors, {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise VlaforgeError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if int8 and (dtype != "fp32" or format != "onnx"):
        raise VlaforgeError("--quantized quantizes fp32 ONNX graphs (QDQ keeps fp32 between the int8 ops); use it "
                            "with --format onnx and without --dtype")
    if format == "executorch":
        if (why := executorch.available()) is not None:
            raise VlaforgeError(why)
        if dtype != "fp32":
            raise VlaforgeError("--format executorch writes fp32 programs (XNNPACK); drop --dtype")
    ckpt = resolve_checkpoint(str(checkpoint), ".", what="CHECKPOINT")
    out = Path(out)
    _check_out(out, ckpt)
    source = PolicyRuntime.load(ckpt, device="cpu", dtype="fp32", cache="none")
    if format != "onnx" and is_policy(source.model):
        raise VlaforgeError(f"--format {format} of a LeRobot policy is not built (its lowered programs fail in "
                            "ExecuTorch's runtime: execute error 0x12); use --format onnx")
    if getattr(source.model, "quantization", None) is not None:
        raise VlaforgeError(f"{ckpt} is a `vlaforge quantize` folder: torchao's quantized tensors do not trace to "
                            "ONNX; export the float run, with --quantized for an int8 package")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        report = _write_package(ckpt, tmp, source, format, dtype, int8, calibrate, frames, data, seed)
        check_parity(report)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind; `out` is untouched
        raise
    stamp(tmp, OWNER)
    replace_folder(tmp, out)
    report["package"] = str(out)
    return report


# the parity a package must reach against its checkpoint, or the export fails and writes nothing: fp32 graphs
# compute what PyTorch computes (measured ~1e-6 normalized), fp16 rounds (~1e-2), int8 QDQ approximates (cosine)
PARITY_MAX_ABS = {"fp32": 1e-3, "fp16": 0.1}


PARITY_INT8_COSINE = 0.8


def check_parity(report: dict[str, Any]) -> None:
    """Raise when the package's actions are not the checkpoint's (a graph that traced something the model does
    not compute, such as attention without the model's sliding window): the export fails rather than ship it.

    Raises:
        VlaforgeError: the measured error is over the bar of the package's dtype.
    """
    e = report["action_error"]
    if report.get("int8"):
        bad, bar = e["cosine_mean"] < PARITY_INT8_COSINE, f"cosine mean >= {PARITY_INT8_COSINE}"
    else:
        limit = PARITY_MAX_ABS[report["dtype"]]
        bad, bar = e["max_abs_normalized"] > limit, f"max |error| <= {limit:g} for {report['dtype']}"
    if bad:
        raise VlaforgeError(f"the exported package's actions are not the checkpoint's (max |error| "
                            f"{e['max_abs_normalized']:.3g} normalized, cosine mean {e['cosine_mean']:.3f}; the bar "
                            f"is {bar}): the {report['format']} graphs do not reproduce this model; nothing was "
                            "written (the safetensors export keeps every model)")


def _write_package(ckpt: Path, tmp: Path, source, format: str, dtype: str, int8: bool, calibrate: int, frames: int,
                   data: str | None, seed: int) -> dict[str, Any]:
    from vlaforge import __version__
    from vlaforge.checkpoints.layout import CONFIG_FILE
    from vlaforge.inference.runtime import PolicyRuntime
    from vlaforge.models.blocks import is_policy
    from vlaforge.models.vision import vision_family

    model, spec = source.model, source.spec
    tower = vision_family(model.vision)
    if not tower.static_shapes:
        raise VlaforgeError(f"vlaforge export: the {tower.name} vision tower sizes its attention windows and sequences "
                            "from the values of its patch grid, which a graph export cannot trace; serve this "
                            "checkpoint with vlaforge serve (PyTorch) instead")
    policy = is_policy(model)
    kind = "flow_matching_kv" if policy else "flow_matching" if model.action_head.supports_prefix else "regression"
    t0 = time.perf_counter()
    traced = copy.deepcopy(model).to(DTYPES[dtype]).eval()
    examples = example_inputs(traced, spec, DTYPES[dtype])
    if policy:
        examples, regions = lerobot_policy.example_inputs(traced, examples), lerobot_policy.regions()
    else:
        regions = _regions(traced)
    for name, (inputs, outputs) in GRAPHS[kind].items():
        region = Region(traced, regions[name])
        if format == "onnx":
            onnx.export_graph(region, inputs, outputs, examples, tmp / f"{name}.onnx")
        else:
            rows = len(spec.cameras) * spec.frames if name == "vision" else 1
            executorch.lower(region, tuple(examples[k] for k in inputs), tmp / f"{name}.pte",
                             executorch.MAX_BATCH * rows)
    export_s = time.perf_counter() - t0
    del traced
    _package_files(ckpt, source.tokenizer, tmp)
    head = model.action_head
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "runtime": FORMATS[format],
        "vlaforge_version": __version__, "dtype": dtype, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **({"opset": onnx.OPSET} if format == "onnx" else {"delegate": "XNNPACK", "max_batch": executorch.MAX_BATCH}),
        "source": {"checkpoint": str(ckpt), "weights_sha256": checkpoint_digest(ckpt), "config": CONFIG_FILE},
        "observation": {**{k: getattr(spec, k) for k in (
            "cameras", "frames", "frame_stride", "image_size", "render_size", "instruction_tokens", "text_tokens",
            "chunk")}, **spec.affine()},  # a LeRobot policy's QUANTILES etc. as the affine map they are
        "tokenizer": {"file": "tokenizer.json", "sha256": {"tokenizer.json": file_sha256(tmp / "tokenizer.json")},
                      "pad_id": source.tokenizer.pad_id, "eos_id": source.tokenizer.eos_id,
                      "style": source.tokenizer.style},
        "action_head": lerobot_policy.head_entry(model) if policy else {
            "kind": kind, "chunk": head.chunk, "action_dim": head.action_dim,
            **({"flow_steps": head.flow_steps, "integration": "euler from t=1 (noise) to t=0"}
               if kind == "flow_matching" else {})},
        "dynamic_axes": {"batch": "dimension 0 of every input and output"},
        "quantization": None,
        "graphs": {name: graph_entry(tmp, name, FORMATS[format]) for name in GRAPHS[kind]},
    }
    write_manifest(tmp, manifest)
    report: dict[str, Any] = {"checkpoint": str(ckpt), "format": format, "dtype": dtype, "head": kind,
                              "export_s": round(export_s, 2)}
    dataset = None if data == "none" else (data or _run_data(ckpt))
    picked = _frames(dataset, spec, calibrate + frames if int8 else frames, seed)
    if int8:
        report["int8"] = onnx.quantize_package(tmp, manifest, picked[:calibrate])
        picked = picked[calibrate:]
    report["bytes"] = {name: g["bytes"] for name, g in read_manifest(tmp)["graphs"].items()}
    report["bytes"]["total"] = sum(report["bytes"].values())
    report["bytes"]["checkpoint_fp32"] = int(sum(p.numel() * 4 for p in model.parameters()))
    package = PolicyRuntime.load(tmp, cache="none")
    report |= measure(source, package, picked)
    report["data"] = str(dataset) if dataset else None
    write_atomic(tmp / REPORT, json.dumps(report, indent=1) + "\n")
    return report


def _check_out(out: Path, ckpt: Path) -> None:
    if out.resolve() == ckpt.resolve() or ckpt.resolve().is_relative_to(out.resolve()):
        raise VlaforgeError(f"--out {out} would replace the checkpoint it exports; choose a new folder")
    check_replaceable(out, OWNER)


def _package_files(ckpt: Path, tokenizer, folder: Path) -> None:
    from vlaforge.checkpoints.layout import CONFIG_FILE

    shutil.copy2(ckpt / CONFIG_FILE, folder / CONFIG_FILE)
    tok = tokenizer.tok
    backend = tok if hasattr(tok, "get_vocab_size") else getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise VlaforgeError("the policy's tokenizer is not a fast (Rust `tokenizers`) tokenizer, so it has no "
                            "tokenizer.json for the package; use a pretrained LLM with a fast tokenizer")
    backend.save(str(folder / "tokenizer.json"))


def _run_data(ckpt: Path) -> str | None:
    from vlaforge.checkpoints.layout import saved_config
    from vlaforge.data.hub_dataset import dataset_root

    data = saved_config(ckpt).data
    root = dataset_root(data, fetch=False) if data.path else None
    return str(root) if root is not None and (root / "meta" / "info.json").is_file() else None


def _frames(dataset: str | None, spec, count: int, seed: int) -> list:
    """Dataset frames as runtime observations; without a dataset, observations of random images and states (the
    parity still compares the two runtimes on identical inputs, but not on the policy's own image distribution)."""
    from vlaforge.evaluation.quantization import Frame, dataset_frames
    from vlaforge.inference.runtime import Observation

    if dataset:
        return dataset_frames(dataset, spec, count, seed)
    g = np.random.default_rng(seed)
    cams = [c.removeprefix("observation.images.") for c in spec.cameras]
    out = []
    for i in range(count):
        obs = Observation({c: g.integers(0, 256, (spec.render_size, spec.render_size, 3), dtype=np.uint8)
                           for c in cams}, g.normal(size=len(spec.state_mean)).astype(np.float32) * spec.state_std
                          + np.asarray(spec.state_mean, np.float32), "reach the goal")
        out.append(Frame([obs], i, 0, np.zeros((spec.chunk, len(spec.action_mean)), np.float32)))
    return out


def measure(reference, package, frames: list) -> dict[str, Any]:
    """Action error of `package` against `reference` on `frames` (normalized units; the same noise for flow heads)
    and per-prediction latency of both, interleaved so the machine's noise falls on both alike."""
    from vlaforge.evaluation.quantization import action_error, side_by_side

    ref, got, t_ref, t_pkg = side_by_side(reference, package, frames, seed=0)
    p50 = lambda v: round(float(np.percentile(v, 50)), 3)
    return {"frames": len(frames), "action_error": action_error(ref, got) | {
                "max_abs_normalized": float(np.abs(ref - got).max())},
            "latency_ms": {"pytorch_p50": p50(t_ref), "package_p50": p50(t_pkg),
                           "speedup_p50": round(p50(t_ref) / max(p50(t_pkg), 1e-9), 3),
                           "threads": torch.get_num_threads()}}


def render(report: dict[str, Any]) -> str:
    """The report in a few lines: package, bytes, parity, latency."""
    e, lat, b = report["action_error"], report["latency_ms"], report["bytes"]
    graphs = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in b.items() if k not in ("total", "checkpoint_fp32"))
    kind = f"{report['format']}, " + ("int8 QDQ" if report.get("int8") else report["dtype"])
    on = f"{report['frames']} dataset frames" if report["data"] else f"{report['frames']} random observations"
    return "\n".join([
        f"wrote {report['package']} ({kind}, {report['head']} head; exported in {report['export_s']} s)",
        f"graphs: {graphs}; total {b['total'] / 2**20:.2f} MiB (checkpoint fp32 "
        f"{b['checkpoint_fp32'] / 2**20:.2f} MiB)",
        f"against the checkpoint on {on}: max |error| {e['max_abs_normalized']:.3g} (normalized), cosine mean "
        f"{e['cosine_mean']:.5f} min {e['cosine_min']:.5f}",
        f"latency p50: PyTorch {lat['pytorch_p50']} ms, package {lat['package_p50']} ms ({lat['speedup_p50']}x, "
        f"{lat['threads']} threads)",
        f"report: {report['package']}/{REPORT}"])


