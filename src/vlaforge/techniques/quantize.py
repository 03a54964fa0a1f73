"""`apply_quantization`: per-component weight quantization of a trained VLA with torchao `quantize_`.

Each component gets one mode: `none` (as trained), `fp16` / `bf16` (weights cast, the component computes in that
dtype), `int8` (torchao `Int8WeightOnlyConfig`: per-row int8 weights), `int8_dynamic`
(`Int8DynamicActivationInt8WeightConfig`: int8 weights and per-token int8 activations), or `int4` / `int3` /
`int2` (`IntxWeightOnlyConfig`: symmetric per-group weights of that width; on CUDA `int4` is
`Int4WeightOnlyConfig`'s tinygemm layout, which needs bf16 activations).

Which layers: a component's `nn.Linear`s (its LM head too - the runtime never computes logits, so the head only
costs bytes) and the LLM's token embedding (IntxWeightOnlyConfig; with `int8` per row). Left out, each with its
reason in the report: convolutions (the SigLIP patch embedding: torchao's weight configs cover linears and
embeddings), position tables (small, and every token reads them), and grouped modes' linears whose input width is
not a multiple of the group size. The action head is quantized only with `allow_action_head` (it regresses
continuous actions through a few small layers: bytes saved are small and its error reaches the robot directly).

Smaller is not faster everywhere: `SPEED_FACTS` holds measured latencies of layouts against the unquantized policy
per device (date and source on each row), and `known_slower` gives the rows a chosen layout contains, which
`vlaforge quantize` prints and reports (docs/quantization.md shows the same table).

A quantized or cast component runs inside a dtype boundary: its floating inputs are cast to the dtype it computes
in and its floating outputs back to the caller's, so the components of one model may compute in fp32, fp16 and
bf16 side by side. `prepare_qat` inserts the same quantization as fake quantization for training (torchao's
`QATConfig` prepare step, derived from the very config `apply_quantization` uses: the trained weights then convert
with no gap between fake and real quantization).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.techniques.precision import cast_floating

MODES = ("none", "fp16", "bf16", "int8", "int8_dynamic", "int4", "int3", "int2")
QAT_MODES = ("none", "int4", "int3", "int2")
ALGORITHMS = ("affine", "hqq")  # intx modes: how scales are chosen (min-max, or HQQ's scale-only optimisation)
FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
INTX_BITS = {"int4": 4, "int3": 3, "int2": 2}
CUDA_INT4_GROUPS = (32, 64, 128, 256)  # Int4WeightOnlyConfig's tinygemm group sizes


@dataclass(frozen=True)
class QuantPolicy:
    """One component's quantization: mode, group size of the grouped modes, scale algorithm of the intx modes."""

    mode: str = "none"
    group_size: int = 32
    algorithm: str = "affine"

    def __post_init__(self):
        if self.mode not in MODES:
            raise VlaforgeError(f"quantization mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.algorithm not in ALGORITHMS:
            raise VlaforgeError(f"quantization algorithm {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if self.group_size < 2 or self.group_size & (self.group_size - 1):
            raise VlaforgeError(f"group size {self.group_size} must be a power of two >= 2 (e.g. 32)")

    @property
    def integer(self) -> bool:
        return self.mode.startswith("int")

    def label(self) -> str:
        if self.mode in INTX_BITS:
            return f"{self.mode}/g{self.group_size}" + ("" if self.algorithm == "affine" else f"/{self.algorithm}")
        return self.mode


@dataclass
class ComponentQuant:
    """What `apply_quantization` did to one component: fully qualified layer names (in the model)."""

    policy: QuantPolicy
    config: str = ""  # the torchao config(s), by class name
    compute_dtype: str = "float32"  # the dtype the component computes in
    quantized: dict[str, str] = field(default_factory=dict)  # layer -> "linear" | "embedding"
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why it was left out

    def to_json(self) -> dict[str, Any]:
        return {"policy": asdict(self.policy), "config": self.config, "compute_dtype": self.compute_dtype,
                "quantized": self.quantized, "skipped": self.skipped}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ComponentQuant":
        return cls(QuantPolicy(**d["policy"]), d.get("config", ""), d.get("compute_dtype", "float32"),
                   dict(d.get("quantized", {})), dict(d.get("skipped", {})))


@dataclass
class QuantReport:
    """Per component, what was quantized and how; `device` is where the layout's kernels run ("cpu" | "cuda")."""

    components: dict[str, ComponentQuant]
    device: str = "cpu"

    def mode(self, component: str) -> str:
        return self.components[component].policy.mode

    def policies(self) -> dict[str, QuantPolicy]:
        return {c: q.policy for c, q in self.components.items()}

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "components": {c: q.to_json() for c, q in self.components.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "QuantReport":
        return cls({c: ComponentQuant.from_json(q) for c, q in d["components"].items()}, d.get("device", "cpu"))

    def summary(self) -> str:
        parts = []
        for c, q in self.components.items():
            text = f"{c}={q.policy.label()}"
            if q.policy.integer:
                text += f" ({len(q.quantized)} layers" + (f", {len(q.skipped)} left out)" if q.skipped else ")")
            parts.append(text)
        return " ".join(parts)


@dataclass(frozen=True)
class SpeedFact:
    """One measured latency of a quantized layout against the unquantized policy on one device. A range (low, high)
    where the source gave one for several layouts together; `bytes_ratio` None where it gave none."""

    device: str  # "cpu" | "cuda": where the layout's kernels ran
    hardware: str
    layout: str  # component=mode pairs, e.g. "vision=int8,projector=fp16,llm=int4"
    reference: str  # the unquantized policy's dtype
    latency_ratio: tuple[float, float]  # p50 per prediction / the reference's
    bytes_ratio: tuple[float, float] | None  # weight bytes held in memory / the reference's
    date: str
    source: str

    def modes(self) -> dict[str, str]:
        return dict(part.split("=", 1) for part in self.layout.split(","))

    def line(self) -> str:
        span = lambda r: f"{r[0]:g}x" if r[0] == r[1] else f"{r[0]:g}-{r[1]:g}x"
        size = f" at {span(self.bytes_ratio)} its weight bytes" if self.bytes_ratio else ""
        return (f"slower on {self.device} ({self.hardware}): {self.layout} measured {span(self.latency_ratio)} "
                f"{self.reference}'s latency per prediction{size} ({self.date}, {self.source})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"line": self.line()}


_CPU = "the 2-core CPU this project is built on, 2 threads"
_H100 = "NVIDIA H100 80GB HBM3, torch 2.11 + torchao 0.18"
_CPU_SRC = "bench/quantization.py, docs/quantization.md 'Measured'"
_H100_SRC = "bench/gpu/run_all.sh inference check, `small` through PolicyRuntime, eager"
# NOTE: the H100 run reported its three weight-only layouts together (1.4-1.6x latency, 0.41-0.56x bytes); each row
# holds that range rather than a figure it did not report. The CPU rows are per layout, against fp32.
SPEED_FACTS: tuple[SpeedFact, ...] = (
    SpeedFact("cpu", _CPU, "vision=int8,projector=fp16,llm=int4", "fp32", (1.28, 1.28), (0.380, 0.380),
              "2026-12-01", _CPU_SRC),
    SpeedFact("cpu", _CPU, "vision=int2,projector=int2,llm=int2", "fp32", (1.52, 1.52), (0.375, 0.375),
              "2026-12-01", _CPU_SRC),
    SpeedFact("cuda", _H100, "vision=int8,projector=fp16,llm=int4", "bf16", (1.4, 1.6), (0.41, 0.56),
              "2026-12-06", _H100_SRC),
    SpeedFact("cuda", _H100, "llm=int4", "bf16", (1.4, 1.6), (0.41, 0.56), "2026-12-06", _H100_SRC),
    SpeedFact("cuda", _H100, "llm=int8", "bf16", (1.4, 1.6), (0.41, 0.56), "2026-12-06", _H100_SRC),
    SpeedFact("cuda", _H100, "vision=int8,llm=int8_dynamic", "bf16", (15.0, 15.0), None, "2026-12-06", _H100_SRC),
)


def known_slower(policies: Mapping[str, QuantPolicy | str], device: str | None = None) -> list[SpeedFact]:
    """The measured rows (on `device`, or on every device) slower than the unquantized policy whose layout the chosen
    one contains: each of the row's component modes is chosen too (group size and scale algorithm aside)."""
    chosen = {c: p.mode if isinstance(p, QuantPolicy) else p for c, p in policies.items()}
    return [f for f in SPEED_FACTS if f.latency_ratio[0] > 1 and (device is None or f.device == device)
            and all(chosen.get(c) == m for c, m in f.modes().items())]


def parse_policies(policies: Mapping[str, QuantPolicy | str], allow_action_head: bool = False
                   ) -> dict[str, QuantPolicy]:
    """Every component's policy (missing ones: `none`); the action head's must be `none` unless allowed."""
    unknown = sorted(set(policies) - set(COMPONENTS))
    if unknown:
        raise VlaforgeError(f"unknown component {unknown[0]!r}; components: {', '.join(COMPONENTS)}")
    out = {c: p if isinstance(p, QuantPolicy) else QuantPolicy(p) for c, p in policies.items()}
    out = {c: out.get(c, QuantPolicy()) for c in COMPONENTS}
    if out["action_head"].mode != "none" and not allow_action_head:
        raise VlaforgeError(f"quantizing the action head ({out['action_head'].mode}) needs the explicit flag "
                            "(--allow-action-head): it regresses continuous actions through small layers, saves "
                            "few bytes and its error reaches the robot directly")
    return out


def apply_quantization(model: nn.Module, policies: Mapping[str, QuantPolicy | str], device: torch.device | str = "cpu",
                       allow_action_head: bool = False) -> QuantReport:
    """Quantize or cast each component of `model` (in place, on `device`) as `policies` say.

    Args:
        policies: component -> QuantPolicy or mode name; components left out stay as they are.
        device: where the model will run; `int4` takes the CUDA kernel layout there.
    Returns:
        The report, also kept as `model.quantization` (what a checkpoint writer and the runtime read).
    Raises:
        VlaforgeError: an unknown mode, the action head without `allow_action_head`, or torchao refusing a layer.
    """
    device = torch.device(device)
    chosen = parse_policies(policies, allow_action_head)
    report = QuantReport({}, device.type)
    model.to(device)
    for name in COMPONENTS:
        module, policy = getattr(model, name), chosen[name]
        entry = report.components[name] = ComponentQuant(policy, compute_dtype=_float_dtype_name(module))
        if policy.mode == "none":
            continue
        if policy.mode in FLOAT_DTYPES or (policy.mode == "int4" and device.type == "cuda"):
            module.to(FLOAT_DTYPES.get(policy.mode, torch.bfloat16))  # tinygemm int4 computes in bf16
            entry.compute_dtype = _float_dtype_name(module)
        if policy.integer:
            _quantize_component(model, name, policy, device, entry)
        DtypeBoundary(module, getattr(torch, entry.compute_dtype))
        if name == "llm" and hasattr(module, "get_decoder"):  # the runtime calls the LLM body directly
            DtypeBoundary(module.get_decoder(), getattr(torch, entry.compute_dtype))
    model.quantization = report
    return report


def _float_dtype_name(module: nn.Module) -> str:
    dtypes = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return str(dtypes[0] if dtypes else torch.float32).removeprefix("torch.")


def layer_plan(model: nn.Module, component: str, policy: QuantPolicy) -> tuple[dict[str, str], dict[str, str]]:
    """(layers to quantize -> kind, layers left out -> reason) of one component, by qualified name in `model`."""
    module = getattr(model, component)
    token_embedding = model.llm.get_input_embeddings() if component == "llm" else None
    from vlaforge.models.families import expert_modules

    take, skip = {}, {}
    for local in expert_modules(module):
        skip[f"{component}.{local}"] = "mixture-of-experts weights (3-D stacked experts; torchao's weight configs " \
                                       "cover linears and embeddings)"
    for local, sub in module.named_modules():
        fqn = f"{component}.{local}" if local else component
        if isinstance(sub, nn.Linear):
            if policy.mode in INTX_BITS and sub.in_features % policy.group_size:
                skip[fqn] = f"input width {sub.in_features} is not a multiple of the group size {policy.group_size}"
            else:
                take[fqn] = "linear"
        elif isinstance(sub, nn.Embedding):
            if sub is token_embedding:
                take[fqn] = "embedding"
            else:
                skip[fqn] = "position table (small; every token reads it)"
        elif isinstance(sub, nn.modules.conv._ConvNd):
            skip[fqn] = "convolution (torchao's weight configs cover linears and embeddings)"
    return take, skip


def torchao_config(policy: QuantPolicy, kind: str, device: torch.device):
    """The torchao config of one layer kind ("linear" | "embedding") under `policy` on `device`."""
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quantize_.workflows import IntxChooseQParamsAlgorithm

    algorithm = IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY if policy.algorithm == "hqq" \
        else IntxChooseQParamsAlgorithm.AFFINE
    if policy.mode in INTX_BITS:
        if kind == "linear" and policy.mode == "int4" and device.type == "cuda":
            return Int4WeightOnlyConfig(group_size=policy.group_size, int4_packing_format="tile_packed_to_4d")
        return IntxWeightOnlyConfig(weight_dtype=getattr(torch, policy.mode), granularity=PerGroup(policy.group_size),
                                    intx_choose_qparams_algorithm=algorithm)
    if kind == "embedding":  # int8 modes: per-row int8 table
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    if policy.mode == "int8":
        return Int8WeightOnlyConfig()
    return Int8DynamicActivationInt8WeightConfig()


def _quantize_component(model: nn.Module, name: str, policy: QuantPolicy, device: torch.device,
                        entry: ComponentQuant) -> None:
    from torchao.quantization import quantize_

    if policy.mode == "int4" and device.type == "cuda" and policy.group_size not in CUDA_INT4_GROUPS:
        raise VlaforgeError(f"{name}: int4 on CUDA (tinygemm) takes group sizes {CUDA_INT4_GROUPS}, not "
                            f"{policy.group_size}; pick one with --group-size")
    take, entry.skipped = layer_plan(model, name, policy)
    configs = []
    for kind in ("linear", "embedding"):
        layers = {fqn.removeprefix(f"{name}.") for fqn, k in take.items() if k == kind}
        if not layers:
            continue
        config = torchao_config(policy, kind, device)
        configs.append(type(config).__name__)
        try:
            quantize_(getattr(model, name), config, filter_fn=lambda _m, fqn, chosen=layers: fqn in chosen)
        except (RuntimeError, ValueError, AssertionError, NotImplementedError) as exc:
            raise VlaforgeError(f"{name}: torchao {type(config).__name__} failed on {device.type} "
                                f"({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}); choose "
                                "another mode for this component") from None
    entry.quantized, entry.config = take, " + ".join(dict.fromkeys(configs))


def prepare_qat(model: nn.Module, policies: Mapping[str, Any]) -> dict[str, list[str]]:
    """Insert fake quantization for `components.<c>.qat` (torchao `QATConfig` prepare, in place; before the
    optimizer is built). The same layers and configs as `apply_quantization` on CPU, so converting the trained
    weights with `vlaforge quantize` reproduces the forward the training saw. Returns component -> layers."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    prepared = {}
    for name in COMPONENTS:
        mode = getattr(policies[name], "qat", "none")
        if mode == "none":
            continue
        policy = QuantPolicy(mode, policies[name].qat_group_size)
        take, _ = layer_plan(model, name, policy)
        local = {fqn.removeprefix(f"{name}.") for fqn in take}
        base = torchao_config(policy, "linear", torch.device("cpu"))  # fake quantization is device independent
        quantize_(getattr(model, name), QATConfig(base, step="prepare"),
                  filter_fn=lambda _m, fqn, chosen=local: fqn in chosen)
        prepared[name] = sorted(take)
    return prepared


class DtypeBoundary:
    """Forward hooks that run a module in `dtype`: floating inputs cast to it, floating outputs cast back to the
    dtype of the first floating input (the caller's)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        self.dtype, self.callers = dtype, []
        module.register_forward_pre_hook(self.enter, with_kwargs=True)
        module.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.callers.append(_first_float_dtype((args, kwargs)))
        return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        caller = self.callers.pop()
        return output if caller is None or caller == self.dtype else cast_floating(output, caller)


def _first_float_dtype(obj: Any) -> torch.dtype | None:
    leaves = torch.utils._pytree.tree_leaves(obj)
    return next((t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
