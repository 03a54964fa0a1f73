"""The quantized checkpoint's weights: safetensors plus a manifest, never a pickle.

`model.safetensors` holds every tensor of the state dict as plain tensors: torchao's quantized weights are
flattened by `torchao.prototype.safetensors` (its `qdata`, `scale`, `zero_point` parts under
`<module>._<param>_<part>`, with each weight's class and attributes as JSON in the file's metadata - the format
transformers reads for torchao checkpoints). Loading rebuilds only classes on torchao's allow-list from that JSON
and runs no code from the file, which is why this and not `torch.load(weights_only=True)`: a weights-only unpickler
still needs every torchao tensor class allow-listed by hand and still parses a pickle stream.

torchao keeps int4 / int3 / int2 values one per int8 byte in memory (`IntxUnpackedToInt8Tensor`); on disk they are
bit-packed (torchao's `bitpacking`: 2, 3 or 4 bits per value), so the file is as small as the bit-width says.
`quantization.json` beside it is the manifest: the layout per component (mode, group size, torchao configs, layers
quantized and left out with reasons), the device the layout runs on, and the packed parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError, first_line
from vlaforge.outputs import write_atomic
from vlaforge.techniques.quantize import INTX_BITS, QuantReport, apply_quantization

MANIFEST = "quantization.json"
WEIGHTS = "model.safetensors"
PACKED_KEY = "vlaforge.packed"  # safetensors metadata: part name -> [bits, shape, number of packed pieces]
FORMAT = 1


def is_quantized(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def save_quantized(model: nn.Module, folder: Path) -> dict[str, int]:
    """Write `model`'s weights (quantized by `apply_quantization`) and the manifest into `folder`.

    Returns: bytes on disk per component (the packed tensors as written)."""
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    report: QuantReport = model.quantization
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors, metadata = flatten_tensor_state_dict(state)
    packed = {}
    for key in list(tensors):
        bits = _packed_bits(key, metadata)
        if bits:
            shape, parts = list(tensors[key].shape), _pack(tensors.pop(key), bits)
            packed[key] = [bits, shape, len(parts)]
            for i, part in enumerate(parts):
                tensors[f"{key}.packed{i}"] = part
    metadata[PACKED_KEY] = json.dumps(packed)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    folder = Path(folder)
    tmp = folder / f".{WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, folder / WEIGHTS)
    manifest = {"format": FORMAT, "weights": WEIGHTS, **report.to_json(), "packed": packed}
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    return tensor_bytes(tensors)


def _packed_bits(key: str, metadata: dict[str, str]) -> int | None:
    """Bits per value of an int4/int3/int2 `qdata` part, else None."""
    module, _, part = key.rpartition("._")
    if not part.endswith("_qdata"):
        return None
    info = json.loads(metadata.get(f"{module}.{part.removesuffix('_qdata')}", "{}"))
    if info.get("_type") != "IntxUnpackedToInt8Tensor":
        return None
    target = info.get("_data", {}).get("target_dtype", {})
    return INTX_BITS.get(target.get("_data") if isinstance(target, dict) else None)


def _pack(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    from torchao.prototype.dtypes.uintx.bitpacking import pack

    flat = values.flatten().to(torch.int16) + (1 << (bits - 1))  # signed -> unsigned
    pad = (-flat.numel()) % 8
    flat = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    return pack(flat.to(torch.uint8), bits, dim=-1)


def _unpack(parts: list[torch.Tensor], bits: int, shape: list[int]) -> torch.Tensor:
    from torchao.prototype.dtypes.uintx.bitpacking import unpack

    n = int(torch.Size(shape).numel())
    flat = unpack(parts, bits, dim=-1)[:n].to(torch.int16) - (1 << (bits - 1))
    return flat.to(torch.int8).reshape(shape)


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes per component (the first part of each name) of plain tensors."""
    out = dict.fromkeys(COMPONENTS, 0)
    for k, v in tensors.items():
        component = k.split(".")[0]
        out[component] = out.get(component, 0) + v.numel() * v.element_size()
    return out


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes per component the model holds in memory (the parts of quantized tensors, unpacked)."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    tensors, _ = flatten_tensor_state_dict({k: v.detach() for k, v in model.state_dict().items()})
    return tensor_bytes(tensors)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        QuantReport.from_json(manifest)
    except (OSError, ValueError, KeyError, TypeError, VlaforgeError) as exc:
        raise VlaforgeError(f"{path} is not a vlaforge quantization manifest ({first_line(exc, 120)}); "
                            "re-run `vlaforge quantize`") from None
    if manifest.get("format") != FORMAT:
        raise VlaforgeError(f"{path}: format {manifest.get('format')!r} is not {FORMAT}; re-run `vlaforge quantize` "
                            "with this vlaforge")
    return manifest


def load_quantized(folder: Path, model: nn.Module, device: torch.device | str = "cpu") -> QuantReport:
    """Quantize the freshly built `model` as the manifest says, then load the file's weights into it.

    Raises:
        VlaforgeError: a missing, truncated or foreign file (anything but safetensors with torchao's allow-listed
            classes), a layout for another device, or weights that do not fit the model.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    layout = QuantReport.from_json(manifest)
    device = torch.device(device)
    if layout.device == "cuda" and device.type != "cuda":
        raise VlaforgeError(f"{folder} was quantized for CUDA (int4 tinygemm layout) and cannot run on "
                            f"{device.type}; quantize the float run again without --device cuda")
    # NOTE: the tensor classes follow the device the layout was made for (a CPU layout's int4 is torchao's portable
    # IntxUnpackedToInt8Tensor, which also runs on CUDA); the weights then move to `device`
    apply_quantization(model, layout.policies(), layout.device, allow_action_head=True)
    state = _read_state(folder / manifest.get("weights", WEIGHTS), torch.device(layout.device))
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, ValueError) as exc:
        raise VlaforgeError(f"{folder / WEIGHTS} does not fit the model its config.toml builds "
                            f"({first_line(exc, 160)}); re-run `vlaforge quantize` on the run") from None
    model.to(device)
    model.quantization = layout
    return layout


def _read_state(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError, RuntimeError, ValueError) as exc:
        raise VlaforgeError(f"{path} is not a readable safetensors file ({first_line(exc, 120)}); quantized "
                            "checkpoints load only from safetensors (never a pickle): re-run `vlaforge quantize`") \
            from None
    try:
        for key, (bits, shape, n) in json.loads(metadata.pop(PACKED_KEY, "{}")).items():
            parts = [tensors.pop(f"{key}.packed{i}") for i in range(n)]
            tensors[key] = _unpack(parts, bits, shape).to(device)
        state, leftover = unflatten_tensor_state_dict(tensors, metadata)
    except (KeyError, ValueError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise VlaforgeError(f"{path}: the quantized layout in its metadata is damaged or names a class outside "
                            f"torchao's allow-list ({first_line(exc, 120)}); re-run `vlaforge quantize`") from None
    return {**state, **leftover}


def place(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`model` on `device` in `dtype`; the components of a quantized model (`vlaforge quantize`) that are quantized or
    cast keep their own dtype (each computes behind its dtype boundary, techniques/quantize.py)."""
    layout = getattr(model, "quantization", None)
    if layout is None:
        return model.to(device, dtype)
    model.to(device)
    for name in COMPONENTS:
        if layout.mode(name) == "none":
            getattr(model, name).to(dtype)
    return model
