"""The README's "At a glance" table holds what the published records say: every loss and ratio cell, and the lr
in each row's setting, recomputed by scripts/at_a_glance.py from docs/results/ and compared cell by cell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.example_modules import import_script

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("loss vs AdamW", "loss vs Muon", "optimizer time vs Muon", "communication vs Muon", "host time vs AdamW")


def markdown_table(text: str, heading: str) -> list[dict[str, str]]:
    """The first table under ``## heading``, one dict per row keyed by the header's cells."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, body = split[0], split[2:]
    return [dict(zip(header, row)) for row in body]


def test_the_readme_table_equals_what_the_records_give() -> None:
    script = import_script("at_a_glance")
    records = (script.load(p) for p in (script.SEEDS, script.ADAPTIVE, script.STEP, script.HOST))
    table = script.rows(*records)
    by_name = {row.label.split(" ")[0]: row for row in table}
    shown = markdown_table((ROOT / "README.md").read_text(), "At a glance")
    assert {r["optimizer"] for r in shown} == {"AdamW", "Muon", "PeriodicRowMuon", "MuonBP", "AdaptiveRowMuon"}
    for readme_row in shown:
        row = by_name[readme_row["optimizer"]]
        expected = script.cells(row, table)
        for column in COMPARED:
            assert readme_row[column] == expected[column], (readme_row["optimizer"], column)
        lr = re.search(r"lr=([0-9.e-]+)", readme_row["the setting"])
        assert lr is not None and float(lr.group(1)) == pytest.approx(row.lr), readme_row["optimizer"]


def test_a_changed_record_changes_the_cells() -> None:
    script = import_script("at_a_glance")
    seeds, adaptive, step = (script.load(p) for p in (script.SEEDS, script.ADAPTIVE, script.STEP))
    for run in seeds["runs"]:
        if run["optimizer"] == "periodic_row_muon":
            run["val_loss_ema"] *= 1.02
    table = script.rows(seeds, adaptive, step)
    prm = next(r for r in table if r.key == "periodic_row_muon")
    assert script.cells(prm, table)["loss vs Muon"] == "+2.8%"


def test_the_host_column_reads_the_host_record_at_140_matrices() -> None:
    script = import_script("at_a_glance")
    host = script.load(script.HOST)
    for row in host["rows"]:
        if row["matrices"] == script.HOST_MATRICES and row["name"] == "muon":
            row["host_ms"] *= 2
    before = script.host_ratios(script.load(script.HOST))
    after = script.host_ratios(host)
    assert after["adamw"] == before["adamw"] == 1.0
    assert after["muon"] == pytest.approx(2 * before["muon"])
    assert after["periodic_row_muon"] == before["periodic_row_muon"]
    assert script.host_ratios(None) == {}
