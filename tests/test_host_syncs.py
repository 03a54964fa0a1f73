"""A training step reads no device value on the host between logging steps (each such read stalls the CPU until the
GPU drains its queue); fused AdamW with the schedule on the device; no graph break per decoder layer."""

from __future__ import annotations

import collections
import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlaforge.models.build import build_vla
from vlaforge.training import trainer
from vlaforge.training.numerics import NonFiniteGradientError
from vlaforge.training.optim import StepSchedule, build_optimizer, build_param_groups, build_scheduler

from conftest import make_batch, tiny_config
from launch import NOISE_ONLY
from test_precision import InjectInf, _setup

# who read: torch's optimizers count their steps on the host (foreach AdamW's `_get_value`), transformers reads a
# given padding mask to choose SDPA's is_causal path (`fast_all`; vlaforge's SDPA mask never asks), the data loader
# reads host data it makes (on a GPU too: its batches are moved afterwards); the rest is ours
OPTIMIZER, TRANSFORMERS_MASK, LOADER = "torch/optim/", "transformers/masking_utils.py", "torch/utils/data/"


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values - `aten._local_scalar_dense` (`.item()`, `bool()`, `int()`) and
    `Tensor.tolist` (which reads CPU memory without an op) - by who asked for them."""

    def __init__(self):
        super().__init__()
        self.by = collections.Counter()
        self.tolist = torch.Tensor.tolist

    def _count(self) -> None:
        files = [f.filename for f in traceback.extract_stack()]
        who = next((k for k in (OPTIMIZER, TRANSFORMERS_MASK, LOADER) if any(k in f for f in files)), "ours")
        self.by[who] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._count()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        reads = self

        def tolist(t):
            reads._count()
            return reads.tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)


def _train_reads(tmp_path, steps: int, **sections) -> collections.Counter:
    """Host reads of a whole `train` run of the tiny recipe: logging, checkpoints and evaluation at the end only."""
    cfg = tiny_config(tmp_path / str(steps), train={"steps": steps, "log_every": 1000, "checkpoint_every": 0},
                      **sections)
    with HostReads() as reads:
        trainer.train(cfg)
    return reads.by


@pytest.mark.parametrize("loss_scale", ["off", "always"])
def test_host_reads_do_not_grow_with_steps(tmp_path, loss_scale):
    """The reads of N and of 2N steps are the same: building, the last step's logging and checkpoint read, the
    steps between read nothing (before: grad_norms' `.tolist()`, `bool(isfinite(norm))`, `bool(found_inf)`, and
    the schedule stepped on the host), with fp16 loss scaling too."""
    short, long = (_train_reads(tmp_path, n, loss_scale={"mode": loss_scale}) for n in (3, 6))
    assert long["ours"] == short["ours"], (short, long)
    # the tiny batches are padded: transformers' SDPA mask would read the padding mask twice a forward (before:
    # 2 x 3 more reads for 3 more steps); vlaforge's SDPA mask (models/llm.py) never asks
    assert long[TRANSFORMERS_MASK] == short[TRANSFORMERS_MASK] == 0, (short, long)
    assert long[OPTIMIZER] == short[OPTIMIZER]  # fused AdamW keeps its step counters on the device


def test_fused_adamw_matches_foreach(tmp_path):
    cfg = tiny_config(tmp_path)
    models = [build_vla(cfg.model, cfg.loss) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = build_optimizer(models[0], cfg)
    foreach = torch.optim.AdamW(build_param_groups(models[1], cfg.components), betas=cfg.train.betas,
                                eps=cfg.train.eps, foreach=True)
    assert fused.defaults["fused"] and isinstance(fused.param_groups[0]["lr"], torch.Tensor)
    schedule, reference = build_scheduler(fused, cfg.train), build_scheduler(foreach, cfg.train)
    assert isinstance(schedule, StepSchedule) and isinstance(reference, torch.optim.lr_scheduler.LambdaLR)
    batch = make_batch(cfg, models[0])
    for _ in range(3):
        for model, opt, sched in ((models[0], fused, schedule), (models[1], foreach, reference)):
            opt.zero_grad()
            model.compute_loss(batch)[0].backward()
            opt.step()
            sched.step()
        assert schedule.get_last_lr() == pytest.approx(reference.get_last_lr(), rel=1e-6)  # warmup, then cosine
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-3 if name.endswith(NOISE_ONLY) else 1e-6, msg=name)


def test_a_skipped_step_leaves_weights_and_schedule_on_the_device(tmp_path):
    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg.train)
    model.compute_loss(make_batch(cfg, model))[0].backward()
    before = [p.detach().clone() for p in model.parameters()]
    lrs = sched.get_last_lr()
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    sched.step(torch.ones(()))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert sched.last_epoch == 0 and sched.get_last_lr() == lrs
    assert all(int(s["step"]) == 0 for s in opt.state.values())  # fused AdamW took its counters back
    state = sched.state_dict()
    sched.step()
    sched.load_state_dict(state)
    assert sched.last_epoch == 0 and sched.get_last_lr() == lrs


def test_nonfinite_stop_waits_for_the_next_logging_step(tmp_path, monkeypatch):
    """In the trainer, a step with an inf gradient (no loss scaling) is skipped on the device and the run stops at
    the next logging step, naming the step and the component; no checkpoint is written."""
    build_bare = trainer.build_bare

    def with_inf(cfg, device):
        model = build_bare(cfg, device)
        InjectInf(model.llm.model.layers[0].mlp.up_proj.weight, {1})
        return model

    monkeypatch.setattr(trainer, "build_bare", with_inf)
    cfg = tiny_config(tmp_path, train={"steps": 3, "log_every": 3, "checkpoint_every": 0})
    with pytest.raises(NonFiniteGradientError) as err:
        trainer.train(cfg)
    text = str(err.value)
    assert text.startswith("non-finite gradients at step 1 (no loss scaling; read at step 2, the steps between "
                           "were taken) in components.llm (fp32): ")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_deferred_stop_skips_the_step_on_the_device(tmp_path):
    from vlaforge.training.numerics import NumericsMonitor
    from vlaforge.training.step import StepGuards, train_step

    cfg = tiny_config(tmp_path)
    model, setup, weighting, opt, sched = _setup(cfg)
    InjectInf(model.llm.model.layers[0].mlp.up_proj.weight, {0})
    guards = StepGuards(monitor=NumericsMonitor(cfg.numerics, setup.used), step=1, defer=True)  # (not measured)
    batch = make_batch(cfg, model)
    before = [p.detach().clone() for p in model.parameters()]
    with HostReads() as reads:
        train_step(model, [batch], opt, sched, weighting, 1.0, guards)
    assert reads.by["ours"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    guards.step = 2
    train_step(model, [batch], opt, sched, weighting, 1.0, guards)  # finite: taken
    assert sched.last_epoch == 1
    with pytest.raises(NonFiniteGradientError, match=r"at step 1 \(no loss scaling; read at step 2.*components\.llm"):
        guards.raise_pending(model)


def test_llm_forward_installs_no_capture_hooks_and_a_block_compiles_whole(tmp_path):
    """transformers installs its output-capturing hook on every decoder layer the first time hidden states are asked
    for; the hook reads a ContextVar, where torch.compile breaks the layer's graph (measured on the H100 run)."""
    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    batch = make_batch(cfg, model, size=2)
    reference = copy.deepcopy(model)
    h = model.run_llm(batch, with_text=True)
    mask = reference.token_mask(batch, True)
    embeds = reference.input_embeddings(batch.images, batch.instruction_ids, batch.text_ids)[0]
    out = reference.llm(inputs_embeds=embeds, attention_mask=mask.long(), position_ids=reference.llm_positions(mask),
                        output_hidden_states=True, logits_to_keep=batch.text_ids.shape[1] + 1, use_cache=False)
    assert torch.equal(h["action_hidden"], reference.split_outputs(out.hidden_states[-1], out.logits,
                                                                   batch.text_ids.shape[1])["action_hidden"])
    layer = model.llm.model.layers[0]
    assert not layer._forward_hooks
    x = torch.randn(2, 8, model.llm.config.hidden_size)
    rope = model.llm.model.rotary_emb(x, torch.arange(8)[None])
    assert torch._dynamo.explain(layer)(x, attention_mask=None, position_embeddings=rope).graph_break_count == 0


def test_a_batch_without_padding_passes_no_mask_and_a_padded_one_computes_as_sdpa(tmp_path):
    """A batch made on the host without padding (`Batch.full`, from collate) reaches the LLM with no attention mask
    and no positions (SDPA's is_causal kernels; nothing for transformers to read back); padded or not, the loss is
    plain SDPA's with the mask (transformers' own "sdpa" implementation as the reference)."""
    import dataclasses

    from vlaforge.data.batch import Batch

    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    padded = make_batch(cfg, model)
    assert padded.full is False and not bool(padded.instruction_mask.all())
    unpadded = dataclasses.replace(padded, instruction_mask=torch.ones_like(padded.instruction_mask), full=None)
    one = Batch.collate([dataclasses.replace(unpadded, **{f.name: getattr(unpadded, f.name)[i]
                                                          for f in dataclasses.fields(Batch)
                                                          if isinstance(getattr(unpadded, f.name), torch.Tensor)})
                         for i in range(unpadded.size)])
    assert one.full is True  # read from the samples' CPU masks where the batch is made
    reference = copy.deepcopy(model)
    reference.llm.set_attn_implementation("sdpa")
    seen = []
    model.llm.register_forward_pre_hook(lambda m, a, k: seen.append((k["attention_mask"], k["position_ids"])),
                                        with_kwargs=True)
    for batch in (padded, one):
        torch.manual_seed(0)
        got = model.compute_loss(batch)[0]
        torch.manual_seed(0)
        want = reference.compute_loss(dataclasses.replace(batch, full=None))[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert seen[0][0] is not None and seen[1] == (None, None)
