"""The recomputation profiler behind `vlaforge profile`: every checkpointing strategy on the model in a config.

For each strategy it applies the techniques to a fresh model, runs forward + backward on one batch (the first
samples of the config's dataset; a batch of the config's shapes under fake tensors) and reports
activation bytes (saved for backward, per component and per block, from `techniques/accounting.py`), peak memory
(CUDA's allocator peak on GPU; the saved-bytes accounting on CPU), step time and overhead against no
checkpointing, and which strategy fits a memory budget. With `fake=True` the model and batch are fake tensors
(`FakeTensorMode`): memory in seconds even for large flavors, and step times predicted by the planner for one GPU
of the catalog (calibrated when a `vlaforge plan --calibrate` file has that GPU, else marked uncalibrated) - never
ranked by an assumed order of the strategies.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from vlaforge import COMPONENTS
from vlaforge.config.loading import deep_merge
from vlaforge.config.schema import VLAConfig
from vlaforge.data.batch import Batch
from vlaforge.techniques import accounting as memory
from vlaforge.models.build import synthetic_batch, with_seq_len

WITH_BLOCKS = ("vision", "llm")
# name -> checkpointing of vision and llm (projector and action head: none).
STRATEGIES = {
    "none": {"vision": "none", "llm": "none"},
    "selective_attn": {"vision": "selective_attn", "llm": "selective_attn"},
    "selective_ffn": {"vision": "selective_ffn", "llm": "selective_ffn"},
    "selective": {"vision": "selective", "llm": "selective"},
    "recommended": {"vision": "full", "llm": "selective"},
    "full": {"vision": "full", "llm": "full"},
}
GB = 1e9


def strategy_config(cfg: VLAConfig, name: str, offload: bool) -> VLAConfig:
    """`cfg` with vision/llm checkpointing set to strategy `name` (others none) and optional CPU offload."""
    comps: dict[str, Any] = {c: {"checkpointing": "none", "offload": "none"} for c in COMPONENTS}
    for c in WITH_BLOCKS:
        comps[c] = {"checkpointing": STRATEGIES[name][c], "offload": "cpu" if offload else "none"}
    return VLAConfig.model_validate(deep_merge(cfg.model_dump(), {"components": comps}))


def real_batch(cfg: VLAConfig, model: torch.nn.Module, size: int) -> Batch:
    """The first `size` samples of the config's dataset (synthetic or LeRobot), padded as training pads them."""
    from vlaforge.data.loader import build_data

    ds = build_data(cfg, model).dataset
    return Batch.collate([ds[i % len(ds)] for i in range(size)])


def profile_one(cfg: VLAConfig, device: torch.device, batch_size: int, fake: bool, repeats: int) -> dict:
    """Activation bytes, state bytes, peak and step time of one configured model."""
    from vlaforge.models.build import tokens_per_sample
    from vlaforge.models.fake import fake_build
    from vlaforge.planner.memory import model_state
    from vlaforge.training.trainer import build_model

    with fake_build() if fake else contextlib.nullcontext():
        torch.manual_seed(cfg.train.seed)
        model, _ = build_model(cfg, torch.device("cpu") if fake else device)
        if fake:
            model.llm.tie_weights()
        batch = synthetic_batch(cfg, model, batch_size) if fake else real_batch(cfg, model, batch_size).to(device)
        state = model_state(model, dict(cfg.components.items()), cfg.train.precision_master).total.total
        times: list[float] = []
        peak = None
        for i in range(1 if fake else repeats + 1):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda" and not fake:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            with memory.count_saved(model) as acc:
                loss, _ = model.compute_loss(batch)
            if not fake:
                loss.backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    peak = torch.cuda.max_memory_allocated(device) - base
                if i:  # the first run warms up kernels and allocators
                    times.append(time.perf_counter() - start)
    out = {"activation_bytes": acc.total(memory.DEVICE), "offloaded_bytes": acc.total(memory.CPU),
           "weight_cast_bytes": sum(acc.weight_casts.values()),
           "per_component": acc.per_component(memory.DEVICE),
           "per_block": {c: acc.per_block(c, memory.DEVICE) for c in WITH_BLOCKS},
           "state_bytes": state, "tokens": tokens_per_sample(model, batch.instruction_ids.shape[1],
                                                             0 if batch.text_ids is None else batch.text_ids.shape[1])}
    out["peak_bytes"] = peak if peak is not None else out["activation_bytes"] + out["weight_cast_bytes"] + state
    out["peak_source"] = "cuda" if peak is not None else "saved-bytes accounting + model state"
    if times:
        out["step_s"] = statistics.median(times)
    return out


def profile(cfg: VLAConfig, *, fake: bool = False, budget_gb: float | None = None, seq_len: int | None = None,
            batch_size: int = 1, offload: bool = False, repeats: int = 3, device: torch.device | None = None,
            strategies: tuple[str, ...] | None = None, gpu: str = "h100-80", calibration: str | None = None,
            catalog: str | None = None) -> dict:
    """Run every strategy, or those named in `strategies` in their order ('none' always, last when not named; with
    `offload`, each again with CPU offload of vision + llm); rank and recommend. Under `fake` (no times) each strategy's step time on one `gpu` is
    predicted by the planner, with its `calibration` for that GPU when the file has one."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = with_seq_len(cfg, seq_len)
    rows: dict[str, dict] = {}
    configs: dict[str, VLAConfig] = {}
    for name in STRATEGIES if strategies is None else dict.fromkeys([*strategies, "none"]):
        for off in ((False, True) if offload else (False,)):
            label = name + ("+cpu_offload" if off else "")
            configs[label] = strategy_config(cfg, name, off)
            rows[label] = profile_one(configs[label], device, batch_size, fake, repeats)
    report = {"flavor": cfg.model.flavor, "fake": fake, "device": "fake" if fake else str(device),
              "batch_size": batch_size, "tokens_per_sample": rows["none"]["tokens"], "strategies": rows}
    if fake:
        report["predicted_on"] = predict_steps(configs, rows, batch_size, gpu, calibration, catalog)
    time_key = "predicted_step_s" if fake else "step_s"
    base = rows["none"]
    for r in rows.values():
        r["activation_vs_none"] = r["activation_bytes"] / base["activation_bytes"]
        if time_key in r:
            r["overhead_vs_none"] = r[time_key] / base[time_key] - 1
    if budget_gb is not None:
        report["budget_gb"] = budget_gb
        why = "fastest measured" if not fake else f"fastest predicted on {report['predicted_on'].split(',')[0]}"
        report["recommendation"] = recommend(rows, budget_gb * GB, time_key, why)
    return report


def predict_steps(configs: dict[str, VLAConfig], rows: dict[str, dict], batch_size: int, gpu: str,
                  calibration: str | None, catalog: str | None) -> str:
    """Set each row's `predicted_step_s`: the planner's step time of its config on one `gpu` (the checkpointing
    strategy's recomputation included). Returns what the prediction rests on: the calibration, or the assumptions."""
    from pathlib import Path

    from vlaforge.planner.calibrate import calibrated, uncalibrated_note
    from vlaforge.planner.estimate import estimate
    from vlaforge.planner.hardware import get_gpu, load_catalog
    from vlaforge.planner.types import Assumptions, Cluster, PlanModel

    def one_gpu(c: VLAConfig) -> VLAConfig:  # the profiled batch on one process: no parallel layout
        raw = {k: v for k, v in c.model_dump().items() if k != "parallel"}
        return VLAConfig.model_validate(deep_merge(raw, {"train": {"batch_size": batch_size, "grad_accum": 1}}))

    configs = {k: one_gpu(c) for k, c in configs.items()}
    cluster = Cluster(get_gpu(gpu, load_catalog(Path(catalog) if catalog else None)), gpus_per_node=1, nodes=1)
    assume, source = calibrated(calibration, cluster.gpu.name, Assumptions())
    pm = PlanModel(configs["none"])  # the strategies differ only in checkpointing and offload
    for label, c in configs.items():
        rows[label]["predicted_step_s"] = estimate(pm, c, cluster, assume).step_time_s
    return f"one {cluster.gpu.name}, " + (source or uncalibrated_note(assume))  # NOTE: render splits at the comma


def recommend(rows: dict[str, dict], budget: float, time_key: str, why: str) -> dict:
    """The fastest strategy by `time_key` (measured, or predicted under fake tensors) whose peak fits `budget`
    bytes."""
    order = sorted(rows, key=lambda k: rows[k][time_key])
    fits = [k for k in order if rows[k]["peak_bytes"] <= budget]
    if not fits:
        least = min(rows, key=lambda k: rows[k]["peak_bytes"])
        return {"strategy": None, "reason": f"nothing fits {budget / GB:g} GB; the smallest is {least} at "
                                            f"{rows[least]['peak_bytes'] / GB:.2f} GB (add GPUs or shard)"}
    best = fits[0]
    return {"strategy": best, "peak_gb": rows[best]["peak_bytes"] / GB,
            "reason": f"{why} of the {len(fits)} strategies that fit {budget / GB:g} GB"}


def render(report: dict) -> str:
    """A text table: per strategy, activation bytes per component and per block (llm, vision), peak, time."""
    rows = report["strategies"]
    unit, div = ("GB", GB) if max(r["activation_bytes"] for r in rows.values()) >= GB else ("MB", 1e6)
    lines = [f"{report['flavor']} on {report['device']}, batch {report['batch_size']}, "
             f"{report['tokens_per_sample']} tokens/sample; activation {unit} saved for backward on the device"]
    lines.append(f"{'strategy':<27}" + "".join(f"{c:>12}" for c in (*COMPONENTS, "other")) +
                 f"{'llm/block':>12}{'vis/block':>12}{'total':>9}{'vs none':>8}{'offload':>9}{'casts':>9}{'peak GB':>9}"
                 f"{'step s':>8}{'overhd':>8}")
    for name, r in rows.items():
        comp = "".join(f"{r['per_component'].get(c, 0) / div:>12.3f}" for c in (*COMPONENTS, "other"))
        per_block = "".join(f" {_block(r['per_block'][c], div):>11}" for c in ("llm", "vision"))  # NOTE: a space
        # always: a range ("27.31-27.84") fills the width
        step = r.get("step_s", r.get("predicted_step_s"))
        time_cols = f"{step:>8.3f}{r['overhead_vs_none']:>+8.0%}" if step is not None else f"{'-':>8}{'-':>8}"
        lines.append(f"{name:<27}{comp}{per_block}{r['activation_bytes'] / div:>9.3f}{r['activation_vs_none']:>8.0%}"
                     f"{r['offloaded_bytes'] / div:>9.3f}{r['weight_cast_bytes'] / div:>9.3f}{r['peak_bytes'] / GB:>9.2f}"
                     f"{time_cols}")
    lines.append(f"{unit} = {div:.0e} bytes. per-block: the range over the component's blocks. other: the glue "
                 "outside the four components (token concatenation, losses). casts: autocast's bf16/fp16 copies of "
                 "fp32 weights kept for backward. peak: " + next(iter(rows.values()))["peak_source"] + ".")
    if "predicted_on" in report:
        lines.append(f"step s: predicted by the planner for {report['predicted_on']}")
    if "recommendation" in report:
        rec = report["recommendation"]
        lines.append(f"budget {report['budget_gb']:g} GB -> {rec['strategy']}: {rec['reason']}")
    return "\n".join(lines)


def _block(per_block: dict[str, int], div: float) -> str:
    values = [v for k, v in per_block.items() if k != "rest"]
    if not values:
        return "-"
    lo, hi = min(values) / div, max(values) / div
    return f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.2f}-{hi:.2f}"
