"""The optimizer's collectives, each counted in logical bytes (ALGORITHMS.md section 7).

Logical bytes are what reaches *this* rank from other ranks under the textbook algorithm:
all-gather ``(W-1)/W`` of its output, all-reduce ``2(W-1)/W`` of its tensor (ring), all-to-all
what arrives from the other ranks. They are exact, deterministic and cheap to keep, so tests
assert on them and benchmarks report them next to measured times.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class CommCounter:
    """Per collective kind since the last reset: calls, logical bytes, and seconds this rank sat blocked.

    ``exposed_s`` is the communication time not hidden behind computation: the whole duration of a
    blocking call, and only the time spent in ``wait()`` for an asynchronous one.
    """

    def __init__(self) -> None:
        self._stats: dict[str, dict[str, Any]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "exposed_s": 0.0})

    def record(self, kind: str, logical_bytes: int) -> None:
        entry = self._stats[kind]
        entry["calls"] += 1
        entry["bytes"] += int(logical_bytes)

    def add_exposed(self, kind: str, seconds: float) -> None:
        self._stats[kind]["exposed_s"] += seconds

    def stats(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self._stats.items()}

    def reset(self) -> None:
        self._stats.clear()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class _TimedWork:
    """An async collective handle whose ``wait()`` books the blocked time as exposed."""

    def __init__(self, work: Any, counter: CommCounter, kind: str) -> None:
        self.work, self.counter, self.kind = work, counter, kind

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        self.counter.add_exposed(self.kind, time.perf_counter() - start)


def _timed(counter: CommCounter, kind: str, async_op: bool, call: Callable[[], Any]) -> Any:
    """Run a collective; time it all when blocking, or wrap its handle when asynchronous."""
    if async_op:
        return _TimedWork(call(), counter, kind)
    start = time.perf_counter()
    result = call()
    counter.add_exposed(kind, time.perf_counter() - start)
    return result


class Collectives:
    """Counted collectives over one process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
        self.group = group
        self.counter = counter
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_gather(self, output: Tensor, local: Tensor, async_op: bool = False):
        """``output`` (W * local.numel()) receives every rank's ``local`` in rank order."""
        self.counter.record("all_gather", _nbytes(output) * (self.world - 1) // self.world)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return _timed(self.counter, "all_gather", async_op,
                      lambda: gather(output, local, group=self.group, async_op=async_op))

    def all_reduce(self, tensor: Tensor, async_op: bool = False, kind: str = "all_reduce"):
        """Sum ``tensor`` over ranks in place."""
        self.counter.record(kind, 2 * _nbytes(tensor) * (self.world - 1) // self.world)
        return _timed(self.counter, kind, async_op, lambda: dist.all_reduce(tensor, group=self.group, async_op=async_op))

    def all_true(self, flag: Tensor) -> bool:
        """Whether a boolean holds on every rank (one 4-byte all-reduce)."""
        value = flag.to(torch.int32).reshape(1)
        self.counter.record("all_reduce[check]", 2 * 4 * (self.world - 1) // self.world)
        _timed(self.counter, "all_reduce[check]", False,
               lambda: dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group))
        return bool(value.item())

    def all_to_all(
        self,
        output: Tensor,
        send: Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        async_op: bool = False,
    ):
        """Flat all-to-all: ``send`` is cut by ``input_splits`` per destination, ``output`` by source."""
        arrived = sum(n for r, n in enumerate(output_splits) if r != self.rank)
        self.counter.record("all_to_all", arrived * output.element_size())
        return _timed(self.counter, "all_to_all", async_op, lambda: dist.all_to_all_single(
            output, send, list(output_splits), list(input_splits), group=self.group, async_op=async_op
        ))

    def broadcast(self, tensor: Tensor, src: int, async_op: bool = False):
        """``tensor`` from group rank ``src`` to every rank."""
        self.counter.record("broadcast", _nbytes(tensor) if self.rank != src else 0)
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return _timed(self.counter, "broadcast", async_op,
                      lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op))
