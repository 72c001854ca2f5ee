"""Layouts judged by their placements, on torch's fake process group (this process plays one rank of 16; collectives
do nothing): a 4-D ``(dp_replicate, dp_shard, cp, tp) = (2, 2, 2, 2)`` mesh as torch's SPMD ``fully_shard`` lays
it out is taken by every optimizer and refresh, dimension names do not matter, and what stays unsupported is
refused by placement, naming the parameter, its placements and the supported forms."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WORLD, RANK = 16, 5
NAMES, SHAPE = ("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2)
# name: (out, in, tensor-parallel style). 16 of each shape: every rank of an 8-rank group owns matrices in every
# owner-refresh bucket (the fake backend refuses an all-to-all that sends nothing, which gloo and NCCL take).
LAYERS = {
    f"{kind}{i}": shape for i in range(16) for kind, shape in (("col", (20, 44, "col")), ("row", (14, 38, "row")))
}


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    yield init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    dist.destroy_process_group()


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (out, inp, _) in LAYERS.items():
            setattr(self, name, nn.Linear(inp, out, bias=False))


def _spmd_model(mesh, shard: tuple[str, ...]) -> _Layers:
    """TP placements on the full mesh, then SPMD ``fully_shard`` over ``shard`` with ``dp_replicate`` replicating."""
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = _Layers()
    for name, (_, _, style) in LAYERS.items():
        layer = getattr(model, name)
        placements = [Replicate()] * 3 + [Shard(0 if style == "col" else 1)]
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, placements))
    dims = DataParallelMeshDims(shard=shard, replicate="dp_replicate")
    for name in LAYERS:
        fully_shard(getattr(model, name), mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return model


_SLOW = pytest.mark.slow
CASES = [  # the owner refresh split across replicas in the default run, the others under the slow marker
    ("muon", {"refresh": "owner", "replica_refresh": "split"}),
    pytest.param(("muon", {"refresh": "gather"}), marks=_SLOW),
    pytest.param(("muon", {"refresh": "gather", "replica_refresh": "split"}), marks=_SLOW),
    pytest.param(("periodic_row_muon", {"k": 2, "replica_refresh": "split"}), marks=_SLOW),
    pytest.param(("muon_bp", {"period": 2}), marks=_SLOW),
]


@pytest.mark.parametrize("shard", [("dp_shard", "cp"), ("dp_shard",)], ids=["cp_flattened", "cp_replicating"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(map(str, c[1].values()))}")
def test_spmd_4d_layout_is_taken_by_every_optimizer(mesh, shard, case):
    """Built and stepped twice (a spectral step and a RowNorm or block one) on the 16-rank layout: every matrix
    refreshed in the group of the ranks holding distinct pieces, its replicas over the replicating dimensions."""
    model = _spmd_model(mesh, shard)
    weights = dict(model.named_parameters())
    flat = "dp_shard_cp" if len(shard) == 2 else None
    expected_mesh = ("dp_replicate", flat, "tp") if flat else NAMES
    assert all(p.device_mesh.mesh_dim_names == expected_mesh for p in weights.values())
    optimizer, opts = case
    opt = build(optimizer, list(weights.items()), lr=0.02, ns_dtype=torch.float32, **opts)
    for _ in range(2):
        for p in weights.values():
            p.grad = torch.distributed.tensor.DTensor.from_local(
                torch.randn(p.to_local().shape), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        opt.step()
    engine = opt._engine
    for p in weights.values():
        placed = engine._placements[id(p)][1]
        shard_group = dist.get_process_group_ranks(placed.shard.group)
        assert len(shard_group) == (8 if flat else 4)  # dp_shard x cp x tp, or dp_shard x tp
        replicas = dist.get_process_group_ranks(placed.replicas.group)
        assert len(replicas) == (2 if flat else 4)  # dp_replicate, and cp where it replicates
        assert placed.mine.numel == p.to_local().numel()
    labels = {c.label for c in engine._comms.values()}
    assert ("dp_shard_cp+tp" if flat else "dp_shard+tp") in labels
    assert "cp" not in labels  # nothing over the context dimension alone


def _build(tensor, name: str = "blocks.0.w") -> str:
    try:
        build("muon", [(name, nn.Parameter(tensor))], lr=0.02)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_dimension_names_do_not_matter(mesh):
    """Mesh dimensions named like context, expert or pipeline parallelism shard like any other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    named = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("pp", "dp_shard_cp", "ep", "context"))
    assert _build(distribute_tensor(torch.randn(16, 8), named, [Shard(0), Shard(0), Shard(1), Shard(0)])) == "accepted"


def _refusals(mesh) -> dict[str, str]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def local(placements, shape=(8, 8)):
        return DTensor.from_local(torch.randn(4, 4), mesh, placements, shape=torch.Size(shape), stride=(shape[1], 1))

    return {
        "partial": _build(local([Replicate(), Partial(), Shard(0), Shard(1)])),
        "shard_dim2": _build(
            DTensor.from_local(torch.randn(8, 4, 2, 4), mesh, [Replicate(), Replicate(), Replicate(), Shard(2)])
        ),
        "two_strided": _build(
            local([Replicate(), _StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2), Shard(0)])
        ),
    }


def test_what_stays_unsupported_is_refused_by_placement(mesh):
    errors = _refusals(mesh)
    assert "Partial placements are not supported" in errors["partial"]
    assert "Shard(d) for d > 1" in errors["shard_dim2"] and "Shard(dim=2)" in errors["shard_dim2"]
    assert "two _StridedShard placements on one dimension" in errors["two_strided"]
    for error in errors.values():
        assert "'blocks.0.w'" in error and "4-D mesh (dp_replicate=2, dp_shard=2, cp=2, tp=2)" in error
        assert "dp_shard_cp" in error and "FSDP x TP" in error  # the supported forms
