"""The host's share of an optimizer step, counted: Python calls made inside dimuon per step.

On an accelerator the kernels of a step on small matrices take next to no time and the step is the Python that
dispatches them; its calls should grow with groups, shape classes and step kinds, not with matrices. This counts
them in the accelerator's form of the step (:func:`dimuon.optim.devices.cpu_path` off) on tiny DiT-like blocks
(qkv, proj, fc1, fc2, adaLN: five matrices a block), as ``python -m dimuon.bench.host_calls [--ms]`` prints
(``--ms``: the median host time per step too, unprofiled).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from dimuon.bench.host_probe import accelerator_form, dimuon_calls
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


def _stepping(name: str, matrices: int, **options: Any) -> torch.optim.Optimizer:
    """Optimizer ``name`` on ``matrices`` tiny matrices (a multiple of 5) and one AdamW bias, gradients set."""
    params = tiny_blocks(matrices // 5)
    bias = torch.nn.Parameter(torch.zeros(8))
    bias.grad = torch.ones(8)
    groups = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    return build(name, groups, lr=1e-3, **{**OPTIONS.get(name, {}), **options})


def step_calls(name: str, matrices: int, steps: int = 6, warmup: int = 2, **options: Any) -> float:
    """Mean calls into dimuon per step of optimizer ``name`` on ``matrices`` tiny matrices, over ``steps`` steps
    after ``warmup``, in the accelerator form."""
    with accelerator_form():
        opt = _stepping(name, matrices, **options)
        for _ in range(warmup):
            opt.step()
        return sum(dimuon_calls(opt.step) for _ in range(steps)) / steps


def step_ms(name: str, matrices: int, steps: int = 30, warmup: int = 3, **options: Any) -> float:
    """Median host milliseconds per step, as :func:`step_calls` steps (tiny tensors: the host's work is the step)."""
    with accelerator_form():
        opt = _stepping(name, matrices, **options)
        for _ in range(warmup):
            opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    """Print calls per step (and host ms with ``--ms``) at 20, 140 and 560 matrices for each optimizer."""
    sizes = (20, 140, 560)
    timed = "--ms" in sys.argv
    print(
        f"{'optimizer':<20}" + "".join(f"{n:>10}" for n in sizes) + "   140/20" + ("   ms@20   ms@140" if timed else "")
    )
    for name in OPTIMIZERS:
        counts = [step_calls(name, n, nonfinite="skip") for n in sizes]
        row = f"{name:<20}" + "".join(f"{c:>10.0f}" for c in counts) + f"   {counts[1] / counts[0]:.2f}x"
        if timed:
            row += "".join(f"{step_ms(name, n, nonfinite='skip'):>8.2f}" for n in sizes[:2])
        print(row)


if __name__ == "__main__":
    main()
