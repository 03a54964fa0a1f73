"""What the campaign runs on, as one JSON line: the device's name, the planner catalog entry it is (the denominator
of MFU and the planner's hardware), and the torch / transformers versions. run_all.sh reads `catalog_gpu` before
the checks and puts the whole object into summary.json.

A lent machine may be an H100 or an H200 (or, later, another kind): the catalog entry comes from the device's own
name and memory, not from a default. Without CUDA (the dry run) the entry is `--default`.

    python bench/gpu/detect.py [--default h200-141]
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from vlaforge.planner.hardware import CATALOG, get_gpu


def catalog_entry(device_name: str, memory_gb: float) -> str | None:
    """The catalog entry of a CUDA device by its name ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-40GB",
    "NVIDIA GeForce RTX 4090"): the entries of its family (the name's first part: h100, a100, rtx-4090), the PCIe
    variant only for a PCIe card, and of those the one whose memory is nearest the device's; None if none matches."""
    words = f" {re.sub(r'[^a-z0-9]+', ' ', device_name.lower())} "
    pcie = " pcie " in words
    # the family: the key less its memory suffix (a100-40 -> a100) and its PCIe mark, as whole words of the name
    family = {key: re.sub(r"-(\d{2,3}|pcie)$", "", key).replace("-", " ") for key in CATALOG}
    matches = [g for key, g in CATALOG.items() if f" {family[key]} " in words]
    matches = [g for g in matches if g.name.endswith("-pcie") == pcie] or matches
    if not matches:
        return None
    return min(matches, key=lambda g: abs(g.memory_gb - memory_gb)).name


def describe(default: str) -> dict:
    """Device, catalog entry and versions of this machine."""
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return info | {"device": "cpu", "catalog_gpu": get_gpu(default).name, "catalog_from": "default (no CUDA)"}
    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    found = catalog_entry(name, props.total_memory / 1e9)
    return info | {"device": name, "device_memory_gb": round(props.total_memory / 1e9, 1),
                   "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                   "catalog_gpu": found or get_gpu(default).name,
                   "catalog_from": "device name" if found else f"default ({name!r} is not in the catalog)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", default="h200-141", help="the entry without CUDA or for an unknown device")
    print(json.dumps(describe(ap.parse_args().default)))


if __name__ == "__main__":
    main()
