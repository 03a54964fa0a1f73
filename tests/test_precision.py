"""Per-component precision: dtypes seen by hooks, loss scaling vs. torch.amp.GradScaler, fp8 conversion."""

import copy
import json

import pytest
import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.models.build import build_vla
from vlaforge.techniques import fp8
from vlaforge.techniques.precision import apply_precision
from vlaforge.training.loss_scale import LossScaler
from vlaforge.training.optim import build_optimizer, build_scheduler
from vlaforge.training.step import StepGuards, train_step
from vlaforge.training.trainer import build_loss_weighting, build_model, train

from conftest import make_batch, tiny_config

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU = torch.device("cpu")


def _precision_cfg(tmp_path, mix, **sections):
    return tiny_config(tmp_path, components={c: {"precision": p} for c, p in mix.items()}, **sections)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("mix, master", [
    ({"vision": "bf16", "projector": "fp32", "llm": "bf16", "action_head": "fp32"}, "fp32"),
    ({"vision": "fp16", "projector": "bf16", "llm": "fp16", "action_head": "fp32"}, "fp32"),
    ({"vision": "bf16", "projector": "fp32", "llm": "fp16", "action_head": "bf16"}, "bf16"),
])
def test_activations_gradients_and_weights_in_their_dtypes(tmp_path, mix, master):
    cfg = _precision_cfg(tmp_path, mix)
    model = build_vla(cfg.model, cfg.loss)
    setup = apply_precision(model, dict(cfg.components.items()), CPU, master)
    assert setup.used == mix
    out_dtypes = {c: set() for c in COMPONENTS}
    grad_out_dtypes = {c: set() for c in COMPONENTS}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            c = name.split(".")[0]
            module.register_forward_hook(lambda m, a, out, c=c: out_dtypes[c].add(out.dtype))
            module.register_full_backward_hook(lambda m, gi, go, c=c: grad_out_dtypes[c].add(go[0].dtype))
    loss, _ = model.compute_loss(make_batch(cfg, model))
    assert loss.dtype == torch.float32
    loss.backward()
    for c, p in mix.items():
        assert out_dtypes[c] == {DTYPE[p]}, c  # activations: the component's compute dtype
        assert grad_out_dtypes[c] == {DTYPE[p]}, c  # activation gradients too
        want = DTYPE[master] if p != "fp32" else torch.float32
        for name, param in getattr(model, c).named_parameters():
            assert param.dtype == want, name  # weights: the master dtype
            assert param.grad is not None and param.grad.dtype == want, name


def test_fp32_everywhere_matches_unwrapped_model(tmp_path):
    cfg = tiny_config(tmp_path)
    torch.manual_seed(0)
    plain = build_vla(cfg.model, cfg.loss)
    torch.manual_seed(0)
    wrapped = build_vla(cfg.model, cfg.loss)
    apply_precision(wrapped, dict(cfg.components.items()), CPU)
    batch = make_batch(cfg, plain)
    a, _ = wrapped.compute_loss(batch)
    b, _ = plain.compute_loss(batch)
    assert torch.equal(a, b)
    ids = batch.instruction_ids
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an outer region must not leak into fp32 components
        inside = wrapped.llm(input_ids=ids).logits
    assert inside.dtype == torch.float32
    assert torch.equal(inside, plain.llm(input_ids=ids).logits)


# ---- loss scaling ---------------------------------------------------------------------------------------------

def _setup(cfg):
    torch.manual_seed(0)
    model, setup = build_model(cfg, CPU)
    weighting = build_loss_weighting(cfg, model, CPU)
    optimizer = build_optimizer(model, cfg, list(weighting.parameters()))
    return model, setup, weighting, optimizer, build_scheduler(optimizer, cfg.train)


class InjectInf:
    """Makes one parameter's gradient inf on chosen calls (counted per backward)."""

    def __init__(self, param: torch.Tensor, at: set[int]):
        self.calls, self.at = 0, at
        param.register_hook(self)

    def __call__(self, grad):
        self.calls += 1
        return grad * float("inf") if self.calls - 1 in self.at else grad


def _fp16_llm_cfg(tmp_path, **loss_scale):
    return _precision_cfg(tmp_path, {"vision": "bf16", "projector": "fp32", "llm": "fp16", "action_head": "fp32"},
                          loss_scale=loss_scale, train={"lr_schedule": "constant", "warmup_steps": 0})


def test_scaler_matches_torch_grad_scaler_step_for_step(tmp_path):
    cfg = _fp16_llm_cfg(tmp_path, initial=2.0 ** 10, growth_interval=3, hysteresis=1)
    batches = [make_batch(cfg, build_vla(cfg.model, cfg.loss), start=4 * i) for i in range(3)]
    inf_at = {1, 5, 6}
    model, setup, weighting, opt, sched = _setup(cfg)
    ref_model, ref_opt = copy.deepcopy(model), None
    ref_opt = build_optimizer(ref_model, cfg)
    InjectInf(model.llm.model.layers[0].mlp.up_proj.weight, inf_at)
    InjectInf(ref_model.llm.model.layers[0].mlp.up_proj.weight, inf_at)
    scaler = LossScaler.from_config(cfg.loss_scale, setup.used, COMPONENTS)
    assert scaler.enabled and scaler.scale == 1024
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    guards = StepGuards(scaler)
    for step in range(10):
        batch = batches[step % 3]
        # No clipping here: two norm implementations differ in the last bit and Adam amplifies that; clipping
        # after unscaling is checked exactly in test_scaling_is_exact_with_accumulation_and_clipping.
        train_step(model, [batch], opt, sched, weighting, grad_clip=0.0, guards=guards)
        ref_opt.zero_grad(set_to_none=True)
        loss, _ = ref_model.compute_loss(batch)
        ref.scale(loss).backward()
        ref.step(ref_opt)
        ref.update()
        assert scaler.scale == ref.get_scale(), step
    assert scaler.skipped_steps == len(inf_at)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_overflow_skips_the_step_and_the_scale_recovers(tmp_path):
    cfg = _fp16_llm_cfg(tmp_path, growth_interval=2, hysteresis=2)
    model, setup, weighting, opt, sched = _setup(cfg)
    batch = make_batch(cfg, model)
    InjectInf(model.llm.model.layers[1].self_attn.q_proj.weight, {1, 2})
    guards = StepGuards(LossScaler.from_config(cfg.loss_scale, setup.used, COMPONENTS))
    scales, changed = [], []
    for _ in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        metrics = train_step(model, [batch], opt, sched, weighting, 1.0, guards)
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
        scales.append(metrics["precision/loss_scale"].item())
    assert changed == [True, False, False, True, True]  # overflowing steps leave every weight alone
    assert scales == [1024, 1024, 512, 512, 1024]  # hysteresis 2: back off on the 2nd overflow; regrow after 2
    assert guards.scaler.skipped_steps == 2 and metrics["precision/skipped_steps"].item() == 2
    assert sched.last_epoch == 3  # the schedule does not advance on skipped steps


def test_scaling_is_exact_with_accumulation_and_clipping(tmp_path):
    """Power-of-two scaling in fp32 is exact: unscale-before-clip gives bit-identical updates."""
    updates = []
    for mode in ("off", "always"):
        cfg = tiny_config(tmp_path, loss_scale={"mode": mode}, train={"grad_clip": 0.05})
        model, setup, weighting, opt, sched = _setup(cfg)
        micro = [make_batch(cfg, model, start=0), make_batch(cfg, model, start=4)]
        scaler = LossScaler.from_config(cfg.loss_scale, setup.used, COMPONENTS)
        metrics = train_step(model, micro, opt, sched, weighting, cfg.train.grad_clip, StepGuards(scaler))
        assert metrics["grad_norm/total"] > 0.05  # clipping is active
        updates.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*updates))


@pytest.mark.slow
def test_fp16_run_logs_scale_and_numerics_and_resumes_exactly(tmp_path):
    def cfg(name, **train_kw):
        return _precision_cfg(tmp_path, {"vision": "bf16", "projector": "fp32", "llm": "fp16", "action_head": "fp32"},
                              loss_scale={"growth_interval": 1}, numerics={"every": 3},
                              train={"output_dir": str(tmp_path / name), "steps": 4, **train_kw})

    full = train(cfg("full", checkpoint_every=2))
    train(cfg("part", steps=2))
    resumed = train(cfg("part", resume="latest"))
    assert full["precision/loss_scale"] == resumed["precision/loss_scale"] == 1024 * 2 ** 4
    assert full["loss/total"] == resumed["loss/total"]
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    measured = [r["step"] for r in rows if "numerics/vision/zero_frac" in r]
    assert measured == [1, 4]  # steps 0 and 3 (0-based) measured; logged under their 1-based step
    setup = json.loads((tmp_path / "full" / "precision.json").read_text())
    assert setup["compute"]["llm"] == "fp16" and setup["master"]["llm"] == "float32"


# ---- fp8 ------------------------------------------------------------------------------------------------------

def test_fp8_swaps_exactly_the_llm_eligible_linears(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    # 2 samples of 28 tokens (32 px, 8 instruction tokens): CPU fp8 matmuls cost ~M*N*K in emulation
    cfg = _precision_cfg(tmp_path, {"vision": "bf16", "projector": "bf16", "llm": "fp8", "action_head": "bf16"},
                         model={"image_size": 32}, data={"max_instruction_tokens": 8})
    model = build_vla(cfg.model, cfg.loss)
    keys = set(model.state_dict())
    linears = {n for n, m in model.llm.named_modules() if isinstance(m, nn.Linear)}
    fp8._warned.clear()
    with pytest.warns(fp8.Fp8SlowWarning, match="slower than bf16"):
        setup = apply_precision(model, dict(cfg.components.items()), CPU)
    swapped = {f"{c}.{n}" for c in COMPONENTS for n, m in getattr(model, c).named_modules()
               if isinstance(m, Float8Linear)}
    assert swapped == {f"llm.{n}" for n in linears - {"lm_head"}}
    assert len(swapped) == 7 * len(model.llm.model.layers)  # q, k, v, o, gate, up, down
    assert setup.fp8["llm"].skipped == {"lm_head": "LM head"}
    assert set(model.state_dict()) == keys  # checkpoints keep their names
    loss, _ = model.compute_loss(make_batch(cfg, model, size=2))
    loss.backward()
    assert model.llm.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.float32


def test_fp8_filter_reports_unaligned_dims():
    module = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 64))
    report = fp8.convert_fp8(module, "rowwise")
    assert report.converted == ["0"]
    assert report.skipped == {"1": "dims 48x40 not multiples of 16", "2": "dims 40x64 not multiples of 16"}
    assert type(module[1]) is nn.Linear


@pytest.mark.slow
def test_fp8_llm_training_reduces_loss(tmp_path):
    # NOTE: CPU fp8 matmuls are an emulation whose time grows with M*N*K (~0.45 s for 256x96x128): 32 px images
    # and 8 instruction tokens (28 tokens a sample, not 48) and a batch of 2 keep M small; the LLM's lr of 1e-2
    # halves the loss (mostly its language term) in 6 steps where 1e-3 took 15 (measured: 0.42x at step 6)
    cfg = tiny_config(tmp_path, components={"vision": {"precision": "bf16"}, "projector": {"precision": "bf16"},
                                            "llm": {"precision": "fp8", "fp8_recipe": "rowwise", "lr": 1e-2},
                                            "action_head": {"precision": "bf16", "lr": 1e-3}},
                      model={"image_size": 32}, data={"max_instruction_tokens": 8},
                      train={"lr_schedule": "constant", "warmup_steps": 0})
    model, setup, weighting, opt, sched = _setup(cfg)
    assert setup.used["llm"] == "fp8" and setup.fp8["llm"].converted
    batch = make_batch(cfg, model, size=2)
    losses = [train_step(model, [batch], opt, sched, weighting, 1.0)["loss/total"].item() for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses
