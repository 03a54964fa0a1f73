"""Distillation (`[distill]`, training/distill.py): the terms against hand computations, gradients that reach the
student only, the teacher-output cache (equal to the online teacher, rebuilt when the teacher changes), student
initialization from the teacher, feature projections kept out of the student's weights, and a distilled run under
gradient accumulation and 2-rank data parallel equal to one process."""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaforge.errors import VlaforgeError
from vlaforge.models import losses as L
from vlaforge.models.build import build_vla
from vlaforge.training.distill import Teacher, TeacherCache, cache_key, init_from_teacher, layer_pairs
from vlaforge.training.trainer import build_loss_weighting

from conftest import TINY_RECIPE, make_batch, run_cli, tiny_config
from launch import COMMON, assert_same_weights, metrics, train_distributed, train_single


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A tiny synthetic teacher, trained 4 steps."""
    return train_single(tmp_path_factory.mktemp("teacher"), "--train.steps=4", "--train.checkpoint_every=0")


def distill_config(tmp_path, teacher, **distill):
    return tiny_config(tmp_path, distill={"teacher": str(teacher), **distill})


def student_with(cfg):
    model = build_vla(cfg.model, cfg.loss)
    teacher = Teacher(cfg.distill, torch.device("cpu"))
    return model, teacher, build_loss_weighting(cfg, model, torch.device("cpu"), teacher)


def test_kl_at_temperature_equals_a_hand_computation():
    s = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]])
    t = torch.tensor([[[2.0, 0.0, 1.0], [1.0, 1.0, 1.0]]])
    mask = torch.tensor([[True, False]])
    T = 3.0

    def softmax(x):
        e = np.exp(np.array(x) / T)
        return e / e.sum()

    p_t, p_s = softmax([2.0, 0.0, 1.0]), softmax([1.0, 2.0, 0.5])
    want = T * T * sum(pt * math.log(pt / ps) for pt, ps in zip(p_t, p_s))  # only the first position is valid
    assert L.distillation_kl(s, t, mask, T).item() == pytest.approx(want, rel=1e-5)  # fp32 against fp64
    assert L.distillation_kl(t, t, mask, T).item() == pytest.approx(0.0, abs=1e-7)


def test_uniform_layer_map_and_its_checks():
    assert layer_pairs("uniform", 2, 8) == [(1, 4), (2, 8)]
    assert layer_pairs("uniform", 3, 3) == [(1, 1), (2, 2), (3, 3)]
    with pytest.raises(VlaforgeError, match="out of range"):
        layer_pairs([[1, 9]], 2, 8)


@pytest.mark.parametrize("term", ["action", "kl", "feature"])
def test_each_term_reaches_only_the_student(tmp_path, teacher_run, term):
    weights = {t: float(t == term) for t in ("action", "kl", "feature")}
    cfg = distill_config(tmp_path, teacher_run, weights=weights)
    model, teacher, distiller = student_with(cfg)
    batch = make_batch(cfg, model)
    terms = model(batch, extra=distiller.extra_terms)
    assert set(k for k in terms if k.startswith("distill_")) == {f"distill_{term}"}
    value = terms[f"distill_{term}"]
    assert value.item() > 0 and value.grad_fn is not None
    assert not any(p.requires_grad for p in teacher.model.parameters())
    value.backward()
    assert all(p.grad is None for p in teacher.model.parameters())
    reached = {name: float(sum(p.grad.abs().sum() for p in getattr(model, name).parameters() if p.grad is not None))
               for name in ("vision", "projector", "llm", "action_head")}
    assert reached["llm"] > 0  # every term flows through the student's LLM
    if term == "action":
        assert reached["action_head"] > 0
    if term == "kl":  # the text logits see the action queries (earlier in the layout), not the head's MLP
        assert model.action_head.in_proj.weight.grad is None
    projections = [p.grad for p in distiller.projections.parameters()]
    assert (term == "feature") == bool(projections and all(g is not None and g.abs().sum() > 0 for g in projections))


def test_flow_matching_student_matches_the_teachers_velocity(tmp_path_factory, tmp_path):
    flow = ["--model.action_head.kind=flow_matching"]
    teacher = train_single(tmp_path_factory.mktemp("flow_teacher"), *flow, "--train.steps=2")
    cfg = tiny_config(tmp_path, model={"action_head": {"kind": "flow_matching"}},
                      distill={"teacher": str(teacher), "weights": {"action": 1.0, "kl": 0.0, "feature": 0.0}})
    model, _, distiller = student_with(cfg)
    batch = make_batch(cfg, model)
    torch.manual_seed(1)
    got = model(batch, extra=distiller.extra_terms)["distill_action"]
    # by hand: the same noisy points (same seed), the teacher's velocity there against the student's
    torch.manual_seed(1)
    h = model.run_llm(batch, model.uses_text(batch))
    head = model.action_head(h["action_hidden"], batch.state, batch.actions)
    t_model = distiller.teacher.model
    with torch.no_grad():
        t_h = t_model.run_llm(batch, False)
        want_v = t_model.action_head.velocity(head.x_t, head.t, t_model.action_head.condition(t_h["action_hidden"],
                                                                                             batch.state))
    want = L.masked_mean((head.prediction - want_v).square(), batch.action_mask)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    with pytest.raises(VlaforgeError, match="flow_target = 'chunk'"):
        tiny_config(tmp_path, model={"action_head": {"kind": "flow_matching"}},
                    distill={"teacher": str(teacher), "cache": str(tmp_path / "c.safetensors")})


def test_cached_targets_equal_the_online_teacher(tmp_path, teacher_run):
    """Synthetic samples have no augmentation, so the cached outputs are the online teacher's (to fp16 rounding)."""
    cfg = distill_config(tmp_path, teacher_run)
    model, teacher, distiller = student_with(cfg)
    batch = make_batch(cfg, model, start=8)
    online = distiller.extra_terms(model, batch, model.run_llm(batch, True, keep_hidden=True), _head(model, batch), {})
    path = tmp_path / "cache.safetensors"
    from vlaforge.data.loader import build_data

    data = build_data(cfg, model)
    key = cache_key(teacher, cfg, len(data.dataset))
    TeacherCache.ensure(path, key, teacher, data.dataset, progress=False)
    distiller.cache = TeacherCache.open(path, key)
    cached = distiller.extra_terms(model, batch, model.run_llm(batch, True, keep_hidden=True), _head(model, batch), {})
    for k in online:
        assert cached[k].item() == pytest.approx(online[k].item(), rel=2e-3, abs=1e-6), k


def _head(model, batch):
    h = model.run_llm(batch, True)
    return model.action_head(h["action_hidden"], batch.state, batch.actions)


def test_cache_is_rebuilt_when_the_teacher_changes(tmp_path, teacher_run, capsys):
    import shutil

    changed = tmp_path / "changed_teacher"
    shutil.copytree(teacher_run / "checkpoints" / _latest(teacher_run), changed)
    cfg = distill_config(tmp_path, teacher_run)
    model, teacher, distiller = student_with(cfg)
    from vlaforge.data.loader import build_data

    dataset = build_data(cfg, model).dataset
    path = tmp_path / "cache.safetensors"
    key = cache_key(teacher, cfg, len(dataset))
    TeacherCache.ensure(path, key, teacher, dataset, progress=False)
    before = load_file(str(path))["actions"]
    assert TeacherCache.stale(path, key) is None
    weights = load_file(str(changed / "model.safetensors"))
    weights["action_head.mlp.3.bias"] += 0.5
    save_file(weights, str(changed / "model.safetensors"))
    other = Teacher(distill_config(tmp_path, changed).distill, torch.device("cpu"))
    new_key = cache_key(other, cfg, len(dataset))
    assert new_key["teacher"] != key["teacher"]
    assert TeacherCache.stale(path, new_key) == "made for another teacher"
    with pytest.raises(VlaforgeError, match="made for another teacher"):
        TeacherCache.open(path, new_key)
    TeacherCache.ensure(path, new_key, other, dataset, progress=False)
    assert "rebuilding it" in capsys.readouterr().out
    after = load_file(str(path))["actions"]
    assert not torch.allclose(before, after)


def _latest(run):
    return (run / "checkpoints" / "latest").read_text().strip()


def test_student_starts_from_every_kth_teacher_block(tmp_path, teacher_run):
    teacher_cfg = tiny_config(tmp_path)
    teacher = build_vla(teacher_cfg.model)
    student_cfg = tiny_config(tmp_path)
    student = build_vla(student_cfg.model)
    student.llm.model.layers = student.llm.model.layers[:1]  # 1 block against the teacher's 2: k = 2
    student.llm.config.num_hidden_layers = 1
    copied = init_from_teacher(student, teacher)
    assert "vision" in copied and "projector" in copied and "llm block 0 <- teacher block 1" in copied
    for a, b in zip(student.llm.model.layers[0].parameters(), teacher.llm.model.layers[1].parameters()):
        assert torch.equal(a, b)
    assert torch.equal(student.llm.model.embed_tokens.weight, teacher.llm.model.embed_tokens.weight)


def test_a_gpt_neox_student_takes_whole_blocks_or_none_from_its_teacher():
    """GPT-NeoX keeps its blocks under `gpt_neox.layers`, not `model.layers`: the blocks are the decoder's, found as
    models/families.py finds them. A student whose blocks differ from the teacher's (a narrower MLP) takes the
    tensors outside the blocks (embeddings, final norm, LM head) and no part of any block."""
    from transformers import GPTNeoXConfig

    from vlaforge.models.llm import llm_blocks

    from families import COMMON as FAMILY

    cfg = tiny_config()

    def vla(ffn):
        torch.manual_seed(ffn)
        llm = GPTNeoXConfig(**{**FAMILY, "intermediate_size": ffn}).to_dict()
        return build_vla(cfg.model, cfg.loss, backbones={"llm": llm})

    teacher, student = vla(96), vla(48)
    before = {k: v.clone() for k, v in llm_blocks(student.llm).state_dict().items()}
    copied = init_from_teacher(student, teacher)
    assert {"llm.gpt_neox.embed_in.weight", "llm.gpt_neox.final_layer_norm.weight", "llm.lm_head.weight"} \
        <= set(copied)
    assert not [c for c in copied if ".layers." in c or c.startswith("llm block")], copied
    for k, v in llm_blocks(student.llm).state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(student.llm.gpt_neox.embed_in.weight, teacher.llm.gpt_neox.embed_in.weight)


@pytest.mark.slow
def test_projections_stay_out_of_the_student_and_resume_is_exact(tmp_path, teacher_run):
    """`vlaforge distill`: the student's model.safetensors (and its export) hold the same tensors as a plain run's;
    the projections are in the trainer state, and resuming a distilled run continues bit for bit."""
    common = [*COMMON, "--train.checkpoint_every=2", "--train.keep_checkpoints=5"]
    plain = train_single(tmp_path / "plain", "--train.steps=2")
    whole = tmp_path / "whole"
    done = run_cli("distill", str(teacher_run), "--student", str(TINY_RECIPE), *common, f"--train.output_dir={whole}",
                   fresh=True)  # the entry point itself, once per verb
    assert done.returncode == 0, done.stderr
    student = load_file(str(whole / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert student.keys() == load_file(str(plain / "checkpoints" / "step_00000002" / "model.safetensors")).keys()
    state = torch.load(whole / "checkpoints" / "step_00000003" / "trainer_state.pt", weights_only=True)
    assert any(k.startswith("projections.") for k in state["weighting"])
    assert {"loss/distill_action", "loss/distill_kl", "loss/distill_feature"} <= metrics(whole)[-1].keys()
    exported = tmp_path / "student.safetensors"
    assert run_cli("export", str(whole), "--out", str(exported), fresh=True).returncode == 0
    assert load_file(str(exported)).keys() == student.keys()
    part = tmp_path / "part"
    assert run_cli("distill", str(teacher_run), "--student", str(TINY_RECIPE), *common, "--train.steps=2",
                   f"--train.output_dir={part}").returncode == 0
    assert run_cli("train", "--resume", str(part), "--train.steps=3").returncode == 0
    assert_same_weights(part, whole)


@pytest.mark.distributed
@pytest.mark.slow
def test_grad_accumulation_and_two_ranks_equal_one_process(tmp_path, teacher_run):
    """Distilled: one process accumulating 2 micro-batches of 4, two gloo ranks of 4, and (contrastive off: its
    negatives are per micro-batch) one process with a batch of 8 all reach the same weights."""
    teach = f"--distill.teacher={teacher_run}"
    off = "--loss.weights={contrastive=0.0,language=0.4,action=0.3}"
    accumulated = train_single(tmp_path / "accum", teach, "--train.grad_accum=2")
    train_distributed(tmp_path / "dp", teach)
    assert_same_weights(tmp_path / "dp", accumulated)
    for got, want in zip(metrics(tmp_path / "dp"), metrics(accumulated)):
        if "loss/distill_feature" in want:
            assert got["loss/distill_feature"] == pytest.approx(want["loss/distill_feature"], rel=1e-5)
    large = train_single(tmp_path / "large", teach, off, "--train.batch_size=8")
    accumulated_off = train_single(tmp_path / "accum_off", teach, off, "--train.grad_accum=2")
    assert_same_weights(large, accumulated_off)


def test_bad_distillation_inputs_are_one_line(tmp_path, teacher_run):
    cases = [
        (["--distill.teacher=" + str(tmp_path / "missing")], "distill.teacher"),
        ([f"--distill.teacher={teacher_run}", "--distill.layers=[[1, 9]]"], "out of range"),
        ([f"--distill.teacher={teacher_run}", "--model.image_size=32"], "teacher"),
        ([f"--distill.teacher={teacher_run}", "--parallel.pp=2"], "data parallel only"),
    ]
    for args, words in cases:
        done = run_cli("train", str(TINY_RECIPE), *COMMON, *args, f"--train.output_dir={tmp_path / 'x'}")
        assert done.returncode == 2, (args, done.stderr[-500:])
        assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_quantized_teacher_distils(tmp_path, teacher_run):
    """A `vlaforge quantize`-style folder (int8 LLM) is a teacher like any checkpoint: it loads with its quantized
    layout and gives targets close to the float teacher's."""
    import shutil

    from vlaforge.checkpoints.layout import CONFIG_FILE
    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.techniques.quantize import apply_quantization
    from vlaforge.techniques.quantized_format import save_quantized

    model, _, ckpt = load_policy_model(teacher_run)
    apply_quantization(model, {"llm": "int8"})
    folder = tmp_path / "quantized"
    folder.mkdir()
    shutil.copy(ckpt / CONFIG_FILE, folder)
    save_quantized(model, folder)
    float_cfg, quant_cfg = distill_config(tmp_path, teacher_run), distill_config(tmp_path, folder)
    student, float_teacher, _ = student_with(float_cfg)
    quant_teacher = Teacher(quant_cfg.distill, torch.device("cpu"))
    assert quant_teacher.model.quantization.mode("llm") == "int8"
    batch = make_batch(float_cfg, student)
    want, got = (t.outputs(batch, actions=True, condition=False, logits=True, layers=[1, 2])
                 for t in (float_teacher, quant_teacher))
    assert not torch.equal(want.actions, got.actions)  # quantized
    torch.testing.assert_close(got.actions, want.actions, rtol=0.1, atol=0.05)
