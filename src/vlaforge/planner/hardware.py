"""The accelerator catalog the planner plans for: memory, dense tensor-core throughput per dtype, HBM bandwidth,
the intra-node link (NVLink or PCIe) and the inter-node network, per GPU.

Figures are the vendors' datasheet values for dense math (no 2:4 sparsity), in SI units (1 TFLOP/s = 1e12, 1 GB/s =
1e9 B/s). Link bandwidths are per GPU and per direction, which is what a ring collective moves data at. Inter-node
figures assume the usual one NIC per GPU (A100: HDR 200 Gb/s; H100/H200/B200: NDR 400 Gb/s); clusters differ, so
every field can be overridden from a TOML file (`load_catalog`).

`launch_us` is not a datasheet figure: the host seconds per kernel launch of a training step (Python, dispatcher,
autograd and the CUDA launch), 43.5 us from the first H100 run (planner/launches.py says how), given to every CUDA
entry (it belongs to the host and the software more than to the GPU; override it per cluster). The CPU entry has
none: its calibration fits a fixed overhead instead.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from vlaforge.errors import VlaforgeError

GB = 1e9  # the catalog's unit (and the planner's reports'): SI gigabytes
LAUNCH_US = 43.5  # host microseconds per kernel launch, the first H100 run's (planner/launches.py)
OPTIONAL = ("launch_us",)  # fields a new catalog entry may leave out


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # usable device memory, GB (1e9 bytes)
    bf16_tflops: float  # dense
    fp16_tflops: float  # dense
    fp8_tflops: float  # dense; 0 where the GPU has no fp8 tensor cores
    hbm_gbps: float  # device memory bandwidth, GB/s
    intra_node_gbps: float  # NVLink (or PCIe when there is none), per GPU per direction, GB/s
    inter_node_gbps: float  # network per GPU per direction, GB/s
    pcie_gbps: float  # host link per direction (offload to CPU memory / NVMe goes through it), GB/s
    launch_us: float = LAUNCH_US  # host seconds per kernel launch of a training step, in microseconds (0: no floor)

    def tflops(self, precision: str) -> float:
        """Dense matmul throughput for a component computing in `precision` (fp32 runs on TF32 tensor cores at
        half the bf16 rate on these GPUs).

        Raises:
            VlaforgeError: fp8 on a GPU without fp8 tensor cores (torchao's fp8 linears there are emulated: slower
                than bf16, never a plan)."""
        if precision == "fp8" and not self.fp8_tflops:
            raise VlaforgeError(no_fp8(self.name))
        return {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp8": self.fp8_tflops,
                "fp32": self.bf16_tflops / 2}[precision]


def no_fp8(name: str) -> str:
    return (f"{name} has no fp8 tensor cores: fp8 linears there run slower than bf16 (torchao emulates them); plan "
            "them in bf16, or on a GPU with fp8 units (Ada, Hopper, Blackwell)")


CATALOG: dict[str, GPU] = {g.name: g for g in (
    # Ampere: NVLink 3 600 GB/s total = 300 per direction; PCIe 4 x16 ~32 GB/s per direction; HDR 200 Gb/s = 25 GB/s
    GPU("a100-40", 40, 312, 312, 0, 1555, 300, 25, 32),
    GPU("a100-80", 80, 312, 312, 0, 2039, 300, 25, 32),
    # Hopper: NVLink 4 900 GB/s total = 450 per direction; PCIe 5 x16 ~64 GB/s; NDR 400 Gb/s = 50 GB/s
    GPU("h100-80", 80, 989, 989, 1979, 3350, 450, 50, 64),
    GPU("h100-pcie", 80, 756, 756, 1513, 2000, 64, 50, 64),
    GPU("h200-141", 141, 989, 989, 1979, 4800, 450, 50, 64),
    # Blackwell HGX B200: 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s total = 900 per direction
    GPU("b200", 180, 2250, 2250, 4500, 8000, 900, 50, 64),
    # Ada (PCIe only, no NVLink): L40S 48 GB GDDR6; RTX 4090 24 GB, fp16/bf16 with fp32 accumulate
    GPU("l40s", 48, 362, 362, 733, 864, 32, 25, 32),
    GPU("rtx-4090", 24, 165, 165, 330, 1008, 32, 12.5, 32),
    # RTX 4070 12 GB GDDR6X at 504 GB/s; dense fp16/bf16 with fp32 accumulate 58.3 TFLOPS (Ada's GeForce half rate)
    GPU("rtx-4070", 12, 58.3, 58.3, 116.6, 504, 32, 12.5, 32),
    # The 2-core CPU machine this project is built on (AMD EPYC Zen 4 class, AVX-512 with bf16 dot products): peak
    # ~2 cores x 3 GHz x 64 bf16 FLOP/cycle; fp16 has no vector unit here (measured 5x slower than fp32); DRAM and
    # gloo's shared-memory links are rough figures. It is the entry `vlaforge plan --calibrate` is tested against:
    # what a CPU run reaches of this "peak" comes from calibration, not from these numbers.
    GPU("cpu", 24, 0.38, 0.04, 0, 30, 5, 1, 10, launch_us=0.0),
)}
ALIASES = {"h100": "h100-80", "h100-sxm": "h100-80", "h200": "h200-141", "a100": "a100-80", "4090": "rtx-4090",
           "4070": "rtx-4070"}


def load_catalog(path: Path | None = None) -> dict[str, GPU]:
    """The built-in catalog plus the entries of a TOML file: `[gpu.<name>]` tables with the `GPU` fields; a name
    already in the catalog is updated field by field (e.g. a cluster's slower network), a new one needs every field.

    Raises:
        VlaforgeError: unreadable file, unknown field, or a new entry missing fields.
    """
    catalog = dict(CATALOG)
    if path is None:
        return catalog
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise VlaforgeError(f"{path}: cannot read the GPU catalog ({str(exc).splitlines()[0]}); give a TOML file "
                            "with [gpu.<name>] tables") from None
    names = {f.name for f in fields(GPU)} - {"name"}
    for name, entry in (data.get("gpu") or {}).items():
        unknown = sorted(set(entry) - names)
        if unknown:
            raise VlaforgeError(f"{path}: [gpu.{name}] has unknown fields {unknown}; known: {sorted(names)}")
        values = {k: float(v) for k, v in entry.items()}
        if name in catalog:
            catalog[name] = replace(catalog[name], **values)
            continue
        missing = sorted(names - set(values) - set(OPTIONAL))
        if missing:
            raise VlaforgeError(f"{path}: new GPU [gpu.{name}] lacks {missing}; give every field")
        catalog[name] = GPU(name=name, **values)
    return catalog


def get_gpu(name: str, catalog: dict[str, GPU] | None = None) -> GPU:
    """The catalog entry for `name` (or an alias such as 'h100').

    Raises:
        VlaforgeError: unknown name, listing the known ones.
    """
    catalog = catalog or CATALOG
    key = ALIASES.get(name.lower(), name.lower())
    if key not in catalog:
        raise VlaforgeError(f"--gpu {name!r} is not in the catalog; use one of {', '.join(sorted(catalog))} or add "
                            "it with --catalog FILE.toml")
    return catalog[key]
