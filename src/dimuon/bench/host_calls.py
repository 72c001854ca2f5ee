"""The host's share of an optimizer step, counted: Python calls made inside dimuon per step.

On an accelerator the kernels of a step on small matrices take next to no time and the step is the Python that
dispatches them; its calls should grow with groups, shape classes and step kinds, not with matrices. This counts
them in the accelerator's form of the step (:func:`dimuon.optim.devices.cpu_path` off) on tiny DiT-like blocks
(qkv, proj, fc1, fc2, adaLN: five matrices a block), as ``python -m dimuon.bench.host_calls`` prints:

- ``--ms``: the median host time per step too, unprofiled;
- ``--sharded W``: rank 0's step of an FSDP2 layout of W ranks on torch's fake process group, as
  ``dimuon bench host``'s sharded rows take it, owner refresh;
- ``--sharded W --experts``: rank 0's step of 8, 32 and 128 stacked expert weights on W ranks instead, experts
  whole under expert parallelism and experts with their rows split by FSDP, under each refresh.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from dimuon.bench.host_probe import accelerator_form, dimuon_calls
from dimuon.bench.host_report import sharded_name
from dimuon.optim import build

OPTIMIZERS = ("muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon")


def tiny_blocks(blocks: int, width: int = 8) -> list[torch.nn.Parameter]:
    """``blocks`` DiT-like blocks of tiny matrices, each with a gradient: qkv, proj, fc1, fc2 and adaLN."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width), (6 * width, width)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for _ in range(blocks) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


OPTIONS: dict[str, dict[str, Any]] = {"muon_bp": {"blocks": 2}}  # block steps that cut the matrices

EXPERT_WEIGHTS = (8, 32, 128)  # stacked expert weights: the sizes --experts counts at
# Rank 0's stacked experts on W ranks: whole experts, one a rank, under expert parallelism (``Shard(0)`` over ep=W);
# or experts over ep=8 with each expert's rows split by FSDP over the other W/8 ranks (torchtitan's efsdp,
# ``(Shard(0), Shard(1))``), one row-sharded matrix of several regions on rank 0.
EXPERT_LAYOUTS = ("ep", "ep_efsdp")
EXPERT_PARALLEL = 8  # ep's degree in the ep_efsdp layout


def expert_weights(count: int, layout: str, world: int) -> list[torch.nn.Parameter]:
    """``count`` stacked ``(E, rows, cols)`` expert weights, wide and tall in turn, laid out by ``layout`` on a mesh
    of ``world`` fake ranks (the process group must be up) as rank 0 holds them, each with a gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from dimuon.bench.host_sharded import fake_sharded_parameter

    if layout == "ep":
        experts, split = world, 1
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        placements = [Shard(0)]
    else:
        experts, split = EXPERT_PARALLEL, world // EXPERT_PARALLEL
        mesh = init_device_mesh("cpu", (EXPERT_PARALLEL, split), mesh_dim_names=("ep", "efsdp"))
        placements = [Shard(0), Shard(1)]
    unit = 4 * split  # four rows of each expert on each rank
    g = torch.Generator().manual_seed(0)
    shapes = [(experts, unit, 2 * unit), (experts, 2 * unit, unit // 2)]  # wide, tall
    return [fake_sharded_parameter(shapes[i % 2], mesh, placements, g) for i in range(count)]


@contextlib.contextmanager
def _stepping(
    name: str, matrices: int, world: int = 0, experts: str | None = None, **options: Any
) -> Iterator[torch.optim.Optimizer]:
    """Optimizer ``name`` in the accelerator form on ``matrices`` tiny matrices (a multiple of 5), gradients set:
    in one process with one AdamW bias, or (``world``) on rank 0 of that many fake FSDP2 ranks, the blocks'
    biases in AdamW, or (``experts``, a layout of :data:`EXPERT_LAYOUTS`) on that many stacked expert weights laid
    out on ``world`` fake ranks."""
    options = {**OPTIONS.get(name, {}), **options}
    if experts:
        from dimuon.bench.census import fake_collectives, fake_rank

        with accelerator_form(), fake_rank(0, world), fake_collectives():
            groups = [{"params": expert_weights(matrices, experts, world), "stacked": True}]
            yield build(name, groups, lr=1e-3, **options)
        return
    if world:
        from dimuon.bench import host, host_sharded

        with accelerator_form(), host_sharded.fake_world(world) as mesh:
            yield build(name, host_sharded.shard(host.make_model(matrices, host.Config()), mesh), lr=1e-3, **options)
        return
    params = tiny_blocks(matrices // 5)
    bias = torch.nn.Parameter(torch.zeros(8))
    bias.grad = torch.ones(8)
    groups = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    with accelerator_form():
        yield build(name, groups, lr=1e-3, **options)


def step_calls(name: str, matrices: int, steps: int = 30, warmup: int = 10, **options: Any) -> float:
    """Mean calls into dimuon per step of optimizer ``name`` on ``matrices`` tiny matrices, over ``steps`` steps
    (whole periods: 30 is a multiple of every default period) after ``warmup`` (past the first step of every kind,
    which makes the plans and what they keep), in the accelerator form; ``world`` and ``experts`` in ``options``
    place it as :func:`_stepping` does, the rest go to the optimizer."""
    with _stepping(name, matrices, **options) as opt:
        for _ in range(warmup):
            opt.step()
        return sum(dimuon_calls(opt.step) for _ in range(steps)) / steps


def step_ms(name: str, matrices: int, steps: int = 30, warmup: int = 10, **options: Any) -> float:
    """Median host milliseconds per step, as :func:`step_calls` steps (tiny tensors: the host's work is the step)."""
    with _stepping(name, matrices, **options) as opt:
        for _ in range(warmup):
            opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def table_rows(world: int, experts: bool) -> tuple[tuple[int, ...], list[tuple[str, str, dict[str, Any]]]]:
    """The sizes counted at, and each row's optimizer, title and options: every optimizer in one process or on
    rank 0 of ``world`` fake FSDP2 ranks at 20, 140 and 560 matrices; with ``experts``, every optimizer and refresh
    on each expert layout at :data:`EXPERT_WEIGHTS`."""
    if not experts:
        title = (lambda name: sharded_name(name, world)) if world else (lambda name: name)
        return (20, 140, 560), [(name, title(name), {"world": world}) for name in OPTIMIZERS]
    rows = [
        (name, f"{name} [{layout} W={world}] {refresh}", {"world": world, "experts": layout, "refresh": refresh})
        for layout in EXPERT_LAYOUTS
        for name in OPTIMIZERS
        for refresh in ("gather", "owner")
    ]
    return EXPERT_WEIGHTS, rows


def main(argv: list[str] | None = None) -> None:
    """Print calls per step (and host ms with ``--ms``) at 20, 140 and 560 matrices for each optimizer (with
    ``--sharded W``: on rank 0 of W fake FSDP2 ranks; with ``--experts`` too: at 8, 32 and 128 stacked expert
    weights on each expert layout of W fake ranks, each refresh)."""
    parser = argparse.ArgumentParser(prog="python -m dimuon.bench.host_calls", description=main.__doc__)
    parser.add_argument("--ms", action="store_true", help="the median host ms per step too (unprofiled)")
    parser.add_argument("--sharded", type=int, default=0, metavar="W", help="rank 0 of W fake FSDP2 ranks (W >= 2)")
    parser.add_argument(
        "--experts",
        action="store_true",
        help=f"stacked expert weights on W ranks (--sharded W, a multiple of {EXPERT_PARALLEL}, >= "
        f"{2 * EXPERT_PARALLEL}): {', '.join(EXPERT_LAYOUTS)}",
    )
    args = parser.parse_args(argv)
    if args.sharded == 1 or args.sharded < 0:
        parser.error(f"--sharded must be a world size >= 2, got {args.sharded}")
    if args.experts and (args.sharded < 2 * EXPERT_PARALLEL or args.sharded % EXPERT_PARALLEL):
        parser.error(
            f"--experts needs --sharded W, a multiple of {EXPERT_PARALLEL} and >= {2 * EXPERT_PARALLEL} (ep="
            f"{EXPERT_PARALLEL} x efsdp=W/{EXPERT_PARALLEL} >= 2), got --sharded {args.sharded}"
        )
    sizes, rows = table_rows(args.sharded, args.experts)
    wide = max(len(title) for _, title, _ in rows) + 2
    header = f"{'optimizer':<{wide}}" + "".join(f"{n:>10}" for n in sizes) + f"{f'{sizes[-1]}/{sizes[0]}':>10}"
    print(header + "".join(f"{f'ms@{n}':>9}" for n in sizes[:2] if args.ms))
    for name, title, options in rows:
        counts = [step_calls(name, n, nonfinite="skip", **options) for n in sizes]
        row = f"{title:<{wide}}" + "".join(f"{c:>10.0f}" for c in counts) + f"{counts[-1] / counts[0]:>9.2f}x"
        if args.ms:
            row += "".join(f"{step_ms(name, n, nonfinite='skip', **options):>9.2f}" for n in sizes[:2])
        print(row, flush=True)


if __name__ == "__main__":
    main()
