"""vlaforge against LeRobot 0.6.1 on LeRobot's own policy folders, side by side: one training step's peak memory and
time, the loss at the same noise and flow times, and the latency of one predicted action chunk. Prints one JSON.

Per kind (SmolVLA, pi0, pi0.5): a folder written by LeRobot's own `save_pretrained`
(tests/lerobot_env061/bench_policy.py; random weights, cached under --root), one batch (two 480 x 640 cameras, a
6-joint state, a 50-step chunk of 6 actions, the noise and flow times drawn once and read by both sides from one
safetensors file), and a fresh process for every setting:
- LeRobot (its site .venv/lerobot061): its memory settings that run here, each alone - pi0 / pi0.5 with
  `gradient_checkpointing` on, `dtype` float32 and bfloat16 (bfloat16: weights, gradients and AdamW moments in bf16
  but the SigLIP tower, projector and norms); SmolVLA (no checkpointing in 0.6.1) in float32, with its VLM in
  bfloat16 and the expert in float32 (how `load_vlm_weights=True` loads it) and cast whole to bfloat16. A setting
  LeRobot cannot run is a row with its error line;
- vlaforge (bench/lerobot_policies_worker.py): the kind's recipe (recipes/KIND.toml, LeRobot's fine-tuning defaults)
  on the folder with each variant's techniques; a variant the config refuses is a row with its one-line message.
What trains is LeRobot's default on both sides: SmolVLA its action expert and projections (train_expert_only,
freeze_vision_encoder), pi0 / pi0.5 everything. A step: forward on the preprocessed batch at the pinned noise and
times, backward, the gradient norm clipped, AdamW stepped (LeRobot's preset: torch's AdamW over
`get_optim_params()`; vlaforge's trainer: fused, per component), gradients set to None. Step time: the median of
steps 2..N (step 1 is a warm-up; its loss, before any update, is the one compared). Memory: the peak resident set
(VmHWM reset once model, optimizer and batch are ready: the weights are in it), the RSS before the model is built
(interpreter and libraries) and once ready, and the process's lifetime peak (ru_maxrss); and, after the timed steps,
one more step's peak live tensor bytes (bench/lora.py's `step_tensor_peak`: every tensor alive as it starts plus the
most the CPU allocator's count rises during it, from the profiler's memory events, compiled kernels included) - what
`torch.cuda.max_memory_allocated` measures on a GPU, without the allocator's loose pages, the interpreter and the
compilers the resident set also holds.
Prediction, batch 1: one action chunk, 10 denoising steps, the prefix computed once - LeRobot's
`predict_action_chunk` (what `select_action` runs when its queue is empty) against vlaforge's
`PolicyVLA.sample_actions` (and `PolicyRuntime.predict`, pre- and postprocessing of uint8 frames included) and the
graphs `vlaforge export --format onnx` packages (vision, prefix keys / values, denoising step) in ONNX Runtime; one
warm-up call, the median of --runs; the actions are compared with LeRobot's float32 ones. `--predict-only` leaves
the training rows out.
Timings on a shared machine: before each process the driver waits (up to --quiet-wait s) until other processes use
under a tenth of a core, and each row carries `others_cpu_s`, the CPU time other processes took while it ran.

Sizes: SmolVLA at its published size (SmolVLM2-500M's SigLIP-B/16 at 512 px, the first 16 of its 32 text layers,
the 0.75-wide expert, the 49,280-token vocabulary); pi0 / pi0.5 at PaliGemma-3B's and Gemma-300M's published widths
with fewer layers (--pi-depth Gemma layers each, --pi-vision-layers SigLIP-so400m layers) and a small tokenizer's
vocabulary; `built` in the JSON says what. `--quick` checks the bench itself: the test suite's tiny folders
(tests/lerobot061.py), LeRobot's first setting, two vlaforge variants, the kinds side by side.

`--tensors` measures what the RSS cannot separate from the allocator: the live tensor bytes of one forward and
backward (no optimizer), counted op by op on both sides alike (bench/lora.py's `forward_backward_bytes`): what the
forward keeps for backward and the peak, at batch 1 and --batch, and their growth per sample.

    python bench/lerobot_policies.py [--kinds smolvla,pi0,pi05] [--batch 2] [--out FILE.json] [--quick] [--tensors]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
import lerobot061 as ref061
from lerobot_policies_worker import KINDS, VARIANTS

CAMERAS = ("observation.images.top", "observation.images.wrist")
IMAGE_SHAPE = (3, 480, 640)
STATE_DIM = ACTION_DIM = 6
CHUNK = 50
LEROBOT_TRAIN = {"smolvla": ("float32", "bfloat16", "bfloat16-all"), "pi0": ("float32+gc", "bfloat16+gc"),
                 "pi05": ("float32+gc", "bfloat16+gc")}
LEROBOT_PREDICT = ("float32", "bfloat16")
LEROBOT_TENSORS = {"smolvla": ("float32", "bfloat16"), "pi0": ("float32", "float32+gc", "bfloat16+gc"),
                   "pi05": ("float32", "float32+gc", "bfloat16+gc")}
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # the loss's relative difference to LeRobot's float32 loss
LATENCY_GOAL = ("smolvla", "pi05")  # the 2x prediction goal is for these
QUICK_VARIANTS = "fp32+checkpointing,bf16-master+checkpointing"


# ---- what is built ---------------------------------------------------------------------------------------------
def published_spec(kind: str, pi_depth: int, pi_vision_layers: int) -> tuple[dict, dict]:
    """(the folder's sizes as bench_policy.py's SPEC, what they are in words)."""
    from vlaforge.models.policies.defaults import SMOLVLM2_500M
    from vlaforge.models.policies.families import GEMMA_VARIANTS, PALIGEMMA_VISION

    spec = {"kind": kind, "cameras": list(CAMERAS), "image_shape": list(IMAGE_SHAPE), "state_dim": STATE_DIM,
            "action_dim": ACTION_DIM,
            "config": {"chunk_size": CHUNK, "n_action_steps": CHUNK, "max_state_dim": 32, "max_action_dim": 32}}
    if kind == "smolvla":
        spec["vlm"] = vlm = copy.deepcopy(SMOLVLM2_500M)
        text, vision = vlm["text_config"], vlm["vision_config"]
        return spec, {
            "size": "published (SmolVLAConfig's defaults on SmolVLM2-500M-Video-Instruct's config)",
            "vlm": f"text {text['hidden_size']} wide, MLP {text['intermediate_size']}, {text['num_attention_heads']} "
                   f"heads / {text['num_key_value_heads']} KV, the first 16 of {text['num_hidden_layers']} layers; "
                   f"SigLIP {vision['hidden_size']} wide, {vision['num_hidden_layers']} layers, patch "
                   f"{vision['patch_size']} at {vision['image_size']} px; pixel shuffle {vlm['scale_factor']}",
            "expert": "720 wide (0.75 x 960), 16 layers, cross-attention every other layer",
            "layers": {"vlm": 16, "expert": 16, "vision": vision["num_hidden_layers"]},
            "vocab": f"{text['vocab_size']} (published; the tokenizer is a small BPE)"}
    variants = {name: dict(v, depth=pi_depth) for name, v in GEMMA_VARIANTS.items()}
    vision = {k: v for k, v in PALIGEMMA_VISION.items() if k != "vision_use_head"}
    vision.update(num_hidden_layers=pi_vision_layers, image_size=224)
    spec["sizes"] = {"variants": variants, "vision": vision, "projection_dim": variants["gemma_2b"]["width"]}
    return spec, {
        "size": f"published widths, fewer layers: Gemma-2B and Gemma-300M {pi_depth} layers each (published "
                f"{GEMMA_VARIANTS['gemma_2b']['depth']}), SigLIP-so400m {pi_vision_layers} (published "
                f"{PALIGEMMA_VISION['num_hidden_layers']})",
        "layers": {"vlm": pi_depth, "expert": pi_depth, "vision": pi_vision_layers},
        "widths": {"vlm": variants["gemma_2b"], "expert": variants["gemma_300m"], "vision": vision},
        "vocab": "the small BPE tokenizer's (sizes.json), not PaliGemma's 257,152"}


def built_folder(kind: str, args) -> tuple[Path, dict]:
    """(folder, what was built): the --quick test folder, or the published-size one (built once under --root)."""
    if args.quick:
        out = ref061.policy_folder(kind, args.root)
        return out, {"size": "the test suite's tiny folder (tests/lerobot_env061/make_policy.py)",
                     **json.loads((out / "info.json").read_text())}
    spec, about = published_spec(kind, args.pi_depth, args.pi_vision_layers)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = args.root / f"bench_{kind}_{digest}"
    if not (out / "info.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps(spec, indent=1))
        row = run_lerobot("build", kind, str(out / "spec.json"), str(out), args=args, timeout=1800)
        if "failed" in row:
            raise SystemExit(f"building the {kind} folder failed: {row['failed']}")
    info = json.loads((out / "info.json").read_text())
    return out, {**about, "parameters": info["parameters"], "trainable_parameters": info["trainable_parameters"]}


def write_inputs(path: Path, batch: int, quick: bool, seed: int = 0) -> Path:
    """The batch both sides read: cameras in [0, 1], state, raw actions, noise (B, T, max_action_dim), flow times."""
    from safetensors.torch import save_file

    if quick:
        inputs, tasks = ref061.sample_inputs(batch, seed)
    else:
        g = torch.Generator().manual_seed(seed)
        inputs = {cam: torch.rand(batch, *IMAGE_SHAPE, generator=g) for cam in CAMERAS}
        inputs["observation.state"] = torch.randn(batch, STATE_DIM, generator=g)
        inputs["action"] = torch.randn(batch, CHUNK, ACTION_DIM, generator=g)
        inputs["noise"] = torch.randn(batch, CHUNK, 32, generator=g)
        inputs["time"] = 0.05 + 0.9 * torch.rand(batch, generator=g)
        tasks = [ref061.TASKS[i % len(ref061.TASKS)] for i in range(batch)]
    save_file({k: v.contiguous() for k, v in inputs.items()}, path, metadata={"tasks": json.dumps(tasks)})
    return path


# ---- one process per measurement -------------------------------------------------------------------------------
def _busy_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat's first line: user nice system idle iowait irq
    softirq)."""
    user, nice, system, _, _, irq, softirq = (int(v) for v in Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit_s: float) -> float:
    """Waits until the machine's other processes use under 0.1 core over 1 s, or `limit_s` passed; seconds waited."""
    t0 = time.perf_counter()
    while limit_s > 0:
        before = _busy_s()
        time.sleep(1.0)
        if _busy_s() - before < 0.1 or time.perf_counter() - t0 >= limit_s:
            break
    return time.perf_counter() - t0


def run_process(cmd: list[str], env: dict, what: str, args, timeout: float = 1200) -> dict:
    """The command's last JSON line (or its failure in one line), with its wall time, the seconds waited for a
    quiet machine before it, and the CPU time other processes took while it ran."""
    waited = wait_quiet(args.quiet_wait)
    busy, children, t0 = _busy_s(), _children_s(), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    others = max(0.0, (_busy_s() - busy) - (_children_s() - children))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode == 0 and lines:
        row = json.loads(lines[-1])
    else:
        tail = [ln for ln in done.stderr.splitlines() if ln.strip()] or ["no output"]
        row = {"failed": f"{what} exited {done.returncode}: {tail[-1][:300]}"}
    return {**row, "process_s": round(wall, 1), "waited_s": round(waited, 1), "others_cpu_s": round(others, 1)}


def run_lerobot(*cmd: str, args, timeout: float = 1200) -> dict:
    env = {**ref061.env(), "BENCH_THREADS": str(args.threads)}
    return run_process([sys.executable, str(ref061.SCRIPTS / "bench_policy.py"), *cmd], env, f"LeRobot {cmd[0]}",
                       args, timeout)


def run_vlaforge(*cmd: str, args, timeout: float = 1200) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return run_process([sys.executable, str(ROOT / "bench" / "lerobot_policies_worker.py"), *cmd, "--threads",
                        str(args.threads)], env, "vlaforge worker", args, timeout)


def with_step_time(row: dict) -> dict:
    if "step_s" in row:
        row["step_time_s"] = statistics.median(row["step_s"][1:] or row["step_s"])
    return row


# ---- comparisons -----------------------------------------------------------------------------------------------
def train_ratios(lerobot: dict, vlaforge: dict) -> dict:
    """Per vlaforge variant and LeRobot setting that ran: LeRobot / vlaforge of peak RSS (also above each process's
    RSS before the model was built), step time and a step's peak live tensor bytes; each loss's relative difference
    to LeRobot's float32 loss."""
    ref = next((r["loss"] for s, r in lerobot.items() if s.startswith("float32") and "loss" in r), None)
    out = {}
    for name, mine in vlaforge.items():
        if "loss" not in mine:
            continue
        row = {s: {"peak_rss": theirs["peak_rss_mib"] / mine["peak_rss_mib"],
                   "peak_rss_above_start": (theirs["peak_rss_mib"] - theirs["rss_start_mib"])
                   / (mine["peak_rss_mib"] - mine["rss_start_mib"]),
                   "step_time": theirs["step_time_s"] / mine["step_time_s"],
                   "step_tensor_peak": theirs["step_peak_mib"] / mine["step_peak_mib"]}
               for s, theirs in lerobot.items() if "loss" in theirs}
        if ref is not None:
            rel = abs(mine["loss"] - ref) / abs(ref)
            row["loss_rel_diff"] = rel
            row["loss_within_tolerance"] = rel <= TOLERANCE["bf16" if "bf16" in name else "fp32"]
        out[name] = row
    return out


def latency_ratios(lerobot: list[dict], vlaforge: dict) -> dict:
    """LeRobot's fastest setting that ran over each vlaforge path, LeRobot float32's too; the actions' largest
    difference to LeRobot's float32 ones."""
    theirs = {r["setting"]: r for r in lerobot if "median_ms" in r}
    if not theirs:
        return {}
    best = min(theirs.values(), key=lambda r: r["median_ms"])
    ref = theirs.get("float32")
    out = {"lerobot_fastest": best["setting"]}
    for name, mine in vlaforge.items():
        if not isinstance(mine, dict) or "median_ms" not in mine:
            continue
        row = {"vs_lerobot_fastest": best["median_ms"] / mine["median_ms"]}
        if ref is not None:
            row["vs_lerobot_float32"] = ref["median_ms"] / mine["median_ms"]
            if "actions" in mine:
                row["actions_max_abs_diff"] = float((torch.tensor(mine["actions"]) -
                                                     torch.tensor(ref["actions"])).abs().max())
        out[name] = row
    for r in [*lerobot, *vlaforge.values()]:  # compared: not printed
        r.pop("actions", None)
    return out


def lowest_against(ran: dict, mine: dict, field: str, goal: str, times: float) -> dict:
    """LeRobot's lowest `field` among its settings that ran against vlaforge's lowest among its variants: their names
    and values, LeRobot / vlaforge, and whether that is at least `times` (`goal`)."""
    theirs, ours = min(ran, key=lambda s: ran[s][field]), min(mine, key=lambda v: mine[v][field])
    ratio = ran[theirs][field] / mine[ours][field]
    return {"lerobot": theirs, f"lerobot_{field}": ran[theirs][field], "vlaforge": ours,
            f"vlaforge_{field}": mine[ours][field], "ratio": ratio, goal: ratio >= times}


def summary(kind: str, row: dict) -> dict:
    """The issue's goals: peak memory at least 2x under LeRobot's lowest at the same batch (the resident set, and a
    step's live tensor bytes: what a GPU's allocator would hold), the fastest step at least 1.5x LeRobot's fastest,
    losses within the precision's tolerance, and (SmolVLA, pi0.5) prediction at least 2x faster than LeRobot's
    fastest."""
    ran = {s: r for s, r in row["lerobot"].items() if "peak_rss_mib" in r}
    mine = {v: r for v, r in row["vlaforge"].items() if "peak_rss_mib" in r}
    out = {}
    if ran and mine:
        out["memory"] = lowest_against(ran, mine, "peak_rss_mib", "goal_2x", 2)
        low = out["memory"]
        low["step_time_ratio"] = ran[low["lerobot"]]["step_time_s"] / mine[low["vlaforge"]]["step_time_s"]
        out["tensor_memory"] = lowest_against(ran, mine, "step_peak_mib", "goal_2x", 2)
        out["step_time"] = lowest_against(ran, mine, "step_time_s", "goal_1_5x", 1.5)
    losses = [r.get("loss_within_tolerance", False) for r in row["ratios"].values()]
    out["losses_within_tolerance"] = bool(losses) and all(losses)
    lat = row["latency"]
    fastest = [r for r in lat["lerobot"] if r.get("setting") == lat["ratios"].get("lerobot_fastest")]
    paths = {n: r for n, r in lat["vlaforge"].items() if n.startswith(("sample_actions", "onnx")) and "median_ms" in r}
    if fastest and paths:
        ours = min(paths, key=lambda n: paths[n]["median_ms"])
        ratio = fastest[0]["median_ms"] / paths[ours]["median_ms"]
        out["latency"] = {"lerobot": fastest[0]["setting"], "lerobot_ms": fastest[0]["median_ms"], "vlaforge": ours,
                          "vlaforge_ms": paths[ours]["median_ms"], "ratio": ratio,
                          "goal_2x": ratio >= 2 if kind in LATENCY_GOAL else None}
    disturbed = [f"{side} {name}" for side in ("lerobot", "vlaforge") for name, r in row[side].items()
                 if r.get("others_cpu_s", 0) > 0.1 * r.get("process_s", 1)]
    disturbed += [f"latency {side}" for side in ("lerobot_process", "vlaforge")
                  if lat.get(side, {}).get("others_cpu_s", 0) > 0.1 * lat.get(side, {}).get("process_s", 1)]
    out["timings_disturbed"] = disturbed  # rows during which other processes took over 10 % of the wall time
    return out


def measure_kind(kind: str, args) -> dict:
    folder, built = built_folder(kind, args)
    work = folder / "bench"
    work.mkdir(exist_ok=True)
    train_in = write_inputs(work / f"train_b{args.batch}.safetensors", args.batch, args.quick)
    predict_in = write_inputs(work / "predict_b1.safetensors", 1, args.quick, seed=1)
    row = {"built": built, "lerobot": {}, "vlaforge": {}}
    settings = LEROBOT_TRAIN[kind][:1] if args.quick else LEROBOT_TRAIN[kind]
    if args.lerobot_settings:
        settings = [s for s in settings if s in args.lerobot_settings.split(",")]
    for setting in [] if args.predict_only else settings:
        row["lerobot"][setting] = with_step_time(run_lerobot("train", str(folder / "policy"), str(train_in), setting,
                                                             str(args.steps), args=args))
    for name in [] if args.predict_only else args.variants:
        row["vlaforge"][name] = with_step_time(run_vlaforge("train", "--folder", str(folder), "--kind", kind,
                                                            "--inputs", str(train_in), "--variant", name,
                                                            "--steps", str(args.steps), args=args))
    row["ratios"] = train_ratios(row["lerobot"], row["vlaforge"])
    if args.no_predict:
        row["latency"] = {"lerobot": [], "vlaforge": {}, "ratios": {}}
        row["summary"] = summary(kind, row)
        return row
    theirs = run_lerobot("predict", str(folder / "policy"), str(predict_in), ",".join(LEROBOT_PREDICT),
                         str(args.runs), args=args)
    mine = run_vlaforge("predict", "--folder", str(folder), "--kind", kind, "--inputs", str(predict_in), "--runs",
                        str(args.runs), args=args)
    lat = {"lerobot": theirs.pop("predict", []), "lerobot_process": theirs, "vlaforge": mine}
    lat["ratios"] = latency_ratios(lat["lerobot"], {k: v for k, v in mine.items() if isinstance(v, dict)})
    row["latency"] = lat
    row["summary"] = summary(kind, row)
    return row


def tensors_kind(kind: str, args) -> dict:
    """--tensors: each side's live tensor bytes at batch 1 and --batch, per LeRobot setting and vlaforge variant."""
    folder, built = built_folder(kind, args)
    work = folder / "bench"
    work.mkdir(exist_ok=True)
    paths = ",".join(str(write_inputs(work / f"train_b{b}.safetensors", b, args.quick)) for b in (1, args.batch))
    rows = {"lerobot": {s: run_lerobot("tensors", str(folder / "policy"), paths, s, args=args)
                        for s in LEROBOT_TENSORS[kind]},
            "vlaforge": {v: run_vlaforge("tensors", "--folder", str(folder), "--kind", kind, "--inputs", paths,
                                         "--variant", v, args=args) for v in args.variants}}
    for side in rows.values():
        for row in side.values():
            one, many = (row.get("batches") or {}).get("1"), (row.get("batches") or {}).get(str(args.batch))
            if one and many and args.batch > 1:
                row["per_sample_mib"] = {k: round((many[k] - one[k]) / (args.batch - 1), 2)
                                         for k in ("kept_mib", "peak_mib")}
    return {"built": built, **rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: smolvla, pi0, pi05")
    ap.add_argument("--batch", type=int, default=2, help="training batch (prediction runs at batch 1)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per process (the first is a warm-up)")
    ap.add_argument("--runs", type=int, default=5, help="timed predictions after one warm-up")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--variants", help=f"vlaforge variants (default all; --quick: {QUICK_VARIANTS}): "
                    + ", ".join(VARIANTS))
    ap.add_argument("--lerobot-settings", help="LeRobot's training settings to run, comma-separated (default all: "
                    + "; ".join(f"{k}: {', '.join(v)}" for k, v in LEROBOT_TRAIN.items()) + ")")
    ap.add_argument("--no-predict", action="store_true", help="leave the prediction latencies out")
    ap.add_argument("--pi-depth", type=int, default=2, help="Gemma layers of pi0 / pi0.5 (published: 18)")
    ap.add_argument("--pi-vision-layers", type=int, default=3, help="SigLIP layers of pi0 / pi0.5 (published: 27)")
    ap.add_argument("--predict-only", action="store_true", help="only the prediction latencies")
    ap.add_argument("--quiet-wait", type=float, default=60, help="seconds to wait for a quiet machine per process")
    ap.add_argument("--quick", action="store_true", help="the test suite's tiny folders, LeRobot's first setting, two "
                    "vlaforge variants, the kinds side by side (a check of the bench, not a measurement)")
    ap.add_argument("--tensors", action="store_true", help="live tensor bytes of a forward + backward at batch 1 "
                    "and --batch, both sides (instead of the step and latency rows)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/vlaforge_bench_lerobot_policies"))
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    args.variants = [v.strip() for v in (args.variants or (QUICK_VARIANTS if args.quick else ",".join(VARIANTS)))
                     .split(",") if v.strip()]
    bad = [k for k in kinds if k not in KINDS] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown {bad[0]!r}: kinds are {', '.join(KINDS)}; variants {', '.join(VARIANTS)}")
    args.root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = {"bench": "lerobot_policies", "lerobot": "0.6.1", "torch": torch.__version__,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": args.threads},
              "batch": args.batch, "steps": args.steps, "runs": args.runs, "quick": args.quick,
              "step_time": "median of steps 2..N of one process (step 1 a warm-up)",
              "memory": "MiB; peak_rss: VmHWM from the moment model, optimizer and batch are ready (weights in it); "
                        "step_peak: one step's peak live tensor bytes (the profiler's CPU allocator events)",
              "kinds": {}}
    measure = tensors_kind if args.tensors else measure_kind
    if args.tensors:  # counted, not timed: no waiting for a quiet machine
        args.quiet_wait = 0
    if args.quick:  # tiny folders: the kinds side by side, no waiting for a quiet machine (nothing here is timed)
        args.quiet_wait = 0
        with ThreadPoolExecutor(len(kinds)) as pool:
            result["kinds"] = dict(zip(kinds, pool.map(lambda kind: measure(kind, args), kinds)))
    else:
        result["kinds"] = {kind: measure(kind, args) for kind in kinds}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
