"""The plan's measured host term: fitted by hand, read from a bench host or gpu-check record, used by the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dimuon.plan import command
from dimuon.plan.counts import KindCounts
from dimuon.plan.hardware import GPUS, Efficiency
from dimuon.plan.host import KIND_ROWS, PUBLISHED_HOST, HostTerm, fit_line, host_model, load_host_record
from dimuon.plan.network import mesh_spans
from dimuon.plan.step_time import Cluster, kind_seconds

ROOT = Path(__file__).resolve().parents[2]


def _row(name: str, matrices: int, kinds: dict[str, tuple[float, float]]) -> dict:
    """A bench host row: ``kinds`` maps a step kind to (ops per step, host ms)."""
    return {
        "name": name,
        "mode": "eager",
        "status": "ok",
        "matrices": matrices,
        "kinds": {k: {"ops_per_step": ops, "host_ms": ms} for k, (ops, ms) in kinds.items()},
    }


def _record(op_us: float = 2.0) -> dict:
    """Host ms = (100 + 10 m + 2 ops) us for Muon's spectral step at 195 ops; other rows a fixed line."""
    rows = []
    for m in (20, 140, 560):
        rows.append(_row("muon", m, {"spectral": (195, (100 + 10 * m + op_us * 195) / 1e3)}))
        rows.append(_row("periodic_row_muon", m, {"spectral": (195, 1.0), "rownorm": (45, (50 + 4 * m + 90) / 1e3)}))
        rows.append(_row("muon_bp", m, {"spectral": (195, 1.0), "block": (195, 1.0)}))
        rows.append(_row("adaptive_row_muon", m, {"step": (135, 1.0)}))
        rows.append(_row("adamw_fused", m, {"step": (2, (4 + 0.5 * m) / 1e3)}))
    return {"benchmark": "host", "op_us": op_us, "rows": rows}


def test_fit_line_by_hand():
    assert fit_line([0, 1, 2], [1, 3, 5]) == pytest.approx((1.0, 2.0))
    # three points off a line: mean (4/3, 2), Sxy = 8/3 + 0 + 10/3 = 6, Sxx = 42/9, slope 9/7, intercept 2/7
    assert fit_line([0, 1, 3], [0, 2, 4]) == pytest.approx((2 / 7, 9 / 7))
    assert fit_line([20], [7.0]) == (7.0, 0.0)


def test_host_model_recovers_the_costs_it_was_made_from():
    model = host_model(_record(), "hand")
    terms = dict(model.terms)
    assert set(terms) == set(KIND_ROWS)
    assert terms["spectral_owner"] == HostTerm(100.0, 10.0, 2.0)
    assert terms["rownorm"] == HostTerm(50.0, 4.0, 2.0)
    assert terms["adamw"].per_matrix_us == pytest.approx(0.5) and terms["adamw"].const_us == pytest.approx(0.0)
    # 140 matrices and 195 ops: 100 + 1400 + 390 us
    assert model.seconds("spectral_gather", 140, 195) == pytest.approx(1890e-6)


def test_sharded_rows_give_the_terms_where_the_record_has_them():
    """The plan models a rank's step on a mesh: a record with sharded rows (at two worlds) is fitted from the
    largest world's, and the one-process rows are left aside."""
    record = _record()
    for world, const in ((64, 900.0), (256, 300.0)):
        for m in (20, 140, 560):
            row = _row(f"muon [fsdp W={world}]", m, {"spectral": (195, (const + 2.0 * 195) / 1e3)})
            record["rows"].append({**row, "layout": "fsdp", "world": world})
    terms = dict(host_model(record, "sharded").terms)
    assert terms["spectral_owner"] == HostTerm(300.0, 0.0, 2.0)  # flat in the matrices, from W = 256
    assert terms["rownorm"] == HostTerm(50.0, 4.0, 2.0)  # no sharded PeriodicRowMuon row: the one-process one


def test_a_record_without_a_row_or_a_price_is_refused_by_name():
    record = _record()
    record["rows"] = [r for r in record["rows"] if r["name"] != "muon_bp"]
    with pytest.raises(ValueError, match="hand: the host record has no eager muon_bp row with a block step"):
        host_model(record, "hand")
    with pytest.raises(ValueError, match="no per-op price"):
        host_model({**_record(), "op_us": None}, "hand")


def test_the_model_takes_the_host_term_when_the_host_is_slower_than_the_gpu():
    model = host_model(_record(), "hand")
    k = KindCounts([], 0.0, 0.0, 0.0, 0, 195, 0, 0)
    spans = mesh_spans((("dp_shard", 8),), 8)
    eff = Efficiency()
    ops = kind_seconds(k, spans, Cluster(GPUS["h100"], 8, eff), "spectral_owner", 140)
    fitted = kind_seconds(k, spans, Cluster(GPUS["h100"], 8, eff, model), "spectral_owner", 140)
    assert ops["total"] == pytest.approx(195 * eff.host_op_us * 1e-6)
    assert fitted["total"] == pytest.approx(1890e-6) and fitted["host"] == pytest.approx(1890e-6)


def test_a_gpu_check_record_gives_its_host_part(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"benchmark": "gpu-check", "parts": {"host": {"status": "ok", "results": _record()}}}))
    assert load_host_record(path)["op_us"] == 2.0
    path.write_text(json.dumps({"benchmark": "gpu-check", "parts": {"host": {"status": "timeout", "results": {}}}}))
    with pytest.raises(ValueError, match="its host part kept no result"):
        load_host_record(path)


def test_the_published_host_term_is_the_fit_of_the_published_record():
    """The constants the plan ships are fitted again here from docs/results/host/baseline/host.json: they cannot
    drift."""
    record = json.loads((ROOT / "docs/results/host/baseline/host.json").read_text())
    assert host_model(record, PUBLISHED_HOST.source) == PUBLISHED_HOST


def test_plan_records_which_host_term_it_used(tmp_path):
    argv = ["--model", "DiT-S/2", "--depth", "2", "--heads", "8", "--gpus", "8", "--global-batch", "8"]
    for host, words in (("ops", "ops x host_op_us"), ("published", "docs/results/host/baseline/host.json")):
        out = tmp_path / f"{host}.json"
        assert command.main([*argv, "--image-size", "256", "--host", host, "--json", str(out)]) == 0
        record = json.loads(out.read_text())
        # 5 per block, the timestep MLP's second linear and the final adaLN
        assert words in record["host_term"]["source"] and record["muon_matrices"] == 2 * 5 + 2


def test_the_plan_page_quotes_the_studys_demo_prediction():
    """docs/plan.md's validation row of the H200 demo against the study record's host-term section."""
    demo = json.loads((ROOT / "docs/results/plan/study.json").read_text())["host_term"]["demo"]
    page = (ROOT / "docs/plan.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| dimuon's own demo, one H200"))
    assert (
        f"{demo['model_ms'][0]:.1f} (the calibration point); {demo['model_ms'][1]:.1f} with `--host published`" in row
    )


def test_host_term_comes_from_the_flag_or_a_gpu_check_records_host_part(tmp_path, monkeypatch):
    from dimuon.bench import host as host_bench

    monkeypatch.setattr(host_bench, "run", lambda cfg: _record(op_us=3.0))  # what this machine measured
    measured, words = command.host_term(command.parse(["--host", "measure"]))
    assert dict(measured.terms)["spectral_owner"].per_op_us == 3.0 and "this machine" in words
    assert command.host_term(command.parse([])) == (None, "counted ops x host_op_us")
    assert command.host_term(command.parse(["--host", "published"]))[0] is PUBLISHED_HOST
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"benchmark": "gpu-check", "parts": {"host": {"status": "ok", "results": _record()}}}))
    fitted, words = command.host_term(command.parse(["--host", "published", "--calibrate", str(path)]))
    assert fitted == host_model(_record(), str(path)) and "host part" in words  # the record wins over --host
