"""Sequence parallelism on this machine: the LLM's per-rank activation bytes and fwd+bwd time with the sequence split
over N gloo ranks (ring, Ulysses, all-gather), against one process running the whole sequence with SDPA, measured
in one invocation. Prints JSON.

The model is the tiny flavor's Llama (2 blocks, hidden 128, GQA 4/2) run through the `transformers` attention
registry exactly as training runs it. Activation bytes are what autograd saves in the forward (tensors deduplicated
by storage, parameters excluded); the target is N ranks <= 1/N of one process + 10 %. Times on a shared 2-core
CPU measure the methods' overhead (collectives, blockwise math) rather than GPU speed; with 4 ranks each rank has
half a core.

    python bench/sequence_parallel.py [--tokens 4096 8192 16384] [--ranks 2 4] [--repeats 2] [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("ring", "ulysses", "allgather")


def _model(tokens: int):
    from transformers import LlamaConfig, LlamaModel

    from vlaforge.config.flavors import FLAVORS

    cfg = dict(FLAVORS.get("tiny").llm, max_position_embeddings=max(tokens, 1024))
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(attn_implementation="sdpa", **cfg))


def _autocast(bf16: bool):
    """bf16 autocast over the fp32 (master) weights, as training runs a bf16 LLM; or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _saved_bytes_and_time(model, x, pos, repeats: int, bf16: bool = False) -> tuple[int, float]:
    """(bytes autograd saves in one forward, best fwd+bwd seconds over `repeats`)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    total = 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(bf16):
        out = model(inputs_embeds=x, position_ids=pos).last_hidden_state
    out.float().square().mean().backward()
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        with _autocast(bf16):
            hidden = model(inputs_embeds=x, position_ids=pos).last_hidden_state
        hidden.float().square().mean().backward()
        if dist.is_initialized():
            dist.barrier()
        best = min(best, time.perf_counter() - start)
    return total, best


def _inputs(tokens: int, hidden: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, tokens, hidden, generator=g), torch.arange(tokens)[None]


def _worker(rank: int, world: int, port: int, tokens: int, repeats: int, bf16: bool, out) -> None:
    from vlaforge.distributed.ring import zigzag_shard
    from vlaforge.distributed.sequence_parallel import register_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(tokens)
    x, pos = _inputs(tokens, model.config.hidden_size)
    for method in METHODS:
        model.set_attn_implementation(register_attention(method))
        shard = ((lambda t: zigzag_shard(t, rank, world, dim=1)) if method == "ring"
                 else (lambda t: t.chunk(world, 1)[rank]))
        nbytes, seconds = _saved_bytes_and_time(model, shard(x), shard(pos), repeats, bf16)
        out[(method, rank)] = (nbytes, seconds)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tokens_list: list[int], ranks: list[int], repeats: int, bf16: bool = False) -> dict:
    report: dict = {"model": "tiny llama (2 blocks, hidden 128, heads 4, kv-heads 2)", "threads": os.cpu_count(),
                    "compute": "bf16 autocast over fp32 weights" if bf16 else "fp32",
                    "target": "activation bytes per rank <= 1/N of one process + 10%", "tokens": {}}
    for tokens in tokens_list:
        torch.set_num_threads(os.cpu_count() or 2)
        model = _model(tokens)
        x, pos = _inputs(tokens, model.config.hidden_size)
        single_bytes, single_s = _saved_bytes_and_time(model, x, pos, repeats, bf16)
        row = {"single": {"activation_bytes": single_bytes, "step_s": round(single_s, 4)}}
        for world in ranks:
            out = mp.Manager().dict()
            mp.spawn(_worker, args=(world, _free_port(), tokens, repeats, bf16, out), nprocs=world)
            for method in METHODS:
                per_rank = [out[(method, r)] for r in range(world)]
                worst = max(b for b, _ in per_rank)
                slowest = max(s for _, s in per_rank)
                row.setdefault(method, {})[str(world)] = {
                    "activation_bytes_per_rank": worst, "bytes_vs_single": round(worst / single_bytes, 4),
                    "within_target": worst <= single_bytes * (1 / world + 0.10),
                    "step_s": round(slowest, 4), "time_vs_single": round(slowest / single_s, 3)}
        report["tokens"][str(tokens)] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights (training's bf16 LLM)")
    args = parser.parse_args()
    print(json.dumps(run(args.tokens, args.ranks, args.repeats, args.bf16), indent=2))


if __name__ == "__main__":
    main()
