"""ParallelDims: layouts resolved and validated before any process group work; the mesh on a gloo group."""

import pytest
import torch
import torch.distributed as dist

from vlaforge.config.schema import ModelConfig, ParallelConfig
from vlaforge.distributed.parallel_dims import LayoutError, ParallelDims, World, init_distributed, model_facts

from launch import spawn_ranks


def layout(dp_replicate=1, dp_shard=-1, tp=1, pp=1, cp=1, backend="fsdp2"):
    return ParallelConfig(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, backend=backend)


def test_rest_of_the_world_goes_to_dp_shard_and_mesh_order():
    dims = ParallelDims.build(layout(dp_replicate=2, tp=2), world_size=16, facts=model_facts(ModelConfig(
        flavor="vla-7b")))
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 4, 2, 8)
    assert dims.mesh_shape() == (("dp_replicate", "dp_shard", "tp"), (2, 4, 2))


@pytest.mark.parametrize("flavor, kwargs, world, message", [
    ("tiny", dict(tp=3), 4, "world size 4 is not divisible by dp_replicate x tp x pp x cp = 3"),
    ("tiny", dict(dp_shard=2, tp=2), 8, "= 4 but the world size is 8"),
    ("vla-30b", dict(tp=16), 16, "parallel.tp = 16 does not divide the llm's 8 kv-heads; use one of [1, 2, 4, 8]"),
    ("vla-7b", dict(tp=3, dp_shard=1), 3, "parallel.tp = 3 does not divide the llm's 32 attention heads"),
    ("tiny", dict(pp=4, dp_shard=1), 4, "parallel.pp = 4 exceeds the llm's 2 blocks"),
    ("tiny", dict(backend="ddp"), 4, "backend = 'ddp' replicates the model and cannot shard it"),
])
def test_impossible_layouts_are_one_line(flavor, kwargs, world, message):
    with pytest.raises(LayoutError) as err:
        ParallelDims.build(layout(**kwargs), world, model_facts(ModelConfig(flavor=flavor)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ddp_replicas_are_fine():
    dims = ParallelDims.build(layout(dp_replicate=4, dp_shard=1, backend="ddp"), 4)
    assert dims.dp == 4 and dims.mesh_shape() == (("dp_replicate", "dp_shard"), (4, 1))


def _mesh_worker(rank: int, world: int, port: int, out):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    init_distributed(World(rank, rank, world), torch.device("cpu"))
    dims = ParallelDims.build(layout(), world)
    mesh = dims.build_mesh("cpu")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=mesh.get_group("dp_shard"))
    out[rank] = (mesh.mesh_dim_names, t.item(), dist.get_backend())
    dist.destroy_process_group()


@pytest.mark.distributed
def test_init_and_mesh_on_two_gloo_ranks():
    assert spawn_ranks(_mesh_worker, 2) == {r: (("dp_replicate", "dp_shard"), 3.0, "gloo") for r in (0, 1)}


def test_trainer_refuses_what_distributed_runs_lack_yet(tmp_path, monkeypatch):
    from vlaforge.errors import VlaforgeError
    from vlaforge.training.trainer import train

    from conftest import tiny_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    frozen = {"vision": {"trainable": False, "unfreeze_at_step": 2}}
    with pytest.raises(VlaforgeError, match="unfreeze_at_step is not available with more than one process yet"):
        train(tiny_config(tmp_path, components=frozen))
    with pytest.raises(VlaforgeError, match=r"parallel.pp = 2 needs train.grad_accum >= 2"):
        train(tiny_config(tmp_path, parallel={"pp": 2, "dp_shard": 1}))
    with pytest.raises(VlaforgeError, match="loss.weighting = 'dwa' is not available with parallel.pp > 1"):
        train(tiny_config(tmp_path, parallel={"pp": 2, "dp_shard": 1}, train={"grad_accum": 2},
                          loss={"weighting": "dwa"}))
    assert not (tmp_path / "run").exists()  # refused before anything was built or written
