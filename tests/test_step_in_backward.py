"""`train.step_in_backward` (techniques/step_in_backward.py): each parameter steps and frees its gradient in its
post-accumulate-grad hook. Exact against the plain step in fp32 (weights, gradient norms, numerics statistics, with
accumulation and learned loss weights), one gradient held at a time as the planner counts, resumable bit for bit
with or without the option, FSDP2 and a LeRobot policy; every layout or rule it cannot keep exactly refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlaforge.errors import ConfigError, VlaforgeError
from vlaforge.training.trainer import train

from conftest import run_cli, tiny_config


def _cfg(tmp_path: Path, name: str, in_backward: bool, **train_kw):
    # uncertainty weighting: learned loss weights, which step after backward; numerics measured every step; the
    # projector frozen until step 1 (its parameters are hooked when they start to train)
    return tiny_config(tmp_path, loss={"weighting": "uncertainty"}, numerics={"every": 1},
                       components={"projector": {"precision": "fp32", "trainable": False, "unfreeze_at_step": 1}},
                       train={"steps": 3, "grad_accum": 2, "grad_clip": 0.0, "step_in_backward": in_backward,
                              "lr_schedule": "cosine", "warmup_steps": 1, "output_dir": str(tmp_path / name),
                              **train_kw})


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (any bit)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_the_step_inside_backward_is_the_plain_step_bit_for_bit(tmp_path, monkeypatch):
    """fp32, no clipping, 2 accumulated micro-batches, 3 steps through the trainer: the same weights, losses,
    per-component gradient norms and numerics statistics, bit for bit; every parameter of the four components
    stepped in its hook (only the learned loss weights are left for after backward)."""
    from vlaforge.techniques.step_in_backward import InBackwardOptimizer

    finish, left = InBackwardOptimizer.finish, []

    def counted(self):
        left.append([g["component"] for g in self.param_groups for p in g["params"] if p.grad is not None])
        return finish(self)

    monkeypatch.setattr(InBackwardOptimizer, "finish", counted)
    train(_cfg(tmp_path, "plain", False))
    train(_cfg(tmp_path, "inside", True))
    assert left == [["loss_weighting"]] * 3
    assert not _same(_weights(tmp_path / "plain", 3), _weights(tmp_path / "inside", 3))
    plain, inside = _metrics(tmp_path / "plain"), _metrics(tmp_path / "inside")
    assert len(plain) == len(inside) == 3
    for a, b in zip(plain, inside):
        compared = [k for k in {*a, *b} if k.startswith(("grad_norm/", "numerics/", "loss/", "weight/"))]
        assert {"grad_norm/total", "grad_norm/llm", "numerics/llm/zero_frac"} <= set(compared)
        assert ("grad_norm/projector" in compared) == (a["step"] > 1)  # it trains from step 1 (the second)
        assert {k: a.get(k) for k in compared} == {k: b.get(k) for k in compared}


def _gradient_peaks(tmp_path: Path, in_backward: bool) -> tuple[int, int, int, float]:
    """(most gradient bytes held at once over one training step, the whole model's gradient bytes, its largest
    parameter's, the planner's `grads_held` in bytes), grad_accum 1. Measured by a post-accumulate-grad hook that runs
    before the optimizer's (registered first): it sees every gradient as it completes, before it is freed."""
    from vlaforge.data.loader import build_loader
    from vlaforge.planner.estimate import estimate
    from vlaforge.planner.hardware import GB, get_gpu
    from vlaforge.planner.types import Cluster, PlanModel
    from vlaforge.training.step import train_step
    from vlaforge.training.trainer import build_run

    cfg = tiny_config(tmp_path, train={"grad_clip": 0.0, "step_in_backward": in_backward,
                                       "output_dir": str(tmp_path / f"peak_{in_backward}")})
    run = build_run(cfg)
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    peak = [0]

    def sample(_):
        peak[0] = max(peak[0], sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))

    for p in params:
        p.register_post_accumulate_grad_hook(sample)
    batch = next(iter(build_loader(run.data.dataset, cfg.train.batch_size, 0, 0, 0)))
    train_step(run.model, [batch], run.optimizer, run.scheduler, run.weighting, 0.0, run.guards, run.executor)
    assert all(p.grad is None for p in params) == in_backward  # the step inside backward freed them all
    planned = estimate(PlanModel(cfg), cfg, Cluster(get_gpu("h100-80"), 1, 1)).memory["grads_held"] * GB
    return peak[0], sum(p.numel() * 4 for p in params), max(p.numel() * 4 for p in params), planned


def test_gradients_are_freed_as_they_complete_as_the_planner_counts(tmp_path):
    """With one micro-batch the plain step holds the whole model's gradient (2.9 MB for the tiny flavor); inside
    backward one gradient at a time, the largest parameter's at most (the LLM's 0.5 MB embeddings): measured, and
    the planner's count of the gradients held at once is the measured one, exactly."""
    plain, whole, largest, planned_plain = _gradient_peaks(tmp_path, False)
    inside, _, _, planned_inside = _gradient_peaks(tmp_path, True)
    assert plain == whole == planned_plain
    assert inside == largest == planned_inside
    assert inside < whole / 5


def test_the_planner_holds_one_gradient_at_a_time_and_counts_the_launches():
    """planner/peak.py: inside backward a part's gradients are a transient of its largest one and none is left for an
    optimizer step; with accumulation every gradient is held as before. The hooks' launches go to the launch floor."""
    from vlaforge.planner.estimate import build_case
    from vlaforge.planner.hardware import get_gpu
    from vlaforge.planner.launches import STEP_OPS, step_launches
    from vlaforge.planner.peak import Part, backward_peak, grads_held
    from vlaforge.planner.types import Cluster, PlanModel

    parts = [Part(acts=4, grads=1, largest=0.5), Part(acts=3, grads=5, largest=2), Part(acts=3, grads=1, largest=1)]
    assert backward_peak(parts, 10) == 10 - 4 + 1 + 5  # the plain step: gradients made so far
    assert backward_peak(parts, 10, in_backward=True) == 10 + 0.5  # its start, with one gradient
    assert grads_held(parts, 7, in_backward=True) == 2 and grads_held(parts, 7) == 7
    assert backward_peak(parts, 10, held=7, in_backward=True) == backward_peak(parts, 10, held=7)
    assert grads_held(parts, 7, held=7, in_backward=True) == 7
    cfg = tiny_config(train={"grad_clip": 0.0, "step_in_backward": True})
    case = build_case(PlanModel(cfg), cfg, Cluster(get_gpu("h100-80"), 1, 1))
    assert step_launches(case) == 12 * 72 > STEP_OPS  # the tiny flavor's 72 trained tensors


def test_resume_is_exact_with_or_without_the_option(tmp_path):
    """2 steps then a resume to 4 equal 4 straight steps, bit for bit: the per-parameter optimizers' state is saved
    in the grouped optimizer's layout, so a checkpoint written inside backward resumes with the plain step and the
    other way round (full and sharded checkpoint formats)."""
    train(_cfg(tmp_path, "straight", True, steps=4))
    straight = _weights(tmp_path / "straight", 4)
    for first, then, fmt in ((True, True, "full"), (True, False, "full"), (False, True, "full"),
                             (True, True, "sharded")):
        name = f"{first}_{then}_{fmt}"
        train(_cfg(tmp_path, name, first, steps=2, checkpoint_format=fmt))
        train(_cfg(tmp_path, name, then, steps=4, resume="latest", checkpoint_format=fmt))
        if fmt == "full":
            resumed = _weights(tmp_path / name, 4)
        else:
            from vlaforge.checkpoints.load import load_weights
            from vlaforge.models.build import build_vla

            cfg = _cfg(tmp_path, name, then)
            model = build_vla(cfg.model, cfg.loss)
            load_weights(tmp_path / name / "checkpoints" / "step_00000004", model)
            resumed = {k: v for k, v in model.state_dict().items() if k in straight}
        assert not _same(straight, resumed), name


REFUSED = [
    ([], "train.grad_clip = 0"),  # the default grad_clip 1.0
    (["--train.grad_clip=0", "--components.llm.precision=fp16"], "components.llm.precision = 'fp16' scales the loss"),
    (["--train.grad_clip=0", "--loss_scale.mode=always"], "loss_scale.mode = 'always' scales the loss"),
    (["--train.grad_clip=0", "--parallel.backend=deepspeed"], "parallel.backend = 'deepspeed' with "
                                                               "train.step_in_backward is refused"),
    (["--train.grad_clip=0", "--parallel.pp=2", "--train.grad_accum=2"], "parallel.pp > 1 with"),
    (["--train.grad_clip=0", "--parallel.tp=2"], "parallel.tp > 1 with"),
    (["--train.grad_clip=0", "--parallel.cp=2"], "parallel.cp > 1 with"),
]


@pytest.mark.parametrize("extra,message", REFUSED)
def test_what_it_cannot_keep_exact_is_refused_in_one_line(extra, message):
    r = run_cli("train", "recipes/tiny_synthetic.toml", "--train.step_in_backward=true", "--train.steps=1", *extra)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_ddp_is_refused_in_one_line_and_fsdp2_is_not():
    from vlaforge.distributed.parallel_dims import World, check_layout

    world = World(rank=0, local_rank=0, size=2)
    with pytest.raises(VlaforgeError, match="^parallel.backend = 'ddp' with train.step_in_backward is refused[^\n]*$"):
        check_layout(tiny_config(train={"grad_clip": 0.0, "step_in_backward": True},
                                 parallel={"backend": "ddp", "dp_replicate": 2, "dp_shard": 1}), world)
    check_layout(tiny_config(train={"grad_clip": 0.0, "step_in_backward": True}), world)
    with pytest.raises(ConfigError, match="grad_clip"):  # a config error names the field and the fix
        tiny_config(train={"step_in_backward": True})


def test_a_nonfinite_gradient_stops_the_run_and_its_parameter_never_steps(tmp_path, monkeypatch):
    """A gradient that turns inf in step 1: that parameter does not step (fused AdamW's found_inf, on the device, no
    host read), the schedule does not advance, and the run stops at the next logging step naming the component, as
    without the option; no checkpoint is written."""
    from vlaforge.training import trainer
    from vlaforge.training.numerics import NonFiniteGradientError

    from test_host_syncs import HostReads
    from test_precision import InjectInf

    build_bare, seen = trainer.build_bare, {}

    def with_inf(cfg, device):
        model = build_bare(cfg, device)
        seen["param"] = model.llm.model.layers[0].mlp.up_proj.weight
        InjectInf(seen["param"], {1})
        return model

    step, reads = trainer.train_step, []

    def watched(model, micro, optimizer, *args):
        seen.setdefault("before", []).append(seen["param"].detach().clone())
        with HostReads() as host:
            out = step(model, micro, optimizer, *args)
        reads.append(host.by["ours"])
        seen.setdefault("after", []).append(seen["param"].detach().clone())
        return out

    monkeypatch.setattr(trainer, "build_bare", with_inf)
    monkeypatch.setattr(trainer, "train_step", watched)
    cfg = tiny_config(tmp_path, numerics={"every": 0},  # (a measuring step reads its statistics)
                      train={"steps": 3, "log_every": 3, "checkpoint_every": 0, "grad_clip": 0.0,
                             "step_in_backward": True})
    with pytest.raises(NonFiniteGradientError) as err:
        train(cfg)
    assert str(err.value).startswith("non-finite gradients at step 1 (no loss scaling; read at step 2, the steps "
                                     "between were taken) in components.llm (fp32): ")
    assert not torch.equal(seen["before"][0], seen["after"][0])  # step 0 stepped it
    assert torch.equal(seen["before"][1], seen["after"][1])  # step 1: its gradient was inf
    assert reads == [0, 0, 0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_host_reads_do_not_grow_with_steps(tmp_path):
    """No device value is read on the host by the steps between logging steps (the hooks' norms, finiteness and
    skips stay on the device)."""
    from test_host_syncs import HostReads

    counts = []
    for n in (2, 4):
        cfg = tiny_config(tmp_path / str(n), train={"steps": n, "log_every": 1000, "checkpoint_every": 0,
                                                    "grad_clip": 0.0, "step_in_backward": True})
        with HostReads() as reads:
            train(cfg)
        counts.append(reads.by)
    assert counts[0]["ours"] == counts[1]["ours"], counts


@pytest.mark.distributed
def test_fsdp2_steps_after_its_reduce_scatter_as_the_plain_step(tmp_path):
    """FSDP2 runs a sharded parameter's post-accumulate-grad hooks after its reduce-scatter, on the reduced shard:
    2 ranks, 2 accumulated micro-batches, 2 steps, bit for bit the plain FSDP2 run (weights and gradient norms)."""
    from launch import COMMON, torchrun

    runs = {}
    for name, flag in (("plain", "false"), ("inside", "true")):
        runs[name] = tmp_path / name
        r = torchrun("train", "recipes/tiny_synthetic.toml", *COMMON, "--train.steps=2", "--train.grad_accum=2",
                     "--train.grad_clip=0", f"--train.step_in_backward={flag}", f"--train.output_dir={runs[name]}")
        assert r.returncode == 0, r.stderr[-3000:]
    assert not _same(_weights(runs["plain"], 2), _weights(runs["inside"], 2))
    for a, b in zip(_metrics(runs["plain"]), _metrics(runs["inside"])):
        norms = [k for k in a if k.startswith(("grad_norm/", "numerics/"))]
        assert norms and {k: a[k] for k in norms} == {k: b[k] for k in norms}


@pytest.fixture
def session_root(tmp_path_factory) -> Path:
    """The folder the session's workers share for LeRobot-made policy folders (tests/lerobot061.py)."""
    import lerobot061 as ref061

    return ref061.session_root(tmp_path_factory)


def test_a_lerobot_smolvla_fine_tune_steps_inside_backward_bit_for_bit(session_root, tmp_path):
    """Two steps of a LeRobot SmolVLA folder (its VLM and action expert training, fp32, LeRobot's grad clip of 10
    set to 0) through `vlaforge train` end on the plain step's weights, bit for bit, and so do they with both
    components' AdamW on the host (`optim_state = "cpu"`, techniques/host_optimizer.py) inside backward."""
    import lerobot061 as ref061

    args = ref061.train_args("smolvla", session_root, tmp_path / "ds") + [
        "--train.batch_size=2", "--components.llm.trainable=true", "--train.steps=2", "--train.checkpoint_every=2",
        "--train.grad_clip=0"]
    weights = {}
    host = ["--components.llm.optim_state=cpu", "--components.action_head.optim_state=cpu"]
    for name, extra in (("plain", []), ("inside", ["--train.step_in_backward=true"]),
                        ("host", ["--train.step_in_backward=true", *host])):
        r = run_cli(*args, *extra, f"--train.output_dir={tmp_path / name}", timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        weights[name] = ref061.trained(tmp_path / name, 2)
    start = load_file(str(ref061.policy_folder("smolvla", session_root) / "policy" / "model.safetensors"))
    assert not torch.equal(weights["plain"]["action_head.action_in_proj.weight"],
                           start["model.action_in_proj.weight"])  # it trained
    assert not _same(weights["plain"], weights["inside"]) and not _same(weights["plain"], weights["host"])
    # lerobot-train: the policy's grad clip (10 here) is refused, naming LeRobot's flag that sets it to 0
    from vlaforge.config import load_config
    from vlaforge.lerobot_train import translate

    folder = f"--policy.path={ref061.policy_folder('smolvla', session_root) / 'policy'}"
    for extra, refused in (([], True), (["--policy.optimizer_grad_clip_norm=0"], False)):
        t = translate([folder, "--dataset.repo_id=a/b", *extra, "--train.step_in_backward=true"])
        if refused:
            with pytest.raises(ConfigError, match="--policy.optimizer_grad_clip_norm=0"):
                load_config(t.recipe, t.overrides)
        else:
            assert load_config(t.recipe, t.overrides).train.step_in_backward


def test_another_optimizer_class_steps_per_parameter_as_its_group(tmp_path):
    """`per_parameter` builds each parameter's optimizer from the grouped optimizer's class and settings: SGD with
    momentum, stepped inside backward, equals SGD over the groups."""
    from vlaforge.models.build import build_vla
    from vlaforge.techniques.step_in_backward import apply_step_in_backward
    from vlaforge.training.optim import build_param_groups

    from conftest import make_batch

    cfg = tiny_config(tmp_path)
    models = [build_vla(cfg.model, cfg.loss) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    plain, grouped = (torch.optim.SGD(build_param_groups(m, cfg.components), lr=1e-2, momentum=0.9) for m in models)
    inside = apply_step_in_backward(grouped)
    batch = make_batch(cfg, models[0])
    for _ in range(2):
        plain.zero_grad()
        models[0].compute_loss(batch)[0].backward()
        plain.step()
        inside.begin()
        inside.arm(True)
        models[1].compute_loss(batch)[0].backward()
        assert all(p.grad is None for p in models[1].parameters())
        inside.finish()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert inside.state_dict()["state"].keys() == plain.state_dict()["state"].keys()
