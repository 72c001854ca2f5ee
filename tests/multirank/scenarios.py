"""Rank-side programs of the multi-rank tests (importable, so spawned ranks can run them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build, param_groups

STEPS = 8
LR = 0.02


class OddShapes(nn.Module):
    """Matrices with m < n, m > n, m = n, rows not divisible by 2 or 4, fewer rows (3) than 4 ranks,
    a fused matrix split in three, plus biases and a LayerNorm for the AdamW group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 13)  # (13, 12): tall, 13 rows
        self.b = nn.Linear(13, 40)  # (40, 13): tall
        self.c = nn.Linear(40, 16)  # (16, 40): wide
        self.d = nn.Linear(16, 16)  # square
        self.g = nn.Linear(16, 48)  # (48, 16): fused, split into 3 squares
        self.e = nn.Linear(48, 3)  # (3, 48): 3 rows
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.a, self.b, self.c, self.d, self.g, self.e):
            x = torch.tanh(layer(x))
        return self.norm(x)


class DiTShaped(nn.Module):
    """Two transformer-block-shaped layers of width D (qkv, proj, fc1, fc2, adaLN)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.qkv, blk.proj = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
            blk.fc1, blk.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            blk.ada = nn.Linear(d, 6 * d)
            self.blocks.append(blk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk.proj(torch.tanh(blk.qkv(x))) + blk.fc2(torch.tanh(blk.fc1(x))) + blk.ada(x)[..., : x.shape[-1]]
        return x


class Tiny(nn.Module):
    """Four small layers: a tall matrix, two squares of one shape (one batch), a wide one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


MODELS = {"odd": (OddShapes, 12, {"g.weight": 3}), "dit": (DiTShaped, 64, None), "tiny": (Tiny, 12, None)}


def make(model_name: str, optimizer: str, opts: dict, world: int | None, device: str = "cpu"):
    """Seeded model + optimizer on ``device``; sharded with FSDP2 over ``world`` ranks when ``world`` is given."""
    cls, _, splits = MODELS[model_name]
    torch.manual_seed(0)
    model = cls().to(device)
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(torch.device(device).type, (world,))
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if optimizer == "adamw":
        return model, build("adamw", model, lr=LR, weight_decay=0.05, **opts)
    if optimizer == "muon_adamw_only":  # the Muon family's AdamW group alone
        return model, build("muon", param_groups(model, rules={"*": "adamw"}), lr=LR, weight_decay=0.05, **opts)
    opt = build(
        optimizer, param_groups(model, split_sizes=splits), lr=LR, weight_decay=0.05, ns_dtype=torch.float32, **opts
    )
    return model, opt


def batch(model_name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, width, _ = MODELS[model_name]
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, width, generator=g)
    out = 3 if model_name == "odd" else width
    return x, torch.randn(32, out, generator=g)


def train(model, opt, model_name: str, start: int, stop: int, refreshes: list | None = None) -> list[dict]:
    """Steps ``[start, stop)`` on the same full batch on every rank; comm stats of each step. ``refreshes``, if
    given, receives each step's spectral flag per matrix (Muon family only)."""
    stats = []
    for t in range(start, stop):
        x, y = batch(model_name, t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.reset_comm_stats() if hasattr(opt, "reset_comm_stats") else None
        opt.reset_refresh_stats() if hasattr(opt, "reset_refresh_stats") else None
        opt.step()
        stats.append(opt.comm_stats() if hasattr(opt, "comm_stats") else {})
        if refreshes is not None:
            refreshes.append({k: m["spectral"] for k, m in opt.refresh_stats()["matrices"].items()})
    return stats


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole and on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
    return out


def parity(rank: int, world: int, cases: list[tuple[str, str, str, dict]]) -> dict:
    """Train each case sharded; return full parameters and per-step comm stats (rank 0's view too)."""
    results = {}
    for key, model_name, optimizer, opts in cases:
        model, opt = make(model_name, optimizer, opts, world)
        refreshes: list = []
        stats = train(model, opt, model_name, 0, STEPS, refreshes if optimizer in REFRESH_STATS else None)
        tables = getattr(opt, "_tables", None)  # the fused kernels' address tables: made by their launches only
        results[key] = {
            "params": full_params(model),
            "stats": stats,
            "kinds": None,
            "refreshes": refreshes,
            "fused_tables": len(tables._kept) if tables is not None else 0,
        }
    dist.barrier()
    return results


REFRESH_STATS = ("muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon")  # optimizers with refresh_stats()


def reference(
    model_name: str, optimizer: str, opts: dict, steps: int = STEPS, refreshes: list | None = None
) -> dict[str, torch.Tensor]:
    model, opt = make(model_name, optimizer, opts, None)
    train(model, opt, model_name, 0, steps, refreshes)
    return full_params(model)


def dcp_save_then_continue(rank: int, world: int, path: str, optimizer: str, opts: dict, save_at: int) -> dict:
    """Train to ``save_at``, save model+optimizer with DCP, then keep going to STEPS (uninterrupted run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make("odd", optimizer, opts, world)
    train(model, opt, "odd", 0, save_at)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    refreshes: list = []
    train(model, opt, "odd", save_at, STEPS, refreshes)
    return {"params": full_params(model), "refreshes": refreshes}


def dcp_load_and_continue(rank: int, world: int, path: str, optimizer: str, opts: dict, save_at: int) -> dict:
    """Fresh model+optimizer, load the DCP checkpoint, continue from ``save_at`` to STEPS."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = make("odd", optimizer, opts, world)
    # Materialize optimizer state so the loaded checkpoint has somewhere to land.
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    phase = [g["step"] for g in opt.param_groups]
    kinds = [str(k) for k in opt.step_kinds()]
    ages = [s.get("refresh_age") for s in opt.state.values() if "momentum_buffer" in s]
    refreshes: list = []
    train(model, opt, "odd", save_at, STEPS, refreshes)
    return {"params": full_params(model), "phase": phase, "kinds": kinds, "ages": ages, "refreshes": refreshes}


def replicated(rank: int, world: int, optimizer: str, opts: dict) -> dict:
    """Plain (DDP-style replicated) parameters with the Newton-Schulz work split over the world group."""
    model, _ = make("odd", "adamw", {}, None)
    opt = build(
        optimizer,
        param_groups(model, split_sizes=MODELS["odd"][2]),
        lr=LR,
        weight_decay=0.05,
        ns_dtype=torch.float32,
        process_group=dist.group.WORLD,
        **opts,
    )
    refreshes: list = []
    stats = train(model, opt, "odd", 0, STEPS, refreshes)
    return {"params": full_params(model), "stats": stats, "refreshes": refreshes}


def replicate_dtensor(rank: int, world: int, steps: int = 4) -> dict:
    """``Replicate()`` DTensor parameters with seeded gradients: work split by owners, results broadcast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    shapes = [(13, 12), (40, 13), (16, 40), (16, 16), (3, 48)]
    plain = [torch.randn(s) for s in shapes]
    params = [nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()])) for w in plain]
    opt = build("periodic_row_muon", params, lr=LR, weight_decay=0.05, ns_dtype=torch.float32, k=2)
    stats = []
    for t in range(steps):
        g = torch.Generator().manual_seed(500 + t)
        for p, s in zip(params, shapes):
            p.grad = distribute_tensor(torch.randn(s, generator=g), mesh, [Replicate()])
        opt.reset_comm_stats()
        opt.step()
        stats.append(opt.comm_stats())
    return {"params": [p.full_tensor().clone() for p in params], "stats": stats}


def _poison(model: nn.Module, name: str) -> None:
    """NaN in the local gradient of parameter ``name`` (every rank holds rows of it)."""
    grad = dict(model.named_parameters())[name].grad
    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")


def nonfinite_on_one_rank(rank: int, world: int, cases: list[tuple[str, str, str, int]]) -> dict:
    """NaN gradients on the last rank only, at step ``bad``: what each rank did at every step.

    ``layout`` is "fsdp" (FSDP2 DTensors) or "ddp" (plain replicated parameters, ``process_group=``).
    """
    results = {}
    for key, layout, mode, bad in cases:
        opts = {"k": 2, "nonfinite": mode}
        if layout == "fsdp":
            model, opt = make("odd", "periodic_row_muon", opts, world)
        else:
            model, _ = make("odd", "adamw", {}, None)
            opt = build(
                "periodic_row_muon",
                param_groups(model, split_sizes=MODELS["odd"][2]),
                lr=LR,
                ns_dtype=torch.float32,
                process_group=dist.group.WORLD,
                **opts,
            )
        outcomes = []
        for t in range(3):
            x, y = batch("odd", t)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if t == bad and rank == world - 1:
                _poison(model, "b.weight")
            try:
                opt.step()
                outcomes.append("stepped")
            except FloatingPointError as e:
                outcomes.append(f"raised: {e}")
        results[key] = {
            "outcomes": outcomes,
            "skipped": opt.skipped_steps,
            "phase": [g["step"] for g in opt.param_groups],
            "params": full_params(model),
        }
    return results


# Every engine path, and the options that change what it allocates.
DEVICE_CASES = [
    (
        "local",
        "periodic_row_muon",
        {"k": 2, "ns_coefficients": "polar_express", "ns_algorithm": "gram", "adamw_fused": False},
    ),
    ("fsdp_gather", "periodic_row_muon", {"k": 2, "comm_dtype": torch.bfloat16}),  # RowNorm with m > n
    ("fsdp_owner", "muon", {"refresh": "owner", "ns_algorithm": "gram", "ns_coefficients": "polar_express"}),
    ("fsdp_blocks", "muon_bp", {"period": 2}),
    ("ddp_replicated", "muon_bp", {"period": 2, "blocks": 2}),
    ("replicate_dtensor", "periodic_row_muon", {"k": 2}),
    ("fsdp_adaptive", "adaptive_row_muon", {"threshold": 0.3, "k_min": 1, "k_max": 3}),  # its reference state
]


def _device_case(key: str, optimizer: str, opts: dict, world: int, trap: bool) -> dict[str, torch.Tensor]:
    """Build and step one case; with ``trap``, the optimizer is built and stepped (and its state saved and
    loaded) with the default device set to meta, so any tensor made without ``device=`` lands there."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model, _ = make("odd", "adamw", {}, world if key.startswith("fsdp") else None)
    if key == "replicate_dtensor":
        mesh = init_device_mesh("cpu", (world,))
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    if key == "ddp_replicated":
        opts = {**opts, "process_group": dist.group.WORLD}
    trapped = torch.device("meta") if trap else contextlib.nullcontext()
    with trapped:
        opt = build(optimizer, param_groups(model, split_sizes=MODELS["odd"][2]), lr=LR, weight_decay=0.05, **opts)
    for t in range(4):
        x, y = batch("odd", t)
        if key == "replicate_dtensor":
            x, y = (distribute_tensor(v, model.a.weight.device_mesh, [Replicate()]) for v in (x, y))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with trapped:
            opt.step()
            if t == 1:
                opt.load_state_dict(opt.state_dict())
    misplaced = misplaced_state(opt)
    assert not misplaced, (key, misplaced)
    return full_params(model)


def misplaced_state(opt) -> list[str]:
    """State tensors not on their parameter's device, except where torch itself keeps them elsewhere: AdamW's
    step counter on the CPU when the foreach kernel runs (``adamw_fused=False``)."""
    return [
        f"{name!r} on {v.device} for a parameter on {p.device}"
        for p, state in opt.state.items()
        for name, v in state.items()
        if isinstance(v, torch.Tensor)
        and v.device != p.device
        and not (name == "step" and v.device.type == "cpu" and opt.adamw_fused is False)
    ]


def device_audit(rank: int, world: int) -> dict:
    """Each case with the meta trap and without: the trap must neither break nor change anything."""
    with torch.device("meta"):
        assert torch.empty(1).device.type == "meta"  # the trap catches an allocation without device=
    out = {}
    for key, optimizer, opts in DEVICE_CASES:
        try:
            trapped = _device_case(key, optimizer, opts, world, trap=True)
        except Exception as e:
            raise RuntimeError(f"case {key!r} made or mixed a tensor on another device: {e}") from e
        out[key] = (trapped, _device_case(key, optimizer, opts, world, trap=False))
    return out


def _train_dropping(model, opt, start: int, stop: int, rank: int) -> None:
    """Training steps in which rank 1 never has a gradient for the LayerNorm weight (an AdamW parameter)."""
    for t in range(start, stop):
        x, y = batch("odd", t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if rank == 1:
            model.norm.weight.grad = None
        opt.step()


def dcp_early_saves(rank: int, world: int, root: str) -> dict:
    """Save with DCP before the first step, then train 6 steps (the uninterrupted run), reading the
    optimizer state's keys again after 3 steps in which rank 1 had no gradient for one parameter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make("odd", "periodic_row_muon", {"k": 3}, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    keys = [sorted(optim_sd["state"])]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/step0")
    phase = [g["step"] for g in opt.param_groups]
    _train_dropping(model, opt, 0, 3, rank)
    keys.append(sorted(get_state_dict(model, opt)[1]["state"]))
    _train_dropping(model, opt, 3, 6, rank)
    return {"params": full_params(model), "keys": keys, "phase": phase}


def dcp_early_resume(rank: int, world: int, root: str) -> dict:
    """Resume the checkpoint taken before the first step and train the same 6 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = make("odd", "periodic_row_muon", {"k": 3}, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{root}/step0")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train_dropping(model, opt, 0, 6, rank)
    return full_params(model)


# Sharded paths that one process can run (world 1: gloo on CPU, NCCL on one GPU).
ONE_PROCESS_CASES = [
    ("gather", "muon", {"refresh": "gather"}),
    ("owner", "muon", {"refresh": "owner"}),
    ("rownorm", "periodic_row_muon", {"k": 2}),
    ("blocks", "muon_bp", {"period": 2}),
    ("replicated", "periodic_row_muon", {"k": 2, "process_group": "world"}),
    ("adamw_only", "muon_adamw_only", {}),
    ("adamw_foreach", "muon_adamw_only", {"adamw_fused": False}),
    ("adaptive", "adaptive_row_muon", {"threshold": 0.3, "k_min": 1, "k_max": 3}),
]


def grouped_broadcasts(rank: int, world: int, device: str) -> dict:
    """Three broadcasts from rank 0 through the engine's :meth:`Collectives.broadcasts` on ``device``'s backend:
    the values each rank ends with, whether the backend groups them, and the counted calls and launches."""
    from dimuon.optim.distributed.collectives import Collectives, CommCounter, groups_launches

    counter = CommCounter()
    comm = Collectives(None, counter)
    pieces = [(torch.full((n,), float(rank == 0) * (n + 1), device=device), 0) for n in (3, 5, 2)]
    comm.broadcasts(pieces).wait()
    stats = counter.stats()["broadcast"]
    return {
        "values": [t.cpu().tolist() for t, _ in pieces],
        "grouped": groups_launches(None, torch.device(device)),
        "calls": stats["calls"],
        "launches": stats["launches"],
    }


def one_process_sharded(rank: int, world: int, device: str) -> dict:
    """Each case sharded (or replicated) against the same optimizer in one process, on ``device``: the gap,
    where every state tensor lives, and the exposed communication time."""
    out = {}
    for key, optimizer, opts in ONE_PROCESS_CASES:
        replicated = opts.get("process_group") == "world"
        if replicated:
            opts = {**opts, "process_group": dist.group.WORLD}
        model, opt = make("odd", optimizer, opts, None if replicated else world, device)
        train_on(model, opt, device, 4)
        local = {k: v for k, v in opts.items() if k not in ("refresh", "process_group")}
        reference, ref_opt = make("odd", optimizer, local, None, device)
        train_on(reference, ref_opt, device, 4)
        got, expect = full_params(model), full_params(reference)
        stats = opt.comm_stats()
        out[key] = {
            "gap": max((got[n] - expect[n]).abs().max().item() for n in expect),
            "misplaced": misplaced_state(opt),
            "exposed": [v["exposed_s"] for v in stats.values()],
            "kinds": sorted(stats),
        }
    return out


def train_on(model, opt, device: str, steps: int) -> None:
    for t in range(steps):
        x, y = batch("odd", t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
