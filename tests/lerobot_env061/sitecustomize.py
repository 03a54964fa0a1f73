"""Copied into .venv/lerobot061 by `make test`: Python imports it at startup in every process that has the site on
PYTHONPATH (the project's venv has no sitecustomize of its own). Two shims, nothing imported here eagerly:

- `kernels` (the project's venv has kernels 0.19) is hidden: transformers 5.5.4 builds its hub-kernel table at
  import time with an API kernels >= 0.13 refuses ("Either a revision or a version must be specified"). So are
  torchao and deepspeed, which transformers imports when it finds them (LeRobot's policies use neither).
- torchvision 0.28.0 (PyPI's CUDA build) cannot load its `_C` here (no CUDA libraries): its fake-tensor
  registrations then fail with "operator torchvision::nms does not exist". Before torchvision is first imported the
  `_C` library is loaded if it can be, else the two operators it registers fakes for are declared (schema only: they
  cannot run; LeRobot's and transformers' code paths used here only use torchvision.transforms).
"""

import importlib.abc
import os
import sys

# find_spec -> None, import -> ImportError
for _name in ("kernels", "torchao", "deepspeed"):
    sys.modules[_name] = None
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


class _TorchvisionOps(importlib.abc.MetaPathFinder):
    """Runs once, at the first lookup of `torchvision`; finds nothing itself (the path finder then loads it)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        here = next((os.path.join(p, "torchvision", "_C.so") for p in sys.path
                     if os.path.isfile(os.path.join(p or ".", "torchvision", "_C.so"))), None)
        try:
            if here is None:
                raise OSError("no torchvision/_C.so")
            torch.ops.load_library(here)
        except (OSError, RuntimeError):
            for op in ("nms", "qnms"):
                try:
                    torch.library.define(f"torchvision::{op}", _SCHEMA)
                except RuntimeError:  # declared already
                    pass
        return None


sys.meta_path.insert(0, _TorchvisionOps())
