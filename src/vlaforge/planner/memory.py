"""Analytic model-state memory per component: parameters, gradients and AdamW state, whole and per GPU.

Counted from the model's real parameter shapes (a fake-tensor build for the large flavors costs seconds), under
vlaforge's precision design: every component keeps master weights in fp32, or in `train.precision_master` when
it computes in bf16 / fp16 / fp8 (fp8 linears keep bf16/fp32 masters; their per-tensor scales are bytes, not
counted). Gradients are in the master dtype. AdamW keeps two moments in the master dtype and a fp32 step scalar
per parameter tensor; a component with `optim_state = "8bit"` keeps torchao's 8-bit moments where torchao quantizes
(a tensor of at least 4096 values, a multiple of 256: 1 byte a value, an fp32 scale per 256 values and a 1 KiB code
map per moment; techniques/optimizer_state.py), master-dtype ones elsewhere. Stochastic rounding adds nothing: the
bf16 weights are the only copy (no fp32 master). A frozen component has parameters only (one that unfreezes later
is planned as trainable: its state is allocated when it starts to train). Tied weights belong to the first component
that owns them.

Per GPU: FSDP2 / ZeRO-3 divide everything by the shard degree; tensor parallel divides the LLM blocks' attention
and MLP weights by tp (norms, embeddings, heads and the other components stay replicated); a pipeline stage holds
only its own parameters.

The mixed-precision rule of thumb "16 bytes per parameter" is right for fp32 masters + AdamW (4 weight + 4 grad +
8 moments) whatever the compute dtype: bf16 autocast does not store a second weight copy; the transient bf16
casts of the weights are activation memory. With `precision_master = "bf16"` it is 8 bytes; with 8-bit moments as
well (and stochastic rounding to keep bf16 updates unbiased) ~6.03 bytes (2 + 2 + 2 x 1.016).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from vlaforge.models.llm import llm_blocks
from vlaforge.techniques.freezing import ever_trains
from vlaforge.techniques.optimizer_state import adam_state_bytes
from vlaforge.techniques.precision import master_dtype


@dataclass
class StateBytes:
    """Bytes of model state; `tp_sharded`: the part of params that tensor parallel splits (LLM block linears)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    tp_sharded_params: int = 0
    numel: int = 0
    tensors: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def add(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(*(getattr(self, f) + getattr(other, f) for f in
                            ("params", "grads", "optimizer", "tp_sharded_params", "numel", "tensors")))


@dataclass
class ModelState:
    by_component: dict[str, StateBytes] = field(default_factory=dict)

    @property
    def total(self) -> StateBytes:
        out = StateBytes()
        for s in self.by_component.values():
            out = out.add(s)
        return out


def _tp_split(model: nn.Module) -> set[int]:
    """ids of the parameters tensor parallel splits: the LLM blocks' layers the family's plan shards (q/k/v/o and
    gate/up/down in Llama; `families.tp_plan`). A family tensor parallel refuses (MoE experts) splits nothing."""
    from vlaforge.errors import VlaforgeError
    from vlaforge.models.families import tp_plan

    try:
        plan = tp_plan(model.llm.config)
    except VlaforgeError:
        return set()
    ids = set()
    for block in llm_blocks(model.llm):
        for name in (n for n, kind in plan.items() if kind != "replicated_with_grad_allreduce"):
            module = block.get_submodule(name)
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


def model_state(model: nn.Module, policies: Mapping[str, Any], master: str = "fp32") -> ModelState:
    """Whole-model state bytes per component (no sharding); a LoRA component (planner/lora.py): its frozen base as
    stored, its adapters trained."""
    from vlaforge.planner.lora import adapted, adapter_state, frozen_param_bytes
    from vlaforge.training.optim import owned_parameters

    tp_ids = _tp_split(model)
    out = ModelState()
    for name, params in owned_parameters(model).items():
        policy = policies[name]
        size = torch.empty((), dtype=master_dtype(policy.precision, master)).element_size()
        trains = ever_trains(policy)
        lora = adapted(model, name, policy)
        s = StateBytes()
        eight_bit = getattr(policy, "optim_state", "master") == "8bit"
        if lora is not None:
            s.params, s.grads, s.optimizer = adapter_state(lora, size, eight_bit)
            s.numel, s.tensors = lora.numel, 2 * len(lora.linears)
        for p in params:
            n = p.numel()
            s.numel += n
            s.tensors += 1
            if lora is not None:
                s.params += frozen_param_bytes(lora, p, size)
                continue
            s.params += n * size
            if id(p) in tp_ids:
                s.tp_sharded_params += n * size
            if trains:
                s.grads += n * size
                s.optimizer += adam_state_bytes(n, size, getattr(policy, "optim_state", "master"))
        out.by_component[name] = s
    return out


def per_gpu(state: StateBytes, shard: int = 1, tp: int = 1) -> StateBytes:
    """One GPU's share of `state` under FSDP2 / ZeRO-3 sharding over `shard` ranks and tensor parallel `tp`
    (FSDP2's padding of dim 0 to a multiple of the shard count is below a row per tensor and not counted)."""

    def split(total: int, tp_part: int) -> int:
        return (total - tp_part + tp_part // tp) // shard

    frac = state.tp_sharded_params / state.params if state.params else 0.0
    return StateBytes(params=split(state.params, state.tp_sharded_params),
                      grads=split(state.grads, int(state.grads * frac)),
                      optimizer=split(state.optimizer, int(state.optimizer * frac)),
                      tp_sharded_params=state.tp_sharded_params // (tp * shard),
                      numel=state.numel, tensors=state.tensors)
