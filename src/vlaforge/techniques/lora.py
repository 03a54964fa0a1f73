"""`apply_lora`: low-rank adapters (peft's LoRA) on a component's linears over a frozen, possibly quantized base
(`components.<c>.lora`; docs/lora.md).

Why peft: it installs beside the pinned torch and transformers, injects into plain modules (no PeftModel wrapper,
so the model stays the VLA every other technique sees), and its names (`X.base_layer.weight`,
`X.lora_A.default.weight`, `X.lora_B.default.weight`) and semantics are what users' tools read. The base storage is
ours: `base = "nf4"` holds each frozen weight as torchao's `NF4Tensor` (torchtune's QLoRA), whose linear saves
the 4-bit weight for backward and dequantizes per use; `int8` is torchao's int8 weight-only tensor; `bf16` /
`fp32` cast the frozen weights only.

A LoRA component trains only its adapters, and the modules its `full` list names (peft's modules_to_save: its
convolutions, its norms, or named modules); the rest - embeddings, biases, base weights - stays as loaded.
`merge_lora` folds the adapters back (W = dequant(W0) + scaling * B A, in fp32) into plain `nn.Linear`s with
the original names, which is what inference, quantization and export load.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError

ADAPTER_MARKS = (".lora_A.", ".lora_B.")
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NF4_BLOCK = 64  # weights per NF4 scale (torchtune's QLoRA default)


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name (of the model or of a component) is a LoRA adapter tensor."""
    return any(m in f".{name}" for m in ADAPTER_MARKS)


def named(names: list[str], target: str) -> list[str]:
    """The module names a `targets` / `full` entry picks: the name itself, or names ending in '.' + it."""
    return [n for n in names if n == target or n.endswith("." + target)]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.RMSNorm)) or \
        type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def full_parameters(module: nn.Module, cfg) -> set[str]:
    """Names inside a LoRA component of the parameters its `lora.full` trains in full ('convs', 'norms', or modules
    named as in `targets`); none may be an adapter or the base of an adapted linear.

    Raises:
        VlaforgeError: a name matches no module, or a chosen module holds an adapted linear.
    """
    full = getattr(cfg, "full", None) or []
    if not full:
        return set()
    modules = [(n, m) for n, m in module.named_modules() if n]
    chosen: list[str] = []
    for item in full:
        if item == "convs":
            found = [n for n, m in modules if isinstance(m, nn.modules.conv._ConvNd)]
        elif item == "norms":
            found = [n for n, m in modules if _is_norm(m)]
        else:
            found = named([n for n, _ in modules], item)
            if not found:
                raise VlaforgeError(f"lora.full: {item!r} names no module of the component; give 'convs', 'norms' or "
                                    "a module name inside it")
        chosen += found
    names = {f"{n}.{p}" for n in chosen for p, _ in module.get_submodule(n).named_parameters()}
    clash = sorted(n for n in names if is_adapter(n) or ".base_layer." in f".{n}")
    if clash:
        raise VlaforgeError(f"lora.full trains {clash[0]} in full, but it belongs to an adapted linear; leave that "
                            "module out of full or out of targets")
    return names


def lora_trains(name: str, full: set[str]) -> bool:
    """Whether a LoRA component's parameter (its name inside the component) trains: an adapter or a `full` one."""
    return is_adapter(name) or name in full


def lora_components(policies: Mapping[str, Any]) -> list[str]:
    return [c for c in COMPONENTS if getattr(policies[c], "lora", None) is not None]


@dataclass
class LoraReport:
    """What `apply_lora` did to one component."""

    base: str = "auto"  # lora.base: how the frozen base linears are stored
    layers: list[str] = field(default_factory=list)  # names inside the component that got adapters
    adapter_params: int = 0
    base_params: int = 0  # the frozen rest of the component
    full_params: int = 0  # trained in full beside the adapters (`lora.full`)
    base_bytes: int = 0  # bytes of the frozen base linears' weights as stored
    float_kept: list[str] = field(default_factory=list)  # nf4 requested, shape does not fit its blocks

    def summary(self, name: str) -> str:
        share = (self.adapter_params + self.full_params) / max(1, self.adapter_params + self.full_params
                                                                + self.base_params)
        kept = f", {len(self.float_kept)} kept float (shape)" if self.float_kept else ""
        full = f" + {self.full_params:,} trained in full" if self.full_params else ""
        return (f"{name} LoRA on {len(self.layers)} linears ({self.adapter_params:,} adapter parameters{full}, "
                f"{100 * share:.2f} % of the component; base {self.base}{kept})")


def target_linears(model: nn.Module, component: str, targets) -> list[str]:
    """Names inside `component` of the linears that get adapters: every nn.Linear (the LLM's output head
    excepted: it is tied to the embeddings in most families and the vocabulary-wide adapter buys nothing), the
    model's preset (`lerobot`: `PolicyVLA.lora_preset`), or the named ones (a name matches a module called it or
    ending in '.' + it).

    Raises:
        VlaforgeError: a name in `targets` matches no linear of the component.
    """
    module = getattr(model, component)
    head = module.get_output_embeddings() if component == "llm" and hasattr(module, "get_output_embeddings") \
        else None
    linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and m is not head and n]
    if targets == "all-linear":
        return linears
    if targets == "lerobot":
        preset = getattr(model, "lora_preset", None)
        if preset is None:
            raise VlaforgeError(f"components.{component}.lora.targets = 'lerobot' is a LeRobot policy's default "
                                "(model.lerobot.pretrained); name the linears, or use 'all-linear'")
        targets = preset(component)
    chosen = []
    for target in targets:
        found = named(linears, target)
        if not found:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise VlaforgeError(f"components.{component}.lora.targets: {target!r} names no linear of the "
                                f"{component} (its linears end in {', '.join(leaves) or 'nothing'}); pick from those")
        chosen += [n for n in found if n not in chosen]
    return chosen


def apply_lora(model: nn.Module, policies: Mapping[str, Any], shards: int = 1) -> dict[str, LoraReport]:
    """Inject adapters into each component with a `lora` policy and store its frozen base as asked; call after
    `apply_precision` (the master-dtype cast would dequantize an NF4 base) and before the optimizer is built.
    `shards`: the FSDP2 shard degree the model will get (an NF4 weight is split into that many equal pieces).

    Returns:
        component -> what was done (empty when no component has LoRA).
    """
    reports = {}
    for name in lora_components(policies):
        reports[name] = _inject(model, name, policies[name].lora, shards)
    if reports:
        model.lora = reports  # NOTE: freezing, the optimizer groups and the checkpoint read which components
    return reports


def _inject(model: nn.Module, name: str, cfg, shards: int) -> LoraReport:
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    layers = target_linears(model, name, cfg.targets)
    if not layers:
        raise VlaforgeError(f"components.{name}.lora: the {name} has no linear layers to adapt; drop its lora")
    module = getattr(model, name)
    pattern = "|".join(re.escape(n) for n in layers)  # peft full-matches a string: exactly these modules
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=pattern,
                              init_lora_weights=True if cfg.init == "kaiming" else "gaussian",
                              use_rslora=cfg.rslora, bias="none")
    from vlaforge.models.fake import fake_mode_active

    with _fake_safe_moves() if fake_mode_active() else contextlib.nullcontext():
        inject_adapter_in_model(peft_cfg, module)
    report = LoraReport(base=cfg.base, layers=layers)
    for layer in lora_layers(module).values():
        _store_base(layer.base_layer, cfg.base, report, name, shards)
    full = full_parameters(module, cfg)
    for pname, p in module.named_parameters():
        if is_adapter(pname):
            report.adapter_params += p.numel()
        elif pname in full:  # trainable as the adapters are (peft's injection froze every other parameter)
            p.requires_grad_(True)
            report.full_params += p.numel()
        else:
            p.requires_grad_(False)
            report.base_params += p.numel()
    return report


@contextlib.contextmanager
def _fake_safe_moves():
    """NOTE: peft moves new adapters with `Module.to`, which must swap every fake parameter (planning builds under a
    fake-tensor mode) and torch refuses that (a FakeTensor carries weakrefs). Meanwhile `Module.to` replaces each
    parameter and buffer that has to change by a converted copy instead (what it does to real tensors)."""

    def to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for m in module.modules():
            for table in (m._parameters, m._buffers):
                for key, t in list(table.items()):
                    if t is None:
                        continue
                    want = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    if t.dtype == want and (device is None or t.device == device):
                        continue
                    moved = t.detach().to(device=device or t.device, dtype=want)
                    table[key] = nn.Parameter(moved, requires_grad=t.requires_grad) if key in m._parameters \
                        else moved
        return module

    original = nn.Module.to
    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def add_adapter(model: nn.Module, policies: Mapping[str, Any], name: str) -> None:
    """A second set of adapters, named `name`, beside the ones `apply_lora` injected (the same ranks and targets):
    one base serving several LoRA runs (inference/adapters.py)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    for component in lora_components(policies):
        cfg = policies[component].lora
        module = getattr(model, component)
        pattern = "|".join(re.escape(n) for n in lora_layers(module))
        peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=pattern,
                                  use_rslora=cfg.rslora, bias="none")
        inject_adapter_in_model(peft_cfg, module, adapter_name=name)


def set_adapter(model: nn.Module, name: str) -> None:
    """Make `name` the adapter every LoRA layer of the model applies."""
    for component in COMPONENTS:
        for layer in lora_layers(getattr(model, component)).values():
            layer.set_adapter(name, inference_mode=True)


def lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The peft LoRA layers inside `module`, by name."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}


def _store_base(linear: nn.Linear, base: str, report: LoraReport, component: str, shards: int) -> None:
    """Replace a frozen base linear's weight (and bias) by its storage form."""
    weight = linear.weight.detach()
    if base in BASE_DTYPES:
        linear.weight = nn.Parameter(weight.to(BASE_DTYPES[base]), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach().to(BASE_DTYPES[base]), requires_grad=False)
    elif base == "nf4":
        blocks = weight.numel() // NF4_BLOCK
        if weight.numel() % NF4_BLOCK:
            report.float_kept.append(f"{component}: {tuple(weight.shape)}")
        else:
            # NOTE: the scales are themselves quantized in groups of `group` (256 for any layer of a real model,
            # fewer for tiny ones), chosen from the shape alone so that every layout (and the merge at inference)
            # quantizes alike; their count stays a multiple of gcd(blocks, 64), so FSDP2 splits it evenly
            group = math.gcd(blocks // math.gcd(blocks, 64), 256)
            if weight.shape[0] % shards or (blocks // group) % shards or blocks % shards:
                raise VlaforgeError(f"components.{component}.lora.base = 'nf4': a {tuple(weight.shape)} weight does "
                                    f"not split into {shards} equal NF4 shards; use a shard degree that divides "
                                    f"{math.gcd(weight.shape[0], blocks // group)}, or lora.base = 'bf16'")
            linear.weight = nn.Parameter(_to_nf4(weight, group), requires_grad=False)
    elif base == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(linear, Int8WeightOnlyConfig())
        linear.weight.requires_grad_(False)
    report.base_bytes += stored_bytes(linear.weight)


def _to_nf4(weight: torch.Tensor, group: int) -> torch.Tensor:
    """torchao's NF4 form of `weight` (blocks of NF4_BLOCK, their scales quantized in groups of `group`). In a fake
    build (planning, `plan --measure`, `profile --fake`) it is assembled from inner tensors of the shapes and dtypes
    `to_nf4` gives - two 4-bit codes a byte, an int8 scale a block, a factor a group, the scales' mean, the 16-entry
    table - without running the quantization kernels on values fake tensors do not hold (~370 ops a linear: 20 s of
    a vla-7b QLoRA build on a CPU)."""
    from torchao.quantization import to_nf4

    from vlaforge.models.fake import fake_mode_active

    if not fake_mode_active():
        return to_nf4(weight, NF4_BLOCK, group)
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    n, blocks, dt, dev = weight.numel(), weight.numel() // NF4_BLOCK, weight.dtype, weight.device
    meta = SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(), dt, dev, False)
    return NF4Tensor(meta, NF4_BLOCK, blocks, group, torch.empty(blocks, dtype=torch.int8, device=dev),
                     torch.empty(blocks // group, dtype=dt, device=dev), torch.empty((), dtype=dt, device=dev),
                     torch.empty(n // 2, dtype=torch.uint8, device=dev), torch.empty(16, dtype=dt, device=dev))


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a (possibly torchao-quantized) tensor holds in memory: the sum of its inner tensors."""
    from vlaforge.techniques.accounting import inner_tensors

    return sum(t.numel() * t.element_size() for t in inner_tensors(tensor))


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A stored base weight as an fp32 dense tensor."""
    if hasattr(weight, "get_original_weight"):  # NF4Tensor
        return weight.get_original_weight().float()
    if hasattr(weight, "dequantize"):  # torchao's int8 / intx tensors
        return weight.dequantize().float()
    return weight.detach().float()


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base: each peft LoRA layer becomes an fp32 `nn.Linear` holding
    dequant(W0) + scaling * B @ A under the original name; the LoRA components are cast to fp32. Returns the
    number of layers merged."""
    merged = 0
    for component in COMPONENTS:
        module = getattr(model, component)
        layers = lora_layers(module)
        for name, layer in layers.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, leaf, _merged_linear(layer))
            merged += 1
        if layers:
            module.float()
            module.__dict__.pop("peft_config", None)  # what peft's injection set on the instance
    model.__dict__.pop("lora", None)
    return merged


def _merged_linear(layer) -> nn.Linear:
    base = layer.base_layer
    weight = dequantized(base.weight)
    for adapter in layer.active_adapters:
        a, b = layer.lora_A[adapter].weight.float(), layer.lora_B[adapter].weight.float()
        weight = weight + layer.scaling[adapter] * (b @ a)  # (out, r) @ (r, in)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None, device=weight.device)
    with torch.no_grad():
        out.weight.copy_(weight)
        if base.bias is not None:
            out.bias.copy_(base.bias.float())
    return out


def base_digest(model: nn.Module, components: list[str]) -> str:
    """sha256 over the named tensors of `components` of a bare model (before any technique): what a LoRA run's
    adapters were trained over, and what every later load of them must rebuild."""
    h = hashlib.sha256()
    for component in components:
        for name, tensor in sorted(getattr(model, component).state_dict().items()):
            t = tensor.detach().to("cpu").contiguous()
            h.update(f"{component}.{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def is_base(name: str, components: list[str], full: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a model state-dict name is part of the frozen base of the LoRA `components` (`full`: the model-level
    names those components train in full, which are not)."""
    return name.startswith(tuple(f"{c}." for c in components)) and not is_adapter(name) and name not in full


def adapter_state(state: Mapping[str, torch.Tensor], components: list[str],
                  full: frozenset[str] | set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """A model state dict without the frozen base of the LoRA `components`: their adapters and `full` tensors, and
    every tensor of the other components (what a LoRA run's checkpoint holds)."""
    return {k: v for k, v in state.items() if not is_base(k, components, full)}
