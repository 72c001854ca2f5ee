"""``dimuon bench traffic``: the bytes of a memory-bound step, counted per op, pass by pass."""

from __future__ import annotations

import json

import pytest

from dimuon.bench import optimizer as optimizer_bench
from dimuon.bench import traffic
from dimuon.bench.peers import muon_and_rest
from dimuon.optim import fused

TINY = ["--model", "DiT-S/2", "--depth", "1", "--hidden-size", "32", "--num-heads", "2"]
CFG = {"model": "DiT-S/2", "depth": 1, "hidden_size": 32, "num_heads": 2}  # TINY as a Config


@pytest.mark.skipif(not fused.triton_available(), reason="needs triton")
def test_each_pass_of_a_rownorm_step_moves_what_its_formula_says(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert traffic.main([*TINY, "--out", str(out), "--markdown", str(tmp_path / "t.md")]) == 0
    record = json.loads(out.read_text())
    muon = record["model"]["muon_params"] * 4  # bytes of one fp32 pass over the Muon matrices
    rows = record["rows"]

    def passes(row: str, op: str) -> float:
        return rows[row]["by_op"][op]["bytes"] / muon

    # eager: the momentum lerp 3 and the Nesterov copy 2 and lerp 3, the decay 2, the update 3, the norms 1
    assert passes("rownorm_step_eager", "_foreach_lerp_") == 6
    assert passes("rownorm_step_eager", "_foreach_copy_") == 2
    assert passes("rownorm_step_eager", "_foreach_mul_") == 2
    assert passes("rownorm_step_eager", "_foreach_addcmul_") == pytest.approx(3, abs=0.05)  # + the factors
    # fused: G, M in and M, U out; W, U (+ factors) in and W out; the decay inside the update
    assert passes("rownorm_step_fused", "fused momentum") == 4
    assert passes("rownorm_step_fused", "fused update") == pytest.approx(3, abs=0.05)
    assert rows["rownorm_step_fused"]["by_op"]["fused momentum"]["launches"] == 1
    assert "_foreach_mul_" not in rows["rownorm_step_fused"]["by_op"]
    for row in ("rownorm_step_eager", "rownorm_step_fused"):  # one read per column norm, no squares written
        assert passes(row, "linalg_vector_norm") == pytest.approx(1, abs=0.05)  # + the norms written
        assert "pow" not in rows[row]["by_op"]
    assert rows["adamw_fused"]["transfers_per_element"] == pytest.approx(7, abs=0.01)  # p, g, m, v in; p, m, v out
    per_muon = {row: rows[row]["transfers_per_muon_element"] for row in ("rownorm_step_eager", "rownorm_step_fused")}
    assert per_muon["rownorm_step_fused"] < 0.7 * per_muon["rownorm_step_eager"]
    assert "x fused AdamW" in capsys.readouterr().out and (tmp_path / "t.md").read_text().startswith("DiT-S/2")


def test_per_muon_element_books_only_the_muon_matrices_traffic(tmp_path):
    """The non-finite vote takes the norm of every gradient: its reads of the AdamW group's gradients (and the
    norms it makes of them) are that group's traffic, not the Muon matrices'."""
    out = tmp_path / "t.json"
    assert traffic.main([*TINY, "--rows", "rownorm_step_eager", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    row, model = record["rows"]["rownorm_step_eager"], record["model"]
    muon, rest = muon_and_rest(optimizer_bench.build_model(optimizer_bench.Config(**CFG)))
    vote_on_rest = 4 * (model["params"] - model["muon_params"]) + 4 * len(rest)  # the gradients read, norms made
    assert row["by_op"]["_foreach_norm"]["bytes"] == 4 * model["params"] + 4 * (len(rest) + len(muon))
    moved = row["bytes_read"] + row["bytes_written"] - row["by_op"]["_fused_adamw_"]["bytes"]
    assert row["transfers_per_muon_element"] * 4 * model["muon_params"] == pytest.approx(moved - vote_on_rest, abs=1)


def test_an_unknown_row_is_refused_naming_the_choices(tmp_path, capsys):
    assert traffic.main([*TINY, "--rows", "sgd", "--out", str(tmp_path / "t.json")]) == 2
    assert "--rows got unknown row(s) ['sgd']; choose from ['adamw_fused'" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--depth", "0"], "--depth must be an integer >= 1, got 0"),
        (["--num-heads", "0"], "--num-heads must be an integer >= 1, got 0"),
        (["--model", "DiT-Q/2"], "--model must be one of: DiT-T/2"),
        (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
        (["--weight-decay", "nan"], "--weight-decay must be >= 0, got nan"),
    ],
)
def test_bad_model_and_decay_flags_are_refused_naming_themselves(tmp_path, capsys, flags, message):
    assert traffic.main([*TINY, *flags, "--out", str(tmp_path / "t.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
