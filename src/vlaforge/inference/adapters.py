"""Several LoRA runs over one base, unmerged, in one model (`vlaforge serve --keep-adapters`, `PolicyRuntime.load(...,
adapters=...)`): one copy of the frozen base, each run's adapters under its own name in the peft layers, and a
session names the adapter it runs with.

What a switch does (`AdapterSet.activate`): every LoRA layer's active adapter is set (a flag per layer), and the
tensors the run trained in full - the components without LoRA (typically the projector and the action head) and
any other tensor its checkpoint holds besides adapters - are copied into the model; the runtime then normalizes
with that run's statistics and tokenizes with its tokenizer. Requests of one batch are grouped by adapter, one
forward per group. Every run must share the base (the digest in its lora.json), the LoRA layout (ranks, targets)
and the observation layout (cameras, frames, image size, chunk, state and action sizes); anything else is refused
in one line. docs/lora.md has the measured switch cost and how many adapters fit.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlaforge.errors import VlaforgeError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class Adapter:
    """One LoRA run served beside others: its checkpoint, what it trained in full, its observation spec (the
    normalization) and tokenizer, and its adapter bytes."""

    name: str
    checkpoint: Path
    full: dict[str, torch.Tensor]
    spec: Any
    tokenizer: Any
    adapter_bytes: int
    layer_name: str  # its name inside the peft layers (the first run keeps peft's "default")


@dataclass
class AdapterSet:
    model: nn.Module
    adapters: dict[str, Adapter]
    default: str
    active: str | None = None
    switches: int = 0
    switch_ms: list[float] = field(default_factory=list)

    def activate(self, name: str) -> float:
        """Make `name` the model's adapter (a no-op when it is already); the milliseconds it took."""
        from vlaforge.techniques.lora import set_adapter

        if name == self.active:
            return 0.0
        t0 = time.perf_counter()
        set_adapter(self.model, self.adapters[name].layer_name)
        with torch.no_grad():
            params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            for key, value in self.adapters[name].full.items():
                params[key].copy_(value)
        self.active = name
        ms = (time.perf_counter() - t0) * 1000
        self.switches += 1
        self.switch_ms.append(ms)
        return ms

    def describe(self) -> dict[str, Any]:
        return {"default": self.default,
                "adapters": {n: {"checkpoint": str(a.checkpoint), "adapter_bytes": a.adapter_bytes,
                                 "full_bytes": sum(t.numel() * t.element_size() for t in a.full.values())}
                             for n, a in self.adapters.items()}}


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise VlaforgeError(f"adapter name {name!r}: use 1-64 letters, digits, '_' or '-'")
    return name


def run_name(ckpt: Path) -> str:
    """The adapter name a served run goes by: its run folder's (for a checkpoints/step_* folder, the run's)."""
    return ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else ckpt.name


def parse_adapters(items: list[str], first: str) -> dict[str, str]:
    """`--adapter NAME=RUN` options -> {NAME: RUN}, beside the served run named `first`. One line for an item that
    is not NAME=RUN, for `first`'s own name (that run would be replaced: its requests, and those naming no adapter,
    would get the other run's actions) and for a name given twice (one run would be dropped)."""
    named: dict[str, str] = {}
    for item in items:
        name, sep, run = item.partition("=")
        if not sep or not name or not run:
            raise VlaforgeError(f"--adapter {item!r}: write NAME=RUN (a LoRA run over the same base)")
        if name == first:
            raise VlaforgeError(f"--adapter {item}: {name!r} is the served run's own name (its requests and those "
                                "naming no adapter run it); name the other adapter otherwise")
        if name in named:
            raise VlaforgeError(f"--adapter {name} given twice ({name}={named[name]} and {item}); give each run its "
                                "own name")
        named[name] = run
    return named


def load_adapter_set(runs: dict[str, str | Path], device: torch.device) -> tuple[nn.Module, Any, AdapterSet]:
    """The model of the first run's base with every run's adapters, unmerged: (model, the first run's config, the
    adapter set). Raises VlaforgeError (one line) for a run that is not LoRA or does not share the base or
    layouts."""
    from vlaforge.checkpoints.layout import MODEL_FILE, resolve_run
    from vlaforge.checkpoints.load import rebuild_base
    from vlaforge.checkpoints.lora import check_base, is_lora, load_lora_weights, read_record
    from vlaforge.data.tokenizer import load_tokenizer
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.techniques.lora import add_adapter, apply_lora, base_digest, is_adapter, lora_components, set_adapter
    from vlaforge.techniques.precision import master_dtype

    names = [check_name(n) for n in runs]
    resolved = {n: resolve_run(p, f"adapter {n}") for n, p in runs.items()}
    ckpts = {n: ckpt for n, (ckpt, _) in resolved.items()}
    for n, ckpt in ckpts.items():
        if not is_lora(ckpt):
            raise VlaforgeError(f"adapter {n}: {ckpt} is not a LoRA run (no lora.json); --keep-adapters serves LoRA "
                                "runs over one base")
        if read_record(ckpt).get("full"):
            raise VlaforgeError(f"adapter {n}: {ckpt} trains modules of its LoRA components in full (lora.full), so "
                                "it does not share their base with other runs; serve it alone (merged)")
    first = names[0]
    if "default" in names[1:]:
        raise VlaforgeError("adapter name 'default' is peft's name for the first run's adapters; name the others "
                            "otherwise")
    cfg = resolved[first][1]
    policies = dict(cfg.components.items())
    components = lora_components(policies)
    model = rebuild_base(cfg)
    digest = base_digest(model, components)
    for c in components:  # the dtype apply_precision gave the base before the adapters were injected
        getattr(model, c).to(master_dtype(policies[c].precision, cfg.train.precision_master))
    apply_lora(model, policies)
    adapters = {}
    for n in names:
        ckpt = ckpts[n]
        other = resolved[n][1]
        _check_compatible(n, ckpt, cfg, other, first)
        check_base(ckpt, read_record(ckpt), digest)
        own = "default" if n == first else n  # peft's name for apply_lora's adapters
        if n == first:
            set_adapter(model, own)
            load_lora_weights(ckpt, model, ckpt / MODEL_FILE)
        else:
            add_adapter(model, policies, n)
            set_adapter(model, own)
            _load_renamed(ckpt, model, n)
        state = model.state_dict()
        adapter_keys = [k for k in state if is_adapter(k) and f".{own}." in k]
        full = {k: v.detach().clone() for k, v in state.items()
                if not is_adapter(k) and not k.startswith(tuple(f"{c}." for c in components))}
        adapters[n] = Adapter(n, ckpt, full, ObservationSpec.load(ckpt), load_tokenizer(ckpt, other.model.text_folder),
                              sum(state[k].numel() * state[k].element_size() for k in adapter_keys), own)
    model.to(device)
    for a in adapters.values():
        a.full = {k: v.to(device) for k, v in a.full.items()}
    aset = AdapterSet(model.eval(), adapters, first)
    aset.activate(first)
    return model, cfg, aset


def _check_compatible(name: str, ckpt: Path, cfg, other, first: str) -> None:
    """The same model and LoRA layout as the first run (the base itself is checked by its digest)."""
    if other.model.model_dump() != cfg.model.model_dump():
        raise VlaforgeError(f"adapter {name}: {ckpt} has another model section than {first}'s (cameras, sizes or "
                            "backbones); serve it from its own server")
    for c in ("vision", "projector", "llm", "action_head"):
        a, b = getattr(cfg.components, c).lora, getattr(other.components, c).lora
        if (a is None) != (b is None) or (a is not None and (a.rank, a.targets, a.base, a.alpha, a.rslora)
                                          != (b.rank, b.targets, b.base, b.alpha, b.rslora)):
            raise VlaforgeError(f"adapter {name}: components.{c}.lora differs from {first}'s (rank, targets, base, "
                                "alpha); one server holds adapters of one layout")


def _load_renamed(ckpt: Path, model: nn.Module, name: str) -> None:
    """A LoRA checkpoint's tensors loaded under adapter `name` (its file names them `default`)."""
    from safetensors.torch import load_file

    from vlaforge.checkpoints.layout import MODEL_FILE
    from vlaforge.techniques.lora import is_adapter

    state = load_file(str(ckpt / MODEL_FILE))
    renamed = {k.replace(".default.", f".{name}.") if is_adapter(k) else k: v for k, v in state.items()}
    missing = [k for k in renamed if k not in model.state_dict()]
    if missing:
        raise VlaforgeError(f"adapter {name}: {ckpt} holds {missing[0]}, which the model has not; use a checkpoint "
                            "of the same layout")
    model.load_state_dict(renamed, strict=False)
