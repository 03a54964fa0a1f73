"""The recomputation profiler behind `vlaforge profile`: every checkpointing strategy on the model in a config.

For each strategy it applies the techniques to a fresh model, runs forward + backward on one batch (the first
samples of the config's dataset; a batch of the config's shapes under fake tensors) and reports
activation bytes (saved for backward, per component and per block, from `techniques/accounting.py`), peak memory
(CUDA's allocator peak on GPU; the saved-bytes accounting on CPU), step time and overhead against no
checkpointing, and which strategy fits a memory budget. Step times: every strategy steps once untimed (allocation,
caches, lazy initialisation), then the timed steps go in rounds over the strategies (each the reverse of the one
before), so that a slow spell of the machine hits all of them alike; each row has the min and median of its timed
steps, the ranking uses the min (`STATISTIC`), and the report says where the spread is larger than the differences it
ranks (`spread_notes`).
With `fake=True` the model and batch are fake tensors (`FakeTensorMode`): memory in seconds even for large
flavors, and step times predicted by the planner for one GPU of the catalog (calibrated when a `vlaforge plan
--calibrate` file has that GPU, else marked uncalibrated) - never ranked by an assumed order of the strategies.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vlaforge import COMPONENTS
from vlaforge.config.loading import deep_merge
from vlaforge.config.schema import VLAConfig
from vlaforge.data.batch import Batch
from vlaforge.models.blocks import components_with_blocks
from vlaforge.models.build import synthetic_batch, with_seq_len
from vlaforge.techniques import accounting as memory

# name -> checkpointing of every component with blocks (the others: none); OVERRIDES: per component exceptions
STRATEGIES = {"none": "none", "selective_attn": "selective_attn", "selective_ffn": "selective_ffn",
              "selective": "selective", "recommended": "selective", "full": "full"}
OVERRIDES = {"recommended": {"vision": "full"}}  # a vision tower is cheap to recompute whole
GB = 1e9
# The ranking statistic. Other processes only ever add time to a step, so the fastest of a strategy's steps is the
# closest to its own cost; the median is reported beside it, and their distance is the spread.
STATISTIC = "min"
STATISTIC_WHY = ("the min: other processes only add time to a step, so the fastest is the closest to the strategy's "
                 "own cost")


def strategy_config(cfg: VLAConfig, name: str, offload: bool, with_blocks: tuple[str, ...]) -> VLAConfig:
    """`cfg` with the components in `with_blocks` checkpointed by strategy `name` (the others: none), each with CPU
    offload when `offload`."""
    comps: dict[str, Any] = {c: {"checkpointing": "none", "offload": "none"} for c in COMPONENTS}
    for c in with_blocks:
        comps[c] = {"checkpointing": OVERRIDES.get(name, {}).get(c, STRATEGIES[name]),
                    "offload": "cpu" if offload else "none"}
    return VLAConfig.model_validate(deep_merge(cfg.model_dump(), {"components": comps}))


def real_batch(cfg: VLAConfig, model: torch.nn.Module, size: int) -> Batch:
    """The first `size` samples of the config's dataset (synthetic or LeRobot), padded as training pads them."""
    from vlaforge.data.loader import build_data

    ds = build_data(cfg, model).dataset
    return Batch.collate([ds[i % len(ds)] for i in range(size)])


@dataclass
class Run:
    """One strategy's model, ready to step: built, its techniques applied, its batch in place."""

    label: str
    config: VLAConfig
    model: torch.nn.Module
    batch: Batch
    with_blocks: tuple[str, ...]
    state_bytes: int
    times: list[float] = field(default_factory=list)  # the timed steps' seconds
    acc: Any = None  # the saved-bytes accounting of the last step
    peak: int | None = None  # CUDA's peak above the last step's start


def prepare(cfg: VLAConfig, device: torch.device, batch_size: int, fake: bool,
            strategy: tuple[str, bool] | None = None, weights_from: torch.nn.Module | None = None) -> Run:
    """Build the model of `cfg`; with `strategy` (name, offload) configured as that strategy for the components the
    model says have blocks. With `weights_from` its parameters share that model's storage (see `share_weights`)."""
    from vlaforge.distributed.apply import apply_techniques
    from vlaforge.planner.memory import model_state
    from vlaforge.training.trainer import build_bare

    where = torch.device("cpu") if fake else device
    torch.manual_seed(cfg.train.seed)
    model = build_bare(cfg, where)
    with_blocks = components_with_blocks(model)
    if strategy is not None:
        cfg = strategy_config(cfg, strategy[0], strategy[1], with_blocks)
    apply_techniques(model, cfg, where)
    if fake:
        model.llm.tie_weights()
    if weights_from is not None:
        share_weights(model, weights_from)
    batch = synthetic_batch(cfg, model, batch_size) if fake else real_batch(cfg, model, batch_size).to(device)
    state = model_state(model, dict(cfg.components.items()), cfg.train.precision_master).total.total
    label = "" if strategy is None else strategy[0] + ("+cpu_offload" if strategy[1] else "")
    return Run(label, cfg, model, batch, with_blocks, state)


def share_weights(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Point `model`'s parameters at `source`'s storage where name, shape, dtype and device agree (both are built
    from one seed, so the values are the same): every strategy's model stays alive for the interleaved steps with
    one copy of the weights (six fp32 copies of `small` would take 14 GB). The Parameter objects stay the model's
    own, so anything a technique holds on to still finds them."""
    theirs = dict(source.named_parameters())
    for name, p in model.named_parameters():
        q = theirs.get(name)
        if (q is not None and type(p.data) is torch.Tensor and type(q.data) is torch.Tensor
                and (q.shape, q.dtype, q.device) == (p.shape, p.dtype, p.device)):
            p.data = q.data


def step(run: Run, device: torch.device, backward: bool = True) -> float:
    """One forward (+ backward) of `run`'s model on its batch: records its accounting (and CUDA peak), returns its
    seconds. Gradients are dropped after it: the strategies' models share weights, not gradient memory."""
    cuda = device.type == "cuda" and backward
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with memory.count_saved(run.model) as acc:
        loss, _ = run.model.compute_loss(run.batch)
    if backward:
        loss.backward()
    if cuda:
        torch.cuda.synchronize(device)
        run.peak = torch.cuda.max_memory_allocated(device) - base
    seconds = time.perf_counter() - start
    run.acc = acc
    run.model.zero_grad(set_to_none=True)
    return seconds


def schedule(labels: list[str], repeats: int) -> list[tuple[str, bool]]:
    """(label, timed) in the order to step: every strategy once untimed (the first steps pay for allocation and
    caches), then `repeats` timed rounds, each the reverse of the one before (s1 ... sN, sN ... s1, ...): a load
    that rises or falls steadily through the run then favours no strategy's slot."""
    rounds = [labels if r % 2 == 0 else labels[::-1] for r in range(repeats)]
    return [(label, False) for label in labels] + [(label, True) for order in rounds for label in order]


def measure(runs: dict[str, Run], device: torch.device, repeats: int) -> None:
    """Step the runs by `schedule`, keeping the timed steps' seconds."""
    for label, timed in schedule(list(runs), repeats):
        seconds = step(runs[label], device)
        if timed:
            runs[label].times.append(seconds)


def summarize(run: Run) -> dict:
    """The row of one strategy: activation bytes per component and block, state and peak bytes, step times."""
    from vlaforge.models.build import tokens_per_sample

    acc, batch = run.acc, run.batch
    out = {"activation_bytes": acc.total(memory.DEVICE), "offloaded_bytes": acc.total(memory.CPU),
           "weight_cast_bytes": sum(acc.weight_casts.values()),
           "per_component": acc.per_component(memory.DEVICE),
           "per_block": {c: acc.per_block(c, memory.DEVICE) for c in run.with_blocks},
           "state_bytes": run.state_bytes,
           "tokens": tokens_per_sample(run.model, batch.instruction_ids.shape[1],
                                       0 if batch.text_ids is None else batch.text_ids.shape[1])}
    out["peak_bytes"] = run.peak if run.peak is not None else (out["activation_bytes"] + out["weight_cast_bytes"]
                                                                + run.state_bytes)
    out["peak_source"] = "cuda" if run.peak is not None else "saved-bytes accounting + model state"
    if run.times:
        out |= {"step_s": min(run.times), "step_min_s": min(run.times), "step_median_s": statistics.median(run.times),
                "repeats": len(run.times), "step_times_s": list(run.times)}
    return out


def profile_one(cfg: VLAConfig, device: torch.device, batch_size: int, fake: bool, repeats: int) -> dict:
    """Activation bytes, state bytes, peak and step times of the model `cfg` configures (one warm-up step, then
    `repeats` timed ones; one untimed forward under `fake`)."""
    from vlaforge.models.fake import fake_build

    with fake_build() if fake else contextlib.nullcontext():
        run = prepare(cfg, device, batch_size, fake)
        if fake:
            step(run, device, backward=False)
        else:
            measure({"": run}, device, repeats)
        return summarize(run)


def profile(cfg: VLAConfig, *, fake: bool = False, budget_gb: float | None = None, seq_len: int | None = None,
            batch_size: int = 1, offload: bool = False, repeats: int = 3, device: torch.device | None = None,
            strategies: tuple[str, ...] | None = None, gpu: str = "h100-80", calibration: str | None = None,
            catalog: str | None = None) -> dict:
    """Run every strategy, or those named in `strategies` in their order ('none' always, last when not named; with
    `offload`, each again with CPU offload of the components with blocks); rank and recommend. Measured: one
    untimed step of each, then `repeats` timed rounds (`schedule`). Under `fake` (no times) each strategy's step time
    on one `gpu` is predicted by the planner, with its `calibration` for that GPU when the file has one."""
    from vlaforge.config.flavors import refuse_policy

    if not cfg.model.lerobot.pretrained:
        refuse_policy(cfg.model.flavor, "profile checkpoints vlaforge's components, and a LeRobot policy's joint "
                                        "layers are not checkpointed yet",
                      "profile its VLM's shapes with vlaforge's action head, --model.flavor={vlm}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = with_seq_len(cfg, seq_len)
    names = STRATEGIES if strategies is None else dict.fromkeys([*strategies, "none"])
    wanted = [(name, off) for name in names for off in ((False, True) if offload else (False,))]
    rows = fake_rows(cfg, wanted, device, batch_size) if fake else measured_rows(cfg, wanted, device, batch_size,
                                                                                 repeats)
    configs = {label: config for label, (config, _) in rows.items()}
    rows = {label: row for label, (_, row) in rows.items()}
    report = {"flavor": cfg.model.flavor, "fake": fake, "device": "fake" if fake else str(device),
              "batch_size": batch_size, "tokens_per_sample": rows["none"]["tokens"], "strategies": rows}
    if fake:
        report["predicted_on"] = predict_steps(configs, rows, batch_size, gpu, calibration, catalog)
    else:
        report["timing"] = {"statistic": STATISTIC, "why": STATISTIC_WHY, "warmup_steps": 1, "repeats": repeats,
                            "order": "rounds over the strategies, each the reverse of the one before",
                            "notes": spread_notes(rows)}
    time_key = "predicted_step_s" if fake else "step_s"
    base = rows["none"]
    for r in rows.values():
        r["activation_vs_none"] = r["activation_bytes"] / base["activation_bytes"]
        if time_key in r:
            r["overhead_vs_none"] = r[time_key] / base[time_key] - 1
    if budget_gb is not None:
        report["budget_gb"] = budget_gb
        why = (f"fastest measured ({STATISTIC} of {repeats} steps)" if not fake
               else f"fastest predicted on {report['predicted_on'].split(',')[0]}")
        report["recommendation"] = recommend(rows, budget_gb * GB, time_key, why)
    return report


def fake_rows(cfg: VLAConfig, wanted: list[tuple[str, bool]], device: torch.device, batch_size: int
              ) -> dict[str, tuple[VLAConfig, dict]]:
    """label -> (config, row) of each (strategy, offload) under fake tensors: one forward each, nothing timed."""
    from vlaforge.models.fake import fake_build

    out = {}
    for strategy in wanted:
        with fake_build():
            run = prepare(cfg, device, batch_size, True, strategy)
            step(run, device, backward=False)
            out[run.label] = (run.config, summarize(run))
    return out


def measured_rows(cfg: VLAConfig, wanted: list[tuple[str, bool]], device: torch.device, batch_size: int,
                  repeats: int) -> dict[str, tuple[VLAConfig, dict]]:
    """label -> (config, row) of each (strategy, offload), all models alive at once (one copy of the weights) so
    that their steps can interleave."""
    runs: dict[str, Run] = {}
    for strategy in wanted:
        first = next(iter(runs.values()), None)
        run = prepare(cfg, device, batch_size, False, strategy, weights_from=first.model if first else None)
        runs[run.label] = run
    measure(runs, device, repeats)
    return {label: (run.config, summarize(run)) for label, run in runs.items()}


def spread_notes(rows: dict[str, dict]) -> list[str]:
    """Where the measured ranking is not to be trusted: strategies next to each other in the ranking (by the min)
    whose difference is no larger than the spread (median - min) of either, as one line per group; a line when
    there is one timed step per strategy (no spread to judge by)."""
    timed = {k: r for k, r in rows.items() if r.get("step_times_s")}
    if not timed:
        return []
    n = min(len(r["step_times_s"]) for r in timed.values())
    if n < 2:
        return [f"{n} timed step per strategy: no spread to judge the differences by; repeat with --repeats 3 or "
                "more, on a quiet machine"]
    order = sorted(timed, key=lambda k: timed[k]["step_min_s"])
    spread = {k: r["step_median_s"] - r["step_min_s"] for k, r in timed.items()}
    groups = [[order[0]]]
    for a, b in zip(order, order[1:]):
        if timed[b]["step_min_s"] - timed[a]["step_min_s"] <= max(spread[a], spread[b]):
            groups[-1].append(b)
        else:
            groups.append([b])
    return [f"the differences between {', '.join(g[:-1])} and {g[-1]} are within the measurement spread (min to "
            f"median of {n} steps each): repeat with --repeats {2 * n} or on a quiet machine"
            for g in groups if len(g) > 1]


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
    """A text table: per strategy, activation bytes per component and per block (each component with blocks), peak,
    time (measured: min, median and number of timed steps; or predicted); then what the times rest on."""
    rows = report["strategies"]
    unit, div = ("GB", GB) if max(r["activation_bytes"] for r in rows.values()) >= GB else ("MB", 1e6)
    with_blocks = list(next(iter(rows.values()))["per_block"])
    measured = not report.get("fake")
    lines = [f"{report['flavor']} on {report['device']}, batch {report['batch_size']}, "
             f"{report['tokens_per_sample']} tokens/sample; activation {unit} saved for backward on the device"]
    lines.append(f"{'strategy':<27}" + "".join(f"{c:>12}" for c in (*COMPONENTS, "other")) +
                 "".join(f"{c[:3] + '/block':>12}" for c in with_blocks) +
                 f"{'total':>9}{'vs none':>8}{'offload':>9}{'casts':>9}{'peak GB':>9}"
                 f"{'min s' if measured else 'pred s':>8}{'median':>8}{'n':>4}{'overhd':>8}")
    for name, r in rows.items():
        comp = "".join(f"{r['per_component'].get(c, 0) / div:>12.3f}" for c in (*COMPONENTS, "other"))
        per_block = "".join(f" {_block(r['per_block'][c], div):>11}" for c in with_blocks)  # NOTE: a space
        # always: a range ("27.31-27.84") fills the width
        lines.append(f"{name:<27}{comp}{per_block}{r['activation_bytes'] / div:>9.3f}{r['activation_vs_none']:>8.0%}"
                     f"{r['offloaded_bytes'] / div:>9.3f}{r['weight_cast_bytes'] / div:>9.3f}"
                     f"{r['peak_bytes'] / GB:>9.2f}{_time_cols(r)}")
    lines.append(f"{unit} = {div:.0e} bytes. per-block: the range over the component's blocks. other: the glue "
                 "outside the four components (token concatenation, losses). casts: autocast's bf16/fp16 copies of "
                 "fp32 weights kept for backward. peak: " + next(iter(rows.values()))["peak_source"] + ".")
    if "predicted_on" in report:
        lines.append(f"pred s: predicted by the planner for {report['predicted_on']}")
    if "timing" in report:
        timing = report["timing"]
        lines.append(f"min s, median: of the n timed forward + backward steps of each strategy, run in rounds over "
                     f"the strategies (each the reverse of the one before) after one untimed warm-up step of each; "
                     f"ranked by {timing['why']}. overhd: against none's min.")
        lines += [f"note: {note}" for note in timing["notes"]]
    if "recommendation" in report:
        rec = report["recommendation"]
        lines.append(f"budget {report['budget_gb']:g} GB -> {rec['strategy']}: {rec['reason']}")
    return "\n".join(lines)


def _time_cols(r: dict) -> str:
    """min, median, n and overhead of a measured row; the predicted time and overhead of a fake one."""
    if "step_min_s" in r:
        return f"{r['step_min_s']:>8.3f}{r['step_median_s']:>8.3f}{r['repeats']:>4}{r['overhead_vs_none']:>+8.0%}"
    if "predicted_step_s" in r:
        return f"{r['predicted_step_s']:>8.3f}{'-':>8}{'-':>4}{r['overhead_vs_none']:>+8.0%}"
    return f"{'-':>8}{'-':>8}{'-':>4}{'-':>8}"


def _block(per_block: dict[str, int], div: float) -> str:
    values = [v for k, v in per_block.items() if k != "rest"]
    if not values:
        return "-"
    lo, hi = min(values) / div, max(values) / div
    return f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.2f}-{hi:.2f}"
