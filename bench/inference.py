"""Inference latency of a policy, measured side by side in one run. Prints one JSON.

For each model (the demo's tiny policy shape: 96 px, corner + top view; the `small` flavor: 224 px, one view;
random weights - latency does not depend on them) and frame history (1 and 4), per-prediction p50/p99 of:
- `eager`: what `vlaforge eval` did before the runtime: every prediction rebuilds the model input from all F frames
  of the history, tokenizes the instruction, and runs the training forward's LLM pass (padding mask, all hidden
  states, one logit row) and the head under `no_grad` (the vision tower re-encodes every frame);
- `runtime`: `PolicyRuntime` without a cache (inference_mode, no logits, two regions), then compiled;
- `exact`, `frame`, `token`: the runtime with each frame-feature cache.
Frames are a real recorded episode (`--data`, a LeRobot dataset) or, without one, a synthetic scene where one
small square moves over a fixed background (a robot arm in a still scene). `predict_batch` throughput (predictions
per second) at 1/8/32 sessions comes last.

On a GPU (`--device cuda --dtype bf16`, bench/gpu/inference.sh) the models are `small` and `vla-7b-4l` (the
vla-7b flavor's SigLIP-so400m and Llama-2-7B layer shapes, 4 blocks each, so it builds in seconds); attention runs
through SDPA (the flash kernel where no padding mask is needed) and `--compile` compiles the two regions. Models
are built on the device they run on.

Order, most wanted first: latency at the first history for every model, then `--quantize` (latency, bytes and
action cosine of quantized copies; each layout's timed predictions stop after `--quantize-max-s`, so a layout 15x
slower than bf16 cannot eat the check), then the other histories, then `predict_batch`. Past `--budget-s` no new
measurement starts (they are listed in `skipped`), and a compiled variant starts only while the time left covers
the last compile warm-up measured for that model (`compile_s`).

    python bench/inference.py [--data data/metaworld_demo] [--models tiny small] [--steps 12] [--threads 2]
    python bench/inference.py --device cuda --dtype bf16 --models small vla-7b-4l --batches 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch


def layer_shapes_flavor(name: str) -> str:
    """Register `<flavor>-<N>l` when `name` is one and is not registered yet: the flavor's layer shapes with N vision
    and N LLM blocks (vla-7b-4l: SigLIP-so400m and Llama-2-7B layers, 4 + 4), so it builds and compiles in seconds
    while each matmul keeps its full size. Returns `name` (bench/mfu.py's fp8 check builds the same)."""
    import dataclasses
    import re

    from vlaforge.config.flavors import FLAVORS

    match = re.fullmatch(r"(?P<base>.+)-(?P<blocks>\d+)l", name)
    if match and name not in FLAVORS and match["base"] in FLAVORS:
        f, blocks = FLAVORS.get(match["base"]), int(match["blocks"])
        FLAVORS.add(name, dataclasses.replace(f, description=f"{f.description}: {blocks} + {blocks} blocks",
                                              vision=f.vision | {"num_hidden_layers": blocks},
                                              llm=f.llm | {"num_hidden_layers": blocks}, nominal_params={}))
    return name


def _config(model: str, history: int):
    from vlaforge.config import load_config
    from vlaforge.config.loading import deep_merge

    if model == "tiny":
        m = {"flavor": "tiny", "image_size": 96, "cameras": ["corner", "topview"]}
    else:
        m = {"flavor": layer_shapes_flavor(model), "cameras": ["corner"]}
    m |= {"frames": history, "action_chunk": 8, "state_dim": 4, "action_dim": 4}
    return load_config("recipes/tiny_synthetic.toml",
                       deep_merge({"model": m}, {"data": {"max_instruction_tokens": 12}}))


def _frames(data: str | None, cams: list[str], steps: int, size: int) -> list[dict[str, np.ndarray]]:
    if data:
        from vlaforge.data.lerobot_v3 import LeRobotDataset

        d = LeRobotDataset(data)
        e = d.episodes[0]
        keys = [k for k in d.cameras][:len(cams)]
        decoded = {c: d.decode(k, e) for c, k in zip(cams, keys)}
        return [{c: decoded[c][min(t, e.length - 1)] for c in cams} for t in range(steps)]
    g = np.random.default_rng(0)
    base = {c: g.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in cams}
    out = []
    for t in range(steps):
        views = {}
        for c in cams:
            img = base[c].copy()
            x = (4 + 3 * t) % (size - size // 8)
            img[size // 3:size // 3 + size // 8, x:x + size // 8] = 255  # the moving "arm"
            views[c] = img
        out.append(views)
    return out


def _pct(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(values, 50)), 2), "p99_ms": round(float(np.percentile(values, 99)), 2)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Budget:
    """The seconds left of `--budget-s`, and the compile warm-up last measured per model."""

    def __init__(self, seconds: float | None = None):
        self.end = time.monotonic() + (seconds if seconds is not None else float("inf"))
        self.compile_s: dict[str, float] = {}

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows_compile(self, name: str) -> bool:
        return self.left() > self.compile_s.get(name, 0.0)


def _build(cfg, device: str):
    """The model built where it runs (a GPU's model is not initialized on the host's CPU and then copied)."""
    from vlaforge.models.build import build_vla

    with torch.device(device):
        return build_vla(cfg.model, cfg.loss).eval()


def _eager(model, spec, tokenizer, frames, state, instruction, device="cpu", dtype=torch.float32) -> list[float]:
    """The pre-runtime path: all F frames of the history to model images, `predict_actions` under no_grad."""
    from collections import deque

    from vlaforge.data.batch import Batch
    from vlaforge.data.transforms import to_model_images

    cams = [c.removeprefix("observation.images.") for c in spec.cameras]
    history = {c: deque(maxlen=spec.frames) for c in cams}
    times = []
    for views in frames:
        t0 = time.perf_counter()
        for c in cams:
            history[c].append(torch.from_numpy(views[c]))
        rows = spec.history(len(history[cams[0]]) - 1)
        imgs = torch.stack([to_model_images(torch.stack([history[c][r] for r in rows]), spec.image_size)
                            for c in cams]).transpose(0, 1).flatten(0, 1)
        ids, mask = tokenizer.encode([instruction], spec.instruction_tokens)  # per call, as before
        batch = Batch(imgs.to(device, dtype), spec.normalize_state(state).to(device, dtype), ids[0].to(device),
                      mask[0].to(device))
        with torch.no_grad():  # the pre-runtime `predict_actions`: the training forward's LLM pass, then the head
            b = Batch(batch.images[None], batch.state[None], batch.instruction_ids[None], batch.instruction_mask[None])
            actions = model.action_head(model.run_llm(b, with_text=False)["action_hidden"], b.state)[0]
        spec.denormalize_action(actions.cpu()).numpy()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return times


def _measure(runtime, frames, state, instruction, session="s") -> tuple[list[float], dict]:
    from vlaforge.inference.runtime import Observation

    times = [runtime.predict(Observation(v, state, instruction), session).timings["total_ms"] for v in frames]
    return times, runtime.session(session).report()["cache"]


def bench_model(name: str, history: int, data: str | None, steps: int, warm: int, compile_mode: str,
                device: str = "cpu", dtype: str = "fp32", budget: Budget | None = None) -> dict:
    from vlaforge.data.tokenizer import train_bpe
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.inference.feature_cache import CacheConfig
    from vlaforge.inference.runtime import PolicyRuntime

    budget = budget or Budget()
    cfg = _config(name, history)
    torch.manual_seed(0)
    model = _build(cfg, device)
    cams = list(cfg.model.cameras)
    size = model.layout.image_size
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model.to(device, torch_dtype)
    spec = ObservationSpec(cameras=[f"observation.images.{c}" for c in cams], frames=history, frame_stride=1,
                           image_size=size, render_size=size, instruction_tokens=12, text_tokens=0, chunk=8,
                           state_mean=[0.0] * 4, state_std=[1.0] * 4, action_mean=[0.0] * 4, action_std=[1.0] * 4)
    tokenizer = train_bpe(["press the button from the top", "reach the goal"], 300)
    frames = _frames(data, cams, warm + steps, size)
    state, instruction = np.zeros(4, np.float32), "press the button from the top"
    out: dict = {"model": name, "device": device, "dtype": dtype, "history": history, "cameras": len(cams),
                 "image_size": size,
                 "vision_tokens": history * len(cams) * model.layout.patches_per_frame}
    eager = _eager(model, spec, tokenizer, frames, state, instruction, device, torch_dtype)[warm:]
    out["eager"] = _pct(eager)
    variants = {"runtime": ("none", "off"), f"runtime_compiled_{compile_mode}": ("none", compile_mode),
                "exact": ("exact", "off"), "frame": ("frame", "off"), "token": ("token", "off")}
    for label, (mode, comp) in variants.items():
        if comp != "off" and not budget.allows_compile(name):
            out[label] = {"skipped": f"budget: {max(budget.left(), 0):.0f} s left, the last compile took "
                                     f"{budget.compile_s.get(name, 0):.0f} s"}
            continue
        t0 = time.perf_counter()
        rt = PolicyRuntime(model, spec, tokenizer, device=device, dtype=dtype, compile=comp,
                           cache=CacheConfig(mode=mode))
        load_s = time.perf_counter() - t0
        times, cache = _measure(rt, frames, state, instruction)
        out[label] = _pct(times[warm:]) | {"hit_rate": cache["hit_rate"],
                                          "reused_token_share": cache["reused_token_share"]}
        if comp != "off":  # (the runtime compiles and warms up as it is made)
            out[label]["compile_s"] = budget.compile_s[name] = round(load_s, 1)
    base = out["eager"]["p50_ms"]
    out["speedup_vs_eager_p50"] = {k: round(base / v["p50_ms"], 2) for k, v in out.items()
                                   if isinstance(v, dict) and "p50_ms" in v and k != "eager"}
    out["exact_vs_runtime_p50"] = round(out["runtime"]["p50_ms"] / out["exact"]["p50_ms"], 2)
    return out


def bench_batch(name: str, sizes: list[int], repeats: int, device: str = "cpu", dtype: str = "fp32",
                compile_mode: str = "off") -> dict:
    from vlaforge.data.tokenizer import train_bpe
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    cfg = _config(name, 1)
    model = _build(cfg, device)
    cams = list(cfg.model.cameras)
    size = model.layout.image_size
    spec = ObservationSpec(cameras=[f"observation.images.{c}" for c in cams], frames=1, frame_stride=1,
                           image_size=size, render_size=size, instruction_tokens=12, text_tokens=0, chunk=8,
                           state_mean=[0.0] * 4, state_std=[1.0] * 4, action_mean=[0.0] * 4, action_std=[1.0] * 4)
    rt = PolicyRuntime(model, spec, train_bpe(["reach the goal", "open the door"], 300), device=device, dtype=dtype,
                       compile=compile_mode, cache="exact")
    g = np.random.default_rng(0)
    out: dict = {"model": name, "device": device, "dtype": dtype, "compile": compile_mode}
    for n in sizes:
        sessions = [f"s{i}" for i in range(n)]
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms up
            obs = [Observation({c: g.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in cams},
                               np.zeros(4, np.float32), "reach the goal" if i % 2 else "open the door")
                   for i in range(n)]
            t0 = time.perf_counter()
            rt.predict_batch(obs, sessions)
            _sync(device)
            best = min(best, time.perf_counter() - t0) if _ else best
        out[str(n)] = {"predictions_per_s": round(n / best, 1), "ms_per_call": round(best * 1000, 1)}
    first = out[str(sizes[0])]["predictions_per_s"]
    out["throughput_vs_batch_1"] = {str(n): round(out[str(n)]["predictions_per_s"] / first, 2) for n in sizes}
    return out


def bench_quantized(name: str, layouts: list[str], steps: int, warm: int, device: str = "cpu",
                    dtype: str = "fp32", max_s: float | None = None) -> dict:
    """Per-prediction latency, weight bytes and action cosine of quantized copies of the model (`vlaforge quantize`
    layouts, e.g. vision=int8,projector=fp16,llm=int4) next to the unquantized one, in one process. A layout's timed
    predictions stop after `max_s` seconds (at least 3 are timed; `predictions` says how many were)."""
    import copy

    from vlaforge.data.tokenizer import train_bpe
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.inference.runtime import Observation, PolicyRuntime
    from vlaforge.techniques.quantize import QuantPolicy, apply_quantization
    from vlaforge.techniques.quantized_format import resident_bytes

    cfg = _config(name, 1)
    torch.manual_seed(0)
    model = _build(cfg, device)
    cams, size = list(cfg.model.cameras), model.layout.image_size
    spec = ObservationSpec(cameras=[f"observation.images.{c}" for c in cams], frames=1, frame_stride=1,
                           image_size=size, render_size=size, instruction_tokens=12, text_tokens=0, chunk=8,
                           state_mean=[0.0] * 4, state_std=[1.0] * 4, action_mean=[0.0] * 4, action_std=[1.0] * 4)
    tokenizer = train_bpe(["press the button from the top", "reach the goal"], 300)
    frames = _frames(None, cams, warm + steps, size)
    state, instruction = np.full(4, 0.5, np.float32), "press the button from the top"

    def run(m) -> tuple[dict, np.ndarray]:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rt = PolicyRuntime(m, spec, tokenizer, device=device, dtype=dtype, cache="none")
        times, chunks = [], []
        for v in frames:
            p = rt.predict(Observation(v, state, instruction), "s")
            times.append(p.timings["total_ms"])
            chunks.append(p.actions)
            if max_s is not None and len(times) >= warm + 3 and sum(times[warm:]) / 1000 > max_s:
                break
        held = resident_bytes(rt.model)
        row = _pct(times[warm:]) | {"predictions": len(times) - warm, "weight_bytes": sum(held.values()),
                                    "per_component": held}
        if device.startswith("cuda"):
            row["peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return row, np.stack(chunks)

    model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])  # quantized from
    # the runtime's dtype, so its int8 components compute in it as the unquantized one does
    base, ref = run(copy.deepcopy(model))
    out = {"model": name, "device": device, "dtype": dtype, "base": base}
    for text in layouts:
        modes = dict(part.split("=", 1) for part in text.split(","))
        q = copy.deepcopy(model)
        apply_quantization(q, {c: QuantPolicy(m) for c, m in modes.items()}, device,
                           allow_action_head="action_head" in modes)
        row, chunks = run(q)
        n = min(len(ref), len(chunks))  # (a layout cut short by max_s)
        a, b = ref[:n].reshape(n, -1), chunks[:n].reshape(n, -1)
        row["action_cosine_min"] = round(float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) *
                                                                  np.linalg.norm(b, axis=1))).min()), 5)
        row["latency_vs_base_p50"] = round(row["p50_ms"] / base["p50_ms"], 3)
        row["bytes_vs_base"] = round(row["weight_bytes"] / base["weight_bytes"], 3)
        out[text] = row
        print(json.dumps({text: {k: v for k, v in row.items() if k != "per_component"}}), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="a LeRobot dataset whose first episode gives the frames")
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--histories", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--steps", type=int, default=12, help="timed predictions per variant")
    ap.add_argument("--warm", type=int, default=2, help="untimed predictions first")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--compile", default="default", help="torch.compile mode of the compiled variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--out", default=None, help="also rewrite this JSON file after every measurement (a time "
                                                "limit keeps what finished)")
    ap.add_argument("--quantize", nargs="*", default=[], help="also measure these quantization layouts (e.g. "
                                                              "vision=int8,projector=fp16,llm=int4)")
    ap.add_argument("--quantize-only", action="store_true", help="only the --quantize measurement")
    ap.add_argument("--quantize-models", nargs="+", default=None, help="models of the --quantize measurement "
                                                                       "(default: --models)")
    ap.add_argument("--quantize-max-s", type=float, default=None, help="timed seconds per quantized layout")
    ap.add_argument("--big-batches", action="store_true", help="all --batches for every model (else <= 8 past tiny)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new measurement after this many seconds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    budget = Budget(args.budget_s)
    result = {"host": platform.processor() or platform.machine(), "threads": args.threads,
              "torch": torch.__version__, "frames": args.data or "synthetic moving square", "latency": [],
              "batch": {}, "skipped": []}
    models = [] if args.quantize_only else args.models
    # most wanted first: every model's latency at the first history, quantization, the other histories, batches
    plan = [("latency", m, args.histories[0]) for m in models]
    plan += [("quantized", m, None) for m in (args.quantize_models or args.models) if args.quantize]
    plan += [("latency", m, h) for h in args.histories[1:] for m in models]
    plan += [("batch", m, None) for m in models]
    for kind, name, history in plan:
        if budget.left() <= 0:
            result["skipped"].append(f"{kind} {name}" + (f" history {history}" if history else ""))
            continue
        if kind == "latency":
            result["latency"].append(bench_model(name, history, args.data, args.steps, args.warm, args.compile,
                                                 args.device, args.dtype, budget))
            print(json.dumps(result["latency"][-1]), file=sys.stderr, flush=True)
        elif kind == "quantized":
            result.setdefault("quantized", {})[name] = bench_quantized(name, args.quantize, args.steps, args.warm,
                                                                       args.device, args.dtype, args.quantize_max_s)
        else:
            sizes = args.batches if name == "tiny" or args.big_batches else [b for b in args.batches if b <= 8]
            result["batch"][name] = bench_batch(name, sizes, 2 if name == "tiny" else 1, args.device, args.dtype)
            if args.device != "cpu" and args.compile != "off":
                _save(args.out, result)
                if budget.allows_compile(name):
                    result["batch"][f"{name}_compiled"] = bench_batch(name, sizes, 2, args.device, args.dtype,
                                                                      args.compile)
                else:
                    result["skipped"].append(f"batch {name} compiled")
        _save(args.out, result)
    print(json.dumps(result, indent=1))


def _save(path: str | None, result: dict) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
