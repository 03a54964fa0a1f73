"""LeRobot's policies on one device (issue 60, item 6; the GPU campaign's `policies` check): a pi0.5 fine-tune step at
its published size and the prediction latency of SmolVLA and pi0.5. Prints one JSON (and rewrites `--out` after
every row, so a time limit keeps what finished).

- pi0.5 step: LeRobot 0.6.1's pi0.5 at its defaults (`models.policies.defaults`: PaliGemma-3B beside Gemma-300M, 18
  joint layers; random weights, built on the device), everything trained as LeRobot fine-tunes it, through
  vlaforge's techniques: bf16 compute per component with fp32 master weights (`apply_precision`), the joint layers
  and the tower checkpointed (`apply_checkpointing`, full), fused AdamW; micro-batch `--micro` of two 224 px cameras,
  a 200-token prompt (pi0.5's length), a 50-step chunk. A warm-up step, then `--steps` timed: step time, peak
  allocated memory, achieved TFLOP/s counted by torch's `FlopCounterMode` on one step, and MFU against the catalog's
  dense bf16 peak. Then the same under `torch.cuda.set_per_process_memory_fraction` at 24 GB: bf16 master weights
  (fp32 masters and AdamW moments in fp32 need ~53 GB for 3.3 B trained parameters), where it either fits (peak
  reported) or runs out of memory (recorded as such: the planner's 24 GB recipe offloads the optimizer through
  DeepSpeed, which the device does not carry).
- latency: one action chunk at batch 1, 10 denoising steps, the prefix computed once (`PolicyVLA.sample_actions`),
  bf16, for SmolVLA (512 px SigLIP-B + 16 SmolLM2 layers + the 0.75-wide expert) and pi0.5: median of `--runs`
  after two warm-ups, synchronized.

    python bench/policies_gpu.py [--gpu h100-80] [--micro 8] [--steps 3] [--runs 10] [--budget-s 60] [--out F]
    python bench/policies_gpu.py --dry-run     # this CPU, tiny sizes, the same keys
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from pathlib import Path

import torch

TINY_PI = {"variants": {"gemma_2b": {"width": 64, "depth": 2, "mlp_dim": 128, "num_heads": 8, "num_kv_heads": 1,
                                     "head_dim": 16},
                        "gemma_300m": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 8, "num_kv_heads": 1,
                                       "head_dim": 16}},
           "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "patch_size": 8},
           "vocab_size": 300, "projection_dim": 64}
TINY_SMOLVLM = {"model_type": "smolvlm", "scale_factor": 2, "image_token_id": 1, "vocab_size": 300,
                "tie_word_embeddings": False,
                "vision_config": {"model_type": "smolvlm_vision", "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64,
                                  "patch_size": 16},
                "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 512,
                                "rms_norm_eps": 1e-5, "rope_theta": 100_000.0, "tie_word_embeddings": False,
                                "pad_token_id": 2}}
PROMPT = 200  # pi0.5's tokenizer_max_length (its prompt carries the discretized state)


def build(kind: str, device: torch.device, dry: bool):
    """LeRobot's `kind` at its defaults (tiny sizes with `dry`), weights random, allocated on `device`."""
    from vlaforge.models.policies.defaults import default_policy
    from vlaforge.models.policies.families import Overrides, build_policy

    spec = default_policy(kind)
    cfg = copy.deepcopy(spec.config)
    over = Overrides(vlm_config=copy.deepcopy(TINY_SMOLVLM if dry else spec.vlm_config),
                     sizes=copy.deepcopy(TINY_PI) if dry and kind != "smolvla" else None)
    if dry and kind == "smolvla":
        cfg |= {"resize_imgs_with_padding": [64, 64], "num_vlm_layers": 2}
    elif dry:  # 64 px: 64 patches a camera at TINY_PI's patch 8, not 784 at the default 224
        cfg |= {"image_resolution": [64, 64]}
    with device:
        model = build_policy(cfg, over)
    return model


def inputs(model, batch: int, prompt: int, device: torch.device, with_actions: bool = True):
    """Random PolicyInputs at the policy's image size: two cameras, a `prompt`-token instruction, state, actions."""
    from vlaforge.models.policies.model import PolicyInputs

    spec, g = model.spec, torch.Generator(device="cpu").manual_seed(0)
    h, w = spec.image_size
    images = [torch.rand(batch, 3, h, w, generator=g).mul(2).sub(1).to(device) for _ in range(2)]
    vocab = model.llm.get_input_embeddings().num_embeddings
    tokens = torch.randint(1, vocab, (batch, prompt), generator=g).to(device)
    ones = torch.ones(batch, dtype=torch.bool, device=device)
    actions = torch.randn(batch, spec.chunk, spec.max_action_dim, generator=g).to(device) if with_actions else None
    return PolicyInputs(images, [ones, ones], tokens, torch.ones_like(tokens, dtype=torch.bool),
                        torch.randn(batch, spec.max_state_dim, generator=g).to(device), actions)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def fine_tune_step(model, device: torch.device, micro: int, steps: int, master: str, peak_tflops: float,
                   prompt: int) -> dict:
    """`steps` timed training steps (after one warm-up) of the whole policy, bf16 compute over `master` weights,
    joint layers and tower checkpointed."""
    from torch.utils.flop_counter import FlopCounterMode

    from vlaforge.config.components import ComponentConfig
    from vlaforge.techniques.checkpointing import apply_checkpointing
    from vlaforge.techniques.precision import apply_precision

    policies = {c: ComponentConfig(precision="bf16", checkpointing="full" if c in ("vision", "llm") else "none")
                for c in ("vision", "projector", "llm", "action_head")}
    apply_precision(model, policies, device, master)
    apply_checkpointing(model, policies)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2.5e-5, fused=device.type == "cuda")
    x = inputs(model, micro, prompt, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    noise = torch.randn(x.actions.shape, generator=g).to(device)
    time_ = (torch.rand(micro, generator=g) * 0.9 + 0.05).to(device)

    def step():
        loss = model.loss(x, noise, time_)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step()  # warm-up: AdamW's state exists from here
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    with FlopCounterMode(display=False) as counter:
        step()
    step_s = statistics.median(times)
    flops = counter.get_total_flops()
    row = {"micro_batch": micro, "master": master, "compute": "bf16", "checkpointing": "joint layers + tower",
           "trained_parameters": sum(p.numel() for p in params), "step_s": step_s, "steps_s": times,
           "loss": loss.item(), "flops_per_step": flops, "tflops": flops / step_s / 1e12,
           "mfu": flops / step_s / 1e12 / peak_tflops if peak_tflops else None,
           "samples_per_s": micro / step_s}
    if device.type == "cuda":
        row["peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return row


def latency(model, device: torch.device, runs: int, prompt: int) -> dict:
    """One chunk at batch 1, 10 steps, the prefix once, bf16: median ms of `runs` after two warm-ups."""
    model.to(torch.bfloat16).eval()
    x = inputs(model, 1, prompt, device, with_actions=False)
    x.images = [i.to(torch.bfloat16) for i in x.images]
    noise = torch.randn(1, model.spec.chunk, model.spec.max_action_dim, device=device, dtype=torch.bfloat16)
    times = []
    with torch.inference_mode():
        for i in range(runs + 2):
            sync(device)
            t0 = time.perf_counter()
            model.sample_actions(x, noise, steps=10)
            sync(device)
            if i >= 2:
                times.append(1000 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(times), "ms": times, "dtype": "bf16", "steps": 10, "batch": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100-80", help="planner catalog entry: the MFU's denominator")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=60, help="no new row after this many seconds")
    ap.add_argument("--fraction-gb", type=float, default=24.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="this CPU, tiny sizes (the numbers mean nothing)")
    args = ap.parse_args()
    from vlaforge.planner.hardware import get_gpu

    dry = args.dry_run
    if dry:
        args.micro = min(args.micro, 2)
    device = torch.device("cpu" if dry else "cuda")
    peak = get_gpu(args.gpu).bf16_tflops
    prompt = 16 if dry else PROMPT
    result = {"check": "policies", "device": "cpu" if dry else torch.cuda.get_device_name(), "gpu": args.gpu,
              "torch": torch.__version__, "dry_run": dry, "sizes": "tiny" if dry else "LeRobot 0.6.1 defaults",
              "fine_tune": {}, "latency": {}, "skipped": [], "errors": {}}
    start = time.perf_counter()

    def save():
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))

    rows = [("fine_tune", "pi05", lambda: fine_tune_step(build("pi05", device, dry), device, args.micro, args.steps,
                                                         "fp32", peak, prompt)),
            ("latency", "smolvla", lambda: latency(build("smolvla", device, dry), device, args.runs, 48)),
            ("latency", "pi05", lambda: latency(build("pi05", device, dry), device, args.runs, prompt)),
            ("fine_tune", "pi05_24gb", lambda: fraction_row(args, device, dry, peak, prompt))]
    for section, name, run in rows:
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append(f"{section} {name}")
            continue
        try:
            result[section][name] = run()
        except torch.OutOfMemoryError as exc:
            result[section][name] = {"out_of_memory": str(exc).splitlines()[0][:300]}
        except Exception as exc:  # noqa: BLE001 - a bench row records its failure and the next one runs
            result["errors"][f"{section} {name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        gc.collect()  # the row's model and optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    result["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(json.dumps(result))


def fraction_row(args, device: torch.device, dry: bool, peak: float, prompt: int) -> dict:
    """pi0.5's step with bf16 master weights under a 24 GB memory fraction (on the CPU: no fraction, same keys)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.fraction_gb * 1e9 / total), device)
    try:
        row = fine_tune_step(build("pi05", device, dry), device, args.micro, args.steps, "bf16", peak, prompt)
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return {**row, "memory_fraction_gb": args.fraction_gb}


if __name__ == "__main__":
    main()
