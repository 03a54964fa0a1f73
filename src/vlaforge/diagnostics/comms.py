"""Throughput, communication and memory findings: data-loader stalls (`perf/data_s` against `perf/step_s`), straggler
ranks (`perf/step_s_rank_max` / `_min`, logged under torchrun), the communication share and overlap of profiled steps
(`[diagnostics] profile_steps`), the achieved step time against the planner's prediction for the same config (a
finding above a 30% gap, once the planner is calibrated for the hardware: uncalibrated, the gap is shown, not judged),
memory per component and kind (`[diagnostics] memory_steps`) and the CUDA peak against the planner's, with the
biggest lever named."""

from __future__ import annotations

from typing import Any

import numpy as np

from vlaforge.diagnostics.findings import Finding
from vlaforge.diagnostics.signals import RunSignals, aligned

DATA_SHARE = 0.2  # the step waits for data more than 20% of the time
STRAGGLER = 1.2  # the slowest rank's step time over the fastest's
PLAN_GAP = 0.3  # achieved vs predicted step time
MEMORY_GAP = 0.3
COMM_SHARE = 0.3  # communication during more than 30% of a profiled step

LEVERS = {"activations": "activation checkpointing (components.<c>.checkpointing = 'selective' or 'full') or "
                         "activation offload",
          "optimizer": "shard the optimizer state (FSDP2 dp_shard, or DeepSpeed ZeRO 1/2) or offload it",
          "params": "shard the parameters (FSDP2 dp_shard > 1, ZeRO 3) or tensor parallel",
          "grads": "shard the gradients (FSDP2, ZeRO 2)", "buffers": "a smaller micro-batch (train.batch_size)"}


def _steady(values: np.ndarray) -> np.ndarray:
    return values[1:] if len(values) > 1 else values  # the first window holds warm-up


def data_stall(signals: RunSignals) -> list[Finding]:
    data, step = signals.get("perf/data_s"), signals.get("perf/step_s")
    if data is None or step is None:
        return []
    steps, wait, busy = aligned(data, step)
    share = wait / np.maximum(wait + busy, 1e-12)
    steady = _steady(share)
    if not len(steady) or float(np.median(steady)) <= DATA_SHARE:
        return []
    med = float(np.median(steady))
    return [Finding(
        "data_stall", "warning", f"the trainer waits for data {med:.0%} of the time (median over {len(steady)} "
        f"logged windows; {np.median(_steady(wait)) * 1000:.0f} ms per step)",
        (int(steps[0]), int(steps[-1])), {"data_share_median": med, "data_s_median": float(np.median(_steady(wait))),
                                          "step_s_median": float(np.median(_steady(busy)))},
        ["too few loader workers for the decode (video) and augmentation cost",
         "the decoded-frame cache is too small, or the dataset sits on slow storage"],
        ["raise data.num_workers (one per free core)", "raise data.cache_mb so decoded frames stay in memory",
         "keep the dataset on local disk"], score=med)]


def stragglers(signals: RunSignals) -> list[Finding]:
    hi, lo = signals.get("perf/step_s_rank_max"), signals.get("perf/step_s_rank_min")
    if hi is None or lo is None:
        return []
    steps, slowest, fastest = aligned(hi, lo)
    ratio = _steady(slowest / np.maximum(fastest, 1e-12))
    if not len(ratio) or float(np.median(ratio)) <= STRAGGLER:
        return []
    slow = signals.get("perf/slowest_rank")
    rank = int(np.bincount(slow.values.astype(int)).argmax()) if slow is not None else None
    return [Finding(
        "straggler", "warning", f"rank {rank if rank is not None else '?'} is the slowest: the slowest rank's step "
        f"takes {np.median(ratio):.2f}x the fastest's (median over {len(ratio)} windows)",
        (int(steps[0]), int(steps[-1])), {"ratio_median": float(np.median(ratio)), "slowest_rank": rank},
        ["a slower or throttled device, or a busy host (data workers, other jobs) on that rank's node",
         "an uneven split (sequence / pipeline stages) that gives one rank more work"],
        [f"check the node of rank {rank} (nvidia-smi clocks, other processes)", "balance the pipeline stages or "
         "use an even sequence split"], subject=f"rank {rank}", score=float(np.median(ratio)))]


def planner_gap(signals: RunSignals, gpu: str | None, calibration: str | None) -> tuple[list[Finding], dict]:
    """The achieved step time against the planner's for the run's config; a finding only when calibrated."""
    step = signals.get("perf/step_s")
    cfg = signals.cfg
    if step is None or cfg is None:
        return [], {}
    from vlaforge.planner.calibrate import calibrated
    from vlaforge.planner.estimate import estimate
    from vlaforge.planner.hardware import get_gpu
    from vlaforge.planner.types import Assumptions, Cluster, PlanModel

    name = gpu or ("cpu" if signals.get("perf/peak_gb") is None else None)
    if name is None:
        return [], {"note": "a CUDA run: give --gpu (a catalog entry) to compare with the planner"}
    world = signals.get("perf/world_size")
    ranks = int(world.values[-1]) if world is not None else 1
    assume, source = calibrated(calibration, name, Assumptions())
    try:
        est = estimate(PlanModel(cfg), cfg, Cluster(get_gpu(name), gpus_per_node=ranks, nodes=1), assume)
    except Exception as exc:  # noqa: BLE001 - a config the planner cannot model: shown, not fatal
        return [], {"note": f"the planner cannot model this run ({str(exc).splitlines()[0][:160]})"}
    measured = float(np.median(_steady(step.values)))
    gap = measured / est.step_time_s - 1
    info: dict[str, Any] = {"gpu": name, "measured_step_s": measured, "predicted_step_s": est.step_time_s,
                            "gap": gap, "calibration": source, "predicted_memory_gb": est.memory,
                            "predicted_time_s": est.time_s}
    peak = signals.get("perf/peak_gb")
    out = memory_breakdown(signals, est, info)
    if peak is not None:
        info["measured_peak_gb"] = float(np.max(peak.values))
        out += _memory(info, est)
    if source is None:
        info["note"] = ("uncalibrated: the gap is shown, not judged; run `vlaforge plan --calibrate RUN --gpu "
                        f"{name}` on runs of this machine and pass --calibration")
        return out, info
    if gap > PLAN_GAP:
        out.append(Finding(
            "slow_step", "warning", f"steps take {measured:.3g} s, {gap:.0%} longer than the calibrated planner "
            f"predicts for this config on {name} ({est.step_time_s:.3g} s)", (int(step.steps[0]), int(step.steps[-1])),
            {k: info[k] for k in ("measured_step_s", "predicted_step_s", "gap")},
            ["communication the planner does not see overlapping (slow links, a wrong NCCL topology)",
             "data or host overhead inside the step (see data_stall)", "a straggler rank sets the pace"],
            ["profile a few steps ([diagnostics] profile_steps) and look at the communication share",
             "check the interconnect (NCCL_DEBUG=INFO) and the launch topology"], score=gap))
    return out, info


def measured_memory(signals: RunSignals) -> tuple[int, dict[str, dict[str, float]]] | None:
    """The last `[diagnostics] memory_steps` record: (step, {component: {kind: GB}})."""
    keys = [k for k in signals.keys("memory/") if k.count("/") == 2]
    if not keys:
        return None
    step = int(max(signals.series[k].steps[-1] for k in keys))
    out: dict[str, dict[str, float]] = {}
    for k in keys:
        s = signals.series[k]
        if s.steps[-1] == step:
            _, comp, kind = k.split("/")
            out.setdefault(comp, {})[kind.removesuffix("_gb")] = float(s.values[-1])
    return step, out


def memory_breakdown(signals: RunSignals, est, info: dict[str, Any]) -> list[Finding]:
    """Measured memory per component and kind against the planner's for the same config; the biggest lever."""
    found = measured_memory(signals)
    if found is None:
        return []
    step, measured = found
    rows, gaps = {}, []
    total = sum(v for kinds in measured.values() for v in kinds.values()) or 1e-30
    for comp, kinds in measured.items():
        for kind, gb in kinds.items():
            predicted = est.by_component.get(comp, {}).get(kind)
            rows[f"{comp}/{kind}"] = {"measured_gb": gb, "predicted_gb": predicted}
            if predicted is not None and gb > 0.01 * total and abs(gb / max(predicted, 1e-30) - 1) > MEMORY_GAP:
                gaps.append((comp, kind, gb, predicted))
    by_kind = {k: sum(kinds.get(k, 0.0) for kinds in measured.values()) for k in LEVERS}
    biggest = max(by_kind, key=by_kind.get)
    top_comp = max(measured, key=lambda c: measured[c].get(biggest, 0.0))
    info["memory"] = {"step": step, "per_component": rows, "biggest": f"{top_comp} {biggest}",
                      "lever": LEVERS[biggest].replace("<c>", top_comp)}
    if not gaps:
        return []
    worst = max(gaps, key=lambda g: abs(g[2] / max(g[3], 1e-30) - 1))
    return [Finding(
        "memory_model_gap", "info", f"at step {step}, {len(gaps)} component part(s) differ from the planner by more "
        f"than 30%, most {worst[0]} {worst[1]}: {worst[2]:.3g} GB measured, {worst[3]:.3g} GB predicted",
        (step, step), {"gaps": [{"component": c, "kind": k, "measured_gb": m, "predicted_gb": p}
                                for c, k, m, p in gaps], "biggest": info["memory"]["biggest"]},
        ["memory the planner does not model (a technique's buffers, allocator caching, a second copy)",
         "a config the planner reads differently from the trainer (report it)"],
        [f"the biggest lever here: {info['memory']['lever']}", "plan with the measured numbers: vlaforge plan "
         "--measure"], subject=worst[0], score=float(len(gaps)))]


def _memory(info: dict[str, Any], est) -> list[Finding]:
    measured, predicted = info["measured_peak_gb"], est.memory["total"]
    parts = {k: est.memory[k] for k in LEVERS if k in est.memory}
    biggest = max(parts, key=parts.get)
    info["biggest_memory_part"] = biggest
    info["lever"] = LEVERS[biggest]
    if measured <= predicted * (1 + MEMORY_GAP):
        return []
    return [Finding(
        "memory_gap", "info", f"the measured peak ({measured:.1f} GB) is {measured / predicted - 1:.0%} above the "
        f"planner's {predicted:.1f} GB; the biggest part is {biggest}", None,
        {"measured_peak_gb": measured, "predicted_gb": predicted, "parts_gb": parts},
        ["allocator fragmentation or memory the model does not count (buffers, workspaces, a second copy)"],
        [f"the biggest lever: {LEVERS[biggest]}", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"],
        score=measured / predicted)]


def communication(signals: RunSignals) -> list[Finding]:
    """The communication share of the profiled steps (`[diagnostics] profile_steps`) and its overlap."""
    share, overlap = signals.get("perf/comm_share"), signals.get("perf/comm_overlap")
    if share is None or float(np.max(share.values)) <= COMM_SHARE:
        return []
    worst = int(np.argmax(share.values))
    over = float(overlap.values[min(worst, len(overlap) - 1)]) if overlap is not None else None
    hidden = f", {over:.0%} of it overlapped by computation" if over is not None else ""
    return [Finding(
        "communication_bound", "warning", f"communication takes {share.values[worst]:.0%} of profiled step "
        f"{share.steps[worst]}{hidden}", (int(share.steps[0]), int(share.steps[-1])),
        {"comm_share": float(share.values[worst]), "comm_overlap": over, "traces": "RUN/traces/"},
        ["too little work per collective (a small micro-batch for the model size)",
         "collectives not overlapped with computation (FSDP2 prefetch off, blocking all-reduce)",
         "a slow link between the ranks (sharding across nodes)"],
        ["raise train.batch_size or train.grad_accum with train.sync_every = 0 (reduce once per step)",
         "shard within a node and replicate across nodes (parallel.dp_replicate = nodes, dp_shard = GPUs per node)",
         "open the trace (chrome://tracing or ui.perfetto.dev) and look for gaps around the collectives"],
        score=float(share.values[worst]))]


def throughput_findings(signals: RunSignals, gpu: str | None = None, calibration: str | None = None
                        ) -> tuple[list[Finding], dict]:
    gap, info = planner_gap(signals, gpu, calibration)
    return data_stall(signals) + stragglers(signals) + communication(signals) + gap, info
