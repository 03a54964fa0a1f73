"""`vlaforge export --format executorch`: the package's graphs as ExecuTorch programs (`.pte`) with their linear
algebra delegated to XNNPACK, run by ExecuTorch's Python runtime (`inference/packages.py`) and by its C++ runtime on
a device. Same package layout and manifest as ONNX (`export/onnx.py`), `"runtime": "executorch"`.

ExecuTorch plans every buffer ahead of time, so the dynamic batch has an upper bound: `MAX_BATCH` rows for the
policy graphs and `MAX_BATCH` x cameras x frames for the vision graph (one row per frame); fp32 only here (XNNPACK's
int8 needs the PT2E quantization flow, not built).
"""

from __future__ import annotations

from pathlib import Path

import torch

from vlaforge.errors import VlaforgeError

MAX_BATCH = 64


def available() -> str | None:
    """None when ExecuTorch can export here, else why not (one line)."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # noqa: F401 - is it there
        from executorch.exir import to_edge_transform_and_lower  # noqa: F401 - is it there
    except ImportError as exc:
        return (f"--format executorch needs the executorch package ({exc.name or exc} is missing): pip install "
                "executorch==1.5.1 (it runs beside torch 2.13)")
    return None


def lower(region: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, max_batch: int) -> None:
    """torch.export the region with a dynamic batch (up to `max_batch`), lower it to XNNPACK, write the program."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from vlaforge.export.common import exporter_cause

    batch = torch.export.Dim("batch", min=1, max=max_batch)
    try:
        with torch.no_grad():
            program = torch.export.export(region.eval(), args, dynamic_shapes=(tuple({0: batch} for _ in args),))
            lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    except Exception as exc:  # noqa: BLE001 - torch.export / exir raise many types; one line names it
        raise VlaforgeError(f"ExecuTorch export of {path.stem} failed ({exporter_cause(exc)[:300]}); report it with "
                            "the run's config.toml") from None
    path.write_bytes(lowered.buffer)
