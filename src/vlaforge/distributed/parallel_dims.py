"""`ParallelDims`: the runtime layout built from `[parallel]` and the world size, validated before any process group
work; the one place that initializes `torch.distributed` (gloo on CPU, NCCL on GPU) and builds the device mesh.

Mesh dimension order follows torchtitan: pp, dp_replicate, dp_shard, cp, tp (outermost to innermost), so tensor
parallel groups are the closest ranks (one NVLink island) and pipeline stages the farthest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vlaforge.distributed.sequence_parallel import check_ulysses_heads
from vlaforge.errors import VlaforgeError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(VlaforgeError):
    """A parallel layout that cannot run on this world size or this model."""


@dataclass(frozen=True)
class ModelFacts:
    """The shape facts a layout must respect, from the flavor or a pretrained folder's config.json."""

    llm_heads: int
    llm_kv_heads: int
    llm_blocks: int


def model_facts(model_cfg) -> ModelFacts:
    from vlaforge.config.flavors import FLAVORS
    from vlaforge.models.hf_loading import read_config

    flavor = FLAVORS.get(model_cfg.flavor)
    llm = dict(flavor.llm)
    field = "model.vlm.pretrained" if model_cfg.vlm.pretrained else "model.llm.pretrained"
    if model_cfg.text_folder:
        llm = read_config(model_cfg.text_folder, field)
        llm = llm.get("text_config", llm)  # a whole-VLM folder keeps its language model's shape there
    if "num_attention_heads" not in llm or "num_hidden_layers" not in llm:
        raise VlaforgeError(f"{field}: {model_cfg.text_folder}/config.json names no "
                            "num_attention_heads / num_hidden_layers; give a causal-LM folder written by "
                            "save_pretrained")
    heads = llm["num_attention_heads"]
    return ModelFacts(llm_heads=heads, llm_kv_heads=llm.get("num_key_value_heads") or heads,
                      llm_blocks=llm["num_hidden_layers"])


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    world_size: int
    backend: str = "fsdp2"
    sequence_parallel: bool = False  # Megatron-style SP inside the tp groups

    @classmethod
    def build(cls, cfg, world_size: int, facts: ModelFacts | None = None) -> "ParallelDims":
        """Resolve `dp_shard = -1` and validate; raises `LayoutError` with one line naming the fix."""
        others = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise LayoutError(f"world size {world_size} is not divisible by dp_replicate x tp x pp x cp = "
                                  f"{others}; change the degrees or the number of processes")
            dp_shard = world_size // others
        dims = cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.cp, world_size, cfg.backend,
                   cfg.sequence_parallel)
        dims.validate(facts)
        return dims

    def validate(self, facts: ModelFacts | None) -> None:
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if product != self.world_size:
            raise LayoutError(f"parallel: dp_replicate x dp_shard x tp x pp x cp = {product} but the world size is "
                              f"{self.world_size}; make the product equal the number of processes (torchrun "
                              "--nproc-per-node x --nnodes) or set dp_shard = -1")
        if self.backend == "ddp" and self.dp_shard > 1:
            raise LayoutError(f"parallel.backend = 'ddp' replicates the model and cannot shard it (dp_shard = "
                              f"{self.dp_shard}); use dp_replicate = {self.dp_shard * self.dp_replicate}, "
                              "dp_shard = 1, or backend = 'fsdp2'")
        if facts is None:
            return
        # tensor parallel splits the heads (and the kv-heads); context parallel splits the sequence, which any head
        # count allows (Ulysses, which splits heads, is checked with its method)
        for count, what in ((facts.llm_heads, "attention heads"), (facts.llm_kv_heads, "kv-heads")):
            if self.tp > 1 and count % self.tp:
                fits = [d for d in range(1, count + 1) if facts.llm_heads % d == 0 and facts.llm_kv_heads % d == 0]
                raise LayoutError(f"parallel.tp = {self.tp} does not divide the llm's {count} {what}; use one of "
                                  f"{fits}")
        if self.pp > facts.llm_blocks:
            raise LayoutError(f"parallel.pp = {self.pp} exceeds the llm's {facts.llm_blocks} blocks; use at most "
                              f"{facts.llm_blocks} stages")

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel coordinate of global rank `rank` (ranks that differ only in tp / cp see the same
        samples); MESH_ORDER puts tp and cp innermost."""
        return (rank // (self.cp * self.tp)) % self.dp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, sizes) of the mesh in MESH_ORDER: the two data dimensions always (FSDP2 replicates over a 2-D
        (dp_replicate, dp_shard) mesh even when one of them is 1), the others when their degree is above 1."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                 "tp": self.tp}
        kept = [n for n in MESH_ORDER if sizes[n] > 1 or n.startswith("dp_")]
        return tuple(kept), tuple(sizes[n] for n in kept)

    def build_mesh(self, device_type: str):
        """The device mesh over all ranks (needs `init_distributed` first)."""
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = self.mesh_shape()
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    """Rank facts as torchrun sets them (RANK, LOCAL_RANK, WORLD_SIZE); one process without them."""
    return World(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                 int(os.environ.get("WORLD_SIZE", "1")))


# ---- the layout rules of a whole config (beyond the degrees), checked before anything is built ----------------

def check_layout(cfg, world: World) -> ParallelDims:
    """The parallel layout for this world size, validated before anything is built (one line on a bad one)."""
    facts = model_facts(cfg.model)
    dims = ParallelDims.build(cfg.parallel, world.size, facts)
    if dims.backend == "deepspeed":
        check_deepspeed(cfg, dims)
    if dims.pp > 1:
        if cfg.train.grad_accum < dims.pp:
            raise VlaforgeError(f"parallel.pp = {dims.pp} needs train.grad_accum >= {dims.pp} (the accumulation "
                                f"micro-batches are the pipeline's; fewer leave stages idle); set train.grad_accum "
                                f"= {2 * dims.pp} or more")
        if cfg.loss.weighting != "static":
            raise VlaforgeError(f"loss.weighting = '{cfg.loss.weighting}' is not available with parallel.pp > 1 "
                                "(the losses exist on the last stage only); use 'static'")
        if dims.backend == "ddp":
            raise VlaforgeError("parallel.pp > 1 runs with backend = 'fsdp2' (set dp_shard = 1 to replicate); "
                                "use backend = 'fsdp2'")
        if dims.sequence_parallel:
            raise VlaforgeError("parallel.sequence_parallel with pp > 1 is not supported (stages exchange whole "
                                "sequences); set sequence_parallel = false or pp = 1")
    if dims.tp > 1 and cfg.model.text_folder:
        check_family(cfg.model.text_folder, dims)
    if dims.cp > 1:
        if dims.pp > 1 or dims.backend != "fsdp2":
            raise VlaforgeError(f"parallel.cp = {dims.cp} runs with backend = 'fsdp2' and pp = 1 (the gathered "
                                "sequence feeds the heads on every cp rank); set pp = 1 and backend = 'fsdp2', or "
                                "cp = 1")
        if cfg.parallel.cp_method == "ulysses":  # 'auto' avoids it when the heads do not split
            check_ulysses_heads(dims.cp, facts.llm_heads // dims.tp)
    if dims.distributed:
        check_lora_storage(cfg, dims)
        if cfg.train.step_in_backward and dims.backend == "ddp":
            raise VlaforgeError("parallel.backend = 'ddp' with train.step_in_backward is refused: DDP all-reduces "
                                "gradients in buckets after the hooks that would step them have run; use backend = "
                                "'fsdp2' (its hooks run after the reduce-scatter), or one process")
        check_optimizer_state(cfg, dims)
        if any(p.unfreeze_at_step is not None for _, p in cfg.components.items()):
            raise VlaforgeError("unfreeze_at_step is not available with more than one process yet (FSDP2 fixes "
                                "which parameters train when it shards); train the component from the start or "
                                "run in one process")
    return dims


def check_lora_storage(cfg, dims: ParallelDims) -> None:
    """The quantized LoRA bases torchao's tensors can be sharded as: NF4 under FSDP2 sharding (its all-gather
    hooks fail on a replicate dimension: HSDP, DDP), int8 under none (it implements no split)."""
    for name, p in cfg.components.items():
        base = p.lora.base if p.lora is not None else None
        if base == "int8":
            raise VlaforgeError(f"components.{name}.lora.base = 'int8' cannot be sharded or replicated (torchao's "
                                "int8 tensor has no split); use lora.base = 'nf4' or 'bf16' with more than one "
                                "process")
        if base == "nf4" and dims.dp_replicate > 1:
            raise VlaforgeError(f"components.{name}.lora.base = 'nf4' with parallel.dp_replicate = "
                                f"{dims.dp_replicate}: torchao's NF4 tensor shards under FSDP2 but does not "
                                "replicate (HSDP, DDP); set dp_replicate = 1, or lora.base = 'bf16'")


def check_optimizer_state(cfg, dims: ParallelDims) -> None:
    """torchao's optimizers (8-bit moments, stochastic rounding) over more than one process: DDP's replicas, whose
    parameters are plain tensors. Refused where parameters are DTensors (FSDP2 / HSDP shards, tensor and pipeline
    parallel): on 2 gloo ranks torchao's compiled step crashed (SIGSEGV) on a rank's empty shard of a parameter
    with fewer rows than ranks (projector.logit_scale), and a gathered 8-bit moment came back as an
    AsyncCollectiveTensor, which a checkpoint cannot hold."""
    from vlaforge.techniques.optimizer_state import option

    hosted = [c for c, p in cfg.components.items() if option(p)[0] == "cpu"]
    if hosted and dims.world_size > 1:
        raise VlaforgeError(f"components.{hosted[0]}.optim_state = 'cpu' steps plain tensors on the host, one "
                            f"process; this run has {dims.world_size} ({dims.backend}, whose parameters are "
                            "DTensors); run in one process, or offload with parallel.backend = 'deepspeed' and "
                            "offload_optimizer = 'cpu'")
    chosen = [c for c, p in cfg.components.items() if option(p) != ("master", False)]
    if chosen and (dims.backend != "ddp" or dims.tp > 1 or dims.pp > 1 or dims.cp > 1):
        raise VlaforgeError(f"components.{chosen[0]}.optim_state / stochastic_rounding step plain tensors and "
                            f"parallel.backend = '{dims.backend}' on {dims.world_size} processes shards them "
                            "(torchao's 8-bit state does not shard here); use parallel.backend = 'ddp' with "
                            "dp_replicate = the world size and dp_shard = 1, or run in one process")


def check_family(folder: str, dims: ParallelDims) -> None:
    """What the family of a pretrained LLM allows, from its config alone (before any process group): its tensor-
    parallel plan (`families.tp_plan` refuses MoE experts). (Every context-parallel kernel computes sliding windows
    and soft-capped logits.)"""
    from transformers import AutoConfig

    from vlaforge.models.families import tp_plan

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise VlaforgeError(f"model.llm.pretrained: cannot read {folder}/config.json ({exc}); give a "
                            "save_pretrained folder") from None
    config = getattr(config, "text_config", None) or config
    if dims.tp > 1:
        tp_plan(config)


def check_deepspeed(cfg, dims: ParallelDims) -> None:
    """What the DeepSpeed backend runs, refused with one line otherwise."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise VlaforgeError("parallel.backend = 'deepspeed' needs the deepspeed extra: pip install "
                            "'vlaforge[deepspeed]' (DS_BUILD_OPS=0: ops compile on first use)")
    if dims.tp > 1 or dims.pp > 1 or dims.cp > 1 or dims.dp_replicate > 1:
        raise VlaforgeError("parallel.backend = 'deepspeed' shards over all ranks (ZeRO); set tp = pp = cp = "
                            "dp_replicate = 1, or use backend = 'fsdp2' for tensor / pipeline parallel and HSDP")
    if cfg.loss.weighting in ("uncertainty", "gradnorm"):
        raise VlaforgeError(f"loss.weighting = '{cfg.loss.weighting}' is not available with DeepSpeed (its learned "
                            "weights live outside the engine); use 'static' or 'dwa'")
    if any(p.precision == "fp16" for _, p in cfg.components.items()):
        raise VlaforgeError("fp16 components are not available with DeepSpeed (vlaforge's per-component loss scaler "
                            "cannot reach ZeRO's gradient partitions); use 'bf16'")
    if cfg.train.checkpoint_format == "sharded":
        raise VlaforgeError("train.checkpoint_format = 'sharded' is for fsdp2 / ddp; DeepSpeed checkpoints hold "
                            "ZeRO's own partitions plus model.safetensors: use 'full'")
    if any(p.unfreeze_at_step is not None for _, p in cfg.components.items()):
        raise VlaforgeError("unfreeze_at_step is not available with DeepSpeed (ZeRO fixes the trained parameters "
                            "at initialization); train the component from the start")


def init_distributed(world: World, device: torch.device, single: bool = False) -> torch.device:
    """Initialize the default process group (gloo on CPU, NCCL on GPU) when there is more than one process, or
    a one-rank group when `single` (DeepSpeed needs one even in a single process).

    Returns the device this rank uses (cuda:LOCAL_RANK on GPU).
    """
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world.size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    elif single and not dist.is_initialized():
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return device
