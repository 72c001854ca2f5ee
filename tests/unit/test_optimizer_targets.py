"""scripts/optimizer_targets.py: the project's speed targets read from ``dimuon bench optimizer`` records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.example_modules import import_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "optimizer_targets.py"


@pytest.fixture(scope="module")
def targets():
    return import_script("optimizer_targets")


def _record(**medians: float) -> dict:
    return {"optimizers": {k: {"median_ms": v} for k, v in medians.items()}, "ns_flop_rate": None, "machine": {}}


def test_ratios_are_judged_against_their_limits_and_unmeasured_ones_are_not(targets):
    record = _record(periodic_row_muon=30.0, muon=100.0, muon_gram=70.0, reference_muon=100.0)
    by_text = {t["target"]: t for t in targets.check(record)}
    prm = by_text["PeriodicRowMuon K=3 <= 0.40x dimuon Muon"]
    gram = by_text["dimuon Muon (Gram NS) <= 0.60x fp32 reference Muon"]
    assert prm["value"] == pytest.approx(0.3) and prm["met"] is True
    assert gram["value"] == pytest.approx(0.7) and gram["met"] is False
    rownorm = by_text["PeriodicRowMuon RowNorm step <= 1.5x fused AdamW (both memory-bound)"]
    assert rownorm["value"] is None and rownorm["met"] is None  # neither row timed
    record["ns_flop_rate"] = {"standard": {"ratio": 0.9}}
    assert {t["target"]: t for t in targets.check(record)}["NS5 FLOP rate >= 0.85x torch.bmm"]["met"] is True


def test_the_peer_target_takes_the_fastest_peer_of_the_same_newton_schulz_dtype(targets):
    record = _record(muon_gram_bf16=80.0, torch_muon=100.0, heavyball=95.0, muon_fsdp2=50.0)
    rows = record["optimizers"]
    rows["muon_gram_bf16"]["ns_dtype"] = "bfloat16"
    rows["torch_muon"].update(peer=True, ns_dtype="bfloat16")
    rows["heavyball"].update(peer=True, ns_dtype="bfloat16")
    rows["muon_fsdp2"].update(peer=True, ns_dtype="float32")  # another precision: not compared
    text = "dimuon Muon (Gram NS in bf16) <= 0.90x the fastest peer at equal precision"
    peer = {t["target"]: t for t in targets.check(record)}[text]
    assert peer["value"] == pytest.approx(80.0 / 95.0) and peer["met"] is True
    rows["heavyball"]["median_ms"] = 85.0
    peer = {t["target"]: t for t in targets.check(record)}[text]
    assert peer["value"] == pytest.approx(80.0 / 85.0) and peer["met"] is False
    del rows["torch_muon"], rows["heavyball"]
    assert {t["target"]: t for t in targets.check(record)}[text]["met"] is None  # no peer of that dtype timed


def test_the_published_records_give_the_verdicts_they_were_published_with(targets):
    """The records written while the targets were part of the benchmark carry their verdicts: the script's agree."""
    for path in sorted((SCRIPT.parents[1] / "docs" / "results").glob("optimizer-*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        if "targets" in record:
            found = {t["target"]: (t["value"], t["met"]) for t in targets.check(record)}
            for t in record["targets"]:
                assert found[t["target"]] == (pytest.approx(t["value"]), t["met"]), (path.name, t["target"])


def test_the_command_prints_a_verdict_per_target_and_refuses_other_records(targets, tmp_path, capsys):
    good = tmp_path / "bench.json"
    good.write_text(json.dumps(_record(rownorm_step=20.0, adamw_fused=10.0)))
    assert targets.main([str(good), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "- [MISS] PeriodicRowMuon RowNorm step <= 1.5x fused AdamW (both memory-bound): measured 2.000" in out
    assert out.count("[n/a]") == 4
    other = tmp_path / "census.json"
    other.write_text(json.dumps({"jobs": []}))
    assert targets.main([str(other)]) == 2
    assert "no dimuon bench optimizer record" in capsys.readouterr().err
