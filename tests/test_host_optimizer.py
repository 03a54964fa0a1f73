"""`components.<c>.optim_state = "cpu"` (techniques/host_optimizer.py): the component's AdamW on the host - fp32
master weights and moments there, the device keeping its weights and gradients. The plain fused AdamW bit for bit
where the parameter is its own master (fp32 on the host); with bf16 weights, the fp32 AdamW of the master bit for
bit and the weights its nearest bf16, moving where the plain bf16 step stalls; inside backward as after it; bit-exact
resume; counted by the planner; refused in one line where it cannot apply."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlaforge.errors import ConfigError, VlaforgeError
from vlaforge.techniques.host_optimizer import HostAdamW
from vlaforge.training.trainer import train

from conftest import run_cli, tiny_config

BF16 = {"precision": "bf16", "optim_state": "cpu"}


def _cfg(tmp_path: Path, name: str, components: dict, master: str = "fp32", **train_kw):
    return tiny_config(tmp_path, components=components,
                       train={"steps": 3, "grad_accum": 2, "grad_clip": 0.0, "precision_master": master,
                              "output_dir": str(tmp_path / name), **train_kw})


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_fp32_on_the_host_is_the_plain_fused_step_bit_for_bit(tmp_path):
    """Two components' AdamW on the host (here the host is the device: each fp32 parameter is its own master), 3 steps
    of 2 accumulated micro-batches through the trainer: the plain run's weights, bit for bit."""
    train(_cfg(tmp_path, "plain", {}))
    train(_cfg(tmp_path, "host", {"projector": {"precision": "fp32", "optim_state": "cpu"},
                                  "llm": {"precision": "fp32", "optim_state": "cpu"}}))
    assert not _differ(_weights(tmp_path / "plain", 3), _weights(tmp_path / "host", 3))


def test_bf16_weights_step_an_fp32_master_and_move_where_bf16_stalls():
    """bf16 weights: the host's master is exactly fp32 AdamW (fused) over the same gradients, and the weights are its
    nearest bf16 after every step; with updates below half a bf16 ulp the plain bf16 AdamW never moves the weights,
    the host's master accumulates them until the weights move."""
    torch.manual_seed(0)
    start = (1 + torch.rand(64, 64)).bfloat16()  # in [1, 2): half a bf16 ulp is 2 ** -9
    host_p = torch.nn.Parameter(start.clone())
    bf16_p = torch.nn.Parameter(start.clone())
    ref = torch.nn.Parameter(start.float())
    kw = {"lr": 2e-4, "weight_decay": 0.0}
    host, plain = HostAdamW([host_p], **kw), torch.optim.AdamW([bf16_p], fused=True, **kw)
    fp32 = torch.optim.AdamW([ref], fused=True, **kw)
    for _ in range(40):
        g = torch.randn(64, 64).abs().bfloat16()  # one sign: every step pushes the same way
        for p in (host_p, bf16_p):
            p.grad = g.clone()
        ref.grad = g.float()
        host.step(), plain.step(), fp32.step()
        master = host.state[host_p]["master"]
        assert master.dtype == torch.float32 and master.device.type == "cpu"
        assert torch.equal(master, ref.detach()) and torch.equal(host_p.detach(), master.bfloat16())
    assert torch.equal(bf16_p.detach(), start)  # each step's ~2e-4 is under half an ulp: bf16 rounds it away
    assert (host_p.detach() != start).float().mean() > 0.5


def test_inside_backward_it_is_the_step_after_backward_and_resumes_bit_exactly(tmp_path):
    """bf16 weights (precision_master bf16) with the host's AdamW on the llm and the projector: the step inside
    backward gives the step after backward's weights bit for bit; 2 steps then a resume to 3 (full and sharded
    checkpoints: the fp32 masters and moments are saved and come back fp32 on the host) equal 3 straight steps."""
    parts = {"llm": BF16, "projector": BF16}
    train(_cfg(tmp_path, "after", parts, "bf16"))
    train(_cfg(tmp_path, "inside", parts, "bf16", step_in_backward=True, checkpoint_every=1))
    straight = _weights(tmp_path / "after", 3)
    assert not _differ(straight, _weights(tmp_path / "inside", 3))
    assert {v.dtype for k, v in straight.items() if k.startswith("llm.")} == {torch.bfloat16}
    state = torch.load(tmp_path / "inside" / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=True)
    masters = [v["master"] for v in state["optimizer"]["state"].values() if "master" in v]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    for fmt, in_backward in (("full", False), ("sharded", True)):
        name = f"resumed_{fmt}"
        train(_cfg(tmp_path, name, parts, "bf16", steps=2, checkpoint_format=fmt, step_in_backward=in_backward))
        train(_cfg(tmp_path, name, parts, "bf16", resume="latest", checkpoint_format=fmt,
                   step_in_backward=in_backward))
        if fmt == "full":
            resumed = _weights(tmp_path / name, 3)
        else:
            from vlaforge.checkpoints.load import load_weights
            from vlaforge.models.build import build_vla

            cfg = _cfg(tmp_path, name, parts, "bf16")
            model = build_vla(cfg.model, cfg.loss)  # fp32: it holds the bf16 weights exactly
            load_weights(tmp_path / name / "checkpoints" / "step_00000003", model)
            resumed = {k: v.to(straight[k].dtype) for k, v in model.state_dict().items() if k in straight}
        assert not _differ(straight, resumed), fmt


def test_the_planner_moves_the_state_to_the_host_and_counts_its_step():
    """The planner: the component's master and moments (12 bytes a parameter with bf16 weights) in host memory, none
    on the GPU; the step pays the host's AdamW and the gradients' and weights' trips over PCIe."""
    from vlaforge.planner.estimate import estimate
    from vlaforge.planner.hardware import GB, get_gpu
    from vlaforge.planner.types import Cluster, PlanModel

    cluster = Cluster(get_gpu("h100-80"), 1, 1)
    plain = tiny_config(components={"llm": {"precision": "bf16"}}, train={"precision_master": "bf16"})
    host = tiny_config(components={"llm": BF16}, train={"precision_master": "bf16"})
    pm = PlanModel(plain)  # one model for both: its state bytes are cached per optim_state too
    a, b = estimate(pm, plain, cluster), estimate(pm, host, cluster)
    n = sum(p.numel() for p in pm.model.llm.parameters())
    assert a.memory["cpu"] == 0 and b.memory["cpu"] * GB == pytest.approx(12 * n, rel=1e-3)
    assert b.memory["optimizer"] < a.memory["optimizer"] and b.memory["params"] == a.memory["params"]
    assert b.time_s["optimizer"] > a.time_s["optimizer"]


@pytest.mark.parametrize("extra,message", [
    (["--components.llm.stochastic_rounding=true", "--components.llm.precision=bf16",
      "--train.precision_master=bf16"], "stochastic_rounding with optim_state = 'cpu'"),
    (["--components.llm.trainable=false"], "optim_state = 'cpu' on a component with trainable = false"),
    (["--parallel.backend=deepspeed"], "parallel.backend = 'deepspeed' steps its own optimizer"),
])
def test_what_it_cannot_take_is_one_line(extra, message):
    r = run_cli("train", "recipes/tiny_synthetic.toml", "--components.llm.optim_state=cpu", "--train.steps=1",
                *extra)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_more_than_one_process_is_refused():
    from vlaforge.distributed.parallel_dims import World, check_layout

    for parallel in ({"backend": "ddp", "dp_replicate": 2, "dp_shard": 1}, {}):
        with pytest.raises(VlaforgeError, match="^components.llm.optim_state = 'cpu' steps plain tensors on the host, "
                                                "one process[^\n]*$"):
            check_layout(tiny_config(components={"llm": {"optim_state": "cpu"}}, parallel=parallel),
                         World(rank=0, local_rank=0, size=2))
    with pytest.raises(ConfigError, match="optim_state"):
        tiny_config(components={"llm": {"optim_state": "gpu"}})


def test_a_host_without_the_memory_the_planner_counts_is_refused_before_the_step(tmp_path, monkeypatch):
    """The host's AdamW and DeepSpeed's CPU offload are refused in one line when the host has less memory available
    than the planner counts for their state (12 bytes a parameter with bf16 weights), naming both figures."""
    from vlaforge.planner.memory import model_state
    from vlaforge.training import memory_check
    from vlaforge.training.trainer import build_model

    cfg = tiny_config(tmp_path, components={"llm": BF16}, train={"precision_master": "bf16"})
    model, _ = build_model(cfg, torch.device("cpu"))
    need, why = memory_check.host_optimizer_bytes(cfg, model)
    n = sum(p.numel() for p in model.llm.parameters())
    assert why == ["components.llm.optim_state = 'cpu'"] and need == model_state(
        model, dict(cfg.components.items()), "bf16").by_component["llm"].optimizer and 12 * n < need < 12 * n + 9999
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: need - 1)
    with pytest.raises(VlaforgeError, match=r"^components.llm.optim_state = 'cpu' keep 0.0 GiB of optimizer state "
                                            r"on the host, which has 0.0 GiB available; [^\n]*$"):
        train(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run's folder
    ds = tiny_config(tmp_path, parallel={"backend": "deepspeed", "offload_optimizer": "cpu"})
    assert memory_check.host_optimizer_bytes(ds, model)[1] == ["parallel.offload_optimizer = 'cpu'"]
    have = memory_check.host_available_bytes()  # the real reading: some, and no more than the machine has
    assert 0 < have <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: need)
    memory_check.check_host_optimizer(cfg, model)  # enough: no refusal


def test_the_planner_offers_it_where_nothing_fits_on_one_gpu():
    """When nothing fits, the search's alternatives include the host's AdamW on one GPU (its state in host memory,
    less on the GPU than the plain candidates), and not on two (one process only: `check_layout` refuses it there)."""
    import dataclasses

    from vlaforge.planner.hardware import get_gpu
    from vlaforge.planner.search import HOST_OPTIMIZER, search
    from vlaforge.planner.types import Cluster, PlanModel

    cfg = tiny_config()
    pm = PlanModel(cfg)
    plain = search(pm, Cluster(get_gpu("h100-80"), 1, 1), 8)
    need = plain.best.memory["total"]
    small = dataclasses.replace(get_gpu("h100-80"), memory_gb=need * 0.5)
    plan = search(pm, Cluster(small, 1, 1), 8)
    assert plan.best is None and HOST_OPTIMIZER in plan.alternatives
    host = plan.alternatives[HOST_OPTIMIZER]
    assert host.memory["cpu"] > 0 and host.memory["optimizer"] == 0
    assert {p.optim_state for _, p in host.config.components.items() if p.trainable} == {"cpu"}
    assert HOST_OPTIMIZER not in search(pm, Cluster(small, 2, 1), 8).alternatives
