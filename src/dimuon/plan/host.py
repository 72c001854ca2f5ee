"""The host's share of an optimizer step, from what ``dimuon bench host`` measured rather than ops x a constant.

A step's Python grows with its matrices as well as with its ops, so each step kind gets three costs: a constant per
step, a cost per Muon matrix and a cost per dispatched op. The per-op cost is the record's own price of one
dispatched op (``op_us``: dispatch and launch of a one-element op); the constant and the per-matrix cost are the
least-squares line through the kind's host time less its ops' cost, over the record's matrix counts (20, 140, 560).
Where the record has sharded rows (rank 0 of a fake FSDP2 world) the terms come from them: the plan models a rank's
step on a mesh.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dimuon.bench.host_report import LAYOUT
from dimuon.io import read_json_object

__all__ = ["KIND_ROWS", "HostModel", "HostTerm", "fit_line", "host_model", "load_host_record"]

# The model's step kinds -> (the bench host row, its step kind) that measures their host side.
KIND_ROWS: dict[str, tuple[str, str]] = {
    "spectral_gather": ("muon", "spectral"),
    "spectral_owner": ("muon", "spectral"),
    "spectral_split": ("muon", "spectral"),
    "rownorm": ("periodic_row_muon", "rownorm"),
    "block": ("muon_bp", "block"),
    "adaptive": ("adaptive_row_muon", "step"),
    "adamw": ("adamw_fused", "step"),
}


@dataclass(frozen=True)
class HostTerm:
    """Host microseconds of one step of one kind: ``const_us + per_matrix_us x matrices + per_op_us x ops``."""

    const_us: float
    per_matrix_us: float
    per_op_us: float

    def seconds(self, matrices: int, ops: float) -> float:
        return 1e-6 * max(0.0, self.const_us + self.per_matrix_us * matrices + self.per_op_us * ops)


@dataclass(frozen=True)
class HostModel:
    """A :class:`HostTerm` per step kind of the model, and where they were fitted."""

    terms: tuple[tuple[str, HostTerm], ...]
    source: str

    def seconds(self, kind: str, matrices: int, ops: float) -> float:
        """Host seconds of one ``kind`` step (a kind the record did not measure: that of the spectral step)."""
        terms = dict(self.terms)
        return terms.get(kind, terms["spectral_owner"]).seconds(matrices, ops)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "terms": {k: vars(t) for k, t in self.terms}}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs`` (one point: a constant)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return statistics.mean(ys), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _sharded_row(record: dict[str, Any], row: str) -> str | None:
    """The name of ``row``'s sharded twin at the record's largest world (``muon [fsdp W=256]``), where it has one:
    the step the plan models is a rank's sharded step."""
    worlds = [r["world"] for r in record["rows"] if r.get("layout") and r["name"].split(" [")[0] == row]
    return f"{row} [{LAYOUT} W={max(worlds)}]" if worlds else None


def _points(record: dict[str, Any], row: str, kind: str) -> list[tuple[int, float, float]]:
    """(matrices, ops per step, host us per step) of one eager row's step kind at every size measured: its sharded
    twin's where the record has sharded rows."""
    out = []
    name = _sharded_row(record, row) or row
    for r in record["rows"]:
        if r["name"] != name or r["mode"] != "eager" or r["status"] != "ok":
            continue
        k = r["kinds"].get(kind) or (r["kinds"][next(iter(r["kinds"]))] if kind == "step" else None)
        if k and k.get("host_ms") is not None and k.get("ops_per_step") is not None:
            out.append((r["matrices"], k["ops_per_step"], 1e3 * k["host_ms"]))
    return out


def host_model(record: dict[str, Any], source: str) -> HostModel:
    """Every step kind's :class:`HostTerm` fitted from a ``dimuon bench host`` record; ValueError naming ``source``
    and the row where the record lacks one."""
    op_us = record.get("op_us")
    if not op_us:
        raise ValueError(f"{source}: no per-op price (op_us) in the host record")
    terms = []
    for kind, (row, step) in KIND_ROWS.items():
        points = _points(record, row, step)
        if not points:
            raise ValueError(f"{source}: the host record has no eager {row} row with a {step} step")
        const, per_matrix = fit_line([m for m, _, _ in points], [us - op_us * ops for _, ops, us in points])
        terms.append((kind, HostTerm(round(const, 2), round(per_matrix, 3), op_us)))
    return HostModel(tuple(terms), source)


def load_host_record(path: Path | str) -> dict[str, Any]:
    """A ``dimuon bench host`` record, or the host part of a ``scripts/gpu-check`` record; ValueError if neither."""
    record = read_json_object(path, "--calibrate", "a dimuon bench host or gpu-check record")
    if record.get("benchmark") == "gpu-check":
        part = record.get("parts", {}).get("host", {})
        record = part.get("results") or {}
        if not record.get("rows"):
            raise ValueError(f"{path}: its host part kept no result (status {part.get('status')!r})")
    if record.get("benchmark") != "host":
        raise ValueError(f"{path}: not a dimuon bench host record (nor a gpu-check record with a host part)")
    return record


# Fitted by host_model from the published per-matrix record (docs/results/host/baseline/host.json, ``dimuon bench
# host`` on a CPU in the accelerator form, made while every step still went matrix by matrix). Both paths now step
# by class; the current record's per-matrix time on this CPU is mostly the list ops' one kernel per tensor, which a
# GPU does not pay, so the published terms stay those of the baseline (docs/bench-host.md). A test fits them again
# from that file, so the two cannot drift apart.
PUBLISHED_SOURCE = "docs/results/host/baseline/host.json"
PUBLISHED_TERMS: dict[str, tuple[float, float, float]] = {  # kind: (const_us, per_matrix_us, per_op_us)
    "spectral_gather": (986.47, 39.706, 1.99),
    "spectral_owner": (986.47, 39.706, 1.99),
    "spectral_split": (986.47, 39.706, 1.99),
    "rownorm": (371.04, 33.779, 1.99),
    "block": (527.24, 35.666, 1.99),
    "adaptive": (678.49, 49.714, 1.99),
    "adamw": (5.48, 8.974, 1.99),
}
PUBLISHED_HOST = HostModel(tuple((k, HostTerm(*v)) for k, v in PUBLISHED_TERMS.items()), PUBLISHED_SOURCE)
