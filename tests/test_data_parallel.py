"""Data parallel under a real `torchrun`: `vlaforge train` on 2 gloo ranks matches one process that takes the same
global batch as 2 accumulated micro-batches (FSDP2 and DDP) and, with the contrastive term off, one process with a
twice larger batch; HSDP 2x2 on 4 ranks; a distributed run resumes bit for bit."""

import pytest
import torch

from launch import OFF, assert_same_weights, metrics, train_distributed, train_single, weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_single(tmp_path_factory.mktemp("single"), "--train.grad_accum=2")


@pytest.fixture(scope="module")
def single_batch4(tmp_path_factory):
    return train_single(tmp_path_factory.mktemp("single_batch4"))


@pytest.mark.parametrize("layout", [[], ["--parallel.backend=ddp", "--parallel.dp_replicate=2",
                                         "--parallel.dp_shard=1"]], ids=["fsdp2", "ddp"])
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path, single, layout):
    done = train_distributed(tmp_path, *layout, fresh=not layout)  # fsdp2: under the real torchrun
    assert done.stdout.count("done: 3 steps") == 1  # rank 0 reports
    assert_same_weights(tmp_path, single)
    for got, want in zip(metrics(tmp_path), metrics(single)):
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-5)
        assert got["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=1e-5)  # norms over shards
        assert got["numerics/llm/zero_frac"] == pytest.approx(want["numerics/llm/zero_frac"])  # counts too


def test_two_ranks_equal_one_process_with_a_twice_larger_batch(tmp_path):
    """Masked means are normalized over all ranks: 2 ranks x 4 samples give one batch of 8 (contrastive off: its
    negatives are per rank)."""
    large = train_single(tmp_path / "large", OFF, "--train.batch_size=8")
    train_distributed(tmp_path / "dp", OFF)
    assert_same_weights(tmp_path / "dp", large)


@pytest.mark.parametrize("weighting", ["dwa", "uncertainty"])
def test_dynamic_loss_weights_under_data_parallel(tmp_path, weighting):
    """DWA sums every rank's losses; learned weights average their gradients over ranks: 2 ranks match one process
    with grad_accum 2."""
    kind = f"--loss.weighting={weighting}"
    reference = train_single(tmp_path / "single", kind, "--train.grad_accum=2")
    train_distributed(tmp_path / "dp", kind)
    assert_same_weights(tmp_path / "dp", reference)
    assert metrics(tmp_path / "dp")[-1]["weight/action"] == pytest.approx(metrics(reference)[-1]["weight/action"],
                                                                          rel=1e-5)


def test_tensor_parallel_llm_on_two_ranks(tmp_path, single_batch4):
    """tp = 2: both ranks see the same batch; the LLM's blocks are split Megatron-style."""
    train_distributed(tmp_path, "--parallel.tp=2")
    assert_same_weights(tmp_path, single_batch4)
    for got, want in zip(metrics(tmp_path), metrics(single_batch4)):
        assert got["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=1e-5)  # TP shards summed once
        assert got["numerics/llm/zero_frac"] == pytest.approx(want["numerics/llm/zero_frac"])


def test_fsdp2_times_tensor_parallel_2x2_on_four_ranks(tmp_path, single):
    train_distributed(tmp_path, "--parallel.tp=2", nproc=4)
    assert_same_weights(tmp_path, single)


def test_reducing_every_micro_step_keeps_the_math(tmp_path):
    """train.sync_every = 1 reduce-scatters after each of the 2 micro-batches instead of once: the same weights as
    one process accumulating all 4 micro-batches."""
    reference = train_single(tmp_path / "single", "--train.grad_accum=4")
    train_distributed(tmp_path / "dp", "--train.grad_accum=2", "--train.sync_every=1")
    assert_same_weights(tmp_path / "dp", reference)


def test_hsdp_2x2_on_four_ranks(tmp_path):
    reference = train_single(tmp_path / "single", "--train.grad_accum=4")
    train_distributed(tmp_path / "hsdp", "--parallel.dp_replicate=2", "--parallel.dp_shard=2", nproc=4)
    assert_same_weights(tmp_path / "hsdp", reference)


def test_single_process_checkpoint_resumes_on_two_ranks(tmp_path):
    reference = train_single(tmp_path / "single", OFF, "--train.batch_size=8")
    train_single(tmp_path / "mixed", OFF, "--train.steps=2", "--train.batch_size=8")
    train_distributed(tmp_path / "mixed", OFF, "--train.resume=latest")
    assert_same_weights(tmp_path / "mixed", reference)


def test_distributed_resume_is_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_distributed(straight)
    train_distributed(resumed, "--train.steps=2")
    train_distributed(resumed, "--train.resume=latest")
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_quantization_aware_training_on_two_ranks_matches_one_process(tmp_path):
    """Fake-quantized linears (QAT) shard under FSDP2 like plain ones: the ranks fake-quantize the gathered weights,
    so the first step's loss and gradient norm are the one process's. Later steps agree to float noise only: a
    weight that differs by 1e-8 can round to the next int4 level, which is what rounding does (one flip moves the
    tiny model's loss by ~1e-4), so later losses are compared to 1e-3 and the weights at the size of a few Adam
    steps (lr 1e-3)."""
    qat = ("--components.llm.qat=int4", "--components.projector.qat=int4")
    reference = train_single(tmp_path / "single", *qat, "--train.grad_accum=2")
    train_distributed(tmp_path / "dp", *qat)
    got, want = metrics(tmp_path / "dp"), metrics(reference)
    assert got[0]["loss/total"] == pytest.approx(want[0]["loss/total"], abs=1e-6)
    assert got[0]["grad_norm/total"] == pytest.approx(want[0]["grad_norm/total"], rel=1e-5)
    for g, w in zip(got, want):
        assert g["loss/total"] == pytest.approx(w["loss/total"], rel=1e-3)
    a, b = weights(tmp_path / "dp"), weights(reference)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=2e-3) for k in a)
