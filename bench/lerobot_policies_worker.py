"""vlaforge's side of bench/lerobot_policies.py, one measurement per process (its memory figures are its own):

    python bench/lerobot_policies_worker.py train --folder DIR --kind KIND --inputs FILE --variant V [--steps N]
    python bench/lerobot_policies_worker.py predict --folder DIR --kind KIND --inputs FILE [--runs N]

DIR is a folder LeRobot's save_pretrained wrote (DIR/policy, and DIR/sizes.json, DIR/tokenizer for pi0 / pi0.5);
FILE the batch bench_policy.py reads too (tests/lerobot_env061/bench_policy.py: its memory probes are shared).
train: the kind's recipe (recipes/KIND.toml: LeRobot's fine-tuning defaults, what trains) with the variant's
techniques, built by the trainer's `build_model` (`apply_techniques`), `apply_freezing` at step 0 and the trainer's
`build_optimizer`; a variant the config refuses is a row with its one-line message. predict: `sample_actions` (10
steps, the prefix's keys and values computed once) in fp32 and bf16, `PolicyRuntime.predict` the same way, and the
ONNX graphs of a policy package (`onnx_predict`).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "lerobot_env061"), str(ROOT / "tests")]
from bench_policy import read_inputs, settle, step_of, train_steps
from lerobot061 import folder_options as options

KINDS = ("smolvla", "pi0", "pi05")
# per component checkpointing / precision (compute: autocast regions) and train.precision_master (weights,
# gradients, AdamW moments)
VARIANTS = {
    "fp32": {},
    "fp32+checkpointing": {"checkpointing": "full"},
    "bf16+checkpointing": {"checkpointing": "full", "precision": "bf16"},
    "bf16-master+checkpointing": {"checkpointing": "full", "precision": "bf16", "master": "bf16"},
    "bf16-master": {"precision": "bf16", "master": "bf16"},  # nothing recomputed: the fastest step at small batches
    # the optimizer on the GPU (recipes/pi05_24gb.toml): bf16 weights with stochastic rounding, 8-bit moments (on the
    # components that train), each parameter stepped inside backward; no gradient clipping (it needs none)
    "bf16-sr-8bit-inbackward+checkpointing": {"checkpointing": "full", "precision": "bf16", "master": "bf16",
                                              "optim_state": "8bit", "stochastic_rounding": True,
                                              "step_in_backward": True},
}
PREDICT_DTYPES = ("fp32", "bf16")


def variant_config(kind: str, folder: Path, variant: str):
    """The kind's recipe on the folder with the variant's techniques.

    Raises:
        VlaforgeError: a variant the config refuses (its one line)."""
    from vlaforge.config.loading import load_config
    from vlaforge.models.policies.reader import read_policy_config, shapes_of

    v = VARIANTS[variant]
    cameras, state_dim, action_dim = shapes_of(read_policy_config(folder / "policy"))
    components = {c: ({"precision": v["precision"]} if "precision" in v else {})
                  for c in ("vision", "projector", "llm", "action_head")}
    if "checkpointing" in v:
        components["llm"]["checkpointing"] = v["checkpointing"]  # the joint layers
        if kind != "smolvla":  # SmolVLA's tower is frozen: it keeps nothing for backward
            components["vision"]["checkpointing"] = v["checkpointing"]
    overrides = {"model": {"lerobot": {"pretrained": str(folder / "policy"), **options(folder)},
                           "cameras": cameras, "state_dim": state_dim, "action_dim": action_dim},
                 "components": {c: p for c, p in components.items() if p}}
    if "master" in v:
        overrides["train"] = {"precision_master": v["master"]}
    if v.get("step_in_backward"):
        overrides["train"] |= {"step_in_backward": True, "grad_clip": 0.0}
    if "optim_state" in v:  # on the components that train (a frozen one has no optimizer state: refused there)
        from vlaforge.techniques.freezing import ever_trains

        trains = [c for c, p in load_config(ROOT / "recipes" / f"{kind}.toml", overrides).components.items()
                  if ever_trains(p)]
        for c in trains:
            overrides["components"].setdefault(c, {}).update(
                optim_state=v["optim_state"], stochastic_rounding=v["stochastic_rounding"])
    return load_config(ROOT / "recipes" / f"{kind}.toml", overrides)


def frozen_model(cfg):
    """(the variant's model on the CPU with the recipe's freezing, its precision setup)."""
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.training.trainer import build_model

    model, precision = build_model(cfg, torch.device("cpu"))
    apply_freezing(model, dict(cfg.components.items()), 0)
    return model, precision


def pinned_loss(model, inputs_path: Path):
    """(the loss of the inputs file's batch through the folder's own preprocessor (as LeRobot's) at its pinned noise
    and flow times, as a call; that batch's size)."""
    inputs, tasks = read_inputs(inputs_path)
    noise, time_ = inputs.pop("noise"), inputs.pop("time")
    batch = model.pipelines[0]({**inputs, "task": tasks})
    return (lambda: model.loss(model.prepare(batch), noise, time_)), len(tasks)


def train(args) -> dict:
    """`args.steps` training steps of the variant at the pinned noise and flow times."""
    from vlaforge.errors import VlaforgeError
    from vlaforge.training.optim import build_optimizer

    try:
        cfg = variant_config(args.kind, args.folder, args.variant)
    except (VlaforgeError, ValueError) as exc:
        return {"variant": args.variant, "refused": str(exc).strip().splitlines()[0]}
    start = settle()
    model, precision = frozen_model(cfg)
    optimizer = build_optimizer(model, cfg)
    if cfg.train.step_in_backward:  # each parameter steps in its hook; the loop's optimizer.step() finds no gradient
        from vlaforge.techniques.step_in_backward import apply_step_in_backward

        optimizer = apply_step_in_backward(optimizer)
        optimizer.begin()
        optimizer.arm(True)
    loss_of, _ = pinned_loss(model, args.inputs)
    trained = [p for p in model.parameters() if p.requires_grad]
    model.train()
    loaded = settle()
    run = train_steps(step_of(loss_of, trained, cfg.train.grad_clip, optimizer), args.steps)
    setup = precision.to_json()
    return {"variant": args.variant, "rss_start_mib": start, "rss_loaded_mib": loaded, **run,
            "compute": setup["compute"],
            "master": setup["master"], "trainable_parameters": sum(p.numel() for p in trained),
            "parameters": sum(p.numel() for p in model.parameters())}


def tensors(args) -> dict:
    """Live tensor bytes of one forward + backward of the variant per inputs file (`--inputs A,B`): kept for
    backward and the peak, counted as on LeRobot's side (bench/lora.py's `forward_backward_bytes`)."""
    from lora import forward_backward_bytes

    from vlaforge.errors import VlaforgeError

    try:
        cfg = variant_config(args.kind, args.folder, args.variant)
    except (VlaforgeError, ValueError) as exc:
        return {"variant": args.variant, "refused": str(exc).strip().splitlines()[0]}
    model, _ = frozen_model(cfg)
    model.train()
    rows = {}
    for path in str(args.inputs).split(","):
        loss_of, batch = pinned_loss(model, Path(path))
        rows[str(batch)] = forward_backward_bytes(list(model.parameters()), loss_of)
    return {"variant": args.variant, "batches": rows}


def timed(fn, runs: int) -> tuple[dict, object]:
    """({median_ms, ms}, the warm-up call's output): one warm-up call, then `runs` timed ones."""
    out = fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(times), "ms": times}, out


def predict(args) -> dict:
    """One action chunk at the batch's first sample: `sample_actions` on the preprocessed batch (prepare included,
    as LeRobot's predict_action_chunk prepares its images) and `PolicyRuntime.predict` on uint8 frames."""
    import numpy as np

    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.inference.runtime import LeRobotRuntime, Observation

    model, _, _ = load_policy_model(args.folder / "policy", lerobot=options(args.folder))
    model.spec = dataclasses.replace(model.spec, num_steps=10)  # what the runtime samples
    model.eval()
    inputs, tasks = read_inputs(args.inputs)
    noise = inputs.pop("noise")[:1]
    raw = {k: v[:1] for k, v in inputs.items() if k not in ("time", "action")}
    batch = model.pipelines[0]({**raw, "task": tasks[:1]})
    frames = {k.removeprefix("observation.images."): (v[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
              for k, v in raw.items() if k.startswith("observation.images.")}
    obs = Observation(frames, raw["observation.state"][0].numpy(), tasks[0])
    out = {"onnx_fp32": onnx_predict(model, batch, noise, args)}  # first: the bf16 rows round the weights
    for name in PREDICT_DTYPES:
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        model.to(dtype)
        with torch.inference_mode():
            row, actions = timed(lambda start=noise.to(dtype): model.sample_actions(
                model.prepare(batch, with_actions=False), start, steps=10), args.runs)
        out[f"sample_actions_{name}"] = {**row, "actions": actions[:, :, :model.spec.action_dim].float()
                                         .flatten().tolist()}
        runtime = LeRobotRuntime(model, *model.pipelines, str(args.folder), device="cpu", dtype=name)
        row, _ = timed(lambda rt=runtime: rt.predict(obs, noise=np.asarray(noise[0])), args.runs)
        out[f"runtime_{name}"] = row
    return out


def onnx_predict(model, batch: dict, noise: torch.Tensor, args) -> dict:
    """The chunk through the ONNX graphs `vlaforge export` packages for a policy (export/policy.py: vision, prefix
    K/V, denoising step) in ONNX Runtime, integrated by the package runtime's own code (`PackageRegions`): export
    seconds, then the median of --runs of vision + prefix + 10 steps on the prepared images at the pinned noise; its
    largest difference to `sample_actions` fp32's actions."""
    import shutil
    import tempfile

    from vlaforge.export import onnx as onnx_export
    from vlaforge.export import policy as lerobot_policy
    from vlaforge.export.common import Region
    from vlaforge.inference.packages import GRAPHS, OrtGraph, PackageRegions

    x = model.prepare(batch, with_actions=False)
    pixels = torch.cat(x.images)  # one row per camera
    ids, mask, state = x.tokens, x.token_mask.long(), batch["observation.state"].float()
    with torch.inference_mode():
        tokens = model.encode_frames(pixels).reshape(1, -1, model.llm.config.hidden_size)
        reference = model.sample_actions(model.token_inputs(tokens, ids, mask, state), noise, steps=10,
                                         image_tokens=tokens)[:, :, :model.spec.action_dim]
    two = lambda t: torch.cat([t, t])  # traced at batch 2 (a dynamic dimension traced at 1 is specialized)
    examples = lerobot_policy.example_inputs(model, {"pixels": pixels, "tokens": two(tokens), "ids": two(ids),
                                                     "mask": two(mask), "state": two(state)})
    folder = Path(tempfile.mkdtemp(prefix="onnx_", dir=args.folder / "bench"))
    try:
        t0 = time.perf_counter()
        regions = lerobot_policy.regions()
        for name, (inputs, outputs) in GRAPHS["flow_matching_kv"].items():
            onnx_export.export_graph(Region(model, regions[name]), inputs, outputs, examples, folder / f"{name}.onnx")
        export_s = time.perf_counter() - t0
        manifest = {"dtype": "fp32", "action_head": lerobot_policy.head_entry(model) | {"flow_steps": 10},
                    "observation": {"instruction_tokens": ids.shape[1]}, "tokenizer": {"pad_id": 0}}
        package = PackageRegions(folder, manifest, {n: OrtGraph(folder / f"{n}.onnx", "cpu")
                                                    for n in GRAPHS["flow_matching_kv"]})

        def chunk():
            feed = {"tokens": package.encode_frames(pixels).reshape(1, -1, tokens.shape[-1]).numpy(),
                    "ids": ids.numpy(), "mask": mask.numpy(), "state": state.numpy()}
            return package.policy_actions(feed, noise)

        row, actions = timed(chunk, args.runs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**row, "export_s": round(export_s, 1),
            "max_abs_diff_to_sample_actions_fp32": float((actions - reference).abs().max()),
            "actions": actions.flatten().tolist()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("train", "predict", "tensors"))
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--inputs", type=Path, required=True)
    ap.add_argument("--variant", choices=tuple(VARIANTS), default="fp32")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps({"train": train, "predict": predict, "tensors": tensors}[args.mode](args)))


if __name__ == "__main__":
    main()
