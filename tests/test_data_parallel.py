"""Data parallel under a real `torchrun`: `vlaforge train` on 2 gloo ranks matches one process that takes the same
global batch as 2 accumulated micro-batches (FSDP2 and DDP) and, with the contrastive term off, one process with a
twice larger batch; HSDP 2x2 on 4 ranks; a distributed run resumes bit for bit; 8-bit AdamW moments under DDP.

The runs several tests compare with are trained once per session (tests/shared_runs.py)."""

import pytest
import torch
from shared_runs import ddp_run, plain_run, single_run, two_rank_run, warm_optimizer_steps

from launch import OFF, assert_same_weights, metrics, train_distributed, train_single, weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return single_run(tmp_path_factory, "single_accum2", "--train.grad_accum=2")


@pytest.fixture(scope="module")
def single_batch4(tmp_path_factory):
    return plain_run(tmp_path_factory)


@pytest.fixture(scope="module")
def single_accum4(tmp_path_factory):
    return single_run(tmp_path_factory, "single_accum4", "--train.grad_accum=4")


@pytest.fixture(scope="module")
def single_batch8(tmp_path_factory):
    """Contrastive off, batch 8, a checkpoint at step 2 too (a single-process checkpoint to resume on 2 ranks)."""
    return single_run(tmp_path_factory, "single_off_batch8", OFF, "--train.batch_size=8",
                      "--train.checkpoint_every=2")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """FSDP2 on 2 ranks under the real torchrun (the launcher itself, once in the suite)."""
    return two_rank_run(tmp_path_factory, "fsdp2", fresh=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return ddp_run(tmp_path_factory)


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_two_ranks_match_one_process_with_the_same_global_batch(request, single, layout):
    run = request.getfixturevalue(layout)  # rank 0 alone reported "done: 3 steps" (tests/shared_runs.py)
    assert_same_weights(run, single)
    for got, want in zip(metrics(run), metrics(single)):
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-5)
        assert got["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=1e-5)  # norms over shards
        assert got["numerics/llm/zero_frac"] == pytest.approx(want["numerics/llm/zero_frac"])  # counts too


def test_two_ranks_equal_one_process_with_a_twice_larger_batch(tmp_path, single_batch8):
    """Masked means are normalized over all ranks: 2 ranks x 4 samples give one batch of 8 (contrastive off: its
    negatives are per rank)."""
    train_distributed(tmp_path / "dp", OFF)
    assert_same_weights(tmp_path / "dp", single_batch8)


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


def test_reducing_every_micro_step_keeps_the_math(tmp_path, single_accum4):
    """train.sync_every = 1 reduce-scatters after each of the 2 micro-batches instead of once: the same weights as
    one process accumulating all 4 micro-batches."""
    train_distributed(tmp_path / "dp", "--train.grad_accum=2", "--train.sync_every=1")
    assert_same_weights(tmp_path / "dp", single_accum4)


def test_hsdp_2x2_on_four_ranks(tmp_path, single_accum4):
    train_distributed(tmp_path / "hsdp", "--parallel.dp_replicate=2", "--parallel.dp_shard=2", nproc=4)
    assert_same_weights(tmp_path / "hsdp", single_accum4)


def test_single_process_checkpoint_resumes_on_two_ranks(tmp_path, single_batch8):
    """The one-process run's step-2 checkpoint, resumed on 2 ranks (into an empty folder), ends where it ends."""
    ckpt = single_batch8 / "checkpoints" / "step_00000002"
    train_distributed(tmp_path / "mixed", OFF, f"--train.resume={ckpt}")
    assert_same_weights(tmp_path / "mixed", single_batch8)


def test_distributed_resume_is_exact(tmp_path, fsdp2):
    """2 ranks resumed from the 2-rank run's step-2 checkpoint (into an empty folder): its step 3, bit for bit."""
    train_distributed(tmp_path, f"--train.resume={fsdp2 / 'checkpoints' / 'step_00000002'}")
    a, b = weights(tmp_path), weights(fsdp2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


@pytest.mark.over_budget("torchao compiles its 8-bit AdamW step once per parameter shape, and again for DDP's DTensors")
def test_8bit_moments_under_ddp_match_one_process(tmp_path):
    """torchao's 8-bit moments (`components.<c>.optim_state`, techniques/optimizer_state.py) on DDP's replicas, the
    one multi-process layout they run under, match one process as fused AdamW does (measured: the projector in 8
    bits, equal weights bit for bit; the LLM in 8 bits, within 2.1e-5 - the all-reduced gradients differ from one
    process's in the last bits, which can round a moment to the neighbouring code)."""
    warm_optimizer_steps("projector", optim_state="8bit")  # the single run and both ranks fork with its graphs
    opt = "--components.projector.optim_state=8bit"
    reference = train_single(tmp_path / "single", opt, "--train.grad_accum=2")
    train_distributed(tmp_path / "dp", opt, "--parallel.backend=ddp", "--parallel.dp_replicate=2",
                      "--parallel.dp_shard=1")
    assert_same_weights(tmp_path / "dp", reference)
    state = torch.load(tmp_path / "dp" / "checkpoints" / "step_00000003" / "trainer_state.pt", weights_only=True)
    assert set(state["optimizer"]["state"]["model.projector.mlp.0.weight"]["exp_avg"]) == {"codes", "scale", "qmap"}
