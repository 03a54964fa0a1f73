"""The family matrix: tiny random-init `save_pretrained` folders of each LLM family (tests/families.py) as
`model.llm.pretrained` (and vision families as `model.vision.pretrained`), each technique against one process. A
cell is exact (losses and step-3 weights equal one process's) or a one-line refusal with exit 2; never an rc-0 run
that differs."""

import pytest
import torch

from conftest import TINY_RECIPE, run_cli
from families import family_folder, tower_folder, vlm_folder
from launch import COMMON, NOISE_ONLY, assert_matches, torchrun, train_distributed, train_single, weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


class _Singles(dict):
    """family -> its one-process reference run, trained on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        self[name] = train_single(self.root / f"single_{name}", *_llm(self.root, name))
        return self[name]


def _llm(root, name):
    return (f"--model.llm.pretrained={family_folder(name, root / 'folders')}",)


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    return _Singles(tmp_path_factory.mktemp("families"))


# TP+SP on every family whose plan or block differs from Llama's (it runs each of the plan's styles, with the
# row-parallel outputs reduce-scattered, and every block norm sharded); plain TP where its own styles differ from
# those: the q/k-norm gradient sum (Qwen3) and the gathered fused projections without SP (Phi3)
TP_CELLS = [("qwen3", False), ("phi3", False)] + [(n, True) for n in
                                                   ("qwen3", "gemma3_text", "phi3", "phi", "olmo2", "gpt_neox")]


@pytest.mark.parametrize("name,sp", TP_CELLS, ids=[f"{n}-{'tp_sp' if sp else 'tp'}" for n, sp in TP_CELLS])
def test_tensor_parallel_on_each_family_matches_one_process(tmp_path, singles, name, sp):
    """The family's own plan (fused projections gathered, q/k norms' gradients summed over the TP ranks, every norm
    of the block sequence-parallel under SP, the final norm found by what it is)."""
    reference = singles[name]
    extra = ["--parallel.sequence_parallel=true"] if sp else []
    done = torchrun("train", str(TINY_RECIPE), *COMMON, *_llm(singles.root, name), "--parallel.tp=2", *extra,
                    f"--train.output_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_matches(tmp_path, reference, rel_norm=1e-4)


# context parallel on the families whose attention differs from Llama's: per-head q/k norms (Qwen3, OLMo2's
# full-width ones), partial rotary and a parallel MLP (Phi), fused query_key_value (GPT-NeoX), scaled embeddings
# (Gemma); ring and Ulysses both run (the ring refuses windows and soft-caps: test_backbones.py)
CP_CELLS = [("qwen3", "ring"), ("olmo2", "ulysses"), ("phi", "ring"), ("gpt_neox", "ulysses"), ("gemma", "ring"),
            # an 8-token sliding window on a longer sequence (Mistral; Gemma3 on every other layer), Gemma2's
            # soft-capped logits with its window: Ulysses (whose ranks hold whole sequences), the ring and the
            # all-gather kernels (per-block window masks counted in the uncompacted layout, tanh's backward) compute
            # both
            ("mistral", "ulysses"), ("gemma3_text", "ulysses"), ("gemma2", "ulysses"),
            ("mistral", "ring"), ("gemma3_text", "ring"), ("gemma2", "allgather")]


@pytest.mark.parametrize("name,method", CP_CELLS, ids=[f"{n}-{m}" for n, m in CP_CELLS])
def test_context_parallel_on_each_family_matches_one_process(tmp_path, singles, name, method):
    """Both ranks hold half of the sequence; losses (the language loss after the logits' gather too) and step-3
    weights are the one process's."""
    reference = singles[name]
    done = torchrun("train", str(TINY_RECIPE), *COMMON, *_llm(singles.root, name), "--parallel.cp=2",
                    f"--parallel.cp_method={method}", "--train.progress=true", f"--train.output_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"context parallel: cp = 2, {method}" in done.stdout
    assert_matches(tmp_path, reference, ("loss/total", "loss/language"), rel_norm=1e-4)


def test_pipeline_parallel_finds_a_final_norm_not_named_norm(tmp_path, singles):
    """Phi's final norm is `final_layernorm`: the last stage applies it, the first does not."""
    reference = train_single(singles.root / "single_phi_accum2", *_llm(singles.root, "phi"), "--train.grad_accum=2")
    done = torchrun("train", str(TINY_RECIPE), *COMMON, *_llm(singles.root, "phi"), "--parallel.pp=2",
                    "--parallel.dp_shard=1", "--train.grad_accum=2", f"--train.output_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_matches(tmp_path, reference, rel_norm=1e-4)



def test_pipeline_parallel_shares_tied_embeddings_between_the_first_and_last_stage(tmp_path, singles):
    """Gemma ties its token embeddings to its LM head: stage 0 looks tokens up in the weight, the last stage
    projects with it; their gradients are summed (and counted once in the norm), so both copies stay the one
    process's weight, and the checkpoint names it once."""
    reference = train_single(tmp_path / "single", *_llm(singles.root, "gemma"), "--train.grad_accum=2")
    done = torchrun("train", str(TINY_RECIPE), *COMMON, *_llm(singles.root, "gemma"), "--parallel.pp=2",
                    "--parallel.dp_shard=1", "--train.grad_accum=2", f"--train.output_dir={tmp_path / 'pp'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_matches(tmp_path / "pp", reference, rel_norm=1e-4)
    # the pipelined checkpoint (the weight under one name, its optimizer state under both) resumes in one process
    more = [a for a in COMMON if not a.startswith("--train.steps")] + ["--train.steps=4", "--train.grad_accum=2",
                                                                       "--train.resume=latest"]
    for run in (tmp_path / "pp", reference):
        resumed = run_cli("train", str(TINY_RECIPE), *more, *_llm(singles.root, "gemma"), f"--train.output_dir={run}")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
    step4 = weights(tmp_path / "pp", 4), weights(reference, 4)
    for k in step4[1]:
        torch.testing.assert_close(step4[0][k], step4[1][k], rtol=0, atol=2e-3 if k.endswith(NOISE_ONLY) else 1e-5,
                                   msg=k)


@pytest.mark.parametrize("name", ["dinov2_with_registers", "siglip2", "fused"])
def test_fsdp_on_a_vision_family_matches_one_process(tmp_path, singles, name):
    """Every block of the tower is its own FSDP2 unit (DINOv2's `encoder.layer`, SigLIP2's patch-sequence input, a
    fused DINOv2 + SigLIP tower's blocks of both); the sharded run's losses and weights are the one process's."""
    folders = singles.root / "folders"
    tower = (f"--model.vision.pretrained={tower_folder(name, folders)}",) if name != "fused" else \
        (f"--model.vision.pretrained={tower_folder('dinov2_with_registers', folders)}",
         f"--model.vision.fused={tower_folder('siglip', folders)}")
    # one process takes the two ranks' global batch as two accumulated micro-batches (tests/test_data_parallel.py)
    reference = train_single(singles.root / f"single_vision_{name}", *tower, "--train.grad_accum=2")
    train_distributed(tmp_path, *tower)
    assert_matches(tmp_path, reference, rel_norm=1e-4)


def _vlm(root, name):
    return (f"--model.vlm.pretrained={vlm_folder(name, root / 'folders')}", "--model.image_size=32")


# a whole Qwen2.5-VL folder (windowed tower blocks, the merger as the projector, an M-RoPE text model): context
# parallel shards the (3, B, N) positions with the sequence; tensor + sequence parallel runs its text config's plan;
# the pipeline's stages give M-RoPE positions too; FSDP2 wraps the tower's `blocks`
VLM_CELLS = {"cp_ring": (["--parallel.cp=2", "--parallel.cp_method=ring"], []),
             "tp_sp": (["--parallel.tp=2", "--parallel.sequence_parallel=true"], []),
             "pp": (["--parallel.pp=2", "--parallel.dp_shard=1", "--train.grad_accum=2"], ["--train.grad_accum=2"]),
             "fsdp": ([], ["--train.grad_accum=2"])}


@pytest.mark.parametrize("cell", list(VLM_CELLS))
def test_a_qwen_vl_folder_under_each_parallelism_matches_one_process(tmp_path, singles, cell):
    args, single = VLM_CELLS[cell]
    vlm = _vlm(singles.root, "qwen2_5_vl")
    key = f"single_qwen2_5_vl{'_accum2' if single else ''}"
    if key not in singles:
        singles[key] = train_single(singles.root / key, *vlm, *single)
    train_distributed(tmp_path, *vlm, *args)
    assert_matches(tmp_path, singles[key], rel_norm=1e-4)
