"""The blockwise path's overhead on one device: ring attention with a 1-rank group (one causal block, the same
merge and custom backward as on N ranks) against `F.scaled_dot_product_attention` on the full sequence, forward +
backward, at 4k / 8k / 16k tokens. Prints JSON. On CPU the ring's block is torch's fused CPU flash kernel; on CUDA
it is still explicit math (fp32 scores), which is what this measures there.

    python bench/ring_kernel.py [--device auto|cpu|cuda] [--tokens 4096 8192 16384] [--heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def timed(fn, repeats: int, cuda: bool) -> float:
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from vlaforge.distributed.ring import ring_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    rows = {}
    for n in args.tokens:
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)

        def run(attend, q=q, k=k, v=v, grad=grad):  # this length's tensors, bound now
            def step():
                out = attend(q, k, v)
                out.backward(grad)
                q.grad = k.grad = v.grad = None
            return step

        sdpa = timed(run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), args.repeats, cuda)
        ring = timed(run(lambda q, k, v: ring_attention(q, k, v, causal=True)), args.repeats, cuda)
        rows[str(n)] = {"sdpa_s": round(sdpa, 5), "ring_s": round(ring, 5), "ring_vs_sdpa": round(ring / sdpa, 3)}
    dist.destroy_process_group()
    if os.path.exists(store.name):  # the file store may remove it itself
        os.unlink(store.name)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(json.dumps({"device": name, "dtype": str(dtype), "heads": args.heads, "head_dim": args.head_dim,
                      "tokens": rows}, indent=2))


if __name__ == "__main__":
    main()
