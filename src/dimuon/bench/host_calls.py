"""The host's share of an optimizer step, counted: Python calls made inside dimuon per step.

On an accelerator the kernels of a step on small matrices take next to no time and the step is the Python that
dispatches them; its calls should grow with groups, shape classes and step kinds, not with matrices. This counts
them in the accelerator's form of the step (:func:`dimuon.optim.devices.cpu_path` off) on tiny DiT-like blocks
(qkv, proj, fc1, fc2, adaLN: five matrices a block), as ``python -m dimuon.bench.host_calls`` prints.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from dimuon.optim import build, devices

PACKAGE = str(Path(__file__).resolve().parents[1])  # calls into code under this folder are dimuon's
OPTIMIZERS = ("muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon")


@contextlib.contextmanager
def accelerator_form() -> Iterator[None]:
    """The step's accelerator form on any device: the device switch off, as the op census counts it."""
    original = devices.cpu_path
    devices.cpu_path = lambda device: False
    try:
        yield
    finally:
        devices.cpu_path = original


def count_calls(fn: Callable[[], Any]) -> int:
    """Python calls into dimuon's own modules made by one call of ``fn`` (``fn`` itself not counted)."""
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def tiny_blocks(blocks: int, width: int = 8) -> list[torch.nn.Parameter]:
    """``blocks`` DiT-like blocks of tiny matrices, each with a gradient: qkv, proj, fc1, fc2 and adaLN."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width), (6 * width, width)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for _ in range(blocks) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def step_calls(name: str, matrices: int, steps: int = 6, warmup: int = 2, **options: Any) -> tuple[float, float]:
    """Mean calls into dimuon and mean host milliseconds per step of optimizer ``name`` on ``matrices`` tiny
    matrices (a multiple of 5), over ``steps`` steps after ``warmup``, in the accelerator form."""
    params = tiny_blocks(matrices // 5)
    bias = torch.nn.Parameter(torch.zeros(8))
    bias.grad = torch.ones(8)
    groups = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    with accelerator_form():
        opt = build(name, groups, lr=1e-3, **options)
        for _ in range(warmup):
            opt.step()
        calls, start = 0, time.perf_counter()
        for _ in range(steps):
            calls += count_calls(opt.step)
        seconds = time.perf_counter() - start
    return calls / steps, 1e3 * seconds / steps


def main() -> None:
    """Print the table: calls per step at 20, 140 and 560 matrices for each optimizer."""
    sizes = (20, 140, 560)
    print(f"{'optimizer':<20}" + "".join(f"{n:>10}" for n in sizes) + "   140/20")
    for name in OPTIMIZERS:
        counts = [step_calls(name, n, nonfinite="skip")[0] for n in sizes]
        print(f"{name:<20}" + "".join(f"{c:>10.0f}" for c in counts) + f"   {counts[1] / counts[0]:.2f}x")


if __name__ == "__main__":
    main()
