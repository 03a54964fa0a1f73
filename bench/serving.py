"""`vlaforge serve` over loopback: latency and throughput for 1, 8 and 32 concurrent clients, dynamic batching vs
`--max-batch 1`, and the share of a request spent outside inference (serialization + transport + queueing); then
one client over each transport side by side - openpi's websocket and LeRobot's gRPC service (`--protocol lerobot`:
pickled TimedObservation in chunks, as LeRobot's robot client sends it, GetActions, the pickled chunk back; its
inference time read from the server's /metrics around each request). Prints one JSON. Bounded: each point sends
`--requests` requests per client.

The server runs in a subprocess (so clients do not share its interpreter) with a policy of random weights of the
chosen flavor (latency does not depend on the weights): 2 cameras at the flavor's resolution, frame history 1.
Each client is a thread with its own connection (an episode of its own), sending fresh uint8 images every request.

    python bench/serving.py [--flavor small] [--clients 1 8 32] [--requests 3] [--max-wait-ms 20] [--transports-only]
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


def serve_random(flavor: str, port: int, max_batch: int, max_wait_ms: float, protocol: str = "openpi") -> None:
    """The server side (run in the subprocess)."""
    import torch

    from vlaforge.config import load_config
    from vlaforge.config.loading import deep_merge
    from vlaforge.data.tokenizer import train_bpe
    from vlaforge.data.transforms import ObservationSpec
    from vlaforge.inference.runtime import PolicyRuntime
    from vlaforge.models.build import build_vla
    from vlaforge.serving.server import PolicyServer, ServeOptions

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
    PolicyServer(runtime, ServeOptions(port=port, http_port=None if protocol == "lerobot" else 0, max_batch=max_batch,
                                       max_wait_ms=max_wait_ms, max_connections=256, protocol=protocol)).run()


def _start(flavor: str, max_batch: int, max_wait_ms: float, protocol: str = "openpi"
           ) -> tuple[subprocess.Popen, str, str | None]:
    """The server subprocess, its ws:// or grpc:// address and its http:// address (None without)."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", flavor, "--max-batch", str(max_batch),
                             "--max-wait-ms", str(max_wait_ms), "--serve-protocol", protocol],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    for line in proc.stdout:
        found = re.search(r"on ((?:ws|grpc)://[\d.]+:\d+)( and (http://[\d.]+:\d+))?", line)
        if found:
            return proc, found.group(1), found.group(3)
    raise RuntimeError("the server did not start")


def _infer_seconds(http: str) -> float:
    """The server's summed inference time so far (its Prometheus vlaforge_infer_seconds_sum)."""
    import urllib.request

    text = urllib.request.urlopen(f"{http}/metrics", timeout=30).read().decode()
    return float(re.search(r"^vlaforge_infer_seconds_sum ([\d.e+-]+)$", text, re.M).group(1))


def _grpc_client(address: str, http: str, requests: int, seed: int, size: int) -> list[dict]:
    """One robot over LeRobot's gRPC service, sending what LeRobot's robot client sends."""
    import grpc

    from vlaforge.serving import lerobot_pickle as lp
    from vlaforge.serving.lerobot_grpc import CHUNK_BYTES, SERVICE, messages

    m = messages()
    channel = grpc.insecure_channel(address)
    call = lambda name, req, rep, kind="unary_unary": getattr(channel, kind)(
        f"/{SERVICE}/{name}", request_serializer=lambda x: x.SerializeToString(),
        response_deserializer=m[rep].FromString)
    call("Ready", "Empty", "Empty")(m["Empty"]())
    joints = [f"j{i}.pos" for i in range(8)]
    features = {"observation.state": {"dtype": "float32", "shape": (8,), "names": joints}}
    features |= {f"observation.images.{c}": {"dtype": "image"} for c in ("left", "right")}
    call("SendPolicyInstructions", "PolicySetup", "Empty")(m["PolicySetup"](data=lp.dumps(lp.RemotePolicyConfig(
        policy_type="smolvla", pretrained_name_or_path="bench", lerobot_features=features, actions_per_chunk=8,
        device="cpu", rename_map={}))))
    send, act = call("SendObservations", "Observation", "Empty", "stream_unary"), call("GetActions", "Empty", "Actions")
    g = np.random.default_rng(seed)
    out = []
    for step in range(requests):
        raw = {j: float(v) for j, v in zip(joints, g.normal(size=8))}
        raw |= {c: g.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in ("left", "right")}
        before = _infer_seconds(http)
        t0 = time.perf_counter()
        payload = lp.dumps(lp.TimedObservation(timestamp=time.time(), timestep=step, must_go=True,
                                               observation=raw | {"task": "pick up the red block"}))
        parts = [payload[i:i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)]
        states = [1] + [2] * (len(parts) - 2) + [3] if len(parts) > 1 else [3]
        send(iter(m["Observation"](transfer_state=s, data=p) for s, p in zip(states, parts)))
        reply = act(m["Empty"]())
        lp.decode(reply.data, list)
        total = (time.perf_counter() - t0) * 1000
        out.append({"total_ms": total, "infer_ms": (_infer_seconds(http) - before) * 1000, "queue_ms": 0.0,
                    "batch_size": 1})
    channel.close()
    return out


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


def transports(flavor: str, requests: int, max_wait_ms: float) -> dict:
    """One client, `requests` requests, over openpi's websocket and over LeRobot's gRPC service, side by side."""
    from vlaforge.serving.client import PolicyClient

    out, size = {}, None
    for name, protocol in (("openpi_websocket", "openpi"), ("lerobot_grpc", "lerobot")):  # (openpi first: the size)
        proc, address, http = _start(flavor, 1, max_wait_ms, protocol)
        try:
            if protocol == "openpi":
                size = int(PolicyClient(address).metadata["image_size"])
                _client(address, 1, 999)  # warm-up
                rows = _client(address, requests, 0)
            else:
                _grpc_client(address.removeprefix("grpc://"), http, 1, 999, size)
                rows = _grpc_client(address.removeprefix("grpc://"), http, requests, 0, size)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        total = [r["total_ms"] for r in rows]
        outside = [r["total_ms"] - r["infer_ms"] - r["queue_ms"] for r in rows]
        out[name] = {"requests": len(rows), "p50_ms": round(float(np.percentile(total, 50)), 1),
                     "infer_ms_p50": round(float(np.percentile([r["infer_ms"] for r in rows], 50)), 1),
                     "outside_inference_ms_p50": round(float(np.percentile(outside, 50)), 2),
                     "transport_share": round(float(np.sum(outside) / np.sum(total)), 4)}
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=3, help="per client and point")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=20.0)
    ap.add_argument("--transports-only", action="store_true", help="only the one-client transport comparison")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-protocol", default="openpi", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_random(args.serve, 0, args.max_batch, args.max_wait_ms, args.serve_protocol)
    result: dict = {"flavor": args.flavor, "cameras": 2, "max_wait_ms": args.max_wait_ms, "points": {}}
    if args.transports_only:
        result["transports"] = transports(args.flavor, args.requests, args.max_wait_ms)
        print(json.dumps(result, indent=1))
        return
    for label, max_batch in (("batching", args.max_batch), ("max_batch_1", 1)):
        proc, uri, _ = _start(args.flavor, max_batch, args.max_wait_ms)
        try:
            result["points"][label] = [point(uri, n, args.requests) for n in args.clients]
            print(json.dumps({label: result["points"][label]}), file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    on, off = result["points"]["batching"], result["points"]["max_batch_1"]
    result["transports"] = transports(args.flavor, args.requests, args.max_wait_ms)
    result["batching_vs_max_batch_1"] = [
        {"clients": a["clients"], "throughput": round(a["predictions_per_s"] / b["predictions_per_s"], 2),
         "p99": round(a["p99_ms"] / b["p99_ms"], 2)} for a, b in zip(on, off)]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
