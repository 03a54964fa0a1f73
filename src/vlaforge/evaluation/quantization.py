"""`vlaforge quantize`: a quantized checkpoint folder from a float run, with what it costs.

The folder loads like any checkpoint (`vlaforge eval`, `vlaforge serve`, `PolicyRuntime.load`): config.toml,
policy.json and the tokenizer are copied, the weights are `techniques/quantized_format.py`'s safetensors plus
manifest. `quantize.json` holds the costs: bytes per component before and after (on disk, and held in memory),
per-prediction latency of both through `PolicyRuntime` on this machine, the action error against the float policy on
dataset frames (normalized units), the devices where the layout is known to be smaller but slower
(`techniques.quantize.SPEED_FACTS`), and with `eval` closed-loop success per task of both.

Calibration (`calibrate` > 0 frames, disjoint from the measured ones): for each int4 / int3 / int2 component not
trained with fake quantization, both torchao scale algorithms (min-max `affine`, HQQ's scale-only optimisation) are
tried and the one with the smaller action error on the calibration frames is kept - the error is measured on the
actions, the policy's output, not on the layer's weights.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.inference.runtime import Observation, PolicyRuntime
from vlaforge.outputs import check_replaceable, replace_folder, stamp, write_atomic
from vlaforge.techniques.quantize import INTX_BITS, QuantPolicy, apply_quantization, known_slower, parse_policies
from vlaforge.techniques.quantized_format import resident_bytes, save_quantized, tensor_bytes

REPORT = "quantize.json"
OWNER = "vlaforge quantize"  # the command named in the folder's ownership stamp (vlaforge/outputs.py)
# with the tokenizer files, which depend on the LLM; backbones.json rebuilds pretrained components without folders
COPIED = ("config.toml", "policy.json", "backbones.json")


@dataclass
class QuantizeOptions:
    modes: dict[str, str | None]  # component -> mode; None: the run's QAT mode, else "none"
    group_size: int = 32
    algorithm: str = "affine"
    calibrate: int = 0  # calibration frames (0: no search)
    frames: int = 64  # measured frames
    data: str | None = None  # dataset of the frames; None: the run's data.path
    seed: int = 0
    allow_action_head: bool = False
    eval_episodes: int = 0  # closed-loop episodes per task (0: no closed loop)
    eval_workers: int = 2
    progress: bool = True


@dataclass
class Frame:
    """A dataset frame as the runtime sees it: its history (oldest first) ending with the frame itself."""

    history: list[Observation]
    episode: int
    t: int
    expert: np.ndarray  # (T, A) the demonstration's next actions, normalized (held at the episode's end)


def choose_policies(cfg, options: QuantizeOptions) -> dict[str, QuantPolicy]:
    """The policy of each component: the given mode, else the mode its QAT trained for, else none."""
    chosen = {}
    for name in COMPONENTS:
        comp = getattr(cfg.components, name)
        qat = getattr(comp, "qat", "none")
        mode = options.modes.get(name) or qat
        trained_for = qat != "none" and mode == qat
        group = comp.qat_group_size if trained_for else options.group_size
        chosen[name] = QuantPolicy(mode, group, "affine" if trained_for else options.algorithm)
    return parse_policies(chosen, options.allow_action_head)


def dataset_frames(path: str, spec, count: int, seed: int) -> list[Frame]:
    """`count` frames drawn evenly over the dataset's episodes (a fixed draw per seed), as runtime observations."""
    from vlaforge.data.episodes import resolve_cameras
    from vlaforge.data.lerobot_v3 import LeRobotDataset

    reader = LeRobotDataset(path)
    keys = resolve_cameras(reader, list(spec.cameras))
    cams = [k.removeprefix("observation.images.") for k in spec.cameras]
    g = np.random.default_rng(seed)
    picks = sorted((int(e), int(g.integers(0, reader.episodes[e].length)))
                   for e in g.integers(0, len(reader.episodes), count))
    state, tasks = reader.columns["observation.state"], reader.columns.get("task_index")
    actions = spec.normalize_action(np.asarray(reader.columns["action"], dtype=np.float32)).numpy()
    depth = (spec.frames - 1) * spec.frame_stride + 1
    frames, decoded = [], {}
    for e, t in picks:
        ep = reader.episodes[e]
        if e not in decoded:
            decoded = {e: {c: reader.decode(k, ep) for c, k in zip(cams, keys)}}  # one episode held at a time
        rows = range(max(0, t - depth + 1), t + 1)
        text = reader.tasks[int(tasks[ep.start + t])] if tasks is not None else ep.task
        steps = ep.start + np.minimum(np.arange(t, t + spec.chunk), ep.length - 1)
        frames.append(Frame([Observation({c: decoded[e][c][r] for c in cams}, state[ep.start + r], text)
                             for r in rows], e, t, actions[steps]))
    return frames


def predict_all(runtime: PolicyRuntime, frames: list[Frame], seed: int | None = None
                ) -> tuple[np.ndarray, list[float]]:
    """(N, T, A) normalized action chunks and per-prediction latencies (ms) of `runtime` on `frames`; `seed`: torch's
    generator is seeded with seed + i before frame i (a sampling head draws the same noise in every runtime)."""
    out, times = [], []
    for i, f in enumerate(frames):
        session = f"q{i}"
        for obs in f.history[:-1]:
            runtime.observe(obs, session)
        if seed is not None:
            torch.manual_seed(seed + i)
        pred = runtime.predict(f.history[-1], session)
        runtime.reset(session)
        out.append(runtime.spec.normalize_action(pred.actions).numpy())
        times.append(pred.timings["total_ms"])
    return np.stack(out), times


def action_error(reference: np.ndarray, actions: np.ndarray) -> dict[str, float]:
    """Error of `actions` against `reference` chunks (N, T, A) in normalized units: MSE, cosine per chunk."""
    a, b = reference.reshape(len(reference), -1), actions.reshape(len(actions), -1)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return {"mse_normalized": float(np.mean((a - b) ** 2)), "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min()),
            "relative_error": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))}


def quantized_runtime(float_rt: PolicyRuntime, policies: dict[str, QuantPolicy], allow_action_head: bool
                      ) -> PolicyRuntime:
    model = copy.deepcopy(float_rt.model)
    apply_quantization(model, policies, float_rt.device, allow_action_head)
    return PolicyRuntime(model, float_rt.spec, float_rt.tokenizer, device=str(float_rt.device), dtype="fp32",
                         cache="none")


def calibrate(float_rt: PolicyRuntime, policies: dict[str, QuantPolicy], frames: list[Frame], reference: np.ndarray,
              trained: set[str], allow_action_head: bool) -> dict[str, Any]:
    """Per intx component (not QAT-trained), the scale algorithm with the smaller action error on `frames`."""
    tried = {}
    for name in COMPONENTS:
        if policies[name].mode not in INTX_BITS or name in trained:
            continue
        errors = {}
        for algorithm in ("affine", "hqq"):
            trial = {**policies, name: replace(policies[name], algorithm=algorithm)}
            actions, _ = predict_all(quantized_runtime(float_rt, trial, allow_action_head), frames)
            errors[algorithm] = action_error(reference, actions)["mse_normalized"]
        best = min(errors, key=errors.get)
        policies[name] = replace(policies[name], algorithm=best)
        tried[name] = {"mse_normalized": errors, "chosen": best}
    return tried


def quantize_run(checkpoint: str | Path, out: str | Path, options: QuantizeOptions) -> dict[str, Any]:
    """Write the quantized checkpoint folder `out` and its `quantize.json`; returns the report."""
    from vlaforge.checkpoints.layout import resolve_run
    from vlaforge.data.hub_dataset import dataset_root

    ckpt, cfg = resolve_run(checkpoint, "RUN")
    out = Path(out)
    _check_out(out, ckpt)
    policies = choose_policies(cfg, options)
    trained = {c for c in COMPONENTS if getattr(getattr(cfg.components, c), "qat", "none") == policies[c].mode
               and policies[c].mode != "none"}
    data = options.data or (str(dataset_root(cfg.data)) if cfg.data.path else None)
    if not data:
        raise VlaforgeError(f"{ckpt} was not trained on a dataset; give --data DIR (a LeRobot dataset) for the "
                            "frames the action error is measured on")
    float_rt = PolicyRuntime.load(ckpt, device="cpu", dtype="fp32", cache="none")
    frames = dataset_frames(data, float_rt.spec, options.calibrate + options.frames, options.seed)
    calib, measured = frames[:options.calibrate], frames[options.calibrate:]
    report: dict[str, Any] = {"checkpoint": str(ckpt), "data": str(data), "frames": len(measured),
                              "calibration_frames": len(calib)}
    if calib:
        reference, _ = predict_all(float_rt, calib)
        report["calibration"] = calibrate(float_rt, policies, calib, reference, trained, options.allow_action_head)
    quant_rt = quantized_runtime(float_rt, policies, options.allow_action_head)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _copy_run_files(ckpt, tmp)
    disk = save_quantized(quant_rt.model, tmp)
    loaded = PolicyRuntime.load(tmp, device="cpu", cache="none")  # what eval / serve will run: the file
    report |= {"layout": quant_rt.model.quantization.to_json(), "qat_trained": sorted(trained),
               **_measure(float_rt, loaded, measured), "bytes": _bytes(float_rt.model, loaded.model, disk)}
    # where this layout is known to be smaller but slower (measured on each device; this run's device first)
    here = report["layout"]["device"]
    report["known_slower"] = [f.to_json() for f in sorted(known_slower(policies), key=lambda f: f.device != here)]
    write_atomic(tmp / REPORT, json.dumps(report, indent=1) + "\n")
    stamp(tmp, OWNER)
    replace_folder(tmp, out)
    if options.eval_episodes:
        report["closed_loop"] = _closed_loop(ckpt, out, cfg, options)
        write_atomic(out / REPORT, json.dumps(report, indent=1) + "\n")
        stamp(out, OWNER)  # the evaluations and the report it wrote into the folder are its own too
    report["report"] = str(out / REPORT)
    return report


def _check_out(out: Path, ckpt: Path) -> None:
    if out.resolve() == ckpt.resolve() or ckpt.resolve().is_relative_to(out.resolve()):
        raise VlaforgeError(f"--out {out} would replace the run it quantizes; choose a new folder")
    check_replaceable(out, OWNER)


def _copy_run_files(ckpt: Path, dest: Path) -> None:
    for src in ckpt.iterdir():
        if src.name in COPIED or src.name.startswith("tokenizer"):
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / src.name)


def side_by_side(reference: PolicyRuntime, candidate: PolicyRuntime, frames: list[Frame], seed: int | None = None,
                 rounds: int = 3) -> tuple[np.ndarray, np.ndarray, list[float], list[float]]:
    """Both runtimes' normalized actions and per-prediction latencies on the same frames: a warm-up, then `rounds`
    interleaved passes so the machine's noise falls on both alike (`seed`: see `predict_all`)."""
    predict_all(reference, frames[:4], seed), predict_all(candidate, frames[:4], seed)
    ref, t_ref = predict_all(reference, frames, seed)
    got, t_got = predict_all(candidate, frames, seed)
    for _ in range(rounds - 1):
        t_ref += predict_all(reference, frames, seed)[1]
        t_got += predict_all(candidate, frames, seed)[1]
    return ref, got, t_ref, t_got


def _measure(float_rt: PolicyRuntime, quant_rt: PolicyRuntime, frames: list[Frame]) -> dict[str, Any]:
    """Action error and per-prediction latency of both runtimes on the same frames."""
    ref, actions, t_float, t_quant = side_by_side(float_rt, quant_rt, frames)
    p50 = lambda v: round(float(np.percentile(v, 50)), 3)
    p99 = lambda v: round(float(np.percentile(v, 99)), 3)
    expert = np.stack([f.expert for f in frames])
    return {"action_error": action_error(ref, actions),
            "expert_mse_normalized": {"float": float(np.mean((ref - expert) ** 2)),
                                      "quantized": float(np.mean((actions - expert) ** 2))},
            "latency_ms": {"float": {"p50": p50(t_float), "p99": p99(t_float)},
                           "quantized": {"p50": p50(t_quant), "p99": p99(t_quant)},
                           "speedup_p50": round(p50(t_float) / p50(t_quant), 3),
                           "device": str(float_rt.device), "threads": torch.get_num_threads()}}


def _bytes(float_model, quant_model, disk: dict[str, int]) -> dict[str, Any]:
    before = tensor_bytes({k: v for k, v in float_model.state_dict().items()})
    held = resident_bytes(quant_model)
    per = {c: {"fp32": before[c], "disk": disk[c], "memory": held[c],
               "ratio_disk": round(disk[c] / max(before[c], 1), 4)} for c in COMPONENTS}
    total = {"fp32": sum(before.values()), "disk": sum(disk.values()), "memory": sum(held.values())}
    total |= {"ratio_disk": round(total["disk"] / total["fp32"], 4),
              "ratio_memory": round(total["memory"] / total["fp32"], 4)}
    return {"per_component": per, "total": total}


def _closed_loop(ckpt: Path, out: Path, cfg, options: QuantizeOptions) -> dict[str, Any]:
    from vlaforge.evaluation.closed_loop import InferenceOptions, eval_tasks, evaluate

    e = cfg.eval
    runs = {}
    for name, folder in (("float", ckpt), ("quantized", out)):
        r = evaluate(folder, eval_tasks(cfg), options.eval_episodes, options=InferenceOptions(execute=e.execute),
                     max_steps=e.max_steps, workers=options.eval_workers, seed=e.seed, out=out / f"eval_{name}",
                     video=False, progress=options.progress)
        runs[name] = {"mean_success_rate": r["mean_success_rate"], "seconds": r["seconds"],
                      "tasks": {t: {k: v[k] for k in ("successes", "episodes", "success_rate", "ci95")}
                                for t, v in r["tasks"].items()}}
    return runs


def render(report: dict[str, Any]) -> str:
    """The report as a few lines: layout, bytes, action error, latency, closed loop."""
    b, e, lat = report["bytes"], report["action_error"], report["latency_ms"]
    lines = ["component    mode          fp32 B     disk B   ratio"]
    for c, q in report["layout"]["components"].items():
        p = b["per_component"][c]
        mode = QuantPolicy(**q["policy"]).label()
        lines.append(f"{c:<12} {mode:<12} {p['fp32']:>8} {p['disk']:>10}   {p['ratio_disk']:.3f}")
    t = b["total"]
    lines.append(f"{'total':<25} {t['fp32']:>8} {t['disk']:>10}   {t['ratio_disk']:.3f} (in memory "
                 f"{t['ratio_memory']:.3f})")
    lines.append(f"action error on {report['frames']} frames: cosine mean {e['cosine_mean']:.4f} min "
                 f"{e['cosine_min']:.4f}, normalized MSE {e['mse_normalized']:.3g}")
    lines.append(f"latency p50: float {lat['float']['p50']} ms, quantized {lat['quantized']['p50']} ms "
                 f"({lat['speedup_p50']}x, {lat['device']})")
    if report.get("known_slower"):
        lines.append("smaller, not faster - measured slower than the unquantized policy:")
        lines += [f"  {fact['line']}" for fact in report["known_slower"]]
    for name, run in report.get("closed_loop", {}).items():
        tasks = ", ".join(f"{k} {v['success_rate']:.0%}" for k, v in run["tasks"].items())
        lines.append(f"closed loop {name}: mean {run['mean_success_rate']:.1%} ({tasks})")
    return "\n".join(lines)
