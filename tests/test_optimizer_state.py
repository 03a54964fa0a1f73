"""Optimizer state per component (techniques/optimizer_state.py): torchao's 8-bit AdamW moments and bf16 master
weights with stochastic rounding - how close they track fp32 AdamW, the bytes they hold (and the planner counts),
unbiased rounding, bit-exact resume, a skipped fp16 step, and the refusals.

The projector is the component under test throughout: it has the fewest distinct parameter shapes, and torchao
compiles its step once per shape (the tests share those graphs, and the CLI runs forked from this process too)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from vlaforge import COMPONENTS
from vlaforge.config.components import ComponentConfig
from vlaforge.errors import VlaforgeError
from vlaforge.techniques.accounting import inner_tensors
from vlaforge.techniques.optimizer_state import apply_optimizer_state, quantized
from vlaforge.training.optim import build_optimizer
from vlaforge.training.step import train_step
from vlaforge.training.trainer import build_model

from conftest import TINY_RECIPE, make_batch, run_cli, step_setup, tiny_config

pytestmark = pytest.mark.xdist_group("test_optimizer_state")  # one worker: torchao's compiled steps are shared
CPU = torch.device("cpu")
C = "projector"
SR_8BIT = {"precision": "bf16", "optim_state": "8bit", "stochastic_rounding": True}  # with precision_master bf16


def _cfg(tmp_path, master="fp32", **policy):
    return tiny_config(tmp_path, components={C: policy}, train={"precision_master": master})


def _steps(run, batches):
    model, weighting, opt, sched, guards = run
    for batch in batches:
        train_step(model, [batch], opt, sched, weighting, 1.0, guards)


def _state_bytes(opt, params) -> int:
    return sum(t.numel() * t.element_size() for p in params for v in opt.state[p].values() for t in inner_tensors(v))


def _snapshot(state: dict) -> dict:
    return {k: [t.clone() for t in inner_tensors(v)] for k, v in state.items()}


def _same_state(a: dict, b: dict) -> bool:
    """Two optimizer states (or snapshots) hold equal tensors, 8-bit moments compared by codes, scales and map."""
    a, b = (s if all(isinstance(v, list) for v in s.values()) else _snapshot(s) for s in (a, b))
    return a.keys() == b.keys() and all(all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def test_no_option_keeps_one_fused_adamw(tmp_path):
    opt = build_optimizer(build_model(_cfg(tmp_path), CPU)[0], _cfg(tmp_path))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]


def test_8bit_moments_track_fp32_adamw_on_the_chosen_component_only(tmp_path):
    ref_cfg, cfg = _cfg(tmp_path), _cfg(tmp_path, optim_state="8bit")
    ref, run = step_setup(ref_cfg), step_setup(cfg)
    batches = [make_batch(cfg, ref[0], start=4 * i) for i in range(6)]
    start = [p.detach().clone() for p in ref[0].projector.parameters()]
    _steps(ref, batches[:1])
    _steps(run, batches[:1])
    opt = run[2]
    for c in COMPONENTS:  # the others: fused AdamW, bit for bit as without the option
        for (name, a), b in zip(getattr(run[0], c).named_parameters(), getattr(ref[0], c).parameters()):
            kinds = [type(opt.state[a][k]).__name__ for k in ("exp_avg", "exp_avg_sq")]
            assert kinds == ["OptimState8bit" if c == C and quantized(a.numel()) else "Tensor"] * 2, name
            if c != C:
                assert torch.equal(a, b) and _same_state(opt.state[a], ref[2].state[b]), name
    # 8-bit: 1 byte a value, an fp32 scale per 256 and a 1 KiB code map per moment; + the fp32 step
    weights = [p for p in run[0].projector.parameters() if quantized(p.numel())]
    n = sum(p.numel() for p in weights)
    assert len(weights) == 2 and n == 24576
    assert _state_bytes(opt, weights) == 2 * (n + 4 * n // 256 + 1024 * len(weights)) + 4 * len(weights)
    assert _state_bytes(ref[2], [dict(ref[0].named_parameters())[f"projector.mlp.{i}.weight"] for i in (0, 2)]) \
        == 2 * 4 * n + 4 * 2  # fp32 moments
    _steps(ref, batches[1:])
    _steps(run, batches[1:])
    # drift after 6 steps, relative to how far fp32 AdamW moved the projector (measured: 2.8%)
    moved = sum((p.detach() - s).norm() ** 2 for p, s in zip(ref[0].projector.parameters(), start)) ** 0.5
    drift = sum((a.detach() - b.detach()).norm() ** 2
                for a, b in zip(run[0].projector.parameters(), ref[0].projector.parameters())) ** 0.5
    assert 0 < drift < 0.05 * moved


def test_stochastic_rounding_is_unbiased_where_bf16_rounding_stalls():
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    lr, steps = ulp / 8, 64  # each step moves the weight ~lr (Adam on a constant gradient): 1/8 ulp

    def final_mean(dtype, rounding: bool) -> float:
        w = torch.nn.Parameter(torch.full((4096,), 1.5, dtype=dtype))
        group = {"params": [w], "lr": lr, "weight_decay": 0.0, "name": "x", "component": "x"}
        opt = apply_optimizer_state([group], {"x": ComponentConfig(stochastic_rounding=rounding)}, (0.9, 0.95), 1e-8)
        for _ in range(steps):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.double().mean().item()

    fp32 = 1.5 - final_mean(torch.float32, False)
    assert fp32 == pytest.approx(steps * lr, rel=1e-3)  # 8 ulp
    assert 1.5 - final_mean(torch.bfloat16, False) == 0.0  # round to nearest: every update is lost
    assert 1.5 - final_mean(torch.bfloat16, True) == pytest.approx(fp32, rel=0.03)  # measured: 0.3%


def test_planner_counts_the_bytes_the_optimizer_holds(tmp_path):
    from vlaforge.planner.memory import model_state

    for master, policy in (("fp32", {}), ("fp32", {"optim_state": "8bit"}), ("bf16", SR_8BIT)):
        cfg = _cfg(tmp_path, master, **policy)
        run = step_setup(cfg)
        _steps(run, [make_batch(cfg, run[0])])
        held = _state_bytes(run[2], list(run[0].projector.parameters()))
        planned = model_state(run[0], dict(cfg.components.items()), master).by_component[C]
        assert planned.optimizer == held, policy
        params = sum(p.numel() * p.element_size() for p in run[0].projector.parameters())
        assert planned.params == planned.grads == params, policy  # SR: the bf16 weights are the only copy


def test_fp16_skipped_step_leaves_weights_and_8bit_state_alone(tmp_path):
    from test_precision import InjectInf

    cfg = _cfg(tmp_path, precision="fp16", optim_state="8bit")
    run = step_setup(cfg)
    model, opt, guards = run[0], run[2], run[4]
    assert guards.scaler.enabled
    batch = make_batch(cfg, model)
    weight = model.projector.mlp[0].weight
    InjectInf(weight, {1})
    _steps(run, [batch])
    before = [p.detach().clone() for p in model.parameters()]
    state = {p: _snapshot(opt.state[p]) for p in model.parameters() if p in opt.state}
    _steps(run, [batch])  # overflows: skipped
    assert guards.scaler.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert type(opt.state[weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert all(_same_state(state[p], opt.state[p]) for p in state)  # codes, scales, step counters
    _steps(run, [batch])
    assert not _same_state(state[weight], opt.state[weight])


def _train_cli(out, *extra):
    done = run_cli("train", str(TINY_RECIPE), f"--components.{C}.precision=bf16", f"--components.{C}.optim_state=8bit",
                   f"--components.{C}.stochastic_rounding=true", "--train.precision_master=bf16",
                   "--data.num_samples=64", "--train.batch_size=4", "--train.progress=false",
                   "--train.tensorboard=false", "--train.log_every=1", f"--train.output_dir={out}", *extra)
    assert done.returncode == 0, done.stderr[-2000:]


def _checkpoint(run, step):
    """(weights, optimizer state) of a run's checkpoint, full or sharded (every tensor of its DCP shards)."""
    folder = run / "checkpoints" / f"step_{step:08d}"
    if not (folder / "dcp").is_dir():
        state = torch.load(folder / "trainer_state.pt", weights_only=True)
        return load_file(str(folder / "model.safetensors")), state["optimizer"]["state"]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from vlaforge.distributed.state import SafeLoadPlanner, SafeReader

    meta = SafeReader(str(folder / "dcp")).read_metadata().state_dict_metadata
    found = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(found, storage_reader=SafeReader(str(folder / "dcp")), planner=SafeLoadPlanner(), no_dist=True)
    return ({k: v for k, v in found.items() if k.startswith("model.")},
            {k: v for k, v in found.items() if k.startswith("optimizer.state.")})


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_8bit_with_stochastic_rounding_resumes_bit_exactly(tmp_path, fmt):
    """Straight and resumed runs end on the same weights and moments, bit for bit; the sharded case steps inside
    backward (train.step_in_backward: each parameter's optimizer built from its component's part, the stochastic
    rounding's draws in hook order)."""
    f = (f"--train.checkpoint_format={fmt}",) + (("--train.step_in_backward=true", "--train.grad_clip=0")
                                                 if fmt == "sharded" else ())
    _train_cli(tmp_path / "straight", "--train.steps=4", "--train.checkpoint_every=2", "--train.keep_checkpoints=2", *f)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step_00000002", tmp_path / "part" / "ckpt")
    _train_cli(tmp_path / "part", "--train.steps=4", f"--train.resume={tmp_path / 'part' / 'ckpt'}", *f)
    (wa, sa), (wb, sb) = _checkpoint(tmp_path / "straight", 4), _checkpoint(tmp_path / "part", 4)
    key = f"model.{C}.mlp.0.weight"
    assert wa[key.removeprefix("model." if fmt == "full" else "")].dtype == torch.bfloat16
    if fmt == "full":  # plain tensors, no class
        assert set(sa[key]["exp_avg"]) == {"codes", "scale", "qmap"}
    else:
        assert sa[f"optimizer.state.{key}.exp_avg.codes"].dtype == torch.uint8
    assert _equal(wa, wb) and _equal(sa, sb) and len(sa) > 0
    if fmt == "sharded":
        return
    # a checkpoint whose moments are of another kind than this run's: one line
    done = run_cli("train", str(TINY_RECIPE), "--data.num_samples=64", "--train.steps=4",
                   f"--train.output_dir={tmp_path / 'other'}", f"--train.resume={tmp_path / 'part' / 'ckpt'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "are 8-bit and this run keeps them in the master dtype" in done.stderr.strip()


def test_the_step_inside_backward_takes_each_components_optimizer(tmp_path):
    """train.step_in_backward over these optimizers (techniques/step_in_backward.py builds each parameter's from the
    part that steps its group): 8-bit moments on fp32 weights give the plain step's weights and moments bit for bit
    (no randomness; one parameter at a time either way). With stochastic rounding the draws come in hook order, not
    the plain step's: its resume is the sharded case of the test above."""
    eight = (f"--components.{C}.optim_state=8bit", "--data.num_samples=64", "--train.batch_size=4",
             "--train.progress=false", "--train.tensorboard=false", "--train.steps=2", "--train.grad_clip=0")
    for name, extra in (("plain", ()), ("inside", ("--train.step_in_backward=true",))):
        done = run_cli("train", str(TINY_RECIPE), *eight, *extra, f"--train.output_dir={tmp_path / name}")
        assert done.returncode == 0, done.stderr[-2000:]
    (wa, sa), (wb, sb) = _checkpoint(tmp_path / "plain", 2), _checkpoint(tmp_path / "inside", 2)
    assert set(sb[f"model.{C}.mlp.0.weight"]["exp_avg"]) == {"codes", "scale", "qmap"}  # 8-bit inside backward too
    assert _equal(wa, wb) and _equal(sa, sb)


def test_refusals_are_one_line(tmp_path):
    def refused(*args: str) -> str:
        done = run_cli("train", str(TINY_RECIPE), f"--train.output_dir={tmp_path / 'r'}", *args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "train.precision_master = 'bf16'" in refused(f"--components.{C}.stochastic_rounding=true")
    assert "set train.precision_master = 'bf16'" in refused(f"--components.{C}.stochastic_rounding=true",
                                                          f"--components.{C}.precision=bf16")
    assert "steps its own optimizer" in refused("--parallel.backend=deepspeed",
                                                            f"--components.{C}.optim_state=8bit")
    assert "no optimizer state to keep" in refused(f"--components.{C}.trainable=false",
                                                   f"--components.{C}.optim_state=8bit")


def test_fsdp2_sharding_is_refused_and_ddp_is_not(tmp_path):
    from vlaforge.distributed.parallel_dims import World, check_layout

    two = World(rank=0, local_rank=0, size=2)
    with pytest.raises(VlaforgeError, match="torchao's 8-bit state does not shard here"):
        check_layout(_cfg(tmp_path, optim_state="8bit"), two)
    ddp = tiny_config(tmp_path, components={C: {"optim_state": "8bit"}},
                      parallel={"backend": "ddp", "dp_replicate": 2, "dp_shard": 1})
    assert check_layout(ddp, two).dp_replicate == 2


def test_trainer_state_holds_no_optimizer_state_class(tmp_path):
    from torchao.optim.subclass_8bit import OptimState8bit

    from vlaforge.checkpoints.load import load_trainer_state
    from vlaforge.seeding import rng_state

    moment = OptimState8bit.zeros((16, 256), signed=True)
    base = {"step": 1, "scheduler": {"last_epoch": 1, "_step_count": 2}, "weighting": {}, "rng": rng_state()}
    cases = {"OptimState8bit": moment,  # the class itself: never unpickled, though torchao allowlists it
             "an 8-bit moment of 4096 codes has 8 scales": {"codes": moment.codes, "scale": moment.scale[:8],
                                                            "qmap": moment.qmap}}
    for why, value in cases.items():
        (tmp_path / "c").mkdir(exist_ok=True)
        torch.save({**base, "optimizer": {"state": {"w": {"exp_avg": value}}, "param_groups": []}},
                   tmp_path / "c" / "trainer_state.pt")
        with pytest.raises(VlaforgeError, match=why):
            load_trainer_state(tmp_path / "c")
    good = {"codes": moment.codes, "scale": moment.scale, "qmap": moment.qmap}
    torch.save({**base, "optimizer": {"state": {"w": {"exp_avg": good}}, "param_groups": []}},
               tmp_path / "c" / "trainer_state.pt")
    assert load_trainer_state(tmp_path / "c")["optimizer"]["state"]["w"]["exp_avg"]["codes"].dtype == torch.uint8
