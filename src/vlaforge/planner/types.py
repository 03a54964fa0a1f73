"""The planner's shared vocabulary: the cluster, the stated assumptions, the model of a base config, one resolved
candidate (`Case`), memory by kind (`MemoryBytes`), and the config fields a plan decides. `estimate.py`,
`throughput.py`, `search.py` and `report.py` all import from here, and not from each other in both directions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from torch import nn

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.models.families import llm_dims
from vlaforge.models.llm import llm_blocks
from vlaforge.planner.activations import Sequence, sequence_of
from vlaforge.planner.hardware import GPU
from vlaforge.planner.lora import LORA_COUNTED
from vlaforge.planner.memory import ModelState, model_state
from vlaforge.techniques.freezing import ever_trains

SEARCHED = ("parallel.tp", "parallel.sequence_parallel", "parallel.pp", "parallel.cp", "parallel.cp_method",
            "parallel.dp_replicate",
            "parallel.dp_shard", "parallel.backend", "train.batch_size", "train.grad_accum",
            *(f"components.{c}.{k}" for c in COMPONENTS for k in ("precision", "checkpointing", "offload")))


def config_fields(cfg) -> dict[str, Any]:
    """The fields a plan decides, flat and dotted (the rest of the config is the base's); a component's LoRA as its
    settings (`components.<c>.lora`, None without)."""
    out = {}
    for key in SEARCHED:
        section, *rest = key.split(".")
        value = getattr(cfg, section)
        for part in rest:
            value = getattr(value, part)
        out[key] = value
    for comp in LORA_COUNTED:
        lora = getattr(cfg.components, comp).lora
        out[f"components.{comp}.lora"] = lora.model_dump() if lora is not None else None
    out["train.precision_master"] = cfg.train.precision_master
    return out


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    cpu_mem_gb: float = 1024.0  # host memory per node
    nvme_gb: float = 0.0  # NVMe per node
    nvme_gbps: float = 6.0  # NVMe read/write per node

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} x {self.gpu.name}"


@dataclass(frozen=True)
class Assumptions:
    """The stated constants of the throughput and fit model (each overridable on the command line)."""

    matmul_efficiency: float = 0.6  # share of the dense peak large bf16 GEMMs reach (no GPU calibration yet)
    fp8_efficiency: float = 0.47  # share of the fp8 peak fp8 GEMMs reach (their casts apart: launches.py)
    attention_efficiency: float = 0.45  # flash-attention kernels, forward and backward together
    comm_efficiency: float = 0.8  # share of a link's bandwidth ring collectives reach
    elementwise_passes: float = 6.0  # HBM passes over the saved activations by norms, activations, casts, adds
    cpu_adam_gbps: float = 20.0  # optimizer state a node's CPU Adam streams through per second (DeepSpeed offload)
    micro_overhead_s: float = 0.0  # fixed seconds per micro-batch (kernel launches, Python): 0 unless calibrated
    launch_floor: bool = True  # the host's kernel launches bound the step (launches.py); a calibration fits instead
    margin: float = 0.10  # allocator fragmentation
    reserved_gb: float = 1.0  # CUDA context, cuBLAS and NCCL workspaces


class PlanModel:
    """The model of a base config, built once under fake tensors, with the facts every candidate reuses. `padded`:
    whether its micro-batches pad an instruction or text (transformers then builds a B x S x S mask and repeats K/V
    to every head); by default they do, as the trainer's datasets pad instructions to `data.max_instruction_tokens`
    (a benchmark's full-length synthetic batches do not: `padded=False`)."""

    def __init__(self, cfg, padded: bool = True):
        from vlaforge.distributed.parallel_dims import model_facts
        from vlaforge.models.blocks import is_policy
        from vlaforge.models.build import build_vla, objective_from, synthetic_batch
        from vlaforge.models.fake import fake_build
        from vlaforge.planner.measured import MeasuredRows, measured_components, policy_shapes

        with fake_build():
            self.model = build_vla(cfg.model, cfg.loss, fake=True)  # a pretrained folder: its config alone
            if is_policy(self.model):  # its own chunk, vectors and prompt length, whatever the config's defaults
                cfg = policy_shapes(cfg, self.model)
                self.model.objective = objective_from(cfg.loss)
            self.seq = replace(sequence_of(self.model, synthetic_batch(cfg, self.model, 1)), padded=padded)
        self.cfg = cfg
        # the LLM's dimensions as its family states them: a field the family lacks is refused here, in one line
        self.llm_dims = llm_dims(self.model.llm.config)
        proj = self.model.projector
        if getattr(proj, "spec", {}).get("norm") not in (None, "rms"):
            # NOTE: activations.py counts linear + GELU + linear or one linear, after a merge and an RMSNorm or none
            raise VlaforgeError("the planner counts two-layer and one-linear connectors, after a pixel shuffle or "
                                "Qwen2.5-VL's RMSNorm-and-merge; this VLM's patch merger normalizes with a LayerNorm "
                                "(model.vlm.pretrained), which it does not count yet")
        # the blocks no formula counts exactly are measured under fake tensors (planner/measured.py)
        self.measured_components = measured_components(self.model)
        self.measured = (MeasuredRows(cfg, self.model, self.measured_components, padded)
                         if self.measured_components else None)
        self.facts = model_facts(cfg.model)
        self.contrastive = self.model.objective.active("contrastive")
        self._states: dict = {}
        self._plans: dict = {}

    @property
    def tokens_per_sample(self) -> int:
        return self.seq.llm_tokens

    def state(self, policies, master: str):
        key = (master, tuple((c, policies[c].precision, ever_trains(policies[c]), policies[c].optim_state,
                              policies[c].lora.model_dump_json() if policies[c].lora else None) for c in COMPONENTS))
        if key not in self._states:
            self._states[key] = model_state(self.model, policies, master)
        return self._states[key]

    def stage_bounds(self, pp: int) -> tuple[tuple[int, int], ...]:
        if pp not in self._plans:
            from vlaforge.distributed.pipeline import plan_stages

            d = self.cfg.data
            self._plans[pp] = plan_stages(self.model, pp, d.max_instruction_tokens, d.max_text_tokens).bounds
        return self._plans[pp]

    @cached_property
    def llm_numel(self) -> dict[str, int]:
        """The LLM's parameters by place: the token embeddings, one block, the tail (final norm + LM head; a tied
        head is the embeddings, counted there), and 'tied_head': the embeddings again when the head is tied to
        them, which the last pipeline stage holds a copy of."""
        llm = self.model.llm
        blocks = llm_blocks(llm)
        block = sum(p.numel() for p in blocks[0].parameters())
        embed = llm.get_input_embeddings().weight.numel()
        total = sum(p.numel() for p in llm.parameters())
        tied = llm.get_output_embeddings().weight is llm.get_input_embeddings().weight
        return {"embed": embed, "block": block, "tail": total - embed - block * len(blocks),
                "tied_head": embed if tied else 0}

    @cached_property
    def largest_numel(self) -> dict[str, int]:
        """The largest parameter tensor of each place backward makes gradients in, one at a time when the step runs
        inside backward (`train.step_in_backward`): an LLM block, the LLM's embeddings, its tail (final norm and LM
        head), and the other components whole."""
        llm = self.model.llm
        blocks = llm_blocks(llm)
        embed = llm.get_input_embeddings().weight
        inside = {id(p) for b in blocks for p in b.parameters()} | {id(embed)}
        tail = [p.numel() for p in llm.parameters() if id(p) not in inside]
        out = {"llm_block": max(p.numel() for p in blocks[0].parameters()), "embed": embed.numel(),
               "llm_tail": max(tail, default=0)}
        for comp in ("vision", "projector", "action_head"):
            out[comp] = max((p.numel() for p in getattr(self.model, comp).parameters()), default=0)
        return out

    @cached_property
    def matmul_numel(self) -> dict[str, dict[str, int]]:
        """Parameters of the linears and convolutions per component, what autocast casts: 'attn' and 'ffn' of one
        block (vision, llm), 'rest' outside the blocks."""
        from vlaforge.models.blocks import blocks_of
        from vlaforge.techniques.checkpointing import sublayer

        def numel(module) -> int:
            return sum(p.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                       for p in m.parameters(recurse=False))

        out = {}
        for comp in COMPONENTS:
            # the LLM's own decoder blocks (a LeRobot policy's units are joint layers, which own no weights)
            blocks = llm_blocks(self.model.llm) if comp == "llm" else blocks_of(self.model, comp)
            row = {"rest": numel(getattr(self.model, comp)), "attn": 0, "ffn": 0}
            if blocks is not None:  # the average block (a fused tower's blocks are of two widths)
                row["attn"], row["ffn"] = (sum(numel(sublayer(b, r)) for b in blocks) // len(blocks)
                                           for r in ("attn", "ffn"))
                row["rest"] -= len(blocks) * (row["attn"] + row["ffn"])
            out[comp] = row
        return out

    def cast_numel(self, comp: str, strategy: str, blocks: int, tp: int = 1) -> int:
        """Matmul parameters whose casts autograd keeps until backward: a checkpointed region recomputes its casts
        (`full` and `selective` keep none of a block's; `selective_attn` keeps the FFN's, `selective_ffn` the
        attention's); tensor parallel holds 1/tp of the LLM blocks' linears."""
        row = self.matmul_numel[comp]
        kept = {"none": row["attn"] + row["ffn"], "every_nth": row["attn"] + row["ffn"],
                "selective_attn": row["ffn"], "selective_ffn": row["attn"]}.get(strategy, 0)
        return row["rest"] + blocks * kept // (tp if comp == "llm" else 1)

    @cached_property
    def root_numel(self) -> dict[str, int]:
        """Parameters outside the transformer blocks per component: FSDP2's root unit, gathered whole."""

        inside = {id(p) for unit in self.fsdp_units for p in unit.parameters()}
        return {comp: sum(p.numel() for p in getattr(self.model, comp).parameters() if id(p) not in inside)
                for comp in COMPONENTS}

    @cached_property
    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards as units (`distributed.parallelize.apply_data_parallel`), each a list's worth of
        blocks: every tower and LLM block, or a LeRobot policy's joint layer (its VLM block and expert block)."""
        from vlaforge.models.blocks import blocks_of

        units = []
        for comp in COMPONENTS:
            for block in blocks_of(self.model, comp) or ():
                members = getattr(block, "fsdp_members", None)
                units.append(nn.ModuleList(members()) if members is not None else block)
        return units

    @cached_property
    def llm_unit_numel(self) -> int:
        """Parameters of the LLM's largest FSDP2 unit: a block, or a policy's joint layer (both its blocks)."""
        from vlaforge.models.blocks import blocks_of

        blocks = blocks_of(self.model, "llm") or ()
        sizes = [sum(p.numel() for m in (b.fsdp_members() if hasattr(b, "fsdp_members") else [b])
                     for p in m.parameters()) for b in blocks]
        return max(sizes, default=0)

    @cached_property
    def vision_block_numel(self) -> int:
        from vlaforge.models.vision import vision_blocks

        return max(sum(p.numel() for p in b.parameters()) for b in vision_blocks(self.model.vision))


@dataclass(frozen=True)
class Case:
    """One candidate's resolved facts, shared by its memory and step-time estimates (`build_case`)."""

    cfg: Any
    policies: dict
    lora: dict  # component -> planner.lora.Adapted, for the components with adapters
    tp: int
    pp: int
    cp: int
    rep: int
    shard: int
    micro: int
    accum: int
    seq: Sequence  # one micro-batch
    bounds: tuple  # the LLM blocks of each pipeline stage
    state: ModelState
    parts: dict[str, int]  # `activations.activation_parts` for one micro-batch under this layout
    fsdp: bool  # FSDP2 shards over more than one rank (its gather buffers, no autocast weight casts)
    method: str  # the context-parallel method the trainer will run
    backward_through: dict[str, bool]  # whether backward runs through each component

    @property
    def par(self):
        return self.cfg.parallel

    @property
    def dp(self) -> int:
        return self.rep * self.shard

    @property
    def layers(self) -> int:
        return self.bounds[-1][1]


@dataclass
class MemoryBytes:
    """Bytes on one GPU by kind, and what activation offload or DeepSpeed moved to the host or NVMe instead."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # the autocast weight casts included
    buffers: float = 0.0
    weight_casts: float = 0.0
    offloaded: float = 0.0  # activations moved off the GPU
    cpu: float = 0.0
    nvme: float = 0.0
    host_optimizer: float = 0.0  # of `cpu`: the state vlaforge's host AdamW keeps and steps (optim_state = "cpu")
    at_peak: float | None = None  # activations + gradients + working sets at the step's peak (planner/peak.py)
    grads_held: float | None = None  # the most gradient bytes held at once (`peak.grads_held`)

    @property
    def total(self) -> float:
        """What the GPU holds at the step's peak: the state and buffers, plus what `at_peak` says is held then
        (without it, every gradient on top of every activation)."""
        if self.at_peak is not None:
            return self.params + self.optimizer + self.buffers + self.at_peak
        return sum((self.params, self.grads, self.optimizer, self.activations, self.buffers))
