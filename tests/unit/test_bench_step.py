"""dimuon bench step: whole windows per optimizer, the step split read from real training runs, clear flag errors."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import tyro

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
    cfg = step.Config(window=6, train_args_of=("adaptive_row_muon=--optim.k-max=3",))
    assert step.window_steps(cfg, "adaptive_row_muon") == 6
    # Read as dimuon train reads them: --optim.k None is the optimizer's default again.
    cfg = step.Config(window=4, train_args="--optim.k 4 --optim.k None")
    assert step.window_steps(cfg, "periodic_row_muon") == 6


@pytest.mark.parametrize(
    ("args", "period"),
    [
        ("--optim.k=4", 4),
        ("--optim.k 4", 4),
        ("--optim.k 4 --optim.k 2", 2),  # the last one given, as dimuon train takes it
        ("--optim.k=4 --optim.k=None", 3),  # back to the optimizer's default
        ("--lr 0.02", 3),
    ],
)
def test_the_period_is_read_as_dimuon_train_reads_the_flags(args: str, period: int) -> None:
    cfg = step.Config(optimizers=("periodic_row_muon",), train_args=args)
    plan = step.train_plan(cfg, "periodic_row_muon")
    assert step.period_of(plan) == period
    assert plan.cfg.optim.k == (None if period == 3 else period)


@pytest.mark.parametrize(
    ("args", "message", "said_by_train"),
    [
        # Refused by dimuon train's parser: its own message names the flag, then the benchmark's error line.
        ("periodic_row_muon=--optim.kk 3", "dimuon train refuses these flags", "Unrecognized options: --optim.kk"),
        ("periodic_row_muon=--optim.k x", "dimuon train refuses these flags", "Error parsing --optim.k:"),
        # Refused by its start-up checks, as one line.
        (
            "periodic_row_muon=--optim.k 0",
            "--optimizer periodic_row_muon rejects its options (--lr / --optim.*): k must be in [1, inf), got 0",
            None,
        ),
        (
            "muon=--optim.k 3",
            "--optimizer muon rejects its options (--lr / --optim.*): optimizer 'muon' got unknown",
            None,
        ),
        ("muon=--optim.ns-steps 0", "--optimizer muon rejects its options (--lr / --optim.*): ns_steps must be", None),
        ("muon=--skip-limit 3", "--skip-limit 3 has no effect here", None),
    ],
)
def test_bad_train_args_stop_before_anything_runs_naming_the_flag_as_dimuon_train_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: str, message: str, said_by_train: str | None
) -> None:
    name = args.split("=", 1)[0]
    flags = ["--optimizers", "muon", "periodic_row_muon", "--train-args-of", args, "--out", str(tmp_path / "out")]
    assert cli_main(["bench", "step", *flags]) == 2
    err = capsys.readouterr().err
    assert f"dimuon bench step: error: --train-args / --train-args-of {name}: {message}" in err
    if said_by_train is not None:
        assert said_by_train in err and err.index(said_by_train) < err.index("dimuon bench step: error:")
    assert not (tmp_path / "out").exists()


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


def test_train_args_take_the_documented_form_and_the_record_command_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--train-args '--precision bf16'`` (a value that starts with --) parses, and the record's command is
    shell-quoted: split as a shell splits it, it gives the same flags."""
    seen: list[str] = []

    def measure(cfg: step.Config, optimizer: str, world: int, repeat: int = 0) -> dict:
        seen.append(cfg.train_args)
        return {
            "optimizer": optimizer,
            "label": optimizer,
            "world": world,
            "window": 6,
            "status": "not run",
            "error": "-",
        }

    monkeypatch.setattr(step, "measure", measure)
    out = tmp_path / "out"
    flags = ["--worlds", "1", "--optimizers", "adamw", "--no-progress", "--out", str(out)]
    assert cli_main(["bench", "step", *flags, "--train-args", "--precision bf16"]) == 0
    assert seen == ["--precision bf16"]
    command = shlex.split(json.loads((out / "results.json").read_text())["command"])
    assert command[:3] == ["dimuon", "bench", "step"]
    assert tyro.cli(step.Config, args=command[3:]).train_args == "--precision bf16"


def test_bench_help_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "-h"):
        assert cli_main(["bench", flag]) == 0
        assert "bench step" in capsys.readouterr().out


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
    # A model whose patch size does not divide MNIST's 28 pixels: known only once the run opens the data.
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
            "--train-args=--model DiT-S/8",
        ]
    )
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert code == 1 and row["status"] == "failed" and "exited with status 2" in row["error"]
    assert "--model DiT-S/8 has patch size 8, which does not divide the image size 28" in row["tail"]
