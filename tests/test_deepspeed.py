"""The DeepSpeed backend: DeepSpeed JSON/YAML configs mapped onto vlaforge's fields (unhonoured ones refused), and
real `torchrun` runs - ZeRO-2 matches DDP on the same steps; ZeRO-3 with CPU optimizer offload, configured by a
DeepSpeed JSON file, resumes exactly and matches too; a resume at another world size is one line, exit 2."""

import json
import re

import pytest
import torch
from shared_runs import ddp_run

from vlaforge.config import load_config
from vlaforge.config.loading import ConfigError
from vlaforge.distributed.deepspeed_backend import check_resolved, config_overrides, engine_config, read_config_file
from vlaforge.errors import VlaforgeError

from conftest import TINY_RECIPE, run_cli
from launch import assert_same_weights, train_distributed, weights

DS_FILE = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "overlap_comm": False, "reduce_bucket_size": 5e7},
           "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "eps": 1e-8}},
           "steps_per_print": 10}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_deepspeed_file_maps_onto_the_config(tmp_path, suffix):
    import yaml

    path = tmp_path / f"ds{suffix}"
    path.write_text(json.dumps(DS_FILE) if suffix == ".json" else yaml.safe_dump(DS_FILE))
    cfg = load_config(TINY_RECIPE, config_overrides(read_config_file(path), world_size=4))
    p, t = cfg.parallel, cfg.train
    assert (p.backend, p.zero_stage, p.offload_optimizer, p.offload_param) == ("deepspeed", 3, "cpu", "none")
    assert p.zero_tuning == {"overlap_comm": False, "reduce_bucket_size": 5e7}
    assert (t.batch_size, t.grad_accum, t.grad_clip, t.betas) == (2, 2, 1.0, (0.9, 0.95))  # 16 = 2 x 2 x 4 ranks
    ds = engine_config(cfg, dp=4)
    assert ds["train_batch_size"] == 16 and ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert ds["zero_optimization"]["reduce_bucket_size"] == 5e7 and ds["gradient_clipping"] == 1.0


def test_bf16_maps_to_every_component():
    cfg = load_config(TINY_RECIPE, config_overrides({"bf16": {"enabled": True}}, 1))
    assert {p.precision for _, p in cfg.components.items()} == {"bf16"}


@pytest.mark.parametrize("ds, message", [
    ({"fp16": {"enabled": True}}, "fp16.enabled (use bf16"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type 'Lamb'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, "optimizer.params.lr (per component"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler (use train.lr_schedule"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "zero_optimization.cpu_offload"),
    ({"activation_checkpointing": {}}, "activation_checkpointing"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, "train_batch_size 10 != "),
])
def test_unhonoured_fields_are_refused_by_name(ds, message):
    with pytest.raises(VlaforgeError) as err:
        config_overrides(ds, world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("--parallel.offload_param=cpu", "offload_param needs zero_stage = 3"),
    ("--parallel.offload_optimizer=nvme", "needs nvme_path"),
    ("--parallel.zero_tuning={bucket=1}", "unknown zero_optimization keys ['bucket']"),
])
def test_bad_deepspeed_fields(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TINY_RECIPE, ["--parallel.backend=deepspeed", override])
    with pytest.raises(ConfigError, match="need backend = 'deepspeed'"):
        load_config(TINY_RECIPE, ["--parallel.offload_optimizer=cpu"])


def test_bad_deepspeed_file_is_one_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{")
    done = run_cli("train", str(TINY_RECIPE), "--deepspeed", str(path))
    assert done.returncode == 2 and "not valid json" in done.stderr and "Traceback" not in done.stderr


# The ZeRO-2 / ZeRO-3 (CPU offload) configs in the form the transformers Trainer documents: "auto" everywhere
# the trainer has a value of its own.
_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
         "min_loss_scale": 1}
_COMMON = {"fp16": _FP16, "bf16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}},
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
HF_FORMS = {
    "zero2": {**_COMMON, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
        "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
        "contiguous_gradients": True}},
    "zero3": {**_COMMON, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}},
}


@pytest.mark.parametrize("form", sorted(HF_FORMS))
def test_transformers_auto_values_take_vlaforge_settings(form):
    ds = HF_FORMS[form]
    cfg = load_config(TINY_RECIPE, config_overrides(ds, world_size=2))
    check_resolved(cfg, ds, 2)
    base = load_config(TINY_RECIPE)
    t, b = cfg.train, base.train
    assert (t.batch_size, t.grad_accum, t.grad_clip, t.betas, t.eps, t.lr_schedule, t.warmup_steps) == \
        (b.batch_size, b.grad_accum, b.grad_clip, b.betas, b.eps, b.lr_schedule, b.warmup_steps)
    assert [p.precision for _, p in cfg.components.items()] == [p.precision for _, p in base.components.items()]
    engine = engine_config(cfg, dp=2, hidden=128)
    zero = engine["zero_optimization"]
    assert engine["train_batch_size"] == b.batch_size * b.grad_accum * 2 and engine["gradient_clipping"] == b.grad_clip
    assert zero["stage"] == int(form[-1]) and zero["offload_optimizer"] == {"device": "cpu"}
    if form == "zero3":  # sized from the hidden width as transformers does: h^2, 0.9 h^2, 10 h
        assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
                zero["stage3_param_persistence_threshold"]) == (128 * 128, int(0.9 * 128 * 128), 1280)
        assert zero["offload_param"] == {"device": "cpu"} and zero["stage3_max_live_parameters"] == 1e9
    else:
        assert zero["reduce_bucket_size"] == 2e8


@pytest.mark.parametrize("change, overrides, message", [
    ({"train_batch_size": 999}, [], "train_batch_size 999 != train.batch_size"),
    ({"bf16": {"enabled": False}}, ["--components.llm.precision=bf16"], "bf16.enabled = false but components.llm"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": "auto"}}}, [], "optimizer.params.lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, [], "scheduler (use train"),
])
def test_explicit_values_that_contradict_vlaforge_are_refused(change, overrides, message):
    ds = {**HF_FORMS["zero2"], **change}
    with pytest.raises(VlaforgeError) as err:
        cfg = load_config(TINY_RECIPE, config_overrides(ds, world_size=2) + overrides)
        check_resolved(cfg, ds, 2)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(HF_FORMS))
@pytest.mark.over_budget("the first DeepSpeed run on a machine JIT-compiles its CPU ops")
def test_transformers_form_deepspeed_files_train(tmp_path, form):
    pytest.importorskip("deepspeed")
    path = tmp_path / f"ds_config_{form}.json"
    path.write_text(json.dumps(HF_FORMS[form]))
    done = run_cli("train", str(TINY_RECIPE), "--deepspeed", str(path), "--train.steps=2", "--data.num_samples=16",
                   "--train.batch_size=4", "--train.progress=false", f"--train.output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    saved = load_config(tmp_path / "run" / "config.toml")
    got = (saved.parallel.backend, saved.parallel.zero_stage, saved.train.batch_size)
    assert got == ("deepspeed", int(form[-1]), 4)
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "deepspeed").is_dir()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """DDP on 2 ranks, shared with test_data_parallel (tests/shared_runs.py)."""
    return ddp_run(tmp_path_factory)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero2_matches_ddp(tmp_path, ddp):
    pytest.importorskip("deepspeed")
    train_distributed(tmp_path, "--parallel.backend=deepspeed", "--parallel.zero_stage=2")
    assert_same_weights(tmp_path, ddp)
    assert (tmp_path / "checkpoints" / "step_00000003" / "deepspeed").is_dir()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.over_budget("the first DeepSpeed run on a machine JIT-compiles its CPU ops")
def test_zero3_cpu_offload_from_a_deepspeed_file_resumes_exactly(tmp_path, ddp):
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_distributed(straight, "--deepspeed", str(path), "--train.checkpoint_every=2")
    # its step-2 ZeRO checkpoint resumed by 2 ranks into an empty folder
    train_distributed(resumed, "--deepspeed", str(path), f"--train.resume={straight / 'checkpoints' / 'step_00000002'}")
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_same_weights(straight, ddp)
    # ZeRO partitions do not reshard: one process may not resume them
    done = run_cli("train", "--resume", str(resumed), "--train.steps=4")
    assert done.returncode == 2, done.stderr
    assert "was written by DeepSpeed at 2 ranks" in done.stderr and "Traceback" not in done.stderr
