"""What `export/`'s backends share (a leaf: the package writer and both backends import it, it imports neither): the
module a traced region runs as, the exporter's own error line, a graph's manifest entry and the manifest's writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vlaforge.errors import first_line
from vlaforge.inference.packages import GRAPHS, MANIFEST, OrtGraph, PteGraph, file_sha256
from vlaforge.outputs import write_atomic


class Region(torch.nn.Module):
    """One traced region of the model (export needs a module whose forward is the region)."""

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args):
        return self.fn(self.model, *args)


def exporter_cause(exc: Exception) -> str:
    """The exporter's own summary line ("<class ...>: ...") when it wrote one, else the first line."""
    lines = str(exc).splitlines()
    return next((ln for ln in lines if ln.startswith("<class")), first_line(exc))


def graph_entry(folder: Path, name: str, runtime: str = "onnxruntime") -> dict[str, Any]:
    """The manifest's entry of a written graph: files, sha256, bytes, inputs and outputs as its runtime reads them."""
    suffix = "onnx" if runtime == "onnxruntime" else "pte"
    files = [f"{name}.{suffix}"] + ([f"{name}.onnx.data"] if (folder / f"{name}.onnx.data").is_file() else [])
    kind = next(k for k, graphs in GRAPHS.items() if name in graphs)
    inputs, outputs = GRAPHS[kind][name]
    graph = (OrtGraph if runtime == "onnxruntime" else PteGraph)(folder / files[0], "cpu")
    return {"file": files[0], "sha256": {f: file_sha256(folder / f) for f in files},
            "bytes": sum((folder / f).stat().st_size for f in files),
            **graph.signature({"inputs": dict.fromkeys(inputs), "outputs": dict.fromkeys(outputs)})}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:

    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


