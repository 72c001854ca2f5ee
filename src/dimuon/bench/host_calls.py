"""The host's share of an optimizer step, counted: Python calls made inside dimuon per step.

On an accelerator the kernels of a step on small matrices take next to no time and the step is the Python that
dispatches them; its calls should grow with groups, shape classes and step kinds, not with matrices. This counts
them in the accelerator's form of the step (:func:`dimuon.optim.devices.cpu_path` off) on tiny DiT-like blocks
(qkv, proj, fc1, fc2, adaLN: five matrices a block), as ``python -m dimuon.bench.host_calls [--ms] [--sharded W]``
prints (``--ms``: the median host time per step too, unprofiled; ``--sharded W``: rank 0's step of an FSDP2 layout
of W ranks on torch's fake process group, as ``dimuon bench host``'s sharded rows take it, owner refresh).
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


@contextlib.contextmanager
def _stepping(name: str, matrices: int, world: int = 0, **options: Any) -> Iterator[torch.optim.Optimizer]:
    """Optimizer ``name`` in the accelerator form on ``matrices`` tiny matrices (a multiple of 5), gradients set:
    in one process with one AdamW bias, or (``world``) on rank 0 of that many fake FSDP2 ranks, the blocks'
    biases in AdamW."""
    options = {**OPTIONS.get(name, {}), **options}
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


def step_calls(name: str, matrices: int, steps: int = 30, warmup: int = 10, world: int = 0, **options: Any) -> float:
    """Mean calls into dimuon per step of optimizer ``name`` on ``matrices`` tiny matrices, over ``steps`` steps
    (whole periods: 30 is a multiple of every default period) after ``warmup`` (past the first step of every kind,
    which makes the plans and what they keep), in the accelerator form (``world``: rank 0 of that many fake FSDP2
    ranks)."""
    with _stepping(name, matrices, world, **options) as opt:
        for _ in range(warmup):
            opt.step()
        return sum(dimuon_calls(opt.step) for _ in range(steps)) / steps


def step_ms(name: str, matrices: int, steps: int = 30, warmup: int = 10, world: int = 0, **options: Any) -> float:
    """Median host milliseconds per step, as :func:`step_calls` steps (tiny tensors: the host's work is the step)."""
    with _stepping(name, matrices, world, **options) as opt:
        for _ in range(warmup):
            opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    """Print calls per step (and host ms with ``--ms``) at 20, 140 and 560 matrices for each optimizer (with
    ``--sharded W``: on rank 0 of W fake FSDP2 ranks)."""
    parser = argparse.ArgumentParser(prog="python -m dimuon.bench.host_calls", description=main.__doc__)
    parser.add_argument("--ms", action="store_true", help="the median host ms per step too (unprofiled)")
    parser.add_argument("--sharded", type=int, default=0, metavar="W", help="rank 0 of W fake FSDP2 ranks (W >= 2)")
    args = parser.parse_args(argv)
    if args.sharded == 1 or args.sharded < 0:
        parser.error(f"--sharded must be a world size >= 2, got {args.sharded}")
    sizes, world = (20, 140, 560), args.sharded
    wide = 32 if world else 20
    header = f"{'optimizer':<{wide}}" + "".join(f"{n:>10}" for n in sizes) + "   140/20"
    print(header + ("   ms@20   ms@140" if args.ms else ""))
    for name in OPTIMIZERS:
        title = sharded_name(name, world) if world else name
        counts = [step_calls(name, n, world=world, nonfinite="skip") for n in sizes]
        row = f"{title:<{wide}}" + "".join(f"{c:>10.0f}" for c in counts) + f"   {counts[1] / counts[0]:.2f}x"
        if args.ms:
            row += "".join(f"{step_ms(name, n, world=world, nonfinite='skip'):>8.2f}" for n in sizes[:2])
        print(row)


if __name__ == "__main__":
    main()
