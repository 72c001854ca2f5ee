"""Count collectives at the ``torch.distributed`` call boundary, in logical bytes per rank.

While :func:`count_collectives` is active, the collective functions of
``torch.distributed.distributed_c10d`` and of ``torch.distributed._functional_collectives`` (the path
DTensor redistribution takes: ``full_tensor()``, ``redistribute()``) are replaced by wrappers that
book each call, in those modules and in every loaded module that imported one of them by name
(``from torch.distributed import gather``). Any optimizer's traffic is therefore counted the same
way, whether it calls ``torch.distributed`` itself or lets DTensor do it, and whatever it reports.

Logical bytes are those that reach *this* rank from the others under the textbook algorithm of each
kind (docs/algorithms.md, "Logical communication volume", extended to every kind), with ``W`` the
group size and ``N`` the bytes of the tensor named:

- all-gather: ``(W-1)/W`` of the gathered output; all-reduce: ``2(W-1)/W N``; reduce-scatter:
  ``(W-1)/W`` of the input; all-to-all: what arrives from other ranks; broadcast and scatter: ``N``
  on every rank but the source; gather: the other ranks' tensors on the destination; reduce:
  ``(W-1)/W N`` on every rank plus ``(W-1)/W N`` more on the destination; point-to-point: ``N`` on
  the receiver; permute: ``N`` on a rank that receives from another.
- Only the outermost call is booked, under its own kind, so a collective implemented with others
  (``all_gather_into_tensor`` -> ``all_gather_single``) counts once. Object collectives
  (``all_gather_object``, ...) count one call and the bytes of the tensor collectives they issue.
- DTensor's ``Shard(i) -> Shard(j)`` redistribution (``shard_dim_alltoall``) is booked as the
  all-to-all it is, on every backend (gloo runs it as an all-gather plus a local chunk).

Besides the totals per kind, the counter keeps every booked call in issue order (:class:`CallRecord`: kind,
process group, its size, payload dtype, logical bytes and the largest tensor the call names), so a caller can
split the count per process group and compare the sequences of ranks.

Not seen: collectives called as ``torch.ops`` directly by other code, inside a ``torch.compile``d
graph, or through a reference bound before entering and held elsewhere than a module attribute.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import Tensor

__all__ = ["CallCounter", "CallRecord", "count_collectives", "fold_kinds"]


@dataclass(frozen=True)
class CallRecord:
    """One booked collective: its kind, the process group's name (``group_name``) and size, the dtype of the
    tensors it names, its logical bytes, and the bytes of the largest of them (a buffer the call needs)."""

    kind: str
    group: str
    world: int
    dtype: str
    bytes: int
    buffer_bytes: int


class CallCounter:
    """Calls and logical bytes per collective kind since the last reset (this rank's view), and every call in
    the order this rank issued it (``log``)."""

    def __init__(self) -> None:
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})
        self.log: list[CallRecord] = []

    def record(self, kind: str, calls: int, logical_bytes: int, call: CallRecord | None = None) -> None:
        entry = self._stats[kind]
        entry["calls"] += calls
        entry["bytes"] += int(logical_bytes)
        if call is not None:
            self.log.append(call)

    def stats(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": n, "bytes": b}}``, the format of ``opt.comm_stats()`` without timings."""
        return {k: dict(v) for k, v in self._stats.items()}

    def total_bytes(self) -> int:
        return sum(v["bytes"] for v in self._stats.values())

    def reset(self) -> None:
        self._stats.clear()
        self.log.clear()


def fold_kinds(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Calls and bytes per plain kind: ``all_reduce[check]`` is added to ``all_reduce``, timings dropped.

    Makes an optimizer's own ``comm_stats()`` comparable with what the boundary counter sees.
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for kind, value in stats.items():
        entry = out[kind.split("[", 1)[0]]
        entry["calls"] += int(value["calls"])
        entry["bytes"] += int(value["bytes"])
    return dict(out)


# ------------------------------------------------------------------------------- group geometry


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _c10d_geometry(group: Any) -> tuple[int, int]:
    """(W, this rank's index) in a ``distributed_c10d`` group (None: the default group)."""
    return dist.get_world_size(group), dist.get_rank(group)


def _c10d_peer(group: Any, global_rank: int | None, group_rank: int | None) -> int:
    """The group rank of a ``src``/``dst`` given either as a global rank or as ``group_src``/``group_dst``."""
    if group_rank is not None:
        return group_rank
    if global_rank is None:
        return 0
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _resolve_group(group: Any) -> Any:
    """A collective's group as a process group (None: the default one), from any form the two APIs take: a
    process group, its name, a 1-D mesh or ``(mesh, dim)``; a list of global ranks (or rows of them) is returned
    as it is."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


def _funcol_geometry(group: Any) -> tuple[int, int]:
    """(W, this rank's index) of a functional-collective group: a process group, its name, a 1-D mesh,
    ``(mesh, dim)`` or a list of global ranks."""
    group = _resolve_group(group)
    if isinstance(group, list):  # global ranks, or rows of them (this rank's row is its group)
        mine = dist.get_rank()
        row = next(r for r in group if mine in r) if isinstance(group[0], list) else group
        return len(row), row.index(mine)
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all_bytes(out: Tensor, splits: Sequence[int] | None, world: int, rank: int) -> int:
    """Bytes arriving from other ranks: ``splits`` are rows (dim 0) of ``out`` per source rank."""
    if splits is None:
        return _all_but_own_share(_nbytes(out), world)
    row_bytes = _nbytes(out) // out.shape[0] if out.ndim and out.shape[0] else out.element_size()
    return sum(int(n) for r, n in enumerate(splits) if r != rank) * row_bytes


def _others(tensors: Sequence[Tensor] | None, rank: int) -> int:
    return sum(_nbytes(t) for r, t in enumerate(tensors or ()) if r != rank)


def _group_name(group: Any) -> tuple[str, int]:
    """(``group_name``, size) of a collective's group in any form the two APIs take (None: the default group)."""
    group = _resolve_group(group)
    if isinstance(group, list):
        world, _ = _funcol_geometry(group)
        return f"ranks{group}", world
    group = dist.group.WORLD if group is None else group
    return group.group_name, dist.get_world_size(group)


def _call_record(kind: str, arguments: dict[str, Any], nbytes: int) -> CallRecord:
    """The :class:`CallRecord` of a call with these bound arguments: the first tensor's dtype, the largest one."""
    tensors = [
        t for v in arguments.values() for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, Tensor)
    ]
    name, world = _group_name(arguments.get("group"))
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
    return CallRecord(kind, name, world, dtype, int(nbytes), max((_nbytes(t) for t in tensors), default=0))


# ------------------------------------------------------------------- byte rules, one per function
# Each rule takes the call's bound arguments (defaults applied) and returns logical bytes.

Geometry = Callable[[Any], tuple[int, int]]


def _ring_all_reduce(nbytes: int, world: int) -> int:
    return 2 * nbytes * (world - 1) // world


def _all_but_own_share(nbytes: int, world: int) -> int:
    return nbytes * (world - 1) // world


def _every_other_rank(nbytes: int, world: int) -> int:
    return nbytes * (world - 1)


def _per_tensor(arg: str, share: Callable[[int, int], int], geometry: Geometry) -> Callable[[dict[str, Any]], int]:
    """The rule ``share(bytes, W)`` summed over the tensor, or the list of tensors, passed as ``arg``."""

    def rule(a: dict[str, Any]) -> int:
        world, _ = geometry(a["group"])
        tensors = a[arg] if isinstance(a[arg], (list, tuple)) else [a[arg]]
        return sum(share(_nbytes(t), world) for t in tensors)

    return rule


def _c10d_all_gather(a: dict[str, Any]) -> int:
    return _others(a["tensor_list"], _c10d_geometry(a["group"])[1])


def _c10d_all_gather_coalesced(a: dict[str, Any]) -> int:
    rank = _c10d_geometry(a["group"])[1]
    return sum(_others(lst, rank) for lst in a["output_tensor_lists"])


def _c10d_all_to_all_single(a: dict[str, Any]) -> int:
    w, rank = _c10d_geometry(a["group"])
    return _all_to_all_bytes(a["output"], a["output_split_sizes"], w, rank)


def _c10d_all_to_all(a: dict[str, Any]) -> int:
    return _others(a["output_tensor_list"], _c10d_geometry(a["group"])[1])


def _c10d_broadcast(a: dict[str, Any]) -> int:
    _, rank = _c10d_geometry(a["group"])
    return 0 if rank == _c10d_peer(a["group"], a["src"], a["group_src"]) else _nbytes(a["tensor"])


def _c10d_gather(a: dict[str, Any]) -> int:
    _, rank = _c10d_geometry(a["group"])
    return _others(a["gather_list"], rank) if rank == _c10d_peer(a["group"], a["dst"], a["group_dst"]) else 0


def _c10d_scatter(a: dict[str, Any]) -> int:
    _, rank = _c10d_geometry(a["group"])
    return 0 if rank == _c10d_peer(a["group"], a["src"], a["group_src"]) else _nbytes(a["tensor"])


def _c10d_reduce(a: dict[str, Any]) -> int:
    w, rank = _c10d_geometry(a["group"])
    share = _all_but_own_share(_nbytes(a["tensor"]), w)
    return 2 * share if rank == _c10d_peer(a["group"], a["dst"], a["group_dst"]) else share


def _c10d_send(a: dict[str, Any]) -> int:
    return 0


def _c10d_recv(a: dict[str, Any]) -> int:
    return _nbytes(a["tensor"])


def _c10d_batch_p2p(a: dict[str, Any]) -> int:
    return sum(_nbytes(op.tensor) for op in a["p2p_op_list"] if getattr(op.op, "__name__", "") in ("irecv", "recv"))


def _funcol_all_to_all_single(a: dict[str, Any]) -> int:
    w, rank = _funcol_geometry(a["group"])
    return _all_to_all_bytes(a["self"], a["output_split_sizes"], w, rank)


def _funcol_broadcast(a: dict[str, Any]) -> int:
    _, rank = _funcol_geometry(a["group"])
    return 0 if rank == a["src"] else _nbytes(a["self"])


def _funcol_permute(a: dict[str, Any]) -> int:
    _, rank = _funcol_geometry(a["group"])
    sources = [src for src, dst in enumerate(a["src_dst"]) if dst == rank]
    return _nbytes(a["self"]) if sources and sources[0] != rank else 0


def _dtensor_shard_dim_alltoall(a: dict[str, Any]) -> int:
    return _all_but_own_share(_nbytes(a["input"]), a["mesh"].size(a["mesh_dim"]))


@dataclass(frozen=True)
class _Rule:
    kind: str
    nbytes: Callable[[dict[str, Any]], int] | None  # None: an object collective, booked by what it issues


_C10D_RULES: dict[str, _Rule] = {
    "all_gather_single": _Rule("all_gather", _per_tensor("output_tensor", _all_but_own_share, _c10d_geometry)),
    "all_gather_into_tensor": _Rule("all_gather", _per_tensor("output_tensor", _all_but_own_share, _c10d_geometry)),
    "all_gather": _Rule("all_gather", _c10d_all_gather),
    "all_gather_coalesced": _Rule("all_gather", _c10d_all_gather_coalesced),
    "all_reduce": _Rule("all_reduce", _per_tensor("tensor", _ring_all_reduce, _c10d_geometry)),
    "all_reduce_coalesced": _Rule("all_reduce", _per_tensor("tensors", _ring_all_reduce, _c10d_geometry)),
    "reduce_scatter_single": _Rule("reduce_scatter", _per_tensor("input", _all_but_own_share, _c10d_geometry)),
    "reduce_scatter_tensor": _Rule("reduce_scatter", _per_tensor("input", _all_but_own_share, _c10d_geometry)),
    "reduce_scatter": _Rule("reduce_scatter", _per_tensor("input_list", _all_but_own_share, _c10d_geometry)),
    "all_to_all_single": _Rule("all_to_all", _c10d_all_to_all_single),
    "all_to_all": _Rule("all_to_all", _c10d_all_to_all),
    "broadcast": _Rule("broadcast", _c10d_broadcast),
    "gather": _Rule("gather", _c10d_gather),
    "scatter": _Rule("scatter", _c10d_scatter),
    "reduce": _Rule("reduce", _c10d_reduce),
    "send": _Rule("send", _c10d_send),
    "isend": _Rule("send", _c10d_send),
    "recv": _Rule("recv", _c10d_recv),
    "irecv": _Rule("recv", _c10d_recv),
    "batch_isend_irecv": _Rule("p2p", _c10d_batch_p2p),
    "all_gather_object": _Rule("all_gather_object", None),
    "gather_object": _Rule("gather_object", None),
    "scatter_object_list": _Rule("scatter_object", None),
    "broadcast_object_list": _Rule("broadcast_object", None),
    "send_object_list": _Rule("send_object", None),
    "recv_object_list": _Rule("recv_object", None),
}

_FUNCOL_RULES: dict[str, _Rule] = {
    "all_gather_single": _Rule("all_gather", _per_tensor("self", _every_other_rank, _funcol_geometry)),
    "all_gather_tensor": _Rule("all_gather", _per_tensor("self", _every_other_rank, _funcol_geometry)),
    "all_gather_single_autograd": _Rule("all_gather", _per_tensor("self", _every_other_rank, _funcol_geometry)),
    "all_gather_tensor_autograd": _Rule("all_gather", _per_tensor("self", _every_other_rank, _funcol_geometry)),
    "all_gather_single_coalesced": _Rule("all_gather", _per_tensor("self", _every_other_rank, _funcol_geometry)),
    "all_gather_into_tensor_coalesced": _Rule("all_gather", _per_tensor("self", _every_other_rank, _funcol_geometry)),
    "all_reduce": _Rule("all_reduce", _per_tensor("self", _ring_all_reduce, _funcol_geometry)),
    "all_reduce_coalesced": _Rule("all_reduce", _per_tensor("self", _ring_all_reduce, _funcol_geometry)),
    "reduce_scatter_single": _Rule("reduce_scatter", _per_tensor("self", _all_but_own_share, _funcol_geometry)),
    "reduce_scatter_tensor": _Rule("reduce_scatter", _per_tensor("self", _all_but_own_share, _funcol_geometry)),
    "reduce_scatter_single_autograd": _Rule(
        "reduce_scatter", _per_tensor("self", _all_but_own_share, _funcol_geometry)
    ),
    "reduce_scatter_tensor_autograd": _Rule(
        "reduce_scatter", _per_tensor("self", _all_but_own_share, _funcol_geometry)
    ),
    "reduce_scatter_single_coalesced": _Rule(
        "reduce_scatter", _per_tensor("inputs", _all_but_own_share, _funcol_geometry)
    ),
    "reduce_scatter_tensor_coalesced": _Rule(
        "reduce_scatter", _per_tensor("inputs", _all_but_own_share, _funcol_geometry)
    ),
    "all_to_all_single": _Rule("all_to_all", _funcol_all_to_all_single),
    "all_to_all_single_autograd": _Rule("all_to_all", _funcol_all_to_all_single),
    "broadcast": _Rule("broadcast", _funcol_broadcast),
    "permute_tensor": _Rule("permute", _funcol_permute),
}


# DTensor's Shard(i) -> Shard(j) redistribution: an all-to-all on NCCL (through torch.ops, which no
# Python wrapper sees), an all-gather and a local chunk on gloo; booked once, as the all-to-all it is.
_DTENSOR_RULES: dict[str, _Rule] = {
    "shard_dim_alltoall": _Rule("all_to_all", _dtensor_shard_dim_alltoall),
}


# --------------------------------------------------------------------------------- interception

_lock = threading.Lock()
_active: CallCounter | None = None
_local = threading.local()


@dataclass
class _Frame:
    kind: str
    transparent: bool  # an object collective: the tensor collectives inside it add their bytes to it


def _frames() -> list[_Frame]:
    """The wrapped calls in progress on this thread, outermost first."""
    return _local.__dict__.setdefault("frames", [])


def _book(rule: _Rule, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Frame | None:
    """Book one call on the active counter; the frame that nested calls see (None: nothing counted)."""
    counter, frames = _active, _frames()
    if counter is None:
        return None
    if frames and not frames[-1].transparent:
        return _Frame(frames[-1].kind, False)  # inside another counted collective: already booked
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    if rule.nbytes is None:
        if not frames:  # its bytes come from the tensor collectives it issues; its record keeps none
            counter.record(rule.kind, 1, 0, _call_record(rule.kind, bound.arguments, 0))
        return _Frame(frames[-1].kind if frames else rule.kind, True)
    nbytes = rule.nbytes(bound.arguments)
    if frames:  # a tensor collective inside an object collective: its bytes, not a call
        counter.record(frames[-1].kind, 0, nbytes)
    else:
        counter.record(rule.kind, 1, nbytes, _call_record(rule.kind, bound.arguments, nbytes))
    return _Frame(rule.kind, False)


def _wrap(original: Callable[..., Any], rule: _Rule) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        frame = _book(rule, signature, args, kwargs)
        if frame is None:  # not counting: a wrapper some module kept only forwards
            return original(*args, **kwargs)
        frames = _frames()
        frames.append(frame)
        try:
            return original(*args, **kwargs)
        finally:
            frames.pop()

    return wrapper


def _targets() -> list[tuple[ModuleType, str, _Rule]]:
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.tensor._collective_utils as dtensor_collectives

    out = []
    for module, rules in ((c10d, _C10D_RULES), (funcol, _FUNCOL_RULES), (dtensor_collectives, _DTENSOR_RULES)):
        for name, rule in rules.items():
            if callable(getattr(module, name, None)):
                out.append((module, name, rule))
    return out


def _modules() -> list[ModuleType]:
    return [m for m in list(sys.modules.values()) if isinstance(m, ModuleType)]


@contextlib.contextmanager
def count_collectives(counter: CallCounter | None = None) -> Iterator[CallCounter]:
    """Count every collective issued inside the block on ``counter`` (a new one if None), this process only.

    One counting block at a time per process; the functions are restored on exit, even on error.
    """
    global _active
    counter = CallCounter() if counter is None else counter
    with _lock:
        if _active is not None:
            raise RuntimeError("count_collectives is already active in this process")
        _active = counter
    wrappers: dict[int, Callable[..., Any]] = {}
    originals: dict[int, Callable[..., Any]] = {}
    for module, name, rule in _targets():
        fn = getattr(module, name)
        if id(fn) not in wrappers:
            wrappers[id(fn)], originals[id(fn)] = _wrap(fn, rule), fn
    patched: list[tuple[ModuleType, str, Any]] = []
    try:
        for module in _modules():
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for name, value in items:
                key = id(value)
                if key in wrappers and originals[key] is value:
                    setattr(module, name, wrappers[key])
                    patched.append((module, name, value))
        yield counter
    finally:
        for module, name, value in reversed(patched):
            setattr(module, name, value)
        with _lock:
            _active = None
