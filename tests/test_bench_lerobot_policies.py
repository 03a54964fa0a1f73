"""bench/lerobot_policies.py's two sides on the tiny pi0 folder: LeRobot 0.6.1's training step (its site, with its
gradient checkpointing) and vlaforge's (a fresh worker process, its joint layers checkpointed) each report memory
and step time, a step's peak live tensor bytes, and their losses at the same pinned noise and flow times agree in
fp32."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import lerobot061 as ref061
import pytest

pytestmark = pytest.mark.xdist_group("lerobot061")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "lerobot_policies.py"


def _bench(monkeypatch):
    """The bench module; the folders it puts on sys.path (bench/, tests/) are taken off again after the test
    (`monkeypatch`): bench/libero.py would shadow the libero package for the worker's later tests."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_lerobot_policies", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_sides_step_once_and_agree_on_the_loss(tmp_path_factory, tmp_path, monkeypatch):
    bench = _bench(monkeypatch)
    folder = ref061.policy_folder("pi0", ref061.session_root(tmp_path_factory))
    inputs = bench.write_inputs(tmp_path / "in.safetensors", 2, quick=True)
    args = SimpleNamespace(threads=1, quiet_wait=0)
    theirs = bench.run_lerobot("train", str(folder / "policy"), str(inputs), "float32+gc", "2", args=args)
    mine = bench.run_vlaforge("train", "--folder", str(folder), "--kind", "pi0", "--inputs", str(inputs),
                              "--variant", "fp32+checkpointing", "--steps", "2", args=args)
    for row in (theirs, mine):
        assert "failed" not in row, row
        assert len(row["step_s"]) == 2 and row["peak_rss_mib"] >= row["rss_loaded_mib"] > row["rss_start_mib"] > 0
        # a step's live tensors: at least the fp32 weights as it starts, and the gradients (and more) at its peak
        assert row["step_start_mib"] * 2**20 >= 4 * row["parameters"], row
        assert row["step_peak_mib"] * 2**20 >= row["step_start_mib"] * 2**20 + 4 * row["trainable_parameters"], row
    assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * abs(theirs["loss"]), (mine["loss"], theirs["loss"])
    assert mine["trainable_parameters"] > 0 and mine["compute"]["llm"] == "fp32"


def test_both_sides_count_the_tensors_a_forward_keeps(tmp_path_factory, tmp_path, monkeypatch):
    """--tensors: each side counts the live tensor bytes of the same forward + backward (its loss equals the other
    side's) at batch 1 and 2: what the forward keeps grows with the batch and stays under the peak."""
    bench = _bench(monkeypatch)
    folder = ref061.policy_folder("pi0", ref061.session_root(tmp_path_factory))
    paths = ",".join(str(bench.write_inputs(tmp_path / f"in{b}.safetensors", b, quick=True)) for b in (1, 2))
    args = SimpleNamespace(threads=1, quiet_wait=0)
    theirs = bench.run_lerobot("tensors", str(folder / "policy"), paths, "float32+gc", args=args)
    mine = bench.run_vlaforge("tensors", "--folder", str(folder), "--kind", "pi0", "--inputs", paths,
                              "--variant", "fp32+checkpointing", args=args)
    for row in (theirs, mine):
        assert set(row["batches"]) == {"1", "2"}, row
        one, two = row["batches"]["1"], row["batches"]["2"]
        assert 0 < one["kept_mib"] < two["kept_mib"] <= two["peak_mib"], row
    for b in ("1", "2"):
        a, r = mine["batches"][b]["loss"], theirs["batches"][b]["loss"]
        assert abs(a - r) <= 1e-5 * abs(r), (b, a, r)
