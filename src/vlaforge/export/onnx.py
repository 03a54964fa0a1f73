"""The ONNX backend of `vlaforge export` (`export/package.py` writes the package): a region traced by torch.export
into an ONNX graph with a dynamic batch, and the package's graphs replaced by int8 QDQ graphs calibrated on the
inputs the float package receives (`--quantized`)."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlaforge.errors import VlaforgeError, first_line
from vlaforge.export.common import exporter_cause, graph_entry, write_manifest

OPSET = 20

def export_graph(region: torch.nn.Module, inputs: list[str], outputs: list[str], examples: dict[str, torch.Tensor],
                 path: Path) -> None:
    import warnings

    batch = torch.export.Dim("batch", min=1, max=4096)
    args = tuple(examples[k] for k in inputs)
    chatter = io.StringIO()  # the exporter prints its progress; a failure's cause is in the exception
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" for its custom ops
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad(), \
            contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(region.eval(), args, str(path), dynamo=True, external_data=True, opset_version=OPSET,
                              input_names=inputs, output_names=outputs,
                              dynamic_shapes=(tuple({0: batch} for _ in args),), verbose=False)
        except Exception as exc:  # noqa: BLE001 - torch.export / onnxscript raise many types; one line names it
            raise VlaforgeError(f"ONNX export of {path.stem} failed ({exporter_cause(exc)[:300]}); report it with the "
                                "run's config.toml") from None


class _Recorder:
    """Wraps a region's graph and keeps the inputs it is fed (calibration data)."""

    def __init__(self, graph, keep: list[dict[str, np.ndarray]]):
        self.graph, self.keep = graph, keep

    def __call__(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.keep.append({k: np.array(v, copy=True) for k, v in feed.items()})
        return self.graph(feed)


def quantize_package(folder: Path, manifest: dict[str, Any], frames: list) -> dict[str, Any]:
    """Replace an ONNX package's graphs by int8 QDQ graphs calibrated on the inputs the float package receives on
    `frames`; the manifest is rewritten with the new files and hashes."""
    from onnxruntime.quantization.calibrate import CalibrationDataReader

    from vlaforge.evaluation.quantization import predict_all
    from vlaforge.inference.runtime import PolicyRuntime

    if not frames:
        raise VlaforgeError("--quantized needs calibration frames: --calibrate N with N > 0")
    runtime = PolicyRuntime.load(folder, backend="onnx", cache="none")
    recorded: dict[str, list] = {name: [] for name in manifest["graphs"]}
    regions = runtime.model
    regions.graphs = {n: _Recorder(g, recorded[n]) for n, g in regions.graphs.items()}
    predict_all(runtime, frames, seed=0)
    del runtime, regions

    class Reader(CalibrationDataReader):
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    t0 = time.perf_counter()
    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # the quantizer logs advice through the root logger
    try:
        for name, entry in manifest["graphs"].items():
            _quantize_graph(folder, name, entry, recorded[name], Reader)
    finally:
        root.setLevel(level)
    manifest["graphs"] = {name: graph_entry(folder, name) for name in manifest["graphs"]}
    manifest["quantization"] = {"method": "onnxruntime.quantization.quantize_static", "format": "QDQ",
                                "ops": ["MatMul", "Gemm", "Conv"], "weights": "int8 symmetric per channel",
                                "activations": "int8 symmetric per tensor", "calibration": "MinMax",
                                "calibration_frames": len(frames)}
    write_manifest(folder, manifest)
    return {"calibration_frames": len(frames), "seconds": round(time.perf_counter() - t0, 2),
            "calibration_inputs": {n: len(v) for n, v in recorded.items()}}


def _quantize_graph(folder: Path, name: str, entry: dict[str, Any], feeds: list, reader) -> None:
    """`name`'s graph replaced by its int8 QDQ form (weights beside it in `<name>.onnx.data`)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    src, dst = folder / entry["file"], folder / f"{name}.int8.onnx"
    try:
        quantize_static(str(src), str(dst), reader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["MatMul", "Gemm", "Conv"], per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    except Exception as exc:  # noqa: BLE001 - onnxruntime.quantization raises plain exceptions
        raise VlaforgeError(f"int8 quantization of {name} failed ({first_line(exc)[:300]})") from None
    quantized = onnx.load(str(dst))  # with its external data, whatever the quantizer named that file
    for f in entry["sha256"]:
        (folder / f).unlink()
    for f in folder.glob(f"{name}.int8.onnx*"):
        f.unlink()
    onnx.save_model(quantized, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{name}.onnx.data", size_threshold=1024)


