"""Where every rank's piece of a DTensor parameter sits in the parameter's ``(rows, cols)`` matrix.

The DTensor placements decide (docs/algorithms.md, "Layouts"): each mesh dimension either shards the
rows (``Shard(0)``, ``_StridedShard(0, sf)``), shards the columns (``Shard(1)``), or replicates
(``Replicate()``). Placements are applied left to right over the mesh dimensions with
``torch.chunk`` semantics at every level (uneven and empty shards included), ``_StridedShard`` as
DTensor defines it: first cut into ``split_factor`` pieces, cut each piece into the mesh-dimension
size, and give coordinate ``i`` the ``i``-th cut of every piece. A rank's rows (and columns) are
then a list of :class:`Span` (a global range and where it starts in the local tensor).

Supported, on meshes of any number of dimensions, judged by the placements alone (never by a dimension's name):
``Shard(0)``, ``Shard(1)``, ``Replicate()`` and at most one ``_StridedShard`` per tensor dimension (what FSDP2 makes
of a tensor-parallel ``Shard(0)``, and a head-wise ``_StridedShard(0, 3)`` for a fused qkv weight), any number of
mesh dimensions sharding the rows and the columns (their ranks talk over one process group flattened from them) and
any number replicating. That covers FSDP, HSDP, tensor parallelism and their products, and context parallelism as
FSDP2 lays it out: a ``cp`` dimension flattened into the shard dimension (torchtitan's and ``fully_shard(...,
dp_mesh_dims=DataParallelMeshDims(shard=("dp_shard", "cp")))``'s ``dp_shard_cp``), or left replicating on the full
mesh; a dimension of size 1 changes nothing. Refused by :func:`derive_layout` with an error that names the
parameter and its placements: ``Partial``, ``Shard(d)`` for ``d > 1`` (inside the flattened columns), and two
``_StridedShard`` on one tensor dimension, whose data torch itself does not lay out as the placements say.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["SUPPORTED_FORMS", "Layout", "Piece", "Span", "derive_layout", "is_dtensor", "placement_words"]

ROWS, COLS = 0, 1


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (seconds) where nothing has: a
    DTensor exists only once its module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@dataclass(frozen=True)
class Span:
    """Global indices ``[start, stop)`` held at local indices ``[local, local + stop - start)``."""

    start: int
    stop: int
    local: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """The part of the matrix one rank holds: its row spans x its column spans (local order)."""

    rows: tuple[Span, ...]
    cols: tuple[Span, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(s.size for s in self.rows), sum(s.size for s in self.cols))

    @property
    def numel(self) -> int:
        r, c = self.shape
        return r * c

    def rows_in(self, start: int, stop: int) -> list[Span]:
        """The parts of this piece's row spans inside global rows ``[start, stop)``."""
        return _spans_in(self.rows, start, stop)

    def cols_in(self, start: int, stop: int) -> list[Span]:
        """The parts of this piece's column spans inside global columns ``[start, stop)``."""
        return _spans_in(self.cols, start, stop)

    def local_rows_in(self, start: int, stop: int) -> tuple[int, int] | None:
        """Local row range holding global rows ``[start, stop)`` of this piece (None: none held). The
        spans inside one logical matrix are adjacent locally in every supported layout (checked)."""
        spans = self.rows_in(start, stop)
        if not spans:
            return None
        for a, b in itertools.pairwise(spans):
            if b.local != a.local + a.size:
                raise NotImplementedError("a rank's rows of one logical matrix are not adjacent in its local tensor")
        return spans[0].local, spans[-1].local + spans[-1].size

    def write(
        self, out: Tensor, full: Tensor, start: int, stop: int, col_start: int = 0, col_stop: int | None = None
    ) -> None:
        """``out`` (this piece's local tensor) gets its entries of ``full`` = global rows ``[start, stop)`` x
        global columns ``[col_start, col_stop)`` (default: every column)."""
        col_stop = col_start + full.shape[1] if col_stop is None else col_stop
        for r in self.rows_in(start, stop):
            for c in self.cols_in(col_start, col_stop):
                out[r.local : r.local + r.size, c.local : c.local + c.size] = full[
                    r.start - start : r.stop - start, c.start - col_start : c.stop - col_start
                ]

    def place(self, full: Tensor, local: Tensor) -> None:
        """``full`` gets this piece's local tensor ``local`` at its global position."""
        for r in self.rows:
            for c in self.cols:
                full[r.start : r.stop, c.start : c.stop] = local[r.local : r.local + r.size, c.local : c.local + c.size]

    def take(self, full: Tensor) -> Tensor:
        """This piece's local tensor cut out of the full matrix ``full``."""
        out = full.new_empty(self.shape)
        self.write(out, full, 0, full.shape[0])
        return out


@dataclass(frozen=True)
class Layout:
    """How one DTensor parameter is laid out over its mesh, as a ``(rows, cols)`` matrix.

    ``row_dims`` / ``col_dims`` are the mesh dimensions that shard rows / columns, ``rep_dims`` those
    that replicate. ``mine`` is this rank's piece; :meth:`piece_at` gives any coordinate's piece.
    """

    name: str
    rows: int
    cols: int
    mesh: Any
    placements: tuple[Any, ...]
    row_dims: tuple[int, ...]
    col_dims: tuple[int, ...]
    rep_dims: tuple[int, ...]
    col_unit: int  # matrix columns per index of tensor dimension 1 (conv weights: in x kernel)
    mine: Piece

    @property
    def shard_dims(self) -> tuple[int, ...]:
        """Mesh dimensions over which the ranks hold distinct pieces, in mesh order."""
        return tuple(sorted(self.row_dims + self.col_dims))

    def piece_at(self, coord: Sequence[int]) -> Piece:
        shape = (self.rows, self.cols // self.col_unit)
        row_idx = _indices(shape[ROWS], ROWS, self.placements, self.mesh, coord)
        col_idx = _indices(shape[COLS], COLS, self.placements, self.mesh, coord)
        return Piece(_spans(row_idx, 1), _spans(col_idx, self.col_unit))


def _spans_in(spans: Sequence[Span], start: int, stop: int) -> list[Span]:
    """The parts of ``spans`` inside global indices ``[start, stop)``."""
    out = []
    for s in spans:
        lo, hi = max(s.start, start), min(s.stop, stop)
        if lo < hi:
            out.append(Span(lo, hi, s.local + lo - s.start))
    return out


def _mesh_words(mesh: Any) -> str:
    names = mesh.mesh_dim_names
    dims = ", ".join(f"{n}={s}" if names else str(s) for n, s in zip(names or [None] * mesh.ndim, mesh.shape))
    return f"{mesh.ndim}-D mesh ({dims})"


def _placement_dim(p: Any) -> int | None:
    """The tensor dimension a placement shards (None: it replicates), or raise for an unsupported kind."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Replicate):
        return None
    if isinstance(p, Shard) or _is_strided(p):
        return p.dim
    raise NotImplementedError(type(p).__name__)


def _is_strided(p: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(p, _StridedShard)


Runs = tuple[tuple[int, int], ...]  # global indices as runs [start, stop), in local order


def _take(runs: Runs, begin: int, end: int) -> Runs:
    """Elements ``[begin, end)`` of the concatenated runs."""
    out, offset = [], 0
    for a, b in runs:
        lo, hi = max(begin, offset), min(end, offset + b - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return tuple(out)


def _chunk(runs: Runs, n: int, i: int) -> Runs:
    """``torch.chunk(indices, n)[i]`` (empty where torch makes fewer chunks), on runs: chunks of ceil(len / n)."""
    size = -(-sum(b - a for a, b in runs) // n)
    return _take(runs, i * size, (i + 1) * size)


def _split(runs: Runs, placement: Any, size: int, coord: int) -> Runs:
    """Indices that coordinate ``coord`` of a mesh dimension of ``size`` keeps (torch.chunk at every level).

    On runs of indices, not index tensors: every rank derives every shard-group member's piece of every parameter
    (params x W calls at the first step), so each is O(runs), not O(length) or O(W)."""
    if _is_strided(placement):
        sf = int(placement.split_factor)
        return tuple(r for j in range(sf) for r in _chunk(_chunk(runs, sf, j), size, coord))
    return _chunk(runs, size, coord)


def _indices(length: int, dim: int, placements: Sequence[Any], mesh: Any, coord: Sequence[int]) -> Runs:
    runs: Runs = ((0, length),) if length else ()
    for mesh_dim, p in enumerate(placements):
        if _placement_dim(p) == dim:
            runs = _split(runs, p, mesh.size(mesh_dim), coord[mesh_dim])
    return runs


def _spans(runs: Runs, unit: int) -> tuple[Span, ...]:
    """Runs of consecutive global indices (adjacent runs merged), scaled by ``unit`` matrix columns per index."""
    merged: list[list[int]] = []
    local = 0
    for a, b in runs:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b, local])
        local += b - a
    return tuple(Span(a * unit, b * unit, at * unit) for a, b, at in merged)


def placement_words(param: Any) -> str:
    """``placements (...) on a 1-D mesh (4)``: a DTensor's layout in words, for error messages."""
    return f"placements {tuple(param.placements)} on a {_mesh_words(param.device_mesh)}"


SUPPORTED_FORMS = (
    "dimuon's Muon family supports DTensor parameters whose placements are Shard(0), Shard(1), Replicate() and at "
    "most one _StridedShard per tensor dimension (what FSDP2 makes over tensor parallelism), on meshes of any number "
    "of dimensions: FSDP, HSDP (Replicate(), Shard(0)), tensor parallel (Shard(0) colwise, Shard(1) rowwise), FSDP x "
    "TP and HSDP x TP, a context-parallel dimension flattened into the FSDP shard dimension (dp_shard_cp) or "
    "replicating; put other parameters in an 'adamw' group"
)


def _refuse(name: str, what: str, param: Any) -> ValueError:
    return ValueError(
        f"parameter {name!r} has placements {tuple(param.placements)} on a {_mesh_words(param.device_mesh)}: {what}. "
        + SUPPORTED_FORMS
    )


def derive_layout(param: Tensor, name: str) -> Layout:
    """The layout of DTensor ``param`` (called ``name`` in errors), checked against its local tensor's shape.

    Raises ValueError naming the parameter and its placements when the layout is not supported.
    """
    mesh, placements = param.device_mesh, tuple(param.placements)
    dims: list[int | None] = []
    for p in placements:
        try:
            dims.append(_placement_dim(p))
        except NotImplementedError:
            raise _refuse(name, f"{type(p).__name__} placements are not supported", param) from None
    if any(d is not None and d > 1 for d in dims):
        raise _refuse(name, "Shard(d) for d > 1 shards inside the flattened columns", param)
    for d in (ROWS, COLS):
        strided = [p for p, pd in zip(placements, dims) if pd == d and _is_strided(p)]
        if len(strided) > 1:
            raise _refuse(
                name,
                "two _StridedShard placements on one dimension (torch does not lay the data out as they say)",
                param,
            )
    shape = tuple(param.shape)
    rows, cols = shape[0], math.prod(shape[1:])
    col_unit = math.prod(shape[2:])
    row_dims = tuple(i for i, d in enumerate(dims) if d == ROWS)
    col_dims = tuple(i for i, d in enumerate(dims) if d == COLS)
    rep_dims = tuple(i for i, d in enumerate(dims) if d is None)
    if len(row_dims) + len(col_dims) > 1 and not mesh.mesh_dim_names:
        raise _refuse(
            name,
            "several mesh dimensions shard it, which needs a flattened process group, and a mesh "
            "without mesh_dim_names cannot be flattened; name the dimensions (init_device_mesh(..., "
            "mesh_dim_names=...))",
            param,
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise _refuse(name, "this rank is not in the parameter's mesh", param)
    layout = Layout(name, rows, cols, mesh, placements, row_dims, col_dims, rep_dims, col_unit, Piece((), ()))
    mine = layout.piece_at(coord)
    local = param.to_local()
    local_shape = (local.shape[0], math.prod(local.shape[1:])) if local.ndim >= 2 else None
    # An empty piece may come in any empty shape (FSDP2 gives a rank without experts a (0, 0, n) shard).
    if local_shape != mine.shape and not (local.numel() == 0 and mine.numel == 0):
        raise _refuse(
            name,
            f"its local tensor has shape {tuple(local.shape)}, but the placements give this "
            f"rank a {mine.shape[0]} x {mine.shape[1]} piece",
            param,
        )
    return Layout(name, rows, cols, mesh, placements, row_dims, col_dims, rep_dims, col_unit, mine)
