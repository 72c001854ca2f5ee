"""This project's speed targets held against ``dimuon bench optimizer`` records: each target's measured ratio and
whether it is met, per record. The targets are the project's own goals for its published tables
(docs/bench-optimizer.md), not part of the benchmark users run on their models, so they live here, not in the
package.

    python scripts/optimizer_targets.py docs/results/bench-rownorm-adamw.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    """A ratio of two optimizers' median step times (``numerator`` / ``denominator``; ``denominator``
    :data:`FASTEST_PEER`: the fastest peer row whose Newton-Schulz computes in the numerator's dtype), or
    Newton-Schulz's FLOP rate against bare ``torch.bmm`` (``numerator`` ``ns_rate``), held to ``limit`` by ``op``."""

    text: str
    numerator: str
    denominator: str | None
    limit: float
    op: Literal["<=", ">="]


FASTEST_PEER = "fastest_peer"
TARGETS = (
    Target("PeriodicRowMuon K=3 <= 0.40x dimuon Muon", "periodic_row_muon", "muon", 0.40, "<="),
    Target("dimuon Muon (Gram NS) <= 0.60x fp32 reference Muon", "muon_gram", "reference_muon", 0.60, "<="),
    Target("NS5 FLOP rate >= 0.85x torch.bmm", "ns_rate", None, 0.85, ">="),
    Target(
        "PeriodicRowMuon RowNorm step <= 1.5x fused AdamW (both memory-bound)", "rownorm_step", "adamw_fused", 1.5, "<="
    ),
    Target(
        "dimuon Muon (Gram NS in bf16) <= 0.90x the fastest peer at equal precision",
        "muon_gram_bf16",
        FASTEST_PEER,
        0.90,
        "<=",
    ),
)


def measured(target: Target, record: dict[str, Any]) -> float | None:
    """The target's value in a record, None where the record did not measure it."""
    if target.numerator == "ns_rate":
        ns = record.get("ns_flop_rate")
        return ns["standard"]["ratio"] if ns else None
    optimizers = record["optimizers"]
    if target.denominator == FASTEST_PEER and target.numerator in optimizers:
        dtype = optimizers[target.numerator].get("ns_dtype")
        peers = [r["median_ms"] for k, r in optimizers.items() if r.get("peer") and r.get("ns_dtype") == dtype]
        return optimizers[target.numerator]["median_ms"] / min(peers) if peers else None
    if target.numerator in optimizers and target.denominator in optimizers:
        return optimizers[target.numerator]["median_ms"] / optimizers[target.denominator]["median_ms"]
    return None


def check(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its measured value, limit and verdict (``met`` None where not measured)."""
    out = []
    for t in TARGETS:
        value = measured(t, record)
        met = None if value is None else (value <= t.limit if t.op == "<=" else value >= t.limit)
        out.append({"target": t.text, "value": value, "limit": t.limit, "met": met})
    return out


def render(path: str, record: dict[str, Any], markdown: bool = False) -> str:
    """A record's verdicts, one line per target, under the record's machine."""
    machine = record.get("machine", {})
    lines = [f"{path} ({machine.get('cpu_model', '?')}, torch {machine.get('torch', '?')}):"]
    for t in check(record):
        verdict = "n/a" if t["met"] is None else ("PASS" if t["met"] else "MISS")
        value = "-" if t["value"] is None else format(t["value"], ".3f")
        lines.append(f"{'-' if markdown else ' '} [{verdict}] {t['target']}: measured {value}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="dimuon bench optimizer JSON records")
    parser.add_argument("--markdown", action="store_true", help="Markdown list items instead of plain lines")
    args = parser.parse_args(argv)
    for path in args.records:
        record = json.loads(path.read_text(encoding="utf-8"))
        if "optimizers" not in record:
            print(f"optimizer_targets: {path} is no dimuon bench optimizer record (no 'optimizers')", file=sys.stderr)
            return 2
        print(render(str(path), record, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
