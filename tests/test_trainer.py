import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from vlaforge.errors import VlaforgeError
from vlaforge.training.trainer import train

from conftest import run_cli, tiny_config


def _cfg(tmp_path, name, **train_kw):
    return tiny_config(tmp_path, model={"action_head": {"kind": "flow_matching", "flow_steps": 2}},
                       loss={"weighting": "dwa"},
                       train={"output_dir": str(tmp_path / name), "lr_schedule": "cosine", "warmup_steps": 1,
                              **train_kw})


def _weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def _metrics(run_dir):
    return {d["step"]: d for d in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_train_2_resume_2_equals_train_4(tmp_path):
    full = _cfg(tmp_path, "full", steps=4, checkpoint_every=2, keep_checkpoints=3)
    train(full)
    # A second run that stopped at step 2: its checkpoint is a copy of the full run's step-2 checkpoint.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002", resumed_dir / "ckpt")
    train(_cfg(tmp_path, "resumed", steps=4, resume=str(resumed_dir / "ckpt")))
    a, b = _weights(tmp_path / "full", 4), _weights(resumed_dir, 4)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ma, mb = _metrics(tmp_path / "full"), _metrics(resumed_dir)
    for step in (3, 4):
        assert ma[step]["loss/total"] == mb[step]["loss/total"]
        assert ma[step]["weight/action"] == mb[step]["weight/action"]


def test_resume_latest_with_constant_schedule_and_longer_run(tmp_path):
    short = tiny_config(tmp_path, train={"steps": 2, "lr_schedule": "constant", "output_dir": str(tmp_path / "a")})
    train(short)
    train(tiny_config(tmp_path, train={"steps": 4, "lr_schedule": "constant", "resume": "latest",
                                       "output_dir": str(tmp_path / "a")}))
    train(tiny_config(tmp_path, train={"steps": 4, "lr_schedule": "constant", "output_dir": str(tmp_path / "b")}))
    a, b = _weights(tmp_path / "a", 4), _weights(tmp_path / "b", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_run_dir_contents_and_metrics(tmp_path):
    cfg = tiny_config(tmp_path, train={"steps": 3, "tensorboard": True, "grad_accum": 2})
    last = train(cfg)
    run = tmp_path / "run"
    assert (run / "config.toml").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    rows = _metrics(run)
    assert sorted(rows) == [1, 2, 3]
    for key in ("loss/action", "loss/contrastive", "loss/language", "loss/total", "weight/action",
                "grad_norm/vision", "grad_norm/projector", "grad_norm/llm", "grad_norm/action_head",
                "lr/vision", "lr/llm", "perf/tokens_per_s", "perf/samples_per_s"):
        assert key in rows[3], key
    assert last["loss/total"] == rows[3]["loss/total"]
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_00000003"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert not list((run / "checkpoints").glob(".*tmp"))


def test_checkpoints_keep_newest(tmp_path):
    train(tiny_config(tmp_path, train={"steps": 4, "checkpoint_every": 1, "keep_checkpoints": 2}))
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert names == ["step_00000003", "step_00000004"]


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    train(tiny_config(tmp_path, train={"steps": 1}))
    model_file = tmp_path / "run" / "checkpoints" / "step_00000001" / "model.safetensors"
    data = model_file.read_bytes()
    model_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(VlaforgeError, match="truncated or corrupt"):
        train(tiny_config(tmp_path, train={"steps": 2, "resume": "latest"}))
    with pytest.raises(VlaforgeError, match="no checkpoint at"):
        train(tiny_config(tmp_path, train={"steps": 2, "resume": str(tmp_path / "elsewhere")}))


@pytest.mark.slow
def test_cli_train_and_resume_from_run_dir(tmp_path):
    out = tmp_path / "cli"
    proc = run_cli("train", "recipes/tiny_synthetic.toml", "--train.steps=2", f"--train.output_dir={out}",
                   "--train.progress=false", "--data.num_samples=64", fresh=True)  # the entry point, once per verb
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout
    proc = run_cli("train", "--resume", str(out), "--train.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*"))[-1] == "step_00000003"
    proc = run_cli("train", "--resume", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no checkpoint at" in proc.stderr and "Traceback" not in proc.stderr


def test_checkpoint_with_a_scalar_logit_scale_still_loads(tmp_path):
    """Checkpoints from before FSDP2 support stored projector.logit_scale as a 0-d tensor."""
    from safetensors.torch import save_file

    from vlaforge.checkpoints.load import load_weights
    from vlaforge.models.build import build_vla

    cfg = tiny_config(tmp_path)
    model = build_vla(cfg.model, cfg.loss)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["projector.logit_scale"] = torch.tensor(2.5)
    (tmp_path / "ckpt").mkdir()
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    load_weights(tmp_path / "ckpt", model)
    assert model.projector.logit_scale.shape == (1,) and model.projector.logit_scale.item() == 2.5


def test_accumulated_micro_batches_equal_one_large_batch(tmp_path):
    """Masked means are normalized over the whole step (HF's grad-accumulation loss bug, avoided): 4 micro-batches of
    2 give the weights of one batch of 8. The contrastive term is off: its negatives are in-micro-batch by nature."""
    def run(name, batch, accum):
        cfg = tiny_config(tmp_path, loss={"weights": {"contrastive": 0.0, "language": 0.4, "action": 0.3},
                                          "smoothness": 0.1},
                          train={"steps": 3, "batch_size": batch, "grad_accum": accum,
                                 "output_dir": str(tmp_path / name)})
        train(cfg)
        return _weights(tmp_path / name, 3)

    large, accumulated = run("large", 8, 1), run("accumulated", 2, 4)
    for k in large:
        torch.testing.assert_close(accumulated[k], large[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tmp_path):
    """train.compile: every vision and LLM block compiled in place (names unchanged); the losses of 2 steps match
    eager within float tolerance."""
    from vlaforge.techniques.compile import compile_blocks
    from vlaforge.training.trainer import build_model, train

    cfg = tiny_config(tmp_path, train={"steps": 2, "compile": True})
    model, _ = build_model(cfg, torch.device("cpu"))
    assert all(b._compiled_call_impl is not None for b in model.llm.model.layers)
    assert compile_blocks(model) == 4  # 2 vision + 2 llm blocks in the tiny flavor
    eager = train(tiny_config(tmp_path / "eager", train={"steps": 2}))
    compiled = train(cfg)
    assert compiled["loss/total"] == pytest.approx(eager["loss/total"], rel=1e-5)
