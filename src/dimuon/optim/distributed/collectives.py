"""The optimizer's collectives, counted in logical bytes (docs/algorithms.md, "Logical communication volume").

Logical bytes are what reaches *this* rank from other ranks under the textbook algorithm:
all-gather ``(W-1)/W`` of its output, all-reduce ``2(W-1)/W`` of its tensor (ring), all-to-all
what arrives from the other ranks. They are exact, deterministic and cheap to keep, so tests
assert on them and benchmarks report them next to measured times.

Every count is kept per collective kind and per mesh dimension (the group's label: a mesh dimension's
name, names joined by ``+`` for a flattened group of two, ``process_group`` for a plain group).

Exposed time is measured where the waiting happens: on the host for CPU tensors (gloo blocks the
calling thread), on the stream for CUDA tensors (NCCL's ``wait()`` only makes the current stream
wait, so two CUDA events around it time the stall without blocking the host; they are read when
the statistics are asked for).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Key = tuple[str, str]  # (mesh dimension label, collective kind)

# A compiled step breaks its graph at each collective and at each wait for one: they run as in eager, counted and
# timed on the host (the counter's lists and clocks are not traced), and the math between them stays in graphs.
_boundary = torch.compiler.disable


def _empty_entry() -> dict[str, Any]:
    return {"calls": 0, "bytes": 0, "exposed_s": 0.0, "launches": 0}


class CommCounter:
    """Per mesh dimension and collective kind since the last reset: calls, logical bytes, seconds this rank sat
    blocked, and launches (calls, with the collectives issued as one group launch counted once).

    ``exposed_s`` is the communication time not hidden behind computation: the whole duration of a
    blocking call, and only the time spent in ``wait()`` for an asynchronous one (host time on CPU,
    stream time on CUDA).
    """

    def __init__(self) -> None:
        self._stats: dict[Key, dict[str, Any]] = defaultdict(_empty_entry)
        self._pending: deque[tuple[Key, Any, Any]] = deque()  # (key, start, end) CUDA events not yet read
        self.calls: list[Key] = []  # every collective since the last reset, in the order this rank issued them

    def record(self, key: Key, logical_bytes: int) -> None:
        self.calls.append(key)
        entry = self._stats[key]
        entry["calls"] += 1
        entry["bytes"] += int(logical_bytes)
        entry["launches"] += 1

    def record_many(self, key: Key, logical_bytes: Sequence[int]) -> None:
        """One collective of ``key`` per entry of ``logical_bytes``, each its bytes: as :meth:`record` once each, in
        one call (a rank's broadcasts from every owner, whose count grows with the matrices)."""
        self.calls.extend([key] * len(logical_bytes))
        entry = self._stats[key]
        entry["calls"] += len(logical_bytes)
        entry["bytes"] += int(sum(logical_bytes))
        entry["launches"] += len(logical_bytes)

    def record_group(self, key: Key, calls: int) -> None:
        """The last ``calls`` collectives of ``key`` went out as one group launch."""
        self._stats[key]["launches"] -= calls - 1

    def add_exposed(self, key: Key, seconds: float) -> None:
        self._stats[key]["exposed_s"] += seconds

    @contextmanager
    def exposed(self, key: Key, device: torch.device) -> Iterator[None]:
        """Book the time the body keeps this rank waiting as exposed time of ``key``."""
        if device.type != "cuda":
            start = time.perf_counter()
            yield
            self.add_exposed(key, time.perf_counter() - start)
            return
        stream = torch.cuda.current_stream(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        yield
        end.record(stream)
        self._pending.append((key, begin, end))
        self._read_events(block=False)

    def _read_events(self, block: bool) -> None:
        """Book the CUDA intervals that have completed (all of them, waiting if ``block``)."""
        while self._pending:
            key, begin, end = self._pending[0]
            if not block and not end.query():
                return
            end.synchronize()
            self.add_exposed(key, begin.elapsed_time(end) / 1e3)
            self._pending.popleft()

    def stats(self) -> dict[str, dict[str, Any]]:
        """``{kind: {"calls", "bytes", "exposed_s", "launches"}}`` summed over mesh dimensions."""
        out: dict[str, dict[str, Any]] = defaultdict(_empty_entry)
        for (_, kind), value in self._read().items():
            for field, amount in value.items():
                out[kind][field] += amount
        return dict(out)

    def stats_by_mesh_dim(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{mesh dimension: {kind: {"calls", "bytes", "exposed_s", "launches"}}}``."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (dim, kind), value in self._read().items():
            out.setdefault(dim, {})[kind] = dict(value)
        return out

    def _read(self) -> dict[Key, dict[str, Any]]:
        self._read_events(block=True)
        return self._stats

    def reset(self) -> None:
        self._pending.clear()  # intervals of the window being dropped: discarded unread, no sync
        self._stats.clear()
        self.calls.clear()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class _TimedWork:
    """An async collective handle: ``wait()`` books the blocked time as exposed and only then lets go of the
    tensors the collective reads and writes, so none is freed (and reused) while it may still be in flight."""

    def __init__(self, work: Any, counter: CommCounter, key: Key, tensors: tuple[Tensor, ...]) -> None:
        self.work, self.counter, self.key, self.tensors = work, counter, key, tensors

    @_boundary
    def wait(self) -> None:
        with self.counter.exposed(self.key, self.tensors[0].device):
            self.work.wait()
        self.tensors = ()


def _timed(counter: CommCounter, key: Key, async_op: bool, tensors: tuple[Tensor, ...], call: Callable[[], Any]) -> Any:
    """Run a collective over ``tensors``; time it all when blocking, or wrap its handle when asynchronous."""
    if async_op:
        return _TimedWork(call(), counter, key, tensors)
    with counter.exposed(key, tensors[0].device):
        return call()


class _AllWork:
    """Several async handles as one: ``wait()`` waits for each in turn."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    @_boundary
    def wait(self) -> None:
        for work in self.works:
            work.wait()


# The backends whose ``_start_coalescing``/``_end_coalescing`` group any collective into one launch (NCCL's group
# calls; torch's fake backend accepts the same calls, so a traced mesh counts the launches a cluster would see).
GROUPING_BACKENDS = frozenset({"ProcessGroupNCCL", "FakeProcessGroup"})


def groups_launches(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` can issue several collectives as one group launch."""
    try:
        backend = (group if group is not None else dist.group.WORLD)._get_backend(device)
    except (RuntimeError, ValueError):
        return False
    return type(backend).__name__ in GROUPING_BACKENDS


class Collectives:
    """Counted collectives over one process group (gloo or NCCL), booked under the group's ``label``."""

    def __init__(self, group: dist.ProcessGroup | None, counter: CommCounter, label: str = "process_group") -> None:
        self.group = group
        self.counter = counter
        self.label = label
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _key(self, kind: str) -> Key:
        return (self.label, kind)

    @_boundary
    def all_gather(self, output: Tensor, local: Tensor, async_op: bool = False):
        """``output`` (W * local.numel()) receives every rank's ``local`` in rank order."""
        self.counter.record(self._key("all_gather"), _nbytes(output) * (self.world - 1) // self.world)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return _timed(
            self.counter,
            self._key("all_gather"),
            async_op,
            (output, local),
            lambda: gather(output, local, group=self.group, async_op=async_op),
        )

    @_boundary
    def all_reduce(self, tensor: Tensor, async_op: bool = False, kind: str = "all_reduce"):
        """Sum ``tensor`` over ranks in place."""
        self.counter.record(self._key(kind), 2 * _nbytes(tensor) * (self.world - 1) // self.world)
        return _timed(
            self.counter,
            self._key(kind),
            async_op,
            (tensor,),
            lambda: dist.all_reduce(tensor, group=self.group, async_op=async_op),
        )

    @_boundary
    def all_max(self, values: Tensor, kind: str = "all_reduce[agree]") -> Tensor:
        """``values`` replaced in place by their elementwise maximum over the ranks (identical on every rank)."""
        self.counter.record(self._key(kind), 2 * _nbytes(values) * (self.world - 1) // self.world)
        _timed(
            self.counter,
            self._key(kind),
            False,
            (values,),
            lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group),
        )
        return values

    @_boundary
    def all_true(self, flag: Tensor) -> Tensor:
        """``flag`` AND-ed over the ranks by one all-reduce, on ``flag``'s device (no host read): a 0-d bool in 4
        bytes, or each flag of a 1-D bool tensor (a contiguous one, AND-ed in place) in one byte."""
        value = flag.to(torch.int32).reshape(1) if flag.dim() == 0 else flag.view(torch.uint8)
        self.counter.record(self._key("all_reduce[check]"), 2 * _nbytes(value) * (self.world - 1) // self.world)
        _timed(
            self.counter,
            self._key("all_reduce[check]"),
            False,
            (value,),
            lambda: dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group),
        )
        return value[0] > 0 if flag.dim() == 0 else value.view(torch.bool)

    @_boundary
    def all_to_all(
        self,
        output: Tensor,
        send: Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        async_op: bool = False,
    ):
        """Flat all-to-all: ``send`` is cut by ``input_splits`` per destination, ``output`` by source."""
        arrived = sum(output_splits) - output_splits[self.rank]  # from the other ranks (no Python loop over them)
        self.counter.record(self._key("all_to_all"), arrived * output.element_size())
        return _timed(
            self.counter,
            self._key("all_to_all"),
            async_op,
            (output, send),
            lambda: dist.all_to_all_single(
                output, send, list(output_splits), list(input_splits), group=self.group, async_op=async_op
            ),
        )

    @_boundary
    def broadcasts(self, pieces: Sequence[tuple[Tensor, int]]) -> Any:
        """Each ``(tensor, src)`` broadcast from group rank ``src``, async; one handle whose ``wait()`` waits for all.

        On a backend that groups collectives (NCCL, and torch's fake backend that traces it) they go out as one
        group launch (``ncclGroupStart``/``End``): one launch and one completion for the lot, not one per owner,
        each still carrying its own bytes. Elsewhere (gloo has no grouping) one async broadcast each."""
        if not pieces:
            return _AllWork([])
        device = pieces[0][0].device
        if not groups_launches(self.group, device):
            return _AllWork([self.broadcast(tensor, src, async_op=True) for tensor, src in pieces])
        key = self._key("broadcast")
        self.counter.record_many(key, [t.numel() * t.element_size() if self.rank != src else 0 for t, src in pieces])
        with dist._coalescing_manager(self.group, device, async_ops=True) as grouped:
            for tensor, src in pieces:
                global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
                dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)  # its handle: the group's
        self.counter.record_group(key, len(pieces))
        return _TimedWork(grouped, self.counter, key, tuple([tensor for tensor, _ in pieces]))

    @_boundary
    def broadcast(self, tensor: Tensor, src: int, async_op: bool = False):
        """``tensor`` from group rank ``src`` to every rank."""
        self.counter.record(self._key("broadcast"), _nbytes(tensor) if self.rank != src else 0)
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return _timed(
            self.counter,
            self._key("broadcast"),
            async_op,
            (tensor,),
            lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op),
        )
