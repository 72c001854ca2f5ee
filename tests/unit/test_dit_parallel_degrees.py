"""Parallel degrees: resolved against the world size, refused with the flags named."""

import pytest

from dimuon.dit.parallel import Parallelism


def test_dp_shard_takes_the_rest_of_the_world():
    assert Parallelism().resolve(8) == Parallelism(1, 8, 1)
    assert Parallelism(dp_replicate=2).resolve(8) == Parallelism(2, 4, 1)
    assert Parallelism(tp=4).resolve(8) == Parallelism(1, 2, 4)
    assert Parallelism(tp=4).resolve(8).dims == (("dp_shard", 2), ("tp", 4))
    assert Parallelism().resolve(1).dims == ()


@pytest.mark.parametrize(
    "degrees, world, message",
    [
        (
            (1, 3, 1),
            4,
            "--parallel.dp-replicate x --parallel.dp-shard x --parallel.tp = 1 x 3 x 1 = 3 must equal the world size 4",
        ),
        ((3, -1, 1), 4, "--parallel.dp-replicate (3) x --parallel.tp (1) must divide the world size 4"),
        ((2, 1, 2), 4, "--parallel.dp-replicate 2 with --parallel.dp-shard 1 would shard over the replicas"),
        ((1, 0, 1), 4, "--parallel.dp-shard must be >= 1 or -1"),
        ((2, -1, 1), 2, "--parallel.dp-replicate 2 with --parallel.dp-shard 1 would shard over the replicas"),
        ((4, 1, 1), 4, "--parallel.dp-replicate 4 with --parallel.dp-shard 1 would shard over the replicas"),
        ((1, -1, 0), 4, "--parallel.tp must be >= 1"),
        ((1, -1, 1, 0), 4, "--parallel.cp must be >= 1"),
        ((1, -1, 1, 3), 4, "--parallel.dp-replicate (1) x --parallel.tp (1) x --parallel.cp (3) must divide the world"),
        (
            (1, 2, 2, 2),
            4,
            "--parallel.dp-replicate x --parallel.dp-shard x --parallel.tp x --parallel.cp = 1 x 2 x 2 x 2 = 8 must "
            "equal the world size 4",
        ),
    ],
)
def test_bad_degrees_name_the_flags(degrees, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Parallelism(*degrees).resolve(world)


def test_tensor_parallel_degree_must_split_heads_and_mlp():
    Parallelism(tp=2).check_model(hidden_size=64, num_heads=2, mlp_hidden=256)
    with pytest.raises(ValueError, match=r"--parallel.tp \(4\) must divide the model's 2 attention heads"):
        Parallelism(tp=4).check_model(hidden_size=64, num_heads=2, mlp_hidden=256)


def test_hsdp_over_tensor_parallelism_is_a_3d_mesh():
    par = Parallelism(2, -1, 2).resolve(8)
    assert par.dims == (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))


def test_context_parallel_degrees_take_their_place_in_the_mesh():
    assert Parallelism(cp=2).resolve(8).dims == (("dp_shard", 4), ("cp", 2))
    assert Parallelism(2, -1, 2, 2).resolve(16).dims == (("dp_replicate", 2), ("dp_shard", 2), ("cp", 2), ("tp", 2))
    # FSDP shards over cp: replicas of a model sharded over the context ranks are HSDP, not the refused DDP
    assert Parallelism(2, -1, 1, 2).resolve(4).dims == (("dp_replicate", 2), ("cp", 2))
