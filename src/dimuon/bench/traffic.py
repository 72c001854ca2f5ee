"""``dimuon bench traffic``: the memory traffic of one memory-bound optimizer step, counted rather than timed.

A RowNorm step, like an AdamW step, does a few passes over the parameters and their state, so on a GPU its time
is its bytes over the memory bandwidth. This counts them on the CPU, in the form the step takes on a GPU: every op
it dispatches (the accelerator's list-op form, :mod:`dimuon.optim.devices`) books the bytes of the tensors it
reads and writes (an in-place op reads and writes its target; ``copy_``, ``fill_``, ``zero_`` and ``out=``
arguments are written only; views move nothing), and each launch of the fused kernels (:mod:`dimuon.optim.fused`,
run here by Triton's interpreter) books the tensors it loads and stores. Rows, on one model's parameters, every
step from the same gradients:

- ``adamw_fused``: torch's fused AdamW on every parameter (one op: 7 transfers per element);
- ``rownorm_step_eager`` and ``rownorm_step_fused``: PeriodicRowMuon's RowNorm step (its spectral first step
  taken uncounted) with ``kernels="torch"`` and ``kernels="triton"``. Its AdamW group's traffic is booked
  apart: its fused op, and its tensors' share of an op over every parameter's gradient (the non-finite vote's
  norms), so "per Muon element" is the Muon matrices' traffic over their elements.

"transfers per element" is bytes over (elements x 4 bytes): the number of fp32 passes. Run ``dimuon bench
traffic --help``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tyro
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dimuon.bench import optimizer as optimizer_bench
from dimuon.bench.host_probe import accelerator_form
from dimuon.bench.peers import GradientSnapshot, muon_and_rest
from dimuon.bench.report import format_markdown_table, format_table, machine_info, print_report
from dimuon.io import write_json_atomic
from dimuon.optim import build, fused

PROG = "dimuon bench traffic"
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw_fused": ("adamw_fused", {}),
    "rownorm_step_eager": ("rownorm_step", {"kernels": "torch"}),
    "rownorm_step_fused": ("rownorm_step", {"kernels": "triton"}),
}
# Ops that overwrite their target without reading it.
_WRITE_ONLY = {"copy_", "_foreach_copy_", "fill_", "_foreach_fill_", "zero_", "_foreach_zero_"}
_ADAMW_OPS = {"_fused_adamw_", "_fused_adamw"}
# Arguments a schema marks writable that the kernel only reads (fused AdamW's gradients: written only under
# maximize or a grad scaler, neither of which these rows use).
_READ_ONLY = {("_fused_adamw_", "grads")}


@dataclass
class Config:
    """Count the bytes one memory-bound optimizer step moves, on a DiT's parameters."""

    model: str = "DiT-S/2"
    """Registry name of the DiT whose parameters are used."""
    depth: int | None = 2
    """Transformer blocks (the counts scale with the blocks; 2 keeps the interpreted kernels quick)."""
    hidden_size: int | None = None
    """Override the hidden size (tiny test configurations)."""
    num_heads: int | None = None
    """Override the number of attention heads (must divide the hidden size)."""
    rows: tuple[str, ...] = tuple(ROWS)
    """Which rows to count, from: adamw_fused rownorm_step_eager rownorm_step_fused."""
    weight_decay: float = 0.1
    """Weight decay of every row (the eager form's decay is a pass of its own; the fused kernels and fused AdamW
    apply it in their update)."""
    seed: int = 0
    """Seed of the model initialization and the random gradients."""
    out: Path = Path("runs/bench/traffic.json")
    """Where the JSON record goes (written atomically)."""
    markdown: Path | None = None
    """Also write the table as Markdown to this file."""


@dataclass
class Book:
    """Bytes read and written and launches of one step, the AdamW group's apart: its fused op, and the bytes of
    its tensors (``adamw_storages``: the storages of its parameters and gradients) in any other op."""

    read: int = 0
    written: int = 0
    launches: int = 0
    adamw_read: int = 0
    adamw_written: int = 0
    by_op: dict[str, list[int]] = field(default_factory=dict)  # op -> [launches, bytes]
    adamw_storages: frozenset[int] = frozenset()

    def add(self, op: str, read: int, written: int, launches: int = 1, adamw: tuple[int, int] = (0, 0)) -> None:
        """Book an op; ``adamw`` is the (read, written) share of ``read`` and ``written`` on the AdamW group."""
        if op in _ADAMW_OPS:
            adamw = (read, written)
        self.adamw_read += adamw[0]
        self.adamw_written += adamw[1]
        self.read += read - adamw[0]
        self.written += written - adamw[1]
        self.launches += launches
        entry = self.by_op.setdefault(op, [0, 0])
        entry[0] += launches
        entry[1] += read + written

    def nbytes(self, value: Any) -> tuple[int, int]:
        """Bytes of the tensors in ``value``: all of them, and those of the AdamW group."""
        tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, Tensor)]
        adamw = [t for t in tensors if self.adamw_storages and t.untyped_storage().data_ptr() in self.adamw_storages]
        return _nbytes(tensors), _nbytes(adamw)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, Tensor))


class _Traffic(TorchDispatchMode):
    """Books every dispatched op that makes or changes a tensor (views and metadata ops move nothing)."""

    def __init__(self, book: Book) -> None:
        super().__init__()
        self.book = book
        self.paused = False  # inside a fused launch: its bytes are booked from its tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or func.is_view:
            return out
        name = func.overloadpacket.__name__
        schema = func._schema
        values = [*zip(schema.arguments, args), *((a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs)]
        read = written = adamw_read = adamw_written = 0
        for arg, value in values:
            nbytes, adamw = self.book.nbytes(value)
            writes = arg.alias_info is not None and arg.alias_info.is_write and (name, arg.name) not in _READ_ONLY
            if writes:
                written += nbytes
                adamw_written += adamw
            if not (writes and (arg.name == "out" or (name in _WRITE_ONLY and arg.name == "self"))):
                read += nbytes
                adamw_read += adamw
        made = [o for r, o in zip(schema.returns, _returns(out)) if r.alias_info is None]
        written += _nbytes(made)
        adamw_written += _made_for_adamw(self.book, args, made)
        if written:  # something was made or changed: a kernel on a GPU
            self.book.add(name, read, written, adamw=(adamw_read, adamw_written))
        return out


def _returns(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _made_for_adamw(book: Book, args: Sequence[Any], made: Sequence[Any]) -> int:
    """Bytes of a list op's new outputs that belong to the AdamW group: output ``i`` of each returned list is
    made from tensor ``i`` of the op's first list argument (a foreach op's norms, say)."""
    inputs = next((a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor)), None)
    if inputs is None or not book.adamw_storages:
        return 0
    ours = [book.nbytes(t)[1] > 0 for t in inputs]
    return sum(
        _nbytes(o[i])
        for o in made
        if isinstance(o, (list, tuple)) and len(o) == len(inputs)
        for i in range(len(o))
        if ours[i]
    )


@contextlib.contextmanager
def _fused_booked(book: Book, mode: _Traffic) -> Iterator[None]:
    """The fused kernels' launches booked from the tensors each loads and stores, their own workings not."""
    momentum, update = fused.momentum_, fused.update_

    def momentum_(tables, grads, bufs, outs, beta, mask):
        launches = len(fused._dtype_pairs(grads, bufs))
        written = _nbytes(list(bufs)) + (_nbytes(list(outs)) if outs is not None else 0)
        book.add("fused momentum", _nbytes(list(grads)) + _nbytes(list(bufs)), written, launches)
        mode.paused = True
        try:
            momentum(tables, grads, bufs, outs, beta, mask)
        finally:
            mode.paused = False

    def update_(tables, weights, directions, factors, step, decay, mask):
        launches = len(fused._dtype_pairs(weights, directions))
        read = _nbytes(list(weights)) + _nbytes(list(directions)) + _nbytes([f for f in factors if f is not None])
        book.add("fused update", read, _nbytes(list(weights)), launches)
        mode.paused = True
        try:
            update(tables, weights, directions, factors, step, decay, mask)
        finally:
            mode.paused = False

    fused.momentum_, fused.update_ = momentum_, update_
    try:
        yield
    finally:
        fused.momentum_, fused.update_ = momentum, update


@contextlib.contextmanager
def booking(adamw_tensors: Sequence[Tensor] = ()) -> Iterator[Book]:
    """Every op of the body booked, in the accelerator's form of the step; the bytes of ``adamw_tensors`` (the
    AdamW group's parameters and gradients) apart. Works on the meta device: bytes come from shapes."""
    book = Book(adamw_storages=frozenset(t.untyped_storage().data_ptr() for t in adamw_tensors))
    with accelerator_form(), _Traffic(book) as mode, _fused_booked(book, mode):
        yield book


def count_step(step: Callable[[], None], adamw_tensors: Sequence[Tensor] = ()) -> Book:
    """One call of ``step`` booked (:func:`booking`)."""
    with booking(adamw_tensors) as book:
        step()
    return book


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Count every row of ``cfg``; returns the JSON record (also written to ``cfg.out``)."""
    unknown = [r for r in cfg.rows if r not in ROWS]
    if unknown:
        raise ValueError(f"--rows got unknown row(s) {unknown}; choose from {list(ROWS)}")
    if "rownorm_step_fused" in cfg.rows and not fused.triton_available():
        raise ValueError("--rows rownorm_step_fused needs the triton package (pip install 'dimuon[triton]')")
    if not cfg.weight_decay >= 0:  # NaN too
        raise ValueError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    opt_cfg = optimizer_bench.Config(
        model=cfg.model, depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, seed=cfg.seed
    )
    optimizer_bench.check_config(opt_cfg)  # --model, --depth, --hidden-size and --num-heads, as that bench names them
    model = optimizer_bench.build_model(opt_cfg)
    snapshot = GradientSnapshot(model.parameters())
    table = optimizer_bench.variants(opt_cfg)
    muon_params, rest = muon_and_rest(model)
    elements = sum(p.numel() for p in model.parameters())
    muon_elements = sum(p.numel() for p in muon_params)
    rows: dict[str, Any] = {}
    for row in cfg.rows:
        variant_name, extra = ROWS[row]
        v = table[variant_name]
        opt = build(v.name, model, lr=opt_cfg.lr, weight_decay=cfg.weight_decay, **{**v.options, **extra})
        for _ in range(max(1, v.untimed_steps)):  # the state made, and a RowNorm row's spectral first step
            snapshot.restore()
            opt.step()
        snapshot.restore()
        book = count_step(opt.step, [*rest, *(p.grad for p in rest if p.grad is not None)])
        total = book.read + book.written + book.adamw_read + book.adamw_written
        muon_bytes = book.read + book.written
        rows[row] = {
            "label": v.label + (f" ({extra['kernels']} kernels)" if "kernels" in extra else ""),
            "bytes_read": book.read + book.adamw_read,
            "bytes_written": book.written + book.adamw_written,
            "launches": book.launches,
            "transfers_per_element": total / (4 * elements),
            "transfers_per_muon_element": muon_bytes / (4 * muon_elements) if v.name != "adamw" else None,
            "by_op": {op: {"launches": n, "bytes": b} for op, (n, b) in sorted(book.by_op.items())},
        }
    record = {
        "benchmark": "traffic",
        "machine": machine_info(argv),
        "config": {k: (str(val) if isinstance(val, Path) else val) for k, val in asdict(cfg).items()},
        "model": {"name": cfg.model, "params": elements, "muon_params": muon_elements},
        "rows": rows,
    }
    write_json_atomic(cfg.out, record)
    return record


def render(record: dict[str, Any], markdown: bool = False) -> str:
    """The record as one table: bytes, launches and transfers per element, against fused AdamW."""
    rows = record["rows"]
    base = rows.get("adamw_fused")
    header = ["step", "MB read", "MB written", "launches", "transfers/elem", "per Muon elem", "x fused AdamW"]
    body = []
    for r in rows.values():
        moved = r["bytes_read"] + r["bytes_written"]
        ratio = moved / (base["bytes_read"] + base["bytes_written"]) if base else None
        per_muon = r["transfers_per_muon_element"]
        body.append(
            [
                r["label"],
                f"{r['bytes_read'] / 1e6:.1f}",
                f"{r['bytes_written'] / 1e6:.1f}",
                str(r["launches"]),
                f"{r['transfers_per_element']:.2f}",
                "-" if per_muon is None else f"{per_muon:.2f}",
                "-" if ratio is None else f"{ratio:.2f}",
            ]
        )
    m = record["model"]
    title = f"{m['name']}: {m['params'] / 1e6:.2f}M parameters, {m['muon_params'] / 1e6:.2f}M in Muon matrices"
    fmt = format_markdown_table if markdown else format_table
    return f"{title}\n\n{fmt(header, body)}"


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed, nothing counted: SystemExit(2) for a flag the parser refuses (the --rows check is left to
    :func:`run`, which also asks whether triton imports)."""
    return tyro.cli(Config, args=list(argv), prog=PROG)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench traffic``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse(args)
    try:
        record = run(cfg, args)
    except ValueError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    print_report(record, render, cfg.out, cfg.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
