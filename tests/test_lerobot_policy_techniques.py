"""vlaforge's techniques on LeRobot's pretrained policies (issue 60), each exact against the plain policy in fp32,
within its precision, or refused in one line (test_lerobot_policies.py holds the refusals), on folders LeRobot's own
`save_pretrained` wrote: activation checkpointing with the joint layer as the unit (LeRobot 0.6.1 has no
checkpointing for SmolVLA, PR 4150), bf16 / fp16, LoRA and QLoRA, exact accumulation, staged unfreezing and resume,
FSDP2 with the joint layer as the unit, DDP, DeepSpeed ZeRO-3 with CPU offload, pi0.5's state prompt, the planner
and the 24 GB pi0.5 recipe."""

from __future__ import annotations

import json
from pathlib import Path

import lerobot061 as ref061
import pytest
import torch

from conftest import run_cli

KINDS = ("smolvla", "pi0", "pi05")
# two steps of SmolVLA with its VLM trained: the plain run the checkpointed and the ZeRO-3 runs must end on (one
# `trained_run` of the session)
TWO_STEPS = ("--train.batch_size=2", "--components.llm.trainable=true", "--train.steps=2", "--train.checkpoint_every=2")


@pytest.fixture
def session_root(tmp_path_factory) -> Path:
    """The folder the session's workers share (the LeRobot-made folders are built once, under a lock): a function
    fixture, so these tests spread over the workers instead of forming one group."""
    return ref061.session_root(tmp_path_factory)


def _run(args: list[str], out: Path, *extra: str) -> Path:
    """`vlaforge train ARGS EXTRA` into `out` in its own process; asserts it exits 0."""
    done = run_cli(*args, *extra, f"--train.output_dir={out}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _step(kind: str, root: Path, strategies: dict[str, str], precisions: dict[str, str] | None = None,
          master: str = "fp32", seen: list | None = None, compiled: bool = False) -> tuple[float, dict, int]:
    """(loss, gradients, bytes kept for backward) of one training forward at LeRobot's reference inputs (fixed noise
    and time), with each component's checkpointing strategy and precision applied by the trainer's own
    `apply_precision` and `apply_checkpointing` (`compiled`: then `train.compile`'s per-block compile). `seen`: gets
    the dtypes of the first joint layer's query outputs."""
    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.config.components import ComponentConfig
    from vlaforge.techniques import accounting
    from vlaforge.techniques.checkpointing import apply_checkpointing
    from vlaforge.techniques.precision import apply_precision

    out = ref061.policy_folder(kind, root)
    inputs, tasks = ref061.sample_inputs()
    theirs, _ = ref061.reference(kind, root, inputs, tasks)
    model, _, _ = load_policy_model(out / "policy", lerobot=ref061.folder_options(out))
    policies = {c: ComponentConfig(checkpointing=strategies.get(c, "none"),
                                   precision=(precisions or {}).get(c, "fp32"))
                for c in ("vision", "projector", "llm", "action_head")}
    apply_precision(model, policies, torch.device("cpu"), master)
    apply_checkpointing(model, policies)
    if compiled:
        from vlaforge.techniques.compile import compile_blocks

        compile_blocks(model)
    if seen is not None:
        for block in (model.joint_layers[0].vlm, model.joint_layers[0].expert):
            block.self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    model.train()
    x = model.prepare({k[4:]: v for k, v in theirs.items() if k.startswith("pre.")})
    with accounting.count_saved(model) as acc:
        loss = model.loss(x, inputs["noise"], inputs["time"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    saved = sum(acc.total(place) for place in (accounting.DEVICE,))
    return loss.item(), grads, saved


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointed_joint_layers_give_the_plain_gradients_and_keep_less(kind, session_root):
    """`components.llm.checkpointing = 'full'` recomputes each joint layer (both streams) in backward, and the
    tower's blocks with `components.vision.checkpointing`: the loss and every gradient equal the plain policy's
    (fp32; recomputation is the same arithmetic), and what the forward keeps for backward shrinks."""
    plain_loss, plain, plain_saved = _step(kind, session_root, {})
    for strategies in ({"llm": "full"}, {"llm": "every_nth", "vision": "full", "projector": "full"}):
        loss, grads, saved = _step(kind, session_root, strategies)
        assert loss == plain_loss, strategies
        assert grads.keys() == plain.keys() and len(grads) > 20
        worst = max(float((grads[n] - plain[n]).abs().max()) for n in plain)
        assert worst <= 1e-6, (strategies, worst)
        assert saved < plain_saved, (strategies, saved, plain_saved)
    _, _, full_saved = _step(kind, session_root, {"llm": "full", "vision": "full"})
    assert full_saved < 0.6 * plain_saved, (full_saved, plain_saved)


def test_compiled_joint_layers_give_the_plain_gradients(session_root):
    """`train.compile` (lerobot-train's --policy.compile_model) compiles each joint layer and tower block: pi0's loss
    and gradients equal the eager policy's, with the same parameters left without a gradient (the last VLM block's
    output projection and MLP, whose output nothing reads, are not run)."""
    plain_loss, plain, _ = _step("pi0", session_root, {})
    loss, grads, _ = _step("pi0", session_root, {}, compiled=True)
    torch._dynamo.reset()  # (this process's later compiles start from a clean cache)
    assert abs(loss - plain_loss) <= 1e-6 and grads.keys() == plain.keys()
    assert max(float((grads[n] - plain[n]).abs().max()) for n in plain) <= 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_policies_follow_the_fp32_gradients(kind, session_root):
    """`components.<c>.precision` on a policy: autocast regions around each component's computation (the joint layers
    for the LLM and the expert, which compute in one precision). LeRobot's keep-in-fp32 preset (tower and connector
    in fp32, the rest in bf16), everything in bf16 or fp16 over fp32 masters, and bf16 masters: the VLM's and the
    expert's projections run in half precision, the loss and gradients stay within half precision of fp32's."""
    plain_loss, plain, _ = _step(kind, session_root, {})
    half = {"llm": "bf16", "action_head": "bf16"}
    cases = {"lerobot preset": (half, "fp32", torch.bfloat16),
             "bf16": ({**half, "vision": "bf16", "projector": "bf16"}, "fp32", torch.bfloat16),
             "fp16": ({c: "fp16" for c in ("vision", "projector", "llm", "action_head")}, "fp32", torch.float16),
             "bf16 masters": (half, "bf16", torch.bfloat16)}
    for name, (precisions, master, dtype) in cases.items():
        seen: list = []
        loss, grads, _ = _step(kind, session_root, {"llm": "full"}, precisions, master, seen)
        assert seen and set(seen) == {dtype}, (name, seen)
        assert abs(loss - plain_loss) <= 1e-2 * abs(plain_loss), (name, loss, plain_loss)
        assert grads.keys() == plain.keys()
        num = sum(float((grads[n].float() - plain[n]).square().sum()) for n in plain)
        den = sum(float(plain[n].square().sum()) for n in plain)
        assert (num / den) ** 0.5 <= 2e-2, (name, (num / den) ** 0.5)  # measured: bf16 <= 0.0086, fp16 <= 0.0013


@pytest.mark.parametrize("kind", KINDS)
def test_lora_with_lerobots_targets_starts_at_the_policy_and_merges_exactly(kind, session_root):
    """`components.action_head.lora.targets = 'lerobot'`: adapters on LeRobot's default targets (the expert's q / v
    projections and the state, action and time projections the family has), the VLM frozen. At init the loss is
    the policy's exactly (B = 0) and only adapters get gradients; with trained adapters, `merge_lora` folds them into
    plain linears under the policy's own names, the loss unchanged. QLoRA (an NF4 base on every expert linear) stays
    within 4-bit of the policy."""
    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.config.components import ComponentConfig
    from vlaforge.config.lora import LoraConfig
    from vlaforge.techniques.lora import apply_lora, is_adapter, merge_lora

    out = ref061.policy_folder(kind, session_root)
    inputs, tasks = ref061.sample_inputs()
    theirs, _ = ref061.reference(kind, session_root, inputs, tasks)
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}

    def loss_of(model) -> torch.Tensor:
        return model.loss(model.prepare(batch), inputs["noise"], inputs["time"])

    plain, _, _ = load_policy_model(out / "policy", lerobot=ref061.folder_options(out))
    for c in ("vision", "projector", "llm"):  # as frozen as below: the same forward (its context without autograd)
        getattr(plain, c).requires_grad_(False)
    plain_loss, names = loss_of(plain).item(), set(plain.state_dict())
    for base, targets in (("auto", "lerobot"), ("nf4", "all-linear")):
        model, _, _ = load_policy_model(out / "policy", lerobot=ref061.folder_options(out))
        policies = {c: ComponentConfig() for c in ("vision", "projector", "llm")}
        policies["action_head"] = ComponentConfig(lora=LoraConfig(rank=4, targets=targets, base=base))
        for c in ("vision", "projector", "llm"):
            getattr(model, c).requires_grad_(False)
        report = apply_lora(model, policies)["action_head"]
        loss = loss_of(model)
        if base == "nf4":
            assert abs(loss.item() - plain_loss) <= 0.05 * abs(plain_loss), (loss.item(), plain_loss)
            loss.backward()
            continue
        expected = {"action_in_proj", "action_out_proj", "q_proj", "v_proj"}
        assert {n.rsplit(".", 1)[-1] for n in report.layers} >= expected
        assert not any(n.endswith(("k_proj", "o_proj")) or ".mlp." in n for n in report.layers), report.layers
        assert loss.item() == plain_loss
        loss.backward()
        trained = {n for n, p in model.named_parameters() if p.grad is not None}
        assert trained and all(is_adapter(n) for n in trained), sorted(trained)[:4]
        assert len(trained) == 2 * len(report.layers)
        with torch.no_grad():  # adapters as after training
            for n, p in model.named_parameters():
                if is_adapter(n) and ".lora_B." in n:
                    p.copy_(torch.randn_like(p) * 0.05)
            adapted = loss_of(model).item()
        assert adapted != plain_loss
        merge_lora(model)
        assert set(model.state_dict()) == names
        with torch.no_grad():
            assert abs(loss_of(model).item() - adapted) <= 1e-5 * max(1.0, abs(adapted))


def test_a_lora_bf16_fine_tune_writes_back_a_merged_lerobot_folder(session_root, tmp_path):
    """Through the trainer and `vlaforge export --format lerobot`: SmolVLA with LeRobot's LoRA targets, its joint
    layers in bf16 over fp32 masters and checkpointed, trains two steps; the LeRobot folder written back holds the
    source folder's tensors, unchanged except the adapted weights, each W0 + (alpha / rank) B A of the run's
    adapters."""
    from safetensors.torch import load_file

    args = ref061.train_args("smolvla", session_root, tmp_path / "ds")
    run = _run(args, tmp_path / "run", "--train.batch_size=2", "--train.steps=2",
               "--components.action_head.lora.targets=lerobot", "--components.action_head.lora.rank=4",
               "--components.llm.precision=bf16", "--components.action_head.precision=bf16",
               "--components.llm.checkpointing=full")
    done = run_cli("export", str(run), "--format=lerobot", f"--out={tmp_path / 'back'}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = ref061.policy_folder("smolvla", session_root)
    source = load_file(str(out / "policy" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    ckpt = ref061.trained(run, 2)
    assert back.keys() == source.keys() - {k for k in source if "lm_expert.lm_head" in k}
    changed = sorted(k for k in back if not torch.equal(back[k], source[k]))
    assert len(changed) == sum(k.endswith("lora_A.default.weight") for k in ckpt), changed  # the adapted, only
    a, b = (ckpt[f"action_head.action_in_proj.lora_{x}.default.weight"] for x in "AB")
    merged = source["model.action_in_proj.weight"] + (16.0 / 4) * (b @ a)
    assert torch.allclose(back["model.action_in_proj.weight"], merged, atol=1e-6)
    assert all(k.endswith(("q_proj.weight", "v_proj.weight", "proj.weight", "mlp_in.weight", "mlp_out.weight"))
               for k in changed), changed


def test_pi05_fine_tunes_with_its_state_prompt_in_training_and_serving(session_root):
    """pi0.5 prompts with the discretized state ("Task: ..., State: 12 200 ...;\nAction: "): vlaforge's data pipeline
    writes each sample's prompt from its normalized state, token for token what the folder's own prompt and tokenizer
    steps make of that state; the run trains, and its runtime prompts each call with that call's state as well."""
    import numpy as np

    from vlaforge.config.loading import load_config
    from vlaforge.config.shapes import resolve_shapes
    from vlaforge.data.loader import build_data
    from vlaforge.inference.runtime import Observation, PolicyRuntime
    from vlaforge.models.build import build_vla
    from vlaforge.models.policies.processors import LANG_MASK, LANG_TOKENS

    run = ref061.trained_run("pi05", ref061.ONE_STEP, session_root)  # (test_lerobot_policy_export.py's too)
    out = ref061.policy_folder("pi05", session_root)
    lerobot = {"pretrained": str(out / "policy"), **ref061.folder_options(out)}
    cfg, _ = resolve_shapes(load_config("recipes/pi05.toml", {"model": {"lerobot": lerobot},
                                                              "data": {"path": str(run.parent / "ds")}}))
    model = build_vla(cfg.model, cfg.loss)
    data = build_data(cfg, model)
    steps = dict(model.pipelines[0].steps)

    def theirs(task: str, state) -> tuple[list[int], list[int]]:
        b = {"observation.state": state[None], "task": [task]}
        b = steps["tokenizer_processor"](steps["pi05_prepare_state_tokenizer_processor_step"](b))
        return b[LANG_TOKENS][0][b[LANG_MASK][0]].tolist(), b[LANG_MASK][0].tolist()

    reader = data.dataset.reader
    prompts = set()
    for index in (0, 7, len(data.dataset) - 1):
        sample = data.dataset[index]
        task = reader.tasks[int(data.dataset.task_of_row[index])]
        ids, mask = theirs(task, sample.state)
        assert sample.instruction_ids[sample.instruction_mask].tolist() == ids
        assert sample.instruction_mask.tolist() == mask
        prompts.add(tuple(ids))
    assert len(prompts) == 3  # the state's bins differ from frame to frame

    runtime = PolicyRuntime.load(run, device="cpu")
    spec = runtime.spec
    images = {c: np.zeros((32, 32, 3), np.uint8) for c in runtime.cameras}
    for raw in (np.asarray(spec.state_mean, np.float32), np.asarray(spec.state_mean, np.float32) + 0.5):
        runtime.predict(Observation(images, raw, "press the button"))
        normed = spec.normalize_state(raw)  # the policy's own QUANTILES (test_lerobot_train.py: LeRobot's numbers)
        assert spec.norm_map == {"STATE": "QUANTILES", "ACTION": "QUANTILES"}
        ids, _ = theirs("press the button", normed)
        tokens, mask, _ = runtime.session("default").tokens
        assert tokens[mask].tolist() == ids


def test_two_lora_fine_tunes_of_a_policy_serve_side_by_side(session_root, tmp_path):
    """Two LoRA fine-tunes of one SmolVLA (LeRobot's targets, other seeds) served by one runtime over the one base
    (`adapters=`): each observation's actions are its own run's, as that run's own runtime gives them."""
    import numpy as np

    from vlaforge.inference.runtime import Observation, PolicyRuntime

    args = ref061.train_args("smolvla", session_root, tmp_path / "ds")
    for name, seed in (("a", 0), ("b", 3)):
        _run(args, tmp_path / name, "--train.batch_size=2", "--train.steps=2",
             "--components.action_head.lora.targets=lerobot", "--components.action_head.lora.rank=4",
             f"--train.seed={seed}")
    both = PolicyRuntime.load(tmp_path / "a", device="cpu", adapters={"b": tmp_path / "b"})  # "a": its own
    images = {c: np.zeros((32, 32, 3), np.uint8) for c in both.cameras}
    state = np.zeros(len(both.spec.state_mean), np.float32)
    served = {}
    for name in "ab":
        torch.manual_seed(0)
        served[name] = both.predict(Observation(images, state, "press the button", adapter=name)).actions
        alone = PolicyRuntime.load(tmp_path / name, device="cpu")
        torch.manual_seed(0)
        own = alone.predict(Observation(images, state, "press the button")).actions
        assert np.abs(own - served[name]).max() <= 1e-5, name  # measured 1.8e-7
    assert np.abs(served["a"] - served["b"]).max() > 1e-3  # two adapters, two policies


def test_a_checkpointed_policy_trains_to_the_same_weights(session_root, tmp_path):
    """Through the trainer: two steps of SmolVLA with its joint layers and tower checkpointed end on the same weights
    as without (fp32, the same seed: the same noise, times and batches)."""
    args = ref061.train_args("smolvla", session_root, tmp_path / "ds") + list(TWO_STEPS)
    checkpointed = _run(args, tmp_path / "checkpointed", "--components.llm.checkpointing=full",
                        "--components.vision.checkpointing=full")
    weights = {"plain": ref061.trained(ref061.trained_run("smolvla", TWO_STEPS, session_root), 2),
               "checkpointed": ref061.trained(checkpointed, 2)}
    assert weights["plain"].keys() == weights["checkpointed"].keys()
    worst = ref061.max_diff(weights["plain"], weights["checkpointed"])
    assert worst <= 1e-6, worst


def test_staged_unfreezing_and_resume_on_a_policy(session_root, tmp_path):
    """SmolVLA with its VLM frozen until step 1 and then only its last block trained (`unfreeze_at_step`,
    `unfreeze_last_blocks`, its own learning rate): what changes in the VLM is that block alone (its keys and values,
    which the expert reads; its prefix output feeds nothing); two steps and a resume for the third end on the weights
    of three straight steps, bit for bit (the step's noise seed is drawn from the restored generator)."""
    from safetensors.torch import load_file

    args = ref061.train_args("smolvla", session_root, tmp_path / "ds") + [
        "--train.batch_size=2", "--components.llm.unfreeze_at_step=1", "--components.llm.unfreeze_last_blocks=1",
        "--components.llm.lr=1e-3", "--train.lr_schedule=constant"]
    for name, extra in (("straight", ["--train.steps=3"]), ("resumed", ["--train.steps=2"]),
                        ("resumed", ["--train.steps=3", "--train.resume=latest"])):
        _run(args, tmp_path / name, *extra)
    straight, resumed = (ref061.trained(tmp_path / n, 3) for n in ("straight", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    out = ref061.policy_folder("smolvla", session_root)
    source = load_file(str(out / "policy" / "model.safetensors"))
    last = int(json.loads((out / "policy" / "config.json").read_text())["num_vlm_layers"]) - 1
    text = {k: "model.vlm_with_expert.vlm.model.text_model." + k.removeprefix("llm.model.") for k in straight
            if k.startswith("llm.model.")}  # the text model's tensors under LeRobot's names
    changed = {k for k, theirs in text.items() if not torch.equal(straight[k], source[theirs])}
    assert changed and all(k.startswith(f"llm.model.layers.{last}.") for k in changed), sorted(changed)


@pytest.mark.parametrize("kind", ("smolvla", "pi0"))
def test_accumulated_micro_batches_give_the_large_batch_step(kind, session_root, tmp_path):
    """One step of 4 samples equals one of 2 x 2 accumulated (and with the joint layers checkpointed):
    each sample's noise and flow time come from the step's seed and its dataset row, so a sample draws the same in
    any micro-batch."""
    from safetensors.torch import load_file

    args = ref061.train_args(kind, session_root, tmp_path / "ds") + ["--train.steps=2", "--train.checkpoint_every=2"]
    weights = {}
    for name, extra in (("large", ["--train.batch_size=4", "--train.grad_accum=1"]),
                        ("accumulated", ["--train.batch_size=2", "--train.grad_accum=2"]),
                        ("checkpointed", ["--train.batch_size=2", "--train.grad_accum=2",
                                          "--components.llm.checkpointing=full"])):
        weights[name] = ref061.trained(_run(args, tmp_path / name, *extra), 2)
    start = load_file(str(ref061.policy_folder(kind, session_root) / "policy" / "model.safetensors"))
    assert not torch.equal(weights["large"]["action_head.action_in_proj.weight"],
                           start["model.action_in_proj.weight"])  # it trained
    for name in ("accumulated", "checkpointed"):
        worst = ref061.max_diff(weights["large"], weights[name])
        assert worst <= 2e-6, (name, worst)


@pytest.mark.distributed
def test_a_policy_over_two_ranks_steps_as_one_process(session_root, tmp_path):
    """SmolVLA over two gloo ranks of 2 samples, FSDP2 (each joint layer one unit: parameters, gradients and optimizer
    states sharded) and DDP, end two steps on the weights of one process of 4 samples: each rank draws its samples'
    noise and times from the same step seed (every rank's generator starts from `train.seed`)."""
    from launch import torchrun

    args = ref061.train_args("smolvla", session_root, tmp_path / "ds") + [
        "--components.llm.trainable=true", "--train.steps=2", "--train.checkpoint_every=2"]
    one = ref061.trained(_run(args, tmp_path / "one", "--train.batch_size=4"), 2)
    ddp = ["--parallel.backend=ddp", "--parallel.dp_replicate=2", "--parallel.dp_shard=1"]
    for name, extra in (("fsdp2", []), ("ddp", ddp)):
        done = torchrun(*args, "--train.batch_size=2", *extra, f"--train.output_dir={tmp_path / name}")
        assert done.returncode == 0, done.stderr[-3000:]
        two = ref061.trained(tmp_path / name, 2)
        assert two.keys() == one.keys()
        diffs = sorted(((float((two[k] - one[k]).abs().max()), k) for k in one), reverse=True)
        assert diffs[0][0] <= 2e-6, (name, diffs[:6])


@pytest.mark.slow
@pytest.mark.over_budget("the first DeepSpeed run on a machine JIT-compiles its CPU ops")
def test_deepspeed_zero3_with_cpu_offload_steps_a_policy_as_one_process(session_root, tmp_path):
    """SmolVLA through DeepSpeed ZeRO-3 with its optimizer state and step on the CPU (`parallel.offload_optimizer =
    'cpu'`; what fits pi0.5 on one 24 GB GPU, docs/whitepaper.md) and its joint layers checkpointed: ZeRO-3 gathers
    each sub-layer's parameters around its own forward, which the joint layers call; two steps end on the weights of
    the plain one-process run."""
    pytest.importorskip("deepspeed")
    args = ref061.train_args("smolvla", session_root, tmp_path / "ds") + list(TWO_STEPS)
    weights = {"plain": ref061.trained(ref061.trained_run("smolvla", TWO_STEPS, session_root), 2),
               "zero3": ref061.trained(_run(args, tmp_path / "zero3", "--parallel.backend=deepspeed",
                                            "--parallel.zero_stage=3", "--parallel.offload_optimizer=cpu",
                                            "--components.llm.checkpointing=full"), 2)}
    plain = weights["plain"]
    assert weights["zero3"].keys() == plain.keys()
    worst = ref061.max_diff(plain, weights["zero3"])
    assert worst <= 1e-5, worst  # measured 1.8e-6: ZeRO's reductions sum in another order


def _joint_unit_worker(folder, options, batch, inputs, rank, world, port, out):
    """One rank of `test_a_joint_layer_is_one_fsdp2_unit`: the policy's loss and its first joint layer's gradients
    without and with FSDP2 (the joint layers checkpointed), and where the first VLM block's weight is sharded."""
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.config.components import ComponentConfig
    from vlaforge.distributed.parallel_dims import ParallelDims
    from vlaforge.distributed.parallelize import apply_data_parallel
    from vlaforge.techniques.checkpointing import apply_checkpointing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    policies = {c: ComponentConfig(checkpointing="full" if c == "llm" else "none")
                for c in ("vision", "projector", "llm", "action_head")}
    found = {}
    for name in ("one", "fsdp2"):
        model, _, _ = load_policy_model(folder, lerobot=options)
        layer = model.joint_layers[0]
        if name == "fsdp2":
            apply_checkpointing(model, policies)
            dims = ParallelDims(1, world, 1, 1, 1, world)
            apply_data_parallel(model, dims, dims.build_mesh("cpu"), policies)
            q = layer.vlm.self_attn.q_proj
            seen = []
            q.register_forward_hook(lambda m, a, o, seen=seen: seen.append(isinstance(m.weight, DTensor)))
        # NOTE: through the model's own call, as the trainer's step (FSDP2's root gathers around it)
        model.forward = lambda m=model: m.loss(m.prepare(batch), inputs["noise"], inputs["time"])
        loss = model()
        loss.backward()
        grads = {}
        for part, block in (("vlm", layer.vlm), ("expert", layer.expert)):
            for n, p in block.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[f"{part}.{n}"] = g.clone()
        found[name] = (loss.item(), grads)
    weight = layer.vlm.self_attn.q_proj.weight
    out[rank] = (found, isinstance(weight, DTensor) and weight.to_local().shape[0] * world == weight.shape[0],
                 seen, type(layer.vlm).__name__)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ("smolvla", "pi05"))
def test_a_joint_layer_is_one_fsdp2_unit(kind, session_root):
    """FSDP2 over two gloo ranks shards each joint layer's VLM block and expert block as one unit, gathered around
    the joint layer's forward (and its recomputation) and sharded again after: the loss and the gradients equal one
    process's, and the policy's weights stay sharded between layers (what LeRobot's FSDP, with no wrap units for
    these policies, does not do: lerobot's pi0 used 79.6 GB a GPU on 2 GPUs against 16.5 GB on one)."""
    import functools

    from launch import spawn_ranks

    out = ref061.policy_folder(kind, session_root)
    inputs, tasks = ref061.sample_inputs()
    theirs, _ = ref061.reference(kind, session_root, inputs, tasks)
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}
    worker = functools.partial(_joint_unit_worker, out / "policy", ref061.folder_options(out), batch, inputs)
    for rank, (found, sharded, seen, cls) in spawn_ranks(worker, 2).items():
        (one_loss, one), (loss, grads) = found["one"], found["fsdp2"]
        assert abs(loss - one_loss) <= 1e-6 * abs(one_loss), (rank, loss, one_loss)
        assert grads.keys() == one.keys() and any(k.startswith("expert.") for k in one)
        worst = max(float((grads[k] - one[k]).abs().max()) for k in one)
        assert worst <= 1e-6, (rank, worst)
        assert sharded and cls.startswith("FSDP"), (rank, sharded, cls)
        assert seen and not any(seen), seen  # q_proj ran on the gathered weight (forward and recomputation)
