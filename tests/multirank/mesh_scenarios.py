"""Rank-side programs of the 2-D mesh and tensor-parallel tests (HSDP, TP, FSDP x TP) on 4 gloo ranks.

The model is a bag of linear layers whose shapes cover what the layouts must get right: ``m < n`` and
``m > n`` under column-wise (``Shard(0)``) and row-wise (``Shard(1)``) tensor parallelism, uneven and
empty shards on both sides, and a fused matrix split in three. Gradients are seeded full tensors that
every rank cuts by its parameter's placements, so one process with the same gradients is the oracle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build

STEPS = 6
LR = 0.02

# name: (out, in, tensor-parallel style). Under TP 4, FSDP 2 x TP 2 and HSDP 2 x 2 these give uneven
# rows (3, 5 rows), uneven columns (38, 14, 3 columns over 4) and empty pieces (3 rows or 3 columns
# over 4 ranks). Row counts of the column-wise layers keep FSDP-over-TP's chunk-of-chunk row blocks
# equal to torch.chunk(rows, 4), so one process reproduces MuonBP's blocks there.
LAYERS = {
    "wide_c": (20, 44, "col"),
    "tall_c": (40, 13, "col"),
    "thin_c": (3, 10, "col"),
    "fused_c": (48, 16, "col"),  # split in three (16, 16) matrices, like a fused qkv
    "wide_r": (14, 38, "row"),
    "tall_r": (38, 14, "row"),
    "thin_r": (5, 3, "row"),
}

MESHES = {"hsdp2x2": (("replicate", "shard"), (2, 2)), "tp4": (("tp",), (4,)), "fsdp2xtp2": (("dp", "tp"), (2, 2))}

# MuonBP's single-process block grid that reproduces each mesh's pieces, per layer style.
BLOCKS = {"hsdp2x2": {"col": 2, "row": 2}, "tp4": {"col": 4, "row": (1, 4)}, "fsdp2xtp2": {"col": 4, "row": (2, 2)}}


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (out, inp, _) in LAYERS.items():
            setattr(self, name, nn.Linear(inp, out))


def _model() -> Layers:
    torch.manual_seed(0)
    return Layers()


def meshes() -> dict:
    """One device mesh per layout, built once per job (process groups are costly to make)."""
    from torch.distributed.device_mesh import init_device_mesh

    return {key: init_device_mesh("cpu", shape, mesh_dim_names=names) for key, (names, shape) in MESHES.items()}


def shard(model: Layers, key: str, mesh) -> Layers:
    """Lay the model out as ``key`` says: HSDP, tensor parallel, or FSDP over tensor parallel."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if key == "hsdp2x2":
        for name in LAYERS:
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    tp = mesh["tp"]
    plan = {name: ColwiseParallel() if style == "col" else RowwiseParallel() for name, (_, _, style) in LAYERS.items()}
    parallelize_module(model, tp, plan)
    if key == "fsdp2xtp2":
        for name in LAYERS:
            fully_shard(getattr(model, name), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def groups(model: Layers, key: str | None, optimizer: str) -> list[dict]:
    """Muon groups by style (each with its MuonBP blocks), the fused matrix split in three, biases to AdamW."""

    def params(style: str, fused: bool) -> list:
        return [
            (f"{n}.weight", getattr(model, n).weight)
            for n, (_, _, s) in LAYERS.items()
            if s == style and (n == "fused_c") == fused
        ]

    out = []
    for style, fused in (("col", False), ("row", False), ("col", True)):
        group: dict = {"params": params(style, fused)}
        if fused:
            group["split_sizes"] = 3
        if optimizer == "adaptive_row_muon" and style == "row":
            group["algorithm"] = "adamw"  # split by columns under TP, which the adaptive schedule refuses
        if optimizer == "muon_bp" and key is not None:
            group["blocks"] = BLOCKS[key][style]
        out.append(group)
    out.append({"params": [(f"{n}.bias", getattr(model, n).bias) for n in LAYERS], "algorithm": "adamw"})
    return out


def set_grads(model: Layers, step: int) -> None:
    """Seeded full gradients, each rank keeping its piece as the parameter's placements cut it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = full


def make(key: str | None, mesh, optimizer: str, opts: dict):
    model = _model() if key is None else shard(_model(), key, mesh)
    return model, build(
        optimizer, groups(model, key, optimizer), lr=LR, weight_decay=0.05, ns_dtype=torch.float32, **opts
    )


def train(model, opt, start: int, stop: int) -> list[dict]:
    """Steps ``[start, stop)``: per step the comm stats by mesh dimension and the order of the collectives."""
    log = []
    for t in range(start, stop):
        set_grads(model, t)
        opt.reset_comm_stats()
        opt.reset_refresh_stats()
        opt.step()
        engine = opt._engine
        sharded = hasattr(engine, "counter")
        log.append(
            {
                "by_dim": opt.comm_stats(by_mesh_dim=True),
                "kinds": opt.comm_stats(),
                "spectral": opt.refresh_stats()["spectral"],
                "calls": list(engine.counter.calls) if sharded else [],
                "groups": {c.label: tuple(dist.get_process_group_ranks(c.group)) for c in engine._comms.values()}
                if sharded
                else {},
            }
        )
    return log


def full_params(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def everything(rank: int, world: int, cases: list[tuple[str, str, str, dict]], repoint_opts: dict) -> dict:
    """One spawn for the cheap programs (a gloo spawn costs seconds): :func:`parity`, :func:`unsupported`,
    :func:`repointed`."""
    return {
        "parity": parity(rank, world, cases),
        "unsupported": unsupported(rank, world),
        "repointed": repointed(rank, world, repoint_opts),
        "construction": construction(rank, world),
    }


def construction(rank: int, world: int) -> dict:
    """FSDP 2 x TP 2 (its refresh talks over the flattened dp+tp group): what the optimizer's construction
    prepared, and the process groups and layouts its first step still made."""
    from unittest import mock

    from torch.distributed.device_mesh import DeviceMesh

    from dimuon.optim.distributed import sharded

    key = "fsdp2xtp2"
    mesh = meshes()[key]
    flattened = []  # DeviceMesh._flatten calls while the optimizer is built: none (it would register on the mesh)
    flatten = DeviceMesh._flatten

    def recorded(self, *args, **kwargs):
        flattened.append(1)
        return flatten(self, *args, **kwargs)

    with mock.patch.object(DeviceMesh, "_flatten", recorded):
        model, opt = make(key, mesh, "muon", {"refresh": "owner"})
    engine = opt._engine
    prepared = {
        "engine": type(engine).__name__,
        "placements": len(engine._placements),
        "flattened": len(engine._flat_groups),
        "mesh_flattened": len(flattened) + len(mesh._get_root_mesh()._flatten_mapping),
    }
    made = {"new_group": 0, "flatten": 0, "derive_layout": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            made[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    with (
        mock.patch.object(dist, "new_group", counted("new_group", dist.new_group)),
        mock.patch.object(DeviceMesh, "_flatten", counted("flatten", DeviceMesh._flatten)),
        mock.patch.object(sharded, "derive_layout", counted("derive_layout", sharded.derive_layout)),
    ):
        set_grads(model, 0)
        opt.step()
    dist.barrier()
    return {"prepared": prepared, "first_step": made, "same_engine": opt._engine is engine}


def parity(rank: int, world: int, cases: list[tuple[str, str, str, dict]]) -> dict:
    """Each case trained on its mesh: full parameters, placements and per-step communication."""
    import contextlib
    from unittest import mock

    from dimuon.optim import adaptive

    built = meshes()
    out = {}
    for name, key, optimizer, opts in cases:
        opts = dict(opts)
        skew = opts.pop(SKEW, False)
        model, opt = make(key, built[key], optimizer, opts)
        placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters() if n.endswith("weight")}
        with contextlib.ExitStack() as stack:
            if skew and built[key].get_coordinate()[0] == 1:  # replica 1 alone finds every matrix stale
                stack.enter_context(mock.patch.object(adaptive, "staleness_from_sums", _stale))
            log = train(model, opt, 0, STEPS)
        out[name] = {"params": full_params(model), "log": log, "placements": placements}
    dist.barrier()
    return out


# An option of a parity case (popped before the optimizer sees it): replica 1's staleness signal is skewed.
SKEW = "skew_replica_signal"


def _stale(sums: torch.Tensor) -> torch.Tensor:
    """A staleness signal far above any threshold, one per row of ``sums``: every matrix reads as stale."""
    from dimuon.optim.staleness import staleness_from_sums

    return staleness_from_sums(sums) + 10.0


def reference(key: str, optimizer: str, opts: dict, steps: int = STEPS) -> dict[str, torch.Tensor]:
    opts = {k: v for k, v in opts.items() if k not in ("refresh", "replica_refresh", "bucket_mb")}
    model, opt = make(None, None, optimizer, opts)
    if optimizer == "muon_bp":  # the same blocks as the sharded run, in one process
        for group, sharded in zip(opt.param_groups, groups(model, key, optimizer)):
            if "blocks" in sharded:
                group["blocks"] = sharded["blocks"]
    train(model, opt, 0, steps)
    return full_params(model)


def unsupported(rank: int, world: int) -> dict[str, str]:
    """The construction-time error for each layout the optimizer refuses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh1 = init_device_mesh("cpu", (4,))
    unnamed = init_device_mesh("cpu", (2, 2))
    cases = {
        "unnamed_2d": lambda: distribute_tensor(torch.randn(8, 8), unnamed, [Shard(0), Shard(1)]),
        "3d_mesh": lambda: distribute_tensor(torch.randn(8, 8), mesh3, [Shard(0), Shard(0), Shard(1)]),
        "partial": lambda: DTensor.from_local(torch.randn(8, 8), mesh1, [Partial()]),
        "shard_dim2": lambda: distribute_tensor(torch.randn(8, 4, 4, 4), mesh1, [Shard(2)]),
        "adaptive_cols": lambda: distribute_tensor(torch.randn(8, 8), mesh1, [Shard(1)]),
    }
    out = {}
    for name, make_tensor in cases.items():
        p = nn.Parameter(make_tensor())
        try:
            build("adaptive_row_muon" if name.startswith("adaptive") else "muon", [("w", p)], lr=LR)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    # FSDP over a head-wise _StridedShard(0, 3) TP weight: torch stores the data otherwise than the
    # nested placements say (its own full_tensor() is wrong), so the optimizer refuses it.
    lin = nn.Linear(4, 12)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh2["tp"], [_StridedShard(0, split_factor=3)]))
    fully_shard(lin, mesh=mesh2["dp"])
    try:
        build("muon", [("qkv.weight", lin.weight)], lr=LR)
        out["nested_strided"] = "accepted"
    except ValueError as e:
        out["nested_strided"] = str(e)
    dist.barrier()
    return out


def topology_save(
    rank: int, world: int, root: str, key: str, load_from: str | None, start: int, stop: int, opts: dict
) -> dict:
    """Build on ``key``'s mesh (``fsdp4``: FSDP over all ranks), load ``load_from`` if given, train
    ``[start, stop)`` and save to ``root/<key>``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if key == "fsdp4":
        model = _model()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for name in LAYERS:
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build(
            "periodic_row_muon",
            groups(model, None, "periodic_row_muon"),
            lr=LR,
            weight_decay=0.05,
            ns_dtype=torch.float32,
            **opts,
        )
    else:
        model, opt = make(key, meshes()[key], "periodic_row_muon", opts)
    phase = load(model, opt, load_from) if load_from is not None else None
    train(model, opt, start, stop)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{key}")
    return {"phase": phase}


def single_process_resume(path: str, start: int, stop: int, opts: dict) -> tuple[list, dict[str, torch.Tensor]]:
    """Load a DCP checkpoint into one process (no process group) and train ``[start, stop)``."""
    model, opt = make(None, None, "periodic_row_muon", opts)
    phase = load(model, opt, path)
    train(model, opt, start, stop)
    return phase, full_params(model)


def load(model, opt, path: str) -> list[int]:
    """Load a DCP checkpoint of model and optimizer, whatever topology saved it; the groups' phase after it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return [g["step"] for g in opt.param_groups]


def repointed(rank: int, world: int, opts: dict) -> dict:
    """The optimizer built over the plain model, then the model sharded and the optimizer's groups pointed at
    the sharded parameters (what accelerate's FSDP2 plugin does): layouts come from the new parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    opt = build(
        "periodic_row_muon",
        groups(model, None, "periodic_row_muon"),
        lr=LR,
        weight_decay=0.05,
        ns_dtype=torch.float32,
        **opts,
    )
    before = {id(p): name for name, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    for name in LAYERS:
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    after = dict(model.named_parameters())
    for group in opt.param_groups:
        group["params"] = [after[before[id(p)]] for p in group["params"]]
    log = train(model, opt, 0, STEPS)
    momentum = [type(s["momentum_buffer"]).__name__ for s in opt.state.values() if "momentum_buffer" in s]
    saved = opt.state_dict()  # every state entry maps to a parameter of the groups
    return {"params": full_params(model), "log": log, "momentum": momentum, "state_keys": sorted(saved["state"])}


def _dit_inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, 8, 8, generator=gen), torch.rand(2, generator=gen), torch.tensor([1, 3])


def dit_model():
    """DiT-XS/2 (4 heads, 6 blocks) on 8x8 latents, every weight non-zero so every path is exercised."""
    from dimuon.dit.model import build_dit

    torch.manual_seed(0)
    model = build_dit("DiT-XS/2", input_size=8, in_channels=4, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def dit_train(model, opt, steps: int = 3) -> torch.Tensor:
    """``steps`` steps on one batch; the first output."""
    first = None
    for _ in range(steps):
        out = model(*_dit_inputs())
        first = out.detach() if first is None else first
        opt.zero_grad()
        out.square().mean().backward()
        opt.step()
    return first


def dit_parallel(rank: int, world: int, layouts: list[tuple[int, int, int]]) -> dict:
    """dimuon's DiT under each parallel layout (dp_replicate, dp_shard, tp): placements, the parameters as
    saved before training (names and values), the first output and the parameters after 3 steps."""
    from dimuon.dit.parallel import Parallelism, apply_parallelism, build_mesh, tp_process_group
    from dimuon.optim import param_groups

    out = {}
    for degrees in layouts:
        par = Parallelism(*degrees).resolve(world)
        mesh = build_mesh(par, "cpu")
        model = apply_parallelism(dit_model(), par, mesh)
        saved = full_params(model)
        placements = {
            n: str(tuple(p.placements)) if hasattr(p, "placements") else "plain"
            for n, p in model.named_parameters()
            if n.startswith("blocks.0.")
        }
        opt = build(
            "periodic_row_muon",
            param_groups(model),
            lr=LR,
            k=2,
            ns_dtype=torch.float32,
            process_group=tp_process_group(par, mesh),
        )
        first = dit_train(model, opt)
        out[degrees] = {"saved": saved, "placements": placements, "out": first, "params": full_params(model)}
    dist.barrier()
    return out
