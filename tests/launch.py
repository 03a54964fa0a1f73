"""Run `vlaforge train` in one process or under a real `torchrun` (gloo ranks) and compare what the runs wrote; run
a test's worker function on gloo ranks spawned in-process."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import FRESH, ROOT, TINY_RECIPE, check_distributed_marked, run_cli

COMMON = ["--train.steps=3", "--train.batch_size=4", "--train.progress=false", "--train.tensorboard=false",
          "--train.log_every=1", "--data.num_samples=64", "--numerics.every=1"]


def torchrun(*args: str, nproc: int = 2, fresh: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node=NPROC -m vlaforge ARGS`: the real launcher with `fresh` (or
    VLAFORGE_TEST_FRESH=1), otherwise ranks forked from this process with torchrun's environment
    (tests/forked.py:run_ranks)."""
    check_distributed_marked()
    from forked import can_fork, run_ranks

    if not (fresh or FRESH) and can_fork():
        return run_ranks(args, nproc, ROOT, {"PYTHONWARNINGS": "ignore"}, timeout=300)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "vlaforge", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def weights(run_dir, step=3):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


# A key projection's bias has a zero gradient (softmax is invariant to a shift of every logit of a query), so what
# a run computes for it is float noise, which Adam scales to a learning-rate-sized step: another summation order
# (TP's, CP's) moves it by up to lr x steps. The vision tower's (SigLIP's) k_proj has a bias.
NOISE_ONLY = ("self_attn.k_proj.bias",)


def assert_same_weights(run_dir, reference):
    a, b = weights(run_dir), weights(reference)
    assert a.keys() == b.keys(), (a.keys() ^ b.keys())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-3 if k.endswith(NOISE_ONLY) else 1e-5, msg=k)


def assert_matches(run, reference, keys=("loss/total",), rel_norm: float = 1e-5):
    """Same step-3 weights as `reference` and, per logged step, the same `keys` (abs 1e-5) and total gradient norm
    (relative `rel_norm`)."""
    assert_same_weights(run, reference)
    for got, want in zip(metrics(run), metrics(reference)):
        for key in keys:
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
        assert got["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=rel_norm)


def train_single(out, *args: str):
    done = run_cli("train", str(TINY_RECIPE), *COMMON, *args, f"--train.output_dir={out}")
    assert done.returncode == 0, done.stderr
    return out


def train_distributed(out, *args: str, nproc: int = 2, fresh: bool = False) -> subprocess.CompletedProcess:
    done = torchrun("train", str(TINY_RECIPE), *COMMON, *args, f"--train.output_dir={out}", nproc=nproc,
                    fresh=fresh)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


OFF = "--loss.weights={contrastive=0.0,language=0.4,action=0.3}"  # contrastive negatives are per rank


def spawn_ranks(worker, world: int) -> dict:
    """Run `worker(rank, world, port, out)` on `world` processes forked from this one (a free port for their
    rendezvous; fork, not spawn: no ranks re-importing torch); returns what the ranks put in the shared dict `out`."""
    import torch.multiprocessing as mp

    check_distributed_marked()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_forked_rank, args=(worker, world, port, out), nprocs=world, start_method="fork")
    return dict(out)


def _forked_rank(rank, worker, world, port, out):
    torch.set_num_threads(1)  # as torchrun's workers (OMP_NUM_THREADS=1): two ranks share two cores
    worker(rank, world, port, out)
