"""Context and sequence parallel in training: a whole tiny-VLA step with the LLM's sequence split over cp ranks
matches the single-process step (ring and Ulysses at cp = 2; tp = 2 x cp = 2 with Megatron-style sequence parallel
at 4 ranks); under sequence parallel the norms see 1/tp of the tokens; the compacted layout the wiring feeds the
kernels gives masked attention exactly; bad layouts are one line."""

import pytest
import torch
import torch.nn.functional as F

from vlaforge.distributed.sequence_parallel import compact_order

from conftest import TINY_RECIPE
from launch import assert_matches, spawn_ranks, train_distributed, train_single


def test_compacted_causal_attention_equals_the_masked_attention():
    """Real tokens first (in order), padding last: causal attention over the compacted rows gives every real token
    what SDPA with a causal + key-padding mask gives it, so the kernels need no padding mask."""
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 3, 2, 11, 8
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, 3:6] = False  # instruction padding in the middle
    mask[1, 9:] = False  # text padding at the end
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    lay = compact_order(mask, 4)
    assert lay.padded == 12 and lay.length == n
    pad = lambda t: F.pad(t, (0, 0, 0, lay.padded - n))
    index = lay.order[:, None, :, None].expand(-1, h, -1, d)
    qc, kc, vc = (pad(t).gather(2, index) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    back = torch.zeros_like(out).scatter(2, index, out)[:, :, :n]
    real = mask[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(back[real], ref[real], rtol=0, atol=1e-6)
    assert torch.equal(lay.order[0, :8], torch.tensor([0, 1, 2, 6, 7, 8, 9, 10]))  # stable: real order kept


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_single(tmp_path_factory.mktemp("single"))


def _assert_matches(run, reference):
    # the language loss: the text logits after the gather; the zero fraction: gradient counts over the cp ranks
    assert_matches(run, reference, ("loss/total", "loss/language", "numerics/llm/zero_frac"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring"])
def test_cp2_step_matches_one_process(tmp_path, single, method):
    """Both ranks see the same batch and hold half its tokens (zigzag for the ring, contiguous for Ulysses); FSDP2
    shards over the two cp ranks."""
    done = train_distributed(tmp_path, "--parallel.cp=2", f"--parallel.cp_method={method}",
                             "--train.progress=true")
    assert f"context parallel: cp = 2, {method}" in done.stdout
    _assert_matches(tmp_path, single)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_times_cp2_with_sequence_parallel_on_four_ranks_matches_one_process(tmp_path, single):
    """tp = 2 x cp = 2: each cp rank's LLM blocks are Megatron-split with Megatron-style sequence parallel inside
    the tp pair (norms and residuals on half of the rank's tokens); 'auto' picks all-gather at this length."""
    done = train_distributed(tmp_path, "--parallel.cp=2", "--parallel.tp=2", "--parallel.cp_method=auto",
                             "--parallel.sequence_parallel=true", "--train.progress=true", nproc=4)
    assert "context parallel: cp = 2, allgather" in done.stdout
    _assert_matches(tmp_path, single)


@pytest.mark.parametrize("args, message", [
    (("--parallel.cp=2", "--parallel.pp=2", "--train.grad_accum=2", "--parallel.dp_shard=1"),
     "parallel.cp = 2 runs with backend = 'fsdp2' and pp = 1"),
    (("--parallel.cp=2", "--parallel.cp_method=ulysses", "--parallel.tp=2", "--parallel.dp_shard=1",
      "--model.flavor=small"), "cp = 2 to divide the llm's 7 attention heads"),
])
def test_impossible_context_parallel_layouts_are_one_line(args, message):
    from vlaforge.config.loading import load_config
    from vlaforge.distributed.parallel_dims import World, check_layout
    from vlaforge.errors import VlaforgeError

    cfg = load_config(TINY_RECIPE, [*args])
    with pytest.raises(VlaforgeError, match=message):
        check_layout(cfg, World(0, 0, 4))



def _sp_worker(rank, world, port, out):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vlaforge.distributed.parallelize import apply_tensor_parallel
    from vlaforge.models.build import build_vla

    from conftest import make_batch, tiny_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = tiny_config()
    torch.manual_seed(0)
    model = build_vla(cfg.model, cfg.loss)
    batch = make_batch(cfg, model)
    reference = model.compute_loss(batch)[0].item()
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), sequence_parallel=True)
    seen = {}
    block = model.llm.model.layers[0]

    def record(name):
        def hook(module, args, output):  # returns None: the output stays
            seen.setdefault(name, (args[0].to_local() if hasattr(args[0], "to_local") else args[0]).shape[1])
        return hook

    block.input_layernorm.register_forward_hook(record("norm"))
    block.mlp.gate_proj.register_forward_hook(record("ffn"))
    loss = model.compute_loss(batch)[0].item()
    out[rank] = (seen["norm"], seen["ffn"], loss, reference)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_sequence_parallel_norms_hold_a_tp_share_of_the_tokens():
    for rank, (norm, ffn, loss, reference) in spawn_ranks(_sp_worker, 2).items():
        assert ffn % 2 == 0 and norm == ffn // 2, (rank, norm, ffn)  # the FFN sees the gathered sequence
        assert loss == pytest.approx(reference, abs=1e-5)
