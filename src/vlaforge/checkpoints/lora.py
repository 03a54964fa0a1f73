"""Checkpoints of a LoRA run: model.safetensors holds the adapters of the LoRA components (and what their
`lora.full` trains) and every tensor of the others; `lora.json` beside it names the frozen base the adapters were
trained over - by a digest of its weights and the folders it came from - so resuming and loading rebuild that base
and refuse any other in one line.

lora.json: {"digest": sha256 over the LoRA components' tensors of the bare model (after train.init_from),
"components": {name: its lora policy}, "full": the tensors trained in full beside the adapters (`lora.full`;
model-level names, held in model.safetensors), "init_from": path | null, "pretrained": {component: folder},
"seed": train.seed (a randomly initialised base is rebuilt from it), "adapter_tensors", "adapter_bytes"}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlaforge.errors import VlaforgeError
from vlaforge.outputs import write_atomic
from vlaforge.techniques.lora import adapter_state, base_digest, full_parameters, is_adapter, is_base, lora_components

LORA_FILE = "lora.json"


def is_lora(ckpt: Path) -> bool:
    return (Path(ckpt) / LORA_FILE).is_file()


def check_adapters_described(ckpt: Path, weights: Path) -> None:
    """Refuse a weights file that holds LoRA adapter tensors in a checkpoint without the lora.json that names their
    base: without it the adapters can be neither merged nor loaded, and the file has no base weights to stand alone.

    Raises:
        VlaforgeError: adapters without their record.
    """
    from safetensors import safe_open

    if is_lora(ckpt):
        return
    try:
        with safe_open(str(weights), framework="pt") as f:
            adapters = [k for k in f.keys() if is_adapter(k)]
    except Exception:  # noqa: BLE001 - a damaged header: the caller's load reports it
        return
    if adapters:
        raise VlaforgeError(f"checkpoint {ckpt} holds LoRA adapters ({len(adapters)} tensors, e.g. {adapters[0]}) but "
                            f"no {LORA_FILE} naming the base they were trained over; the checkpoint is incomplete: "
                            f"use another checkpoint of the run, or put back its {LORA_FILE}")


def base_record(cfg, model: nn.Module) -> dict[str, Any] | None:
    """What names a LoRA run's base, from the bare model (built and `init_from`-loaded, no technique yet); None
    without LoRA. Under a fake-tensor mode (planning) there are no weights to digest."""
    from vlaforge.models.fake import fake_mode_active

    components = lora_components(dict(cfg.components.items()))
    if not components:
        return None
    m = cfg.model
    pretrained = {"vlm": m.vlm.pretrained, "vision": m.vision.pretrained, "llm": m.llm.pretrained}
    policies = {c: getattr(cfg.components, c).lora for c in components}
    return {"digest": None if fake_mode_active() else base_digest(model, components),
            "components": {c: policies[c].model_dump() for c in components},
            "full": sorted(f"{c}.{n}" for c in components for n in full_parameters(getattr(model, c), policies[c])),
            "init_from": cfg.train.init_from, "seed": cfg.train.seed,
            "pretrained": {k: v for k, v in pretrained.items() if v}}


def checkpoint_weights(record: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a LoRA checkpoint keeps of a full state dict (the frozen base left out)."""
    return adapter_state(state, list(record["components"]), trained_full(record))


def write_record(folder: Path, record: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    adapters = {k: v for k, v in weights.items() if is_adapter(k)}
    body = {**record, "adapter_tensors": len(adapters),
            "adapter_bytes": sum(v.numel() * v.element_size() for v in adapters.values())}
    write_atomic(folder / LORA_FILE, json.dumps(body, indent=1))


def read_record(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / LORA_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VlaforgeError(f"{path} is not readable JSON ({exc}); the checkpoint is damaged: use another "
                            "checkpoint of the run") from None
    if not isinstance(record, dict) or not isinstance(record.get("components"), dict) or "digest" not in record:
        raise VlaforgeError(f"{path} does not describe a LoRA base; the checkpoint is damaged: use another "
                            "checkpoint of the run")
    return record


def check_base(ckpt: Path, record: dict[str, Any], digest: str | None) -> None:
    """Refuse adapters trained over another base than the one rebuilt (`digest`)."""
    saved = record.get("digest")
    if digest is None or saved is None or saved == digest:
        return
    source = ", ".join([f"train.init_from {record['init_from']}"] * bool(record.get("init_from"))
                       + [f"{k} {v}" for k, v in (record.get("pretrained") or {}).items()]) or \
        f"the random initialisation of seed {record.get('seed')}"
    raise VlaforgeError(f"checkpoint {ckpt}: its adapters were trained over base {saved[:16]} (from {source}), but "
                        f"the base rebuilt now is {digest[:16]}; give the base it was trained over (the same "
                        "init_from and pretrained folders)")


def optional_keys(model: nn.Module, record: dict[str, Any]) -> set[str]:
    """The model's tensors a LoRA checkpoint does not hold (its components' frozen base)."""
    full = trained_full(record)
    return {k for k in model.state_dict() if is_base(k, list(record["components"]), full)}


def trained_full(record: dict[str, Any]) -> set[str]:
    """The model-level names a LoRA run trained in full beside its adapters (`lora.full`; none in older records)."""
    return set(record.get("full", ()))


def load_lora_weights(ckpt: Path, model: nn.Module, path: Path) -> None:
    """Load a LoRA checkpoint's tensors into a model with the same adapters; every tensor but the frozen base must
    be in the file, and nothing else.

    Raises:
        VlaforgeError: the file is damaged, or does not match the model.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from vlaforge.errors import first_line

    record = read_record(ckpt)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise VlaforgeError(f"checkpoint file {path} is truncated or corrupt ({first_line(exc)}); use another "
                            "checkpoint") from None
    want = set(model.state_dict()) - optional_keys(model, record)
    missing, unexpected = sorted(want - state.keys()), sorted(state.keys() - set(model.state_dict()))
    if missing or unexpected:
        raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({len(missing)} missing, {len(unexpected)} "
                            f"unexpected tensors, e.g. {(missing or unexpected)[0]}); use the config saved in that "
                            "checkpoint")
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise VlaforgeError(f"checkpoint {ckpt} does not match the model ({first_line(exc, 160)}); use the config "
                            "saved in that checkpoint") from None
