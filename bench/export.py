"""Exported packages against the PyTorch runtime, measured side by side in one run. Prints one JSON.

For each model (the demo's tiny policy shape: 96 px, corner + top view; the `small` flavor: 224 px, one view;
random weights - latency does not depend on them) a checkpoint folder is written, exported as ONNX fp32, ONNX int8
(QDQ, calibrated on `--calibrate` observations) and, when the executorch package is installed, ExecuTorch fp32; then
per-prediction p50/p99 of every variant through `PolicyRuntime` on the same frames (a real recorded episode with
`--data`, else bench/inference.py's synthetic moving square), the variants interleaved round by round so the
machine's noise falls on all alike:
- `pytorch`: the torch backend (inference_mode, two regions), then `pytorch_compiled` (torch.compile default);
- `onnx_fp32`, `onnx_int8`, `executorch_fp32`: the package backends.
No frame-feature cache (`cache none`): every prediction encodes its frames, so the vision graph is timed too.
Also per variant: export seconds, package bytes, and the action error against PyTorch on the same frames
(normalized units; on random weights the int8 error is not the trained policy's - docs/export.md has that).

    python bench/export.py [--models tiny small] [--data data/metaworld_demo] [--steps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from inference import _config, _frames, _pct


def write_checkpoint(name: str, folder: Path):
    """A checkpoint folder of the `name` model at random weights (seed 0), as training writes one."""
    from safetensors.torch import save_model

    from vlaforge.checkpoints.layout import CONFIG_FILE, MODEL_FILE
    from vlaforge.config.loading import dump_toml
    from vlaforge.data.tokenizer import train_bpe
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.models.build import build_vla

    cfg = _config(name, 1)
    torch.manual_seed(0)
    model = build_vla(cfg.model, cfg.loss).eval()
    cams = list(cfg.model.cameras)
    size = model.layout.image_size
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(dump_toml(cfg))
    ObservationSpec(cameras=[f"observation.images.{c}" for c in cams], frames=1, frame_stride=1, image_size=size,
                    render_size=size, instruction_tokens=12, text_tokens=0, chunk=8, state_mean=[0.0] * 4,
                    state_std=[1.0] * 4, action_mean=[0.0] * 4, action_std=[1.0] * 4).save(folder)
    train_bpe(["press the button from the top", "reach the goal"], 300).save(folder)
    save_model(model, str(folder / MODEL_FILE))  # as training does: tied weights once
    params = sum(p.numel() for p in model.parameters())
    del model
    return cams, size, params


def bench_model(name: str, data: str | None, steps: int, warm: int, rounds: int, calibrate: int, compile_mode: str,
                formats: list[str]) -> dict:
    from vlaforge.export.package import export_package
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    tmp = Path(tempfile.mkdtemp(prefix=f"bench_export_{name}_"))
    ckpt = tmp / "ckpt"
    cams, size, params = write_checkpoint(name, ckpt)
    out: dict = {"model": name, "parameters": params, "cameras": len(cams), "image_size": size, "variants": {}}
    runtimes = {"pytorch": PolicyRuntime.load(ckpt, device="cpu", dtype="fp32", cache="none")}
    if compile_mode != "off":
        t0 = time.perf_counter()
        runtimes["pytorch_compiled"] = PolicyRuntime.load(ckpt, device="cpu", dtype="fp32", cache="none",
                                                          compile=compile_mode)
        out["variants"]["pytorch_compiled"] = {"compile_s": round(time.perf_counter() - t0, 1)}
    for label, fmt, int8 in (("onnx_fp32", "onnx", False), ("onnx_int8", "onnx", True),
                             ("executorch_fp32", "executorch", False)):
        if fmt not in formats:
            continue
        t0 = time.perf_counter()
        report = export_package(ckpt, tmp / label, format=fmt, int8=int8, calibrate=calibrate, frames=4,
                                data="none")
        out["variants"][label] = {"export_s": round(report["export_s"], 1),
                                  "export_and_check_s": round(time.perf_counter() - t0, 1),
                                  "bytes": report["bytes"]["total"], "bytes_fp32_weights": report["bytes"][
                                      "checkpoint_fp32"]}
        runtimes[label] = PolicyRuntime.load(tmp / label, cache="none")
    frames = _frames(data, cams, warm + steps, size)
    state, instruction = np.zeros(4, np.float32), "press the button from the top"
    times: dict[str, list[float]] = {k: [] for k in runtimes}
    actions: dict[str, list[np.ndarray]] = {k: [] for k in runtimes}
    for r in range(rounds):
        order = list(runtimes) if r % 2 == 0 else list(runtimes)[::-1]
        for label in order:
            rt = runtimes[label]
            rt.reset("s")
            for i, views in enumerate(frames):
                pred = rt.predict(Observation(views, state, instruction), "s")
                if i >= warm:
                    times[label].append(pred.timings["total_ms"])
                    if r == 0:
                        actions[label].append(pred.actions)
    ref = np.stack(actions["pytorch"])
    for label in runtimes:
        got = np.stack(actions[label])
        out["variants"].setdefault(label, {})
        out["variants"][label] |= _pct(times[label]) | {"max_abs_error_vs_pytorch": float(np.abs(got - ref).max())}
    base = out["variants"]["pytorch"]["p50_ms"]
    out["speedup_vs_pytorch_p50"] = {k: round(base / v["p50_ms"], 2) for k, v in out["variants"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--data", default=None, help="a LeRobot dataset whose first episode gives the frames")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calibrate", type=int, default=64)
    ap.add_argument("--compile", default="default", help="torch.compile mode of the compiled row (off: none)")
    ap.add_argument("--formats", nargs="+", default=["onnx", "executorch"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if "executorch" in args.formats:
        from vlaforge.export.executorch import available

        if available() is not None:
            args.formats.remove("executorch")
    result = {"bench": "export", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
              platform.machine(), "cores": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
              "models": [bench_model(m, args.data, args.steps, args.warm, args.rounds, args.calibrate, args.compile,
                                     args.formats) for m in args.models]}
    import onnxruntime

    result["onnxruntime"] = onnxruntime.__version__
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
