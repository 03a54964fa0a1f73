"""`vlaforge serve` over loopback: latency and throughput for 1, 8 and 32 concurrent clients, dynamic batching vs
`--max-batch 1`, and the share of a request spent outside inference (serialization + transport + queueing).
Prints one JSON. Bounded: each point sends `--requests` requests per client.

The server runs in a subprocess (so clients do not share its interpreter) with a policy of random weights of the
chosen flavor (latency does not depend on the weights): 2 cameras at the flavor's resolution, frame history 1.
Each client is a thread with its own connection (an episode of its own), sending fresh uint8 images every request.

    python bench/serving.py [--flavor small] [--clients 1 8 32] [--requests 3] [--max-wait-ms 20]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import time

import numpy as np


def serve_random(flavor: str, port: int, max_batch: int, max_wait_ms: float) -> None:
    """The server side (run in the subprocess)."""
    from vlaforge.config import load_config
    from vlaforge.config.loading import deep_merge
    from vlaforge.data.tokenizer import train_bpe
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.inference.runtime import PolicyRuntime
    from vlaforge.models.build import build_vla
    from vlaforge.serving.server import PolicyServer, ServeOptions

    import torch

    torch.manual_seed(0)
    cfg = load_config("recipes/tiny_synthetic.toml", deep_merge({"model": {
        "flavor": flavor, "cameras": ["left", "right"], "frames": 1, "action_chunk": 8, "state_dim": 8,
        "action_dim": 7}}, {"data": {"max_instruction_tokens": 16}}))
    model = build_vla(cfg.model, cfg.loss)
    size = model.layout.image_size
    spec = ObservationSpec(cameras=["observation.images.left", "observation.images.right"], frames=1, frame_stride=1,
                           image_size=size, render_size=size, instruction_tokens=16, text_tokens=0, chunk=8,
                           state_mean=[0.0] * 8, state_std=[1.0] * 8, action_mean=[0.0] * 7, action_std=[1.0] * 7)
    runtime = PolicyRuntime(model, spec, train_bpe(["pick up the red block", "open the drawer"], 300),
                            device="cpu", cache="exact")
    PolicyServer(runtime, ServeOptions(port=port, http_port=0, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                       max_connections=256)).run()


def _start(flavor: str, max_batch: int, max_wait_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", flavor, "--max-batch", str(max_batch),
                             "--max-wait-ms", str(max_wait_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    for line in proc.stdout:
        found = re.search(r"on (ws://[\d.]+:\d+)", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError("the server did not start")


def _client(uri: str, requests: int, seed: int) -> list[dict]:
    from vlaforge.serving.client import PolicyClient

    c = PolicyClient(uri, timeout_s=900)  # 32 clients queue behind batches of seconds on a CPU
    size = int(c.metadata["image_size"])
    g = np.random.default_rng(seed)
    out = []
    for _ in range(requests):
        obs = {f"observation/images/{cam}": g.integers(0, 256, (size, size, 3), dtype=np.uint8)
               for cam in ("left", "right")}
        obs |= {"observation/state": g.normal(size=8).astype(np.float32), "prompt": "pick up the red block"}
        t0 = time.perf_counter()
        reply = c.infer(obs)
        total = (time.perf_counter() - t0) * 1000
        t = reply["server_timing"]
        out.append({"total_ms": total, "infer_ms": t["infer_ms"], "queue_ms": t["queue_ms"],
                    "batch_size": t["batch_size"]})
    c.close()
    return out


def point(uri: str, clients: int, requests: int) -> dict:
    _client(uri, 1, 999)  # warm-up
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        rows = [r for rs in pool.map(lambda i: _client(uri, requests, i), range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    total = [r["total_ms"] for r in rows]
    outside = [r["total_ms"] - r["infer_ms"] - r["queue_ms"] for r in rows]
    return {"clients": clients, "requests": len(rows), "predictions_per_s": round(len(rows) / wall, 2),
            "p50_ms": round(float(np.percentile(total, 50)), 1), "p99_ms": round(float(np.percentile(total, 99)), 1),
            "mean_batch": round(float(np.mean([r["batch_size"] for r in rows])), 2),
            "queue_ms_p50": round(float(np.percentile([r["queue_ms"] for r in rows], 50)), 1),
            "transport_share": round(float(np.sum(outside) / np.sum(total)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=3, help="per client and point")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=20.0)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_random(args.serve, 0, args.max_batch, args.max_wait_ms)
    result: dict = {"flavor": args.flavor, "cameras": 2, "max_wait_ms": args.max_wait_ms, "points": {}}
    for label, max_batch in (("batching", args.max_batch), ("max_batch_1", 1)):
        proc, uri = _start(args.flavor, max_batch, args.max_wait_ms)
        try:
            result["points"][label] = [point(uri, n, args.requests) for n in args.clients]
            print(json.dumps({label: result["points"][label]}), file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    on, off = result["points"]["batching"], result["points"]["max_batch_1"]
    result["batching_vs_max_batch_1"] = [
        {"clients": a["clients"], "throughput": round(a["predictions_per_s"] / b["predictions_per_s"], 2),
         "p99": round(a["p99_ms"] / b["p99_ms"], 2)} for a, b in zip(on, off)]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
