"""The LoRA adaptation experiment on Meta-World (issue 42; figures in docs/lora.md). Prints one JSON.

1. data: a pretraining set (button-press-topdown, drawer-close, door-open) and an adaptation set (those three plus
   reach, which the pretrained policy never saw), recorded as `make demo` records its dataset;
2. pretrain the demo recipe on the pretraining set;
3. adapt from that checkpoint (`--train.init_from`) on the adaptation set four ways, the same steps each: full
   fine-tuning, LoRA rank 8, LoRA rank 32, QLoRA rank 32 (NF4 base). Adapters go on the vision tower and the LLM
   (alpha = rank); the projector and the action head train in full, as in recipes/tiny_lora.toml. A fifth run,
   LoRA rank 32 on the LLM only with the vision tower trained in full, says where a gap comes from (the tower's
   conv stem has no linears, so LoRA on the tower leaves it frozen). A sixth trains the tower's convolutions and
   norms in full beside the adapters (`lora.full = ["convs", "norms"]` on the tower), a seventh does that at
   alpha = 2 x rank: the preset, recipes/tiny_lora.toml's LoRA sections. `--variants` picks some, `--seeds`
   repeats the adaptations at other training seeds (issue 61: two);
4. evaluate the pretrained policy and the adapted ones on the four tasks (`--episodes` held-out episodes each,
   Wilson intervals);
5. per variant: the trainable-parameter share, the adapter bytes of its checkpoint, the median step time (its
   metrics), and the peak training memory measured on real tensors over one optimizer step of the recipe's batch
   (`PeakBytes`: parameters, gradients, optimizer state, activations and temporaries, each storage counted while it
   lives; a CPU has no allocator peak).

Every stage is skipped when its output exists, so a cut run goes on where it stopped; OUT/times.json keeps each
stage's seconds across sittings (the JSON's "seconds"). The tiny flavor is what
trains on this CPU: its linears are 64-256 wide, where a rank-32 adapter is half the size of the weight it adapts,
so the trainable share is far from the <= 5 % a 7B model's rank-32 adapters give (docs/lora.md has the planner's
count for vla-7b).

    python bench/lora.py [--out bench-out/lora] [--pretrain-steps 6000] [--adapt-steps 3000] [--episodes 50]
        [--variants full,lora_r32_stem,lora_r32_stem_a64] [--seeds 0,1] [--results bench/results/lora.json]
    python bench/lora.py --out /tmp/lora-smoke --pretrain-steps 20 --adapt-steps 10 --episodes 1 --data-scale 0.05
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_metaworld.toml"
OLD = {"button-press-topdown-v3": 40, "drawer-close-v3": 40, "door-open-v3": 40}
NEW = {"reach-v3": 80}
CAMERAS = "corner,topview,behindGripper"
VARIANTS = {"full": None, "lora_r8": (8, "auto"), "lora_r32": (32, "auto"), "qlora_r32": (32, "nf4"),
            # where the gap comes from: adapters on the LLM only, the vision tower (its conv stem) trained in full
            "lora_r32_llm_only": (32, "auto", ("llm",)),
            # adapters on tower and LLM, the tower's convolutions (its stem) and norms trained in full beside them
            # (`lora.full`), alpha = rank
            "lora_r32_stem": (32, "auto", ("vision", "llm"), ("convs", "norms")),
            # the preset (recipes/tiny_lora.toml's LoRA sections): the same at alpha = 2 x rank
            "lora_r32_stem_a64": (32, "auto", ("vision", "llm"), ("convs", "norms"), 64.0)}
PRESETS = ("lora_r32_stem", "lora_r32_stem_a64")  # the checks of issue 61 (the preset last)


def vlaforge(*args: str, log: Path) -> float:
    """Runs `vlaforge ARGS` (its output to `log`); the seconds it took. A failure ends the bench with its log's tail."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "vlaforge", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        sys.exit(f"vlaforge {' '.join(args[:2])} failed (exit {done.returncode}): {log.read_text()[-2000:]}")
    return time.perf_counter() - t0


def lora_overrides(rank: int, base: str, components: tuple[str, ...] = ("vision", "llm"),
                   full: tuple[str, ...] = (), alpha: float | None = None) -> list[str]:
    """The variant's `components.<c>.lora` settings (alpha = rank unless given); `full`: the tower's modules trained
    in full beside them."""
    out = [f"--components.{c}.lora.{k}={v}" for c in components
           for k, v in (("rank", rank), ("alpha", float(alpha or rank)), ("base", f'"{base}"'))]
    return out + ([f"--components.vision.lora.full={json.dumps(list(full))}"] if full else [])


def timed(times_file: Path, key: str, fn, every_s: float = 30.0) -> None:
    """Run a stage and add its seconds to `times_file` (kept across sittings: a resumed stage adds its part). The
    file is rewritten every `every_s` seconds while the stage runs, so a sitting that is killed (its processes ended
    without a chance to clean up) still leaves its time, to within `every_s`."""
    import threading

    from vlaforge.outputs import write_atomic

    times = json.loads(times_file.read_text()) if times_file.is_file() else {}
    before, t0, done = times.get(key, 0.0), time.perf_counter(), threading.Event()

    def write() -> None:
        times[key] = round(before + time.perf_counter() - t0, 1)
        write_atomic(times_file, json.dumps(times, indent=1))

    def beat() -> None:
        while not done.wait(every_s):
            write()

    threading.Thread(target=beat, daemon=True).start()
    try:
        fn()
    finally:
        done.set()
        write()


def generate(out: Path, tasks: dict[str, int], times: Path) -> Path:
    if not (out / "meta" / "info.json").is_file():
        spec = ",".join(f"{t}:{n}" for t, n in tasks.items())
        timed(times, f"generate {out.name}", lambda: vlaforge(
            "data", "generate", "--out", str(out), "--tasks", spec, "--cameras", CAMERAS, "--hide-distractors",
            "--steer-tcp", "--overwrite", log=out.parent / f"{out.name}.log"))
    return out


def train(run: Path, data: Path, steps: int, extra: list[str], times: Path) -> Path:
    if not (run / "checkpoints" / "latest").is_file():
        timed(times, f"train {run.name}", lambda: vlaforge(
            "train", str(RECIPE), f"--data.path={data}", f"--train.output_dir={run}", f"--train.steps={steps}",
            f"--train.checkpoint_every={steps}", "--train.progress=false", *extra, log=run.parent / f"{run.name}.log"))
    return run


def evaluate(run: Path, episodes: int, tasks: list[str], times: Path) -> dict:
    report = run / "eval" / "report.json"
    if not report.is_file():
        timed(times, f"eval {run.name}", lambda: vlaforge(
            "eval", str(run), "--out", str(run / "eval"), "--episodes", str(episodes), "--tasks", ",".join(tasks),
            log=run.parent / f"{run.name}_eval.log"))
    return json.loads(report.read_text())


def checkpoint_counts(run: Path) -> dict:
    """Trainable share (what a LoRA checkpoint holds - adapters and the components trained in full - over the
    model's parameters; a full fine-tune trains everything) and adapter bytes."""
    from safetensors import safe_open

    ckpt = (run / "checkpoints" / "latest").read_text().strip()
    folder = run / "checkpoints" / ckpt
    with safe_open(folder / "model.safetensors", "pt") as f:
        held = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: math.prod(s) for k, s in held.items()}
    lora = folder / "lora.json"
    record = json.loads(lora.read_text()) if lora.is_file() else None
    return {"held_numel": sum(numel.values()), "adapter_bytes": record["adapter_bytes"] if record else 0,
            "adapter_tensors": record["adapter_tensors"] if record else 0, "lora": record is not None}


def step_seconds(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["perf/step_s"] for r in rows if "perf/step_s" in r)


class PeakBytes:
    """Peak bytes of live tensor storages over a region: the ones given at entry (parameters, gradients, optimizer
    state) plus every storage an op creates inside, each counted until it is freed (a CPU has no allocator peak)."""

    def __init__(self, tensors):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        from vlaforge.techniques.accounting import inner_tensors

        tracker = self
        self.live: dict[int, int] = {}
        self.refs: dict[int, object] = {}
        self.now = self.peak = 0

        def add(t) -> None:
            for st in (x.untyped_storage() for x in inner_tensors(t)):
                key = st._cdata
                if key in tracker.live:
                    continue
                tracker.live[key] = st.nbytes()
                tracker.refs[key] = weakref.ref(st, lambda _, k=key: tracker._free(k))
                tracker.now += tracker.live[key]
            tracker.peak = max(tracker.peak, tracker.now)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, __import__("torch").Tensor):
                        add(t)
                return out

        for t in tensors:
            add(t)
        self.mode = Mode()

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def forward_backward_bytes(params: list, loss_of) -> dict:
    """Live tensor bytes over one forward and backward of `loss_of()` beyond `params` (their gradients set to None
    first), counted by `PeakBytes`: what the forward leaves for backward ("kept") and the peak. The counting both
    sides of bench/lerobot_policies.py's --tensors use (the process's RSS also holds what the allocator keeps)."""
    for p in params:
        p.grad = None
    with PeakBytes(params) as tracker:
        start = tracker.now
        loss = loss_of()
        kept = tracker.now - start
        loss.backward()
    return {"kept_mib": round(kept / 2**20, 2), "peak_mib": round((tracker.peak - start) / 2**20, 2),
            "loss": loss.item()}


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage a Python-visible tensor holds now (a torchao subclass through its inner tensors):
    weights, gradients, optimizer state, batch."""
    import gc

    import torch

    from vlaforge.techniques.accounting import inner_tensors

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            for x in inner_tensors(obj):
                try:
                    st = x.untyped_storage()
                    seen.setdefault(st.data_ptr(), st.nbytes())
                except (NotImplementedError, RuntimeError):  # sparse, storage-less, or a compiler's fake tensors
                    continue
    return sum(seen.values())


def step_tensor_peak(step, warm: int = 1) -> dict:
    """Peak live tensor bytes of one call of `step()` on the CPU - what `torch.cuda.max_memory_allocated` reports on a
    GPU, and what the resident set mixes with the allocator's loose pages, the interpreter and compilers: the live
    bytes as the step starts (`live_tensor_bytes`) plus the most the CPU allocator's count rises above them during it,
    read from the profiler's memory events (so compiled kernels' buffers count too). `warm` calls run first under the
    profiler: the allocator reports a free only of what it saw allocated while profiling, and tensors a step leaves
    to the next (gradients, replaced optimizer state) are then seen freed. Both sides of bench/lerobot_policies.py."""
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(warm):
            step()
        gc.collect()
        start = live_tensor_bytes()
        with record_function("measured_step"):
            step()
    events = prof.profiler.kineto_results.events()
    mark = next(e for e in events if e.name() == "measured_step")
    lo, hi = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    now = rise = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events
                            if e.name() == "[memory]" and lo <= e.start_ns() <= hi):
        now += nbytes
        rise = max(rise, now)
    return {"step_start_mib": round(start / 2**20, 1), "step_peak_mib": round((start + rise) / 2**20, 1)}


def peak_memory(run: Path, data: Path) -> dict:
    """Peak tensor bytes of one optimizer step of `run`'s config on real tensors (`PeakBytes`), after a warm step
    (so AdamW's state exists), and the model's parameter counts."""
    import tempfile

    from vlaforge.config import load_config
    from vlaforge.data.loader import build_loader
    from vlaforge.training.step import train_step
    from vlaforge.training.trainer import build_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(run / "config.toml", [f"--train.output_dir={tmp}/run", "--train.progress=false",
                                                "--train.tensorboard=false", f"--data.path={data}"])
        r = build_run(cfg)
        batches = iter(build_loader(r.data.dataset, cfg.train.batch_size, cfg.train.seed, start_sample=0,
                                    num_workers=0))
        step = lambda batch: train_step(r.model, [batch], r.optimizer, r.scheduler, r.weighting,
                                        cfg.train.grad_clip, r.guards, r.executor)
        step(next(batches))
        batch = next(batches)
        state = [t for group in r.optimizer.state.values() for t in group.values() if hasattr(t, "untyped_storage")]
        params = list(r.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        with PeakBytes(params + grads + state) as tracker:
            step(batch)
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"peak_bytes": int(tracker.peak), "params_in_model": total, "trainable_in_model": trainable}


def adapt(name: str, seed: int, out: Path, pretrained: Path, adapt_data: Path, tasks: list[str], args,
          times: Path) -> dict:
    """One adapted variant at one training seed: its run (seed 0: OUT/NAME, as before seeds were asked; else
    OUT/NAME_sSEED), its evaluation, counts and peak memory."""
    lora = VARIANTS[name]
    extra = [f"--train.init_from={pretrained}", "--train.warmup_steps=100", f"--train.seed={seed}"]
    extra += lora_overrides(*lora) if lora else []
    run = train(out / (name if seed == 0 else f"{name}_s{seed}"), adapt_data, args.adapt_steps, extra, times)
    report = evaluate(run, args.episodes, tasks, times)
    counts, mem = checkpoint_counts(run), peak_memory(run, adapt_data)
    trainable = counts["held_numel"] if counts["lora"] else mem["params_in_model"]
    return {"success": {t: {"rate": v["success_rate"], "ci95": v["ci95"]} for t, v in report["tasks"].items()},
            "mean_success": report["mean_success_rate"],
            "trainable_share": round(trainable / mem["params_in_model"], 4),
            "trainable_share_in_model": round(mem["trainable_in_model"] / mem["params_in_model"], 4),
            "adapter_bytes": counts["adapter_bytes"], "peak_train_bytes": mem["peak_bytes"],
            "step_s_median": round(step_seconds(run), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "lora")
    ap.add_argument("--pretrain-steps", type=int, default=6000)
    ap.add_argument("--adapt-steps", type=int, default=3000)
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--data-scale", type=float, default=1.0, help="times the recorded episodes (a quick smoke run)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--seeds", default="0", help="adaptation training seeds, comma-separated (each variant per seed; "
                                                 "the pretrained run is one)")
    ap.add_argument("--results", type=Path, help="also write the JSON here (bench/results/lora.json)")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    if bad := [v for v in names if v not in VARIANTS]:
        ap.error(f"unknown variant {bad[0]!r}: one of {', '.join(VARIANTS)}")
    scale = lambda tasks: {t: max(2, round(n * args.data_scale)) for t, n in tasks.items()}
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    times = out / "times.json"  # every stage's seconds, summed over sittings
    pre_data = generate(out / "data_pretrain", scale(OLD), times)
    adapt_data = generate(out / "data_adapt", scale(NEW | OLD), times)
    tasks = list(NEW | OLD)
    pretrained = train(out / "pretrained", pre_data, args.pretrain_steps, [], times)
    result: dict = {"episodes": args.episodes, "pretrain_steps": args.pretrain_steps, "adapt_steps": args.adapt_steps,
                    "new_task": next(iter(NEW)), "old_tasks": list(OLD), "seeds": {}}
    pre_report = evaluate(pretrained, args.episodes, tasks, times)
    result["pretrained"] = {t: v["success_rate"] for t, v in pre_report["tasks"].items()}
    for seed in seeds:
        rows = result["seeds"][str(seed)] = {"variants": {}}
        for name in names:
            rows["variants"][name] = adapt(name, seed, out, pretrained, adapt_data, tasks, args, times)
            print(json.dumps({f"{name} seed {seed}": rows["variants"][name]}), file=sys.stderr, flush=True)
        rows["checks"] = checks(rows["variants"], result)
    result["seconds"] = json.loads(times.read_text()) if times.is_file() else {}
    text = json.dumps(result, indent=1)
    (out / "lora.json").write_text(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text + "\n")
    print(text)


def checks(v: dict, result: dict) -> dict:
    """The issues' targets, read off one seed's figures (those of the variants that ran): LoRA r32 and the preset
    within full fine-tuning's interval on the new task and no worse (inside the interval or above) on the old ones,
    their share and memory; QLoRA within 3 points of LoRA at a smaller peak."""
    if "full" not in v:
        return {}
    full, out = v["full"], {}

    def inside(a, task):
        lo, _ = full["success"][task]["ci95"]
        return a["success"][task]["rate"] >= lo

    for name in ("lora_r32", *PRESETS):
        if name in v:
            a = v[name]
            out |= {f"{name}_new_task_within_full_interval": inside(a, result["new_task"]),
                    f"{name}_every_task_within_full_interval": all(inside(a, t) for t in a["success"]),
                    f"{name}_trainable_share_at_most_5pct": a["trainable_share"] <= 0.05,
                    f"{name}_peak_1_3x_lower": full["peak_train_bytes"] / a["peak_train_bytes"] >= 1.3,
                    f"peak_ratio_full_over_{name}": round(full["peak_train_bytes"] / a["peak_train_bytes"], 3)}
    if "lora_r32" in v and "qlora_r32" in v:
        lora, qlora = v["lora_r32"], v["qlora_r32"]
        out |= {"qlora_within_3_points_of_lora": abs(qlora["mean_success"] - lora["mean_success"]) <= 0.03,
                "qlora_peak_smaller": qlora["peak_train_bytes"] < lora["peak_train_bytes"]}
    return out


if __name__ == "__main__":
    main()
