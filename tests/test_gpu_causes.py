"""The causes of the first GPU run's crashes, reproduced on the CPU: the activation offloader took a foreign-device
(CPU) tensor on a CUDA run, and the context-parallel shard check all-reduced a CPU tensor over NCCL."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlaforge.techniques import offload as off

CPU = torch.device("cpu")


# ---- (b) activation offload: only tensors of the offloader's own device ------------------------------------------

def test_offloader_leaves_tensors_of_another_device_in_place():
    """A CUDA run's offloader met torch 2.11's 0-byte CPU checkpoint dummy and sent it to `record_stream`. Here the
    offloader serves `meta` (a device that is not the CPU, as CUDA is not) and gets CPU tensors."""
    offloader = off._Offloader("cpu", torch.device("meta"), min_bytes=0, blocks=None, folder=None)
    dummy, foreign = torch.empty((0,)), torch.randn(64, 64)
    assert offloader.pack(dummy) is dummy
    assert offloader.pack(foreign) is foreign
    assert offloader.handles == []
    own = torch.empty(64, 64, device="meta")
    assert isinstance(offloader.pack(own), off._Handle)  # its own device's tensors still move


class SavesEmptyDummy(torch.autograd.Function):
    """Identity that saves a 0-byte CPU tensor beside its input, as torch 2.11's `_NoopSaveInputs` does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, torch.empty((0,)))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        x, dummy = ctx.saved_tensors
        assert dummy.numel() == 0 and x.shape == grad.shape
        return grad


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        x = SavesEmptyDummy.apply(x)
        return checkpoint(lambda h: self.b(torch.tanh(self.a(h))), x, use_reentrant=False) + x.sin()


def test_offload_skips_empty_tensors_and_keeps_gradients_exact():
    torch.manual_seed(0)
    plain = Block()
    offloaded = Block()
    offloaded.load_state_dict(plain.state_dict())
    offloader = off._Offloader("cpu", CPU, min_bytes=0, blocks=None, folder=None)
    seen, moved = [], []
    pack = offloader.pack

    def spy(t):  # what reaches the hook, and what the hook moved
        seen.append(t)
        out = pack(t)
        if isinstance(out, off._Handle):
            moved.append(out)
        return out

    offloader.pack = spy
    off._wrap_forward(offloaded, offloader)
    x = torch.randn(8, 16)
    for model in (plain, offloaded):
        model(x.clone().requires_grad_()).square().sum().backward()
    assert any(t.numel() == 0 for t in seen)  # the dummy reached the hook ...
    assert moved and all(h.shape.numel() > 0 for h in moved)  # ... and stayed where it was
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a.grad, b.grad), name


# ---- (c) context parallel under NCCL: collectives on the group's device -------------------------------------------

def test_shard_check_allocates_on_the_groups_device(monkeypatch):
    """The tensor the shard check all-reduces is on the device the group's backend serves, not always the CPU (an
    NCCL group serves only CUDA; `meta` stands in for it here)."""
    from vlaforge.distributed import attention_blocks as blocks

    handed = []

    class Handed(Exception):
        pass

    def all_reduce(t, op=None, group=None):
        handed.append(t.device)
        raise Handed  # (a meta tensor holds no value to compare afterwards)

    monkeypatch.setattr(blocks.dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(blocks.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(blocks, "group_device", lambda group: torch.device("meta"), raising=False)
    with pytest.raises(Handed):
        blocks.check_equal_shards(12345, group=object())
    assert handed == [torch.device("meta")]


def test_group_device_is_the_current_accelerator_of_a_group_without_cpu_backend(monkeypatch):
    from vlaforge.distributed import attention_blocks as blocks

    monkeypatch.setattr(blocks.dist.distributed_c10d, "_get_object_coll_device", lambda group: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert blocks.group_device(object()) == torch.device("cuda", 3)
    monkeypatch.setattr(blocks.dist.distributed_c10d, "_get_object_coll_device", lambda group: "cpu")
    assert blocks.group_device(object()) == CPU  # gloo, or a 'cpu:gloo,cuda:nccl' group


def test_cuda_ranks_bind_their_local_device_to_nccl(monkeypatch):
    """torchrun's LOCAL_RANK picks the CUDA device, which the NCCL group is bound to (`device_id`)."""
    import torch.distributed as dist

    from vlaforge.distributed.parallel_dims import World, init_distributed

    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    device = init_distributed(World(rank=3, local_rank=1, size=4), torch.device("cuda"))
    assert device == torch.device("cuda", 1) == calls["set_device"]
    assert calls["init"] == {"backend": "nccl", "device_id": torch.device("cuda", 1)}


def _shard_check_worker(rank, world, port, out):
    import os

    import torch.distributed as dist

    from vlaforge.distributed import attention_blocks as blocks
    from vlaforge.distributed.parallel_dims import World, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    init_distributed(World(rank, rank, world), CPU)
    real, devices = dist.all_reduce, []

    def recorded(t, *args, **kwargs):
        devices.append(t.device)
        return real(t, *args, **kwargs)

    blocks.dist.all_reduce = recorded
    group = dist.group.WORLD
    blocks.check_equal_shards(8, group)
    try:
        blocks.check_equal_shards(16 + rank, group)  # unequal (both new lengths): refused
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    out[rank] = (devices, blocks.group_device(group), refused)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_shard_check_on_a_gloo_group_runs_on_its_device():
    from launch import spawn_ranks

    for rank, (devices, device, refused) in spawn_ranks(_shard_check_worker, 2).items():
        assert device == CPU and devices == [CPU, CPU], rank
        assert "from 16 to 17 tokens" in refused, rank
