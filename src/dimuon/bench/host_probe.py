"""What one optimizer step asks of the host: Python calls made inside dimuon, dispatched ops, the accelerator form.

On a GPU the host only queues kernels, so a step's floor is its Python and dispatch. These probes count that work on
any machine: :func:`dimuon_calls` counts the calls whose code lives under the dimuon package (``sys.setprofile``),
:func:`accelerator_form` switches the step to the form it takes on a GPU (:func:`dimuon.optim.devices.cpu_path`
off, as the op census does), and :func:`op_seconds` prices one dispatched op of a tiny tensor.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch._dynamo.utils import counters

import dimuon
from dimuon.optim import devices

PACKAGE_DIR = str(Path(dimuon.__file__).resolve().parent)
# where inductor logs why it leaves a graph out of CUDA graphs (a warning, whatever TORCH_LOGS says)
CUDAGRAPH_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"


@contextlib.contextmanager
def accelerator_form() -> Iterator[None]:
    """The step in the form it takes on an accelerator (list ops, no CPU workspace), whatever the device."""
    original = devices.cpu_path
    devices.cpu_path = lambda device: False
    try:
        yield
    finally:
        devices.cpu_path = original


def dimuon_calls(fn: Callable[[], Any], package_dir: str | None = None) -> int:
    """Python function calls made by ``fn()`` whose code lives under the dimuon package (``package_dir``: another
    package directory, for tests); calls into torch or the standard library are not counted."""
    root = PACKAGE_DIR if package_dir is None else str(Path(package_dir).resolve())
    cache: dict[str, bool] = {}
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call":
            name = frame.f_code.co_filename
            hit = cache.get(name)
            if hit is None:
                hit = cache[name] = str(Path(name).resolve()).startswith(root)
            count += hit

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count


def op_seconds(
    device: torch.device | str, repeats: int = 7, ops: int = 2000, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median seconds (on ``clock``) of one dispatched in-place op on a one-element tensor: its dispatch and
    launch, no work."""
    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    samples = []
    for _ in range(repeats + 1):
        sync()
        start = clock()
        for _ in range(ops):
            x.add_(1.0)
        sync()
        samples.append((clock() - start) / ops)
    return statistics.median(samples[1:])


@contextlib.contextmanager
def cudagraph_skips() -> Iterator[dict[str, Any]]:
    """The graphs compiled with ``mode="reduce-overhead"`` inside the block that inductor runs without CUDA graphs
    (``count``, its own counter) and the reasons it gives (``reasons``: a CPU tensor in the graph, an input mutated
    that is not a static address...). Off CUDA every such graph is skipped, without a reason given."""
    found: dict[str, Any] = {"count": 0, "reasons": []}
    before = counters["inductor"]["cudagraph_skips"]

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found["reasons"].append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger(CUDAGRAPH_LOGGER)
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        found["count"] = counters["inductor"]["cudagraph_skips"] - before
