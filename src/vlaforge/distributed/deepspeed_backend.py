"""`parallel.backend = "deepspeed"`: DeepSpeed ZeRO stage 1/2/3 with optimizer / parameter offload to CPU or NVMe,
built from the same `[parallel]` and `[train]` sections as the torch-native backends (the optional `deepspeed`
extra).

What stays vlaforge's: per-component precision (autocast regions over fp32 master weights, as with FSDP2, so
DeepSpeed runs its fp32 path and the components keep their own compute dtypes), per-component learning rates (the
optimizer's groups), the schedule, the global loss normalization and the checkpoints' consolidated weights. What is
DeepSpeed's: partitioning optimizer state (ZeRO-1), gradients (ZeRO-2) and parameters (ZeRO-3), offload, the
gradient all-reduce / reduce-scatter, clipping (`gradient_clipping = train.grad_clip`, the same formula as ours) and
the optimizer step at the accumulation boundary.

`config_overrides` maps a DeepSpeed JSON/YAML file onto vlaforge's fields and rejects the fields it does not
honour, with the reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlaforge.config.schema import ZERO_AUTO_FROM_HIDDEN, ZERO_TUNING
from vlaforge.errors import VlaforgeError, first_line, load_refusal

ENGINE_DIR = "deepspeed"  # inside a checkpoint folder: DeepSpeed's own partitioned optimizer state
TAG = "state"

IGNORED = ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "dump_state")
AUTO = "auto"  # transformers' convention: "take this value from the trainer's own settings"
# Tuning keys whose "auto" is sized from the LLM's hidden width h, as transformers sizes them from the model's
# hidden_size; "auto" on any other tuning key leaves DeepSpeed's default.
AUTO_FROM_HIDDEN = dict(zip(ZERO_AUTO_FROM_HIDDEN, (lambda h: h * h, lambda h: int(0.9 * h * h), lambda h: 10 * h)))


def engine_config(cfg, dp: int, hidden: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config for this run; `hidden`: the LLM's width, for tuning sizes given as "auto"."""
    p, t = cfg.parallel, cfg.train
    tuning = dict(p.zero_tuning)
    for key, size in AUTO_FROM_HIDDEN.items():
        if tuning.get(key) == AUTO:
            if hidden is None:
                raise ValueError(f"zero_optimization.{key} = 'auto' needs the model's hidden size")
            tuning[key] = size(hidden)
    zero: dict[str, Any] = {"stage": p.zero_stage, **tuning}
    for kind, device in (("offload_optimizer", p.offload_optimizer), ("offload_param", p.offload_param)):
        if device != "none":
            zero[kind] = {"device": device, **({"nvme_path": p.nvme_path} if device == "nvme" else {})}
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * dp,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        # torch's AdamW with our per-component groups also under offload (DeepSpeedCPUAdam is used on GPUs)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_engine(model: nn.Module, cfg, dp: int, groups: list[dict], scheduler_factory, device: torch.device):
    """(engine, scheduler): `model` wrapped by DeepSpeed with our per-component AdamW parameter `groups`; the
    schedule steps inside `engine.step()` at each accumulation boundary."""
    import deepspeed

    t = cfg.train
    if cfg.parallel.offload_optimizer == "cpu" and device.type == "cuda":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, betas=t.betas, eps=t.eps, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(groups, betas=t.betas, eps=t.eps, foreach=True)
    scheduler = scheduler_factory(optimizer)
    if cfg.parallel.zero_stage == 3:
        # ZeRO-3 gathers a module's parameters around its own forward; these two are read by the VLA's forward
        # outside their modules' (the action queries join the LLM input, the temperature scales the contrastive
        # logits), so the root module gathers them too. A LeRobot policy reads none outside its modules.
        outside = (getattr(model.action_head, "queries", None), getattr(model.projector, "logit_scale", None))
        for param in (p for p in outside if p is not None):
            deepspeed.zero.register_external_parameter(model, param)
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it; torchrun sets it, one process has rank 0
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=engine_config(cfg, dp, model.llm.config.hidden_size),
                                           dist_init_required=False)
    return engine, scheduler


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (ZeRO-3 gathers its partitions; a collective)."""
    import deepspeed

    model = engine.module
    if engine.zero_optimization_stage() < 3:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def save_engine(engine, folder: Path) -> None:
    """Collective: DeepSpeed writes its partitioned optimizer state (one file per rank) into folder/deepspeed."""
    engine.save_checkpoint(str(folder / ENGINE_DIR), tag=TAG, client_state={}, save_latest=False)


def load_engine(engine, folder: Path, saved_world: int | None, world: int) -> None:
    """Restore DeepSpeed's partitioned state (the model weights come with it).

    Raises:
        VlaforgeError: the checkpoint is not a DeepSpeed one, or was written at another world size.
    """
    if not (folder / ENGINE_DIR / TAG).is_dir():
        raise VlaforgeError(f"checkpoint {folder} has no DeepSpeed state ({ENGINE_DIR}/); a deepspeed run resumes "
                            "from a deepspeed checkpoint: use parallel.backend = 'fsdp2' to resume this one")
    if saved_world is not None and saved_world != world:
        raise VlaforgeError(f"checkpoint {folder} was written by DeepSpeed at {saved_world} ranks and ZeRO "
                            f"partitions do not reshard; resume with --nproc-per-node x --nnodes = {saved_world}")
    engine.checkpoint_engine = _data_only_engine(engine.checkpoint_engine)
    path, _ = engine.load_checkpoint(str(folder / ENGINE_DIR), tag=TAG, load_lr_scheduler_states=False)
    if path is None:
        raise VlaforgeError(f"checkpoint {folder}: DeepSpeed could not read {ENGINE_DIR}/{TAG}; resume from another "
                            "checkpoint")


# What DeepSpeed's own state files hold besides tensors and builtins (ZeRO-1/2/3, torch's AdamW; listed with
# `torch.serialization.get_unsafe_globals_in_checkpoint`): an enum, the loss scaler's plain attributes and a
# (start, numel) record. Nothing else is admitted when they are read.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def _data_only_engine(engine):
    """DeepSpeed's checkpoint engine with `load` reading through `torch.load(weights_only=True)`: DeepSpeed calls
    torch's unrestricted unpickler (weights_only off), which runs whatever code a crafted file carries."""
    import importlib

    allowed = [getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
               for name in DEEPSPEED_GLOBALS]

    def load(path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - UnpicklingError for foreign objects, others for damaged files
            raise VlaforgeError(f"DeepSpeed state file {path} holds more than tensors and plain data, or is damaged "
                                f"({load_refusal(exc)}); vlaforge reads no code from checkpoints - resume from a "
                                "checkpoint you wrote") from None

    engine.load = load
    return engine


def read_config_file(path: Path) -> dict[str, Any]:
    """A DeepSpeed JSON or YAML config.

    Raises:
        VlaforgeError: missing or unparsable.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise VlaforgeError(f"--deepspeed {path}: cannot read it ({exc.strerror}); give a DeepSpeed JSON or YAML "
                            "file") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - json / yaml syntax errors (yaml's own types)
        first = first_line(exc, None)
        raise VlaforgeError(f"--deepspeed {path}: not valid {path.suffix.lstrip('.') or 'JSON'} ({first}); fix the "
                            "file") from None
    if not isinstance(data, dict):
        raise VlaforgeError(f"--deepspeed {path}: expected a mapping of DeepSpeed fields at the top level")
    return data


def _given(value: Any) -> bool:
    """An explicit value: present and not "auto"."""
    return value is not None and value != AUTO


def config_overrides(ds: dict[str, Any], world_size: int, where: str = "--deepspeed") -> list[str]:
    """`--section.key=value` overrides equivalent to a DeepSpeed config, for `load_config`. A value of "auto" (as
    in the configs the transformers Trainer documents) takes vlaforge's own setting; `check_resolved` then refuses
    the explicit values that contradict the resolved config.

    Raises:
        VlaforgeError: a field vlaforge does not honour (named, with where its setting lives), or inconsistent
            batch sizes.
    """
    out = ["--parallel.backend=deepspeed"]
    ds = dict(ds)
    rejected = _zero_overrides(dict(ds.pop("zero_optimization", {}) or {}), out)
    rejected += _precision_overrides(ds, out)
    _batch_overrides(ds, world_size, where, out)
    if _given(ds.get("gradient_clipping")):
        out.append(f"--train.grad_clip={float(ds['gradient_clipping'])}")
    ds.pop("gradient_clipping", None)
    rejected += _optimizer_overrides(ds.pop("optimizer", None), out)
    scheduler = ds.pop("scheduler", None)
    if scheduler and not _all_auto(scheduler.get("params")):
        rejected.append("scheduler (use train.lr_schedule and train.warmup_steps; a scheduler whose params are all "
                        "'auto' is accepted and vlaforge's schedule runs)")
    for key in IGNORED:
        ds.pop(key, None)
    rejected += list(ds)
    if rejected:
        raise VlaforgeError(f"{where}: fields vlaforge does not honour: {', '.join(rejected)}; remove them (the "
                            "honoured ones: zero_optimization stage/offload/tuning, bf16, batch sizes, "
                            "gradient_clipping, optimizer betas/eps; 'auto' anywhere takes vlaforge's value)")
    return out


def _all_auto(params: Any) -> bool:
    return isinstance(params, dict) and bool(params) and all(v == AUTO for v in params.values())


def _zero_overrides(zero: dict[str, Any], out: list[str]) -> list[str]:
    """zero_optimization -> [parallel] overrides; returns the rejected keys."""
    rejected: list[str] = []
    if _given(zero.get("stage")):
        out.append(f"--parallel.zero_stage={int(zero['stage'])}")
    zero.pop("stage", None)
    for kind in ("offload_optimizer", "offload_param"):
        spec = dict(zero.pop(kind, None) or {})
        if spec:
            out.append(f"--parallel.{kind}={spec.pop('device', 'none')}")
            if "nvme_path" in spec:
                out.append(f"--parallel.nvme_path={json.dumps(str(spec.pop('nvme_path')))}")
            spec.pop("pin_memory", None)  # always pinned where it matters
            rejected += [f"zero_optimization.{kind}.{k}" for k in spec]
    tuning = {k: zero.pop(k) for k in list(zero) if k in ZERO_TUNING}
    tuning = {k: v for k, v in tuning.items() if v != AUTO or k in AUTO_FROM_HIDDEN}  # other autos: DS defaults
    if tuning:
        table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in tuning.items())  # a TOML inline table
        out.append(f"--parallel.zero_tuning={{{table}}}")
    return rejected + [f"zero_optimization.{k}" for k in zero]


def _precision_overrides(ds: dict[str, Any], out: list[str]) -> list[str]:
    """bf16 / fp16 sections: enabled = true maps (bf16) or is refused (fp16); "auto" or false keeps vlaforge's
    per-component precision (a contradicting false is refused by `check_resolved`). Returns the rejected keys."""
    rejected = []
    if (ds.pop("fp16", None) or {}).get("enabled") is True:
        rejected.append("fp16.enabled (use bf16: DeepSpeed's fp16 loss scaler would replace vlaforge's "
                        "per-component one)")
    if (ds.pop("bf16", None) or {}).get("enabled") is True:
        out += [f"--components.{c}.precision=bf16" for c in ("vision", "projector", "llm", "action_head")]
    return rejected


def _batch_overrides(ds: dict[str, Any], world_size: int, where: str, out: list[str]) -> None:
    micro, accum, total = (ds.pop("train_micro_batch_size_per_gpu", None), ds.pop("gradient_accumulation_steps", None),
                           ds.pop("train_batch_size", None))
    micro, accum, total = (v if _given(v) else None for v in (micro, accum, total))
    if total is not None:
        if micro is None and accum is not None:
            micro, rest = divmod(int(total), int(accum) * world_size)
            if rest or micro == 0:
                raise VlaforgeError(f"{where}: train_batch_size {total} is not gradient_accumulation_steps "
                                    f"{accum} x world size {world_size} x a micro-batch; fix the batch fields")
        elif micro is not None and int(micro) * int(accum or 1) * world_size != int(total):
            raise VlaforgeError(f"{where}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                                f"gradient_accumulation_steps {accum or 1} x world size {world_size}; fix the batch "
                                "fields")
    if micro is not None:
        out.append(f"--train.batch_size={int(micro)}")
    if accum is not None:
        out.append(f"--train.grad_accum={int(accum)}")


def _optimizer_overrides(optimizer: dict[str, Any] | None, out: list[str]) -> list[str]:
    if not optimizer:
        return []
    rejected = []
    kind = optimizer.get("type", AUTO)
    if _given(kind) and str(kind).lower() not in ("adam", "adamw"):
        rejected.append(f"optimizer.type {kind!r} (vlaforge trains with AdamW)")
    params = {k: v for k, v in dict(optimizer.get("params", {})).items() if _given(v)}
    if "betas" in params:
        out.append(f"--train.betas={json.dumps(list(params.pop('betas')))}")
    if "eps" in params:
        out.append(f"--train.eps={float(params.pop('eps'))}")
    return rejected + [f"optimizer.params.{k} (per component: components.<name>.lr / weight_decay)" for k in params]


def check_resolved(cfg, ds: dict[str, Any], world_size: int, where: str = "--deepspeed") -> None:
    """Explicit values of a DeepSpeed file that contradict the resolved config (after "auto" took vlaforge's).

    Raises:
        VlaforgeError: naming the field and the vlaforge setting it contradicts.
    """
    total = ds.get("train_batch_size")
    t = cfg.train
    if _given(total) and int(total) != t.batch_size * t.grad_accum * world_size:
        raise VlaforgeError(f"{where}: train_batch_size {total} != train.batch_size {t.batch_size} x train.grad_accum "
                            f"{t.grad_accum} x world size {world_size}; set it to 'auto' or fix the batch fields")
    if (ds.get("bf16") or {}).get("enabled") is False:
        bf16 = [c for c, p in cfg.components.items() if p.precision == "bf16"]
        if bf16:
            raise VlaforgeError(f"{where}: bf16.enabled = false but components.{bf16[0]}.precision = 'bf16'; set it "
                                "to 'auto' (the components' precision decides) or change the components")
