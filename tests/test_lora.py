"""LoRA / QLoRA (techniques/lora.py, checkpoints/lora.py): only the adapters train and the base stays bit for
bit; a LoRA checkpoint holds the adapters and a record of its base, resumes bit-exact and refuses another base in
one line; the merged policy equals the unmerged model; an NF4 base holds NF4's bytes; 2-rank FSDP2 and DDP equal one
process; the compositions not carried yet are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from shared_runs import base_run, dataset, link_dataset, shared_run

from vlaforge.config import load_config
from vlaforge.errors import VlaforgeError

from conftest import TINY_RECIPE, make_batch, run_cli, tiny_config, train_on_dataset
from fake_lerobot import CAMS

ALL_LORA = ['--components.vision.lora={rank=4}', '--components.projector.lora={rank=4}',
            '--components.llm.lora={rank=4,base="nf4"}', '--components.action_head.lora={rank=4}']


def _step(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The session's full run (tests/shared_runs.py: 2 steps, a checkpoint each: two different bases) and a LoRA run
    on all four components over its step-2 checkpoint (2 steps, a checkpoint each), trained once per session."""
    base = base_run(tmp_path_factory)
    lora = shared_run(tmp_path_factory, "lora_all", f"--train.init_from={_step(base, 2)}",
                      "--train.checkpoint_every=1", *ALL_LORA)
    return base.parent, base, lora


def test_only_adapters_train_and_the_base_stays_bit_identical():
    """The real optimizer groups and freezing: after 3 AdamW steps (weight decay on) every base tensor of the LoRA
    components is bit-identical (the NF4 base still NF4), their adapters moved, the full components trained."""
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.techniques.lora import is_adapter
    from vlaforge.training.optim import build_optimizer
    from vlaforge.training.trainer import build_model

    cfg = tiny_config(components={"llm": {"lora": {"rank": 4, "base": "nf4"}, "weight_decay": 0.1},
                                  "vision": {"lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}}})
    torch.manual_seed(0)
    model, _ = build_model(cfg, torch.device("cpu"))
    apply_freezing(model, dict(cfg.components.items()), 0)
    optimizer = build_optimizer(model, cfg)
    grouped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    for n, p in named.items():
        lora = n.startswith(("llm.", "vision."))
        assert p.requires_grad == (not lora or is_adapter(n)), n
        assert (id(p) in grouped) == p.requires_grad, n
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in named if n.startswith("vision.") and is_adapter(n)} \
        == {"q_proj", "v_proj"}
    before = {n: _inner(t) for n, t in model.state_dict().items()}
    batch = make_batch(cfg, model)
    for _ in range(3):
        loss, _ = model.compute_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = {n: _inner(t) for n, t in model.state_dict().items()}
    for n, t in after.items():
        if n.startswith(("llm.", "vision.")) and not is_adapter(n):
            assert len(t) == len(before[n]) and all(torch.equal(x, y) for x, y in zip(t, before[n])), n
    assert type(model.llm.model.layers[0].self_attn.q_proj.base_layer.weight).__name__ == "NF4Tensor"
    changed = {n for n in after if not all(torch.equal(x, y) for x, y in zip(after[n], before[n]))}
    assert all(n in changed for n in after if ".lora_B." in n)
    assert any(n.startswith("action_head.") for n in changed) and any(n.startswith("projector.") for n in changed)


def _inner(t):
    """The tensors a (possibly NF4) tensor holds, copied (NF4's own clone re-quantizes with its default blocks)."""
    if hasattr(t, "__tensor_flatten__"):
        return tuple(getattr(t, n).detach().clone() for n in t.__tensor_flatten__()[0])
    return (t.detach().clone(),)


def test_nf4_base_holds_nf4_bytes():
    """QLoRA: each NF4 base weight holds 4 bits per weight plus one int8 scale per 64 (0.516 bytes per weight, vs
    4 in fp32), measured over its inner tensors."""
    from vlaforge.techniques.lora import stored_bytes
    from vlaforge.training.trainer import build_model

    cfg = tiny_config(components={"llm": {"lora": {"rank": 4, "base": "nf4"}}})
    model, _ = build_model(cfg, torch.device("cpu"))
    weights = [m.base_layer.weight for m in model.llm.modules() if hasattr(m, "base_layer")]
    numel = sum(w.numel() for w in weights)
    held = sum(stored_bytes(w) for w in weights)
    assert all(type(w).__name__ == "NF4Tensor" for w in weights) and weights
    assert numel * (0.5 + 1 / 64) <= held <= numel * (0.5 + 1 / 64) * 1.05  # + the scales' own fp32 factors
    assert model.lora["llm"].base_bytes == held


def test_checkpoint_holds_the_adapters_and_names_its_base(runs):
    tmp, base, lora = runs
    ckpt = _step(lora, 2)
    record = json.loads((ckpt / "lora.json").read_text())
    state = load_file(str(ckpt / "model.safetensors"))
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)  # every component has LoRA
    adapter_bytes = sum(v.numel() * v.element_size() for v in state.values())
    assert record["adapter_bytes"] == adapter_bytes and record["adapter_tensors"] == len(state)
    size = (ckpt / "model.safetensors").stat().st_size
    assert adapter_bytes < size <= adapter_bytes + 200 * len(state)  # the safetensors header: names and shapes
    assert record["init_from"] == str(_step(base, 2)) and len(record["digest"]) == 64
    full = (_step(base, 2) / "model.safetensors").stat().st_size
    assert size < full / 10


def test_resume_is_bit_exact(runs, tmp_path):
    """Resumed from the LoRA run's step-1 checkpoint (adapters, optimizer, schedule, data position; the base rebuilt
    from init_from) into an empty folder: its step 2 is the straight run's, bit for bit."""
    tmp, base, lora = runs
    again = train_on_dataset(link_dataset(tmp_path, lora), "again", f"--train.init_from={_step(base, 2)}", *ALL_LORA,
                             f"--train.resume={_step(lora, 1)}")
    a, b = load_file(str(_step(again, 2) / "model.safetensors")), load_file(str(_step(lora, 2) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_another_base_is_refused_in_one_line(runs, tmp_path):
    """Resuming over, and loading with, another base (the base run's step 1): one line naming both digests."""
    import shutil

    from vlaforge.checkpoints.load import load_policy_model

    tmp, base, lora = runs
    moved = tmp_path / "moved"
    shutil.copytree(_step(lora, 2), moved)
    config = (moved / "config.toml").read_text()
    (moved / "config.toml").write_text(config.replace(str(_step(base, 2)), str(_step(base, 1))))
    with pytest.raises(VlaforgeError, match="trained over base [0-9a-f]{16}.* is [0-9a-f]{16}"):
        load_policy_model(moved)
    done = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={tmp / 'ds'}",
                   f"--model.cameras={json.dumps(CAMS)}", "--model.image_size=32", "--data.max_instruction_tokens=8",
                   "--train.steps=3", "--train.progress=false", f"--train.init_from={_step(base, 1)}", *ALL_LORA,
                   f"--train.resume={_step(lora, 2)}", f"--train.output_dir={lora}")
    assert done.returncode == 2 and "trained over base" in done.stderr and "Traceback" not in done.stderr


def test_merged_policy_equals_the_unmerged_model(runs, tmp_path):
    """What eval / serve / quantize / export load (the adapters merged into fp32 linears) predicts what the trained
    LoRA model predicts (fp32, within 1e-5); `vlaforge export --format safetensors` writes those merged weights."""
    from vlaforge.checkpoints.layout import MODEL_FILE
    from vlaforge.checkpoints.load import load_policy_model, rebuild_base
    from vlaforge.checkpoints.lora import load_lora_weights
    from vlaforge.distributed.apply import apply_techniques
    from vlaforge.inference.runtime import PolicyRuntime

    tmp, base, lora = runs
    ckpt = _step(lora, 2)
    cfg = load_config(ckpt / "config.toml")
    unmerged = rebuild_base(cfg)
    apply_techniques(unmerged, cfg, torch.device("cpu"))
    load_lora_weights(ckpt, unmerged, ckpt / MODEL_FILE)
    merged = load_policy_model(ckpt)[0]
    assert not any(".lora_" in n for n in merged.state_dict())
    batch = make_batch(cfg, unmerged)
    with torch.no_grad():
        want, got = unmerged.eval().predict_actions(batch), merged.eval().predict_actions(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    runtime = PolicyRuntime.load(lora, device="cpu")
    assert runtime.model.state_dict().keys() == merged.state_dict().keys()
    out = tmp_path / "merged.safetensors"
    done = run_cli("export", str(lora), f"--out={out}")
    assert done.returncode == 0, done.stderr[-2000:]
    exported = load_file(str(out))
    assert all(torch.equal(exported[k], v) for k, v in merged.state_dict().items() if k in exported)


@pytest.mark.parametrize("override, words", [
    ({"components": {"llm": {"lora": {"rank": 4}, "precision": "fp8"}}}, "fp8"),
    ({"components": {"llm": {"lora": {"rank": 4}, "qat": "int4"}}}, "qat"),
    ({"components": {"llm": {"lora": {"base": "bf16"}}}}, "precision = 'bf16'"),
    ({"components": {"llm": {"lora": {"rank": 4}, "trainable": False}}}, "never train"),
    ({"components": {"llm": {"lora": {"targets": []}}}}, "non-empty list"),
    ({"components": {"llm": {"lora": {}}}, "parallel": {"tp": 2}}, "parallel.tp"),
    ({"components": {"llm": {"lora": {}}}, "parallel": {"pp": 2}}, "parallel.pp"),
    ({"components": {"llm": {"lora": {}}}, "parallel": {"backend": "deepspeed"}}, "deepspeed"),
    ({"components": {"llm": {"lora": {}}}, "train": {"checkpoint_format": "sharded"}}, "sharded"),
    ({"components": {"llm": {"lora": {}}}, "train": {"compile": True}}, "train.compile"),
])
def test_compositions_not_carried_are_refused_in_config(override, words):
    with pytest.raises(VlaforgeError, match="lora"):
        try:
            tiny_config(**override)
        except VlaforgeError as exc:
            assert words in str(exc), str(exc)
            raise


def test_a_target_that_names_no_linear_is_refused():
    from vlaforge.training.trainer import build_model

    cfg = tiny_config(components={"llm": {"lora": {"targets": ["qproj"]}}})
    with pytest.raises(VlaforgeError, match="'qproj' names no linear of the llm .*q_proj"):
        build_model(cfg, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout, lora", [
    ([], ['--components.llm.lora={rank=4,base="nf4"}', '--components.vision.lora={rank=4}']),
    (["--parallel.backend=ddp", "--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
     ['--components.llm.lora={rank=4,base="bf16"}', "--components.llm.precision=bf16",
      '--components.vision.lora={rank=4}'])], ids=["fsdp2-nf4", "ddp-bf16"])
def test_two_ranks_with_lora_equal_one_process(tmp_path, layout, lora):
    """FSDP2 (an NF4 base sharded) and DDP (a bf16 base): the loss and gradient norm of every step and the adapters
    at the end equal one process taking the same global batch as 2 micro-batches."""
    from launch import metrics, train_distributed, train_single, weights

    lora = [*lora, "--train.lora_random_base=true"]  # an equality check: the base needs no pretraining
    single = train_single(tmp_path / "single", *lora, "--train.grad_accum=2")
    train_distributed(tmp_path / "dp", *layout, *lora)
    bf16 = "bf16" in lora[0]
    for got, want in zip(metrics(tmp_path / "dp"), metrics(single)):
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-3 if bf16 else 1e-5)
        assert got["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=1e-2 if bf16 else 1e-5)
    a, b = weights(tmp_path / "dp"), weights(single)
    assert a.keys() == b.keys() and any(".lora_B." in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=0, atol=1e-2 if bf16 else 1e-5, msg=k)


@pytest.mark.parametrize("base, replicate, words", [("int8", 1, "no split"), ("nf4", 2, "does not replicate")])
def test_quantized_bases_data_parallel_cannot_carry_are_refused(base, replicate, words):
    """Measured on 2 gloo ranks: torchao's int8 tensor has no split (FSDP2 fails), NF4's all-gather hooks fail on a
    replicate dimension (DDP, HSDP); both are refused before anything is built."""
    from types import SimpleNamespace

    from vlaforge.distributed.parallel_dims import check_lora_storage

    cfg = tiny_config(components={"llm": {"lora": {"base": base}}})
    with pytest.raises(VlaforgeError, match=words):
        check_lora_storage(cfg, SimpleNamespace(dp_replicate=replicate))
    check_lora_storage(tiny_config(components={"llm": {"lora": {"base": "fp32"}}}),
                       SimpleNamespace(dp_replicate=replicate))


def test_a_lora_checkpoint_without_its_record_is_refused_not_exported_raw(runs, tmp_path):
    """A LoRA checkpoint that lost lora.json holds adapters and no base: export and loading refuse it in one line
    (before: export wrote the raw lora_A / lora_B tensors with exit 0), and --out is not written."""
    import shutil

    from test_safety import one_line

    _, _, lora = runs
    damaged = tmp_path / "step"
    shutil.copytree(_step(lora, 2), damaged)
    (damaged / "lora.json").unlink()
    out = tmp_path / "merged.safetensors"
    one_line(run_cli("export", str(damaged), f"--out={out}"), "holds LoRA adapters", "lora.json")
    assert not out.exists()
    one_line(run_cli("train", str(TINY_RECIPE), f"--train.init_from={damaged}", "--train.steps=1",
                     f"--train.output_dir={tmp_path / 'run'}"), "holds LoRA adapters")


def test_full_modules_train_beside_the_adapters_and_round_trip(tmp_path, tmp_path_factory):
    """`lora.full = ["convs", "norms"]` on a conv-stem tower: the stem's convolutions and every norm train with the
    adapters (their optimizer group, their weights move) while the base linears stay bit for bit; the checkpoint holds
    them beside the adapters and lora.json names them; the loaded run predicts what the trained model does; resuming
    (from its step-1 checkpoint) is bit-exact; serving it as one of several adapters and planning it are refused in
    one line."""
    from vlaforge.inference.runtime import PolicyRuntime

    (tmp_path / "ds").symlink_to(dataset(tmp_path_factory))
    stem = ["--model.vision_stem=conv"]
    base = train_on_dataset(tmp_path, "base", *stem, steps=1)  # only a base to start from
    full = ['--components.vision.lora={rank=4,full=["convs","norms"]}', f"--train.init_from={_step(base, 1)}", *stem]
    run = train_on_dataset(tmp_path, "lora", *full, "--train.checkpoint_every=1")
    ckpt = _step(run, 2)
    record = json.loads((ckpt / "lora.json").read_text())
    state, before = load_file(str(ckpt / "model.safetensors")), load_file(str(_step(base, 1) / "model.safetensors"))
    assert record["full"] and all(k in state for k in record["full"])
    assert any("patch_embedding" in k for k in record["full"]) and any("norm" in k for k in record["full"])
    assert all(not torch.equal(state[k], before[k]) for k in record["full"] if k.endswith("weight"))  # they trained
    vision = {k for k in state if k.startswith("vision.")}
    assert vision == set(record["full"]) | {k for k in vision if ".lora_" in k}  # no frozen base tensor saved
    again = train_on_dataset(tmp_path, "again", *full, f"--train.resume={_step(run, 1)}")
    a = load_file(str(_step(again, 2) / "model.safetensors"))
    assert a.keys() == state.keys() and all(torch.equal(a[k], state[k]) for k in a)

    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.techniques.lora import merge_lora

    rt = PolicyRuntime.load(ckpt, device="cpu")
    model, _, _ = load_policy_model(ckpt, torch.device("cpu"))
    for k in record["full"]:
        assert torch.equal(model.state_dict()[k].float(), state[k].float()), k  # the trained stem, not the base's
    assert merge_lora(rt.model) == 0  # the runtime's model is merged already
    done = run_cli("serve", str(run), "--keep-adapters", f"--adapter=b={run}", "--port=0", timeout=120)
    assert done.returncode == 2 and "lora.full" in done.stderr.strip().splitlines()[-1], done.stderr[-800:]
    with pytest.raises(VlaforgeError, match="lora.full"):
        from vlaforge.planner.lora import adapted

        cfg = load_config(run / "config.toml")
        adapted(model, "vision", cfg.components.vision)
