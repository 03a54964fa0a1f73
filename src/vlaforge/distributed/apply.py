"""`apply_techniques`: every technique, applied to an unchanged VLA in one fixed order (DESIGN.md), as torchtitan's
`parallelize_llama` does. Each step is one function in `techniques/` or `distributed/`; this file owns the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vlaforge.distributed.parallelize import GradReducer, apply_data_parallel, apply_tensor_parallel
from vlaforge.distributed.pipeline import StageModule, StagePlan, split_for_stage, tie_stages
from vlaforge.distributed.sequence_parallel import SequenceParallel, apply_sequence_parallel
from vlaforge.techniques.checkpointing import apply_checkpointing
from vlaforge.techniques.compile import compile_blocks
from vlaforge.techniques.lora import LoraReport, apply_lora
from vlaforge.techniques.offload import apply_offload
from vlaforge.techniques.precision import PrecisionSetup, apply_precision
from vlaforge.techniques.quantize import prepare_qat

if TYPE_CHECKING:
    from vlaforge.distributed.parallel_dims import ParallelDims


@dataclass
class Applied:
    """What applying the techniques produced that the run keeps using."""

    precision: PrecisionSetup
    reducer: GradReducer | None = None  # gradient / metric reductions over the data-parallel ranks
    stage: StageModule | None = None  # this rank's pipeline stage (pp > 1): the module its schedule runs
    stage_plan: StagePlan | None = None
    sequence_parallel: SequenceParallel | None = None
    qat: dict[str, list[str]] | None = None  # component -> fake-quantized layers
    lora: dict[str, LoraReport] | None = None  # component -> its adapters


def apply_techniques(model: nn.Module, cfg, device: torch.device, dims: "ParallelDims | None" = None, mesh=None,
                     tokens: int = 0) -> Applied:
    """Apply `cfg`'s techniques to `model` in place, in DESIGN.md's order. Without `dims` (or in one process, or
    under DeepSpeed, whose engine is the data-parallel step and is built with the optimizer) only the one-process
    techniques run. `tokens`: the LLM sequence of one sample (context parallel's `auto` method)."""
    policies = dict(cfg.components.items())
    # 1. freezing is a schedule: the loop applies it at each step where it changes (techniques/freezing.py)
    # 2. converters: fake quantization (QAT), fp8 linears (inside each component's autocast region)
    # NOTE: before tensor parallel, so the TP plan shards the converted Float8Linear modules
    # NOTE: fake quantization (QAT) before precision: fp8 is refused beside it, and the master-dtype cast then
    # applies to the fake-quantized linears like any other
    qat = prepare_qat(model, policies)
    applied = Applied(apply_precision(model, policies, device, cfg.train.precision_master), qat=qat)
    # NOTE: adapters after precision: its master-dtype cast would dequantize an NF4 base (and the adapters are
    # created in the base's dtype, so a bf16 master trains bf16 adapters, an fp32 master fp32 ones)
    layout = dims is not None and dims.distributed and dims.backend != "deepspeed"
    applied.lora = apply_lora(model, policies, shards=dims.dp_shard if layout else 1)
    if layout and dims.pp > 1:
        # NOTE: the pipeline split comes first among the layouts: every later step applies to the modules this
        # rank's stage keeps
        applied.stage, applied.stage_plan = split_for_stage(model, cfg, dims.pp, mesh)
    # 3. tensor and context parallel
    tp_partial: list[str] = []
    if layout and dims.tp > 1:
        tp_partial = apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel)
    if layout and dims.cp > 1:
        applied.sequence_parallel = apply_sequence_parallel(model, dims, mesh, cfg, tokens)
    # 4. activation memory. NOTE: checkpointing replaces each block's `forward` and offload wraps each component's,
    # both on the instance, so the TP / CP hooks registered above run inside them, on every recomputation too
    apply_checkpointing(model, policies)
    apply_offload(model, policies, device)
    # 5. compile per block. NOTE: after the hooks above (compiled with the block), before FSDP2 (which shards the
    # compiled blocks as its units)
    if cfg.train.compile:
        compile_blocks(model)
    # 6. data-parallel sharding (FSDP2 / HSDP / DDP); DeepSpeed's engine takes this place in the trainer
    if layout:
        applied.reducer = apply_data_parallel(model, dims, mesh, policies, root=applied.stage, tp_partial=tp_partial)
        if dims.pp > 1:
            tie_stages(model, applied.reducer, mesh)  # tied embeddings on the first and last stage
    return applied
