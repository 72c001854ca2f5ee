"""dimuon bench step: whole windows per optimizer, the step split read from real training runs, clear flag errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dimuon.bench import step
from dimuon.cli import main as cli_main

TINY = ["--model", "DiT-T/4", "--batch-size", "8", "--window", "2", "--windows", "2", "--threads", "1", "--no-progress"]


def test_windows_hold_whole_periods() -> None:
    cfg = step.Config(window=6)
    assert {o: step.window_steps(cfg, o) for o in step.DEFAULT_OPTIMIZERS} == {
        "adamw": 6,
        "torch_muon": 6,
        "muon": 6,
        "periodic_row_muon": 6,
        "muon_bp": 10,
        "adaptive_row_muon": 8,
    }
    assert step.window_steps(step.Config(window=4), "periodic_row_muon") == 6
    # A period set through the optimizer's flags sizes its windows, not the class default.
    cfg = step.Config(window=6, train_args_of=("periodic_row_muon=--optim.k 4", "muon_bp=--optim.period=4"))
    assert step.window_steps(cfg, "periodic_row_muon") == 8 and step.window_steps(cfg, "muon_bp") == 8
    assert step.window_steps(cfg, "adaptive_row_muon") == 8  # its default k_max
    with pytest.raises(ValueError, match=r"periodic_row_muon's --optim.k must be an integer >= 1, got '0'"):
        step.check_config(step.Config(train_args_of=("periodic_row_muon=--optim.k 0",)))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "DiT-Q/9"], "--model must be one of"),
        (["--optimizers", "adamw", "sgd"], "--optimizers must name distinct values from"),
        (["--worlds", "1", "1"], "--worlds must be distinct process counts >= 1"),
        (
            ["--worlds", "1", "3"],
            "--batch-size must be >= 1 and divisible by every --worlds entry, got 16 (not by [3])",
        ),
        (["--windows", "0"], "--windows must be >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--train-args-of", "sgd=--lr 1"], "--train-args-of expects NAME=FLAGS with NAME one of"),
        (["--train-args-of", "muon=--x 1", "muon=--y 2"], "--train-args-of names muon twice"),
        (["--train-args-of", "muon=--x 'open"], "--train-args / --train-args-of muon: No closing quotation"),
    ],
)
def test_bad_flags_stop_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert cli_main(["bench", "step", "--out", str(tmp_path / "out"), *flags]) == 2
    assert capsys.readouterr().err.startswith(f"dimuon bench step: error: {message}")
    assert not (tmp_path / "out").exists()


def test_train_args_of_reach_only_their_optimizer(tmp_path: Path) -> None:
    cfg = step.Config(
        optimizers=("muon", "muon_bp"), train_args="--precision bf16", train_args_of=("muon_bp=--optim.blocks 4",)
    )
    muon, bp = (step.train_command(cfg, name, 1, tmp_path) for name in cfg.optimizers)
    assert muon[-2:] == ["--precision", "bf16"]
    assert bp[-4:] == ["--precision", "bf16", "--optim.blocks", "4"]


def test_one_process_rows_come_from_the_runs_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = cli_main(
        ["bench", "step", *TINY, "--worlds", "1", "--optimizers", "adamw", "periodic_row_muon", "--out", str(out)]
    )
    record = json.loads((out / "results.json").read_text())
    assert code == 0, [r.get("tail") for r in record["rows"]]
    adamw, prm = record["rows"]
    for row, window in ((adamw, 2), (prm, 3)):
        assert row["status"] == "ok" and row["window"] == window
        assert row["steps"] == 3 * window and row["records_used"] == 2  # the warm-up window left out
        metrics = [
            json.loads(line)
            for line in (out / "runs" / f"{row['optimizer']}-w1" / "metrics.jsonl").read_text().splitlines()
        ]
        steady = [r["opt_ms"] for r in metrics if r["kind"] == "train"][1:]
        assert row["opt_ms"] == pytest.approx(sum(steady) / 2)  # the median of two
        assert 0 < row["opt_share"] < 1 and row["comm_bytes_per_step"] == 0
    assert adamw["step_x_adamw"] == 1.0 and prm["opt_x_adamw"] == pytest.approx(prm["opt_ms"] / adamw["opt_ms"])
    assert (out / "step_time.png").is_file()
    text = (out / "results.md").read_text()
    assert "| PeriodicRowMuon |" in text and "3-step windows x 2" in text
    assert text in capsys.readouterr().out


@pytest.mark.slow  # six training processes (40 s); the one-run rows are covered by the tests above
def test_repeats_run_in_rounds_and_give_medians(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        cli_main(
            [
                "bench",
                "step",
                *TINY,
                "--worlds",
                "1",
                "--optimizers",
                "adamw",
                "muon",
                "--repeats",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads((out / "results.json").read_text())
    for row in record["rows"]:
        assert row["repeats"] == 3 and row["records_used"] == 6
        assert row["step_ms"] == sorted(row["repeat_step_ms"])[1]
    logs = sorted(p.name for p in (out / "runs").glob("*.log"))
    assert logs == [
        "adamw-w1-r1.log",
        "adamw-w1-r2.log",
        "adamw-w1.log",
        "muon-w1-r1.log",
        "muon-w1-r2.log",
        "muon-w1.log",
    ]
    # rounds: every optimizer once before any runs twice
    starts = {p.name: p.stat().st_mtime for p in (out / "runs").glob("*.log")}
    assert starts["muon-w1.log"] < starts["adamw-w1-r1.log"]
    assert "(3 runs)" in (out / "results.md").read_text()


def test_a_repeat_that_failed_decides_the_row() -> None:
    ok = {"status": "ok", "step_ms": 1.0, "records_used": 2, **{k: 1.0 for k in step.TIMES}}
    failed = {"status": "failed", "error": "x"}
    assert step.combine([ok, failed, ok]) is failed
    assert step.combine([ok]) is ok


def test_a_failed_run_is_reported_with_its_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = cli_main(
        [
            "bench",
            "step",
            *TINY,
            "--worlds",
            "1",
            "--optimizers",
            "muon",
            "--out",
            str(out),
            "--train-args=--optim.ns-steps 0",
        ]
    )
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert code == 1 and row["status"] == "failed" and "exited with status 2" in row["error"]
    assert "--optim.ns-steps" in row["tail"]
