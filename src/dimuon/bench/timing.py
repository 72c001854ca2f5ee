"""Wall-clock timing shared by the benchmarks: warm-up, round-robin sampling, medians.

On a shared or throttling machine the load drifts during a run. Taking one sample of every
candidate per round (instead of all samples of one candidate, then the next) spreads that drift
over all of them, so the ratios between candidates stay meaningful even when absolute times wander.

On a GPU the host only queues kernels: a sample starts and ends with ``torch.cuda.synchronize``
(:func:`synchronizer`), so it measures the work done, launch overhead included, as a training step
experiences it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm


@dataclass
class Candidate:
    """One thing to time: ``fn`` is called ``calls`` times in a row per sample (e.g. a whole period).

    A sample is the mean time per call of those ``calls`` calls; ``warmup`` samples are taken first
    and thrown away. ``setup``, if given, runs untimed before every sample (e.g. to put the same
    gradients back).
    """

    name: str
    fn: Callable[[], Any]
    repeats: int
    warmup: int = 1
    calls: int = 1
    setup: Callable[[], Any] | None = None


@dataclass
class Timing:
    """Samples of one candidate, in seconds per call; ``first`` is its first (warm-up) sample, if it had one."""

    samples: list[float] = field(default_factory=list)
    calls: int = 1
    first: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (milliseconds)."""
        return {
            "median_ms": 1e3 * self.median,
            "min_ms": 1e3 * self.min,
            "max_ms": 1e3 * self.max,
            "repeats": len(self.samples),
            "calls_per_sample": self.calls,
            "samples_ms": [1e3 * s for s in self.samples],
            "first_ms": None if self.first is None else 1e3 * self.first,
        }


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """What waits for a device's queued work: ``torch.cuda.synchronize`` on a GPU, nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_calls(fn: Callable[[], Any], calls: int = 1, sync: Callable[[], None] | None = None) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn`` (``time.perf_counter``), between two ``sync``."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - start) / calls


def interleave(
    candidates: Sequence[Candidate],
    progress: bool = True,
    desc: str = "timing",
    sync: Callable[[], None] | None = None,
    on_round: Callable[[dict[str, Timing]], None] | None = None,
) -> dict[str, Timing]:
    """Warm every candidate up, then sample them round-robin; returns a :class:`Timing` per name.

    Candidates with fewer repeats than others take their samples in the first rounds. ``sync`` waits for
    the device before and after every sample (see :func:`synchronizer`). The first warm-up sample is kept
    apart (``Timing.first``): it holds one-off costs such as state allocation and compilation. ``on_round``
    gets the timings of the candidates sampled so far after every round (a caller that must not lose them
    to a time limit writes them out).
    """
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate names must be unique, got {names}")
    for c in candidates:
        if c.repeats < 1 or c.warmup < 0 or c.calls < 1:
            raise ValueError(f"{c.name}: need repeats >= 1, warmup >= 0, calls >= 1")
    total = sum((c.warmup + c.repeats) * c.calls for c in candidates)
    results = {c.name: Timing(calls=c.calls) for c in candidates}
    with tqdm(total=total, desc=desc, unit="call", disable=not progress, leave=False) as bar:
        for c in candidates:
            bar.set_postfix_str(f"{c.name} (warm-up)")
            for i in range(c.warmup):
                if c.setup is not None:
                    c.setup()
                elapsed = time_calls(c.fn, c.calls, sync)
                if i == 0:
                    results[c.name].first = elapsed
                bar.update(c.calls)
        for round_ in range(max(c.repeats for c in candidates)):
            for c in candidates:
                if round_ < c.repeats:
                    bar.set_postfix_str(c.name)
                    if c.setup is not None:
                        c.setup()
                    results[c.name].samples.append(time_calls(c.fn, c.calls, sync))
                    bar.update(c.calls)
            if on_round is not None:
                on_round({name: t for name, t in results.items() if t.samples})
    return results
