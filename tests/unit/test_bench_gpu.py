"""The GPU check, dry-run on the CPU (every part on tiny sizes), so that it works the day a GPU is at hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dimuon.bench import gpu
from dimuon.bench.optimizer import FUSED_ONLY, OPTIMIZERS
from dimuon.cli import main as cli_main

TESTS = str(Path(__file__).resolve().parents[1])


def dry_run(tmp_path: Path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "gpu-check.json"
    code = cli_main(
        [
            "bench",
            "gpu",
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--tests",
            TESTS,
            *flags,
        ]
    )
    return code, json.loads(out.read_text())


def test_the_dry_run_runs_every_part_and_records_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, record = dry_run(tmp_path)
    assert code == 0, {name: (p["status"], p["tail"]) for name, p in record["parts"].items()}
    parts = record["parts"]
    assert {name: p["status"] for name, p in parts.items()} == {
        "tests": "ok",
        "bench": "ok",
        "peers": "ok",
        "train": "ok",
    }
    assert all(0 < p["seconds"] <= p["budget_s"] for p in parts.values())
    tests = parts["tests"]["results"]  # the CUDA-marked tests were collected and skip themselves here
    assert tests["skipped"] > 0 and tests["failed"] == tests["errors"] == tests["passed"] == 0
    bench = parts["bench"]["results"]
    # compiling: CPU only; the eager-kernel rows: CUDA only (where the others fuse)
    assert set(bench["optimizers"]) == {*OPTIMIZERS, "torch_muon"} - {"muon_compiled", *FUSED_ONLY}
    assert bench["config"]["device"] == "cpu" and bench["ns_flop_rate"]["dtype"] == "float32"
    peers = parts["peers"]["results"]  # dimuon's Muon rows beside the peers (torch's alone in a dry run)
    assert set(peers["optimizers"]) == {*gpu.PEER_PART_ROWS, "torch_muon"} and peers["ns_flop_rate"] is None
    train = parts["train"]["results"]
    assert train["steps"] == 4 and train["device"] == "cpu" and train["steps_per_s"] > 0
    assert 0 < train["opt_ms"] < train["step_ms"] and 0 < train["fwd_bwd_ms"] < train["step_ms"]
    machine = record["machine"]
    assert machine["torch"] == torch.__version__ and machine["cpu_model"] and machine["gpu"] is None
    printed = capsys.readouterr().out
    assert record["readme"] in printed and "| dimuon PeriodicRowMuon K=3 (per step) |" in printed
    assert "| training (demo task, bf16 autocast) |" in printed and "CUDA-marked tests: ok" in printed
    assert "Other Muon packages, optimizer step, DiT-S/2 parameter shapes" in printed


def test_a_part_over_its_budget_is_recorded_and_the_others_still_run(tmp_path: Path, capsys) -> None:
    code, record = dry_run(tmp_path, "--parts", "tests", "train", "--tests-budget-s", "0.5")
    parts = record["parts"]
    assert code == 1
    assert (parts["tests"]["status"], parts["bench"]["status"], parts["peers"]["status"], parts["train"]["status"]) == (
        "timeout",
        "not run",
        "not run",
        "ok",
    )
    assert parts["tests"]["seconds"] < 30  # stopped at its budget, not when it finished
    assert parts["tests"]["results"]["partial"] is True
    assert "Did not complete: tests (timeout)" in record["readme"]


def test_an_overrun_keeps_what_finished_and_a_hung_test_fails_alone(tmp_path: Path) -> None:
    """Tests: each outcome is kept as it ends, and a test past --test-timeout-s fails while the rest run on."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(Path(TESTS, "conftest.py").read_text())
    (suite / "test_some.py").write_text(
        "import signal, time, pytest\n"
        "pytestmark = pytest.mark.cuda\n"
        "def test_quick(): pass\n"
        "def test_hangs(): time.sleep(60)\n"  # stopped by its 2 s limit
        "def test_after(): pass\n"
        "def test_forever():\n"  # out of the limit's reach: the part's budget stops it
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "    time.sleep(600)\n"
    )
    out = tmp_path / "gpu-check.json"
    code = cli_main(
        [
            "bench",
            "gpu",
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--tests",
            str(suite),
            "--parts",
            "tests",
            "--test-timeout-s",
            "2",
            "--tests-budget-s",
            "25",
        ]
    )
    tests = json.loads(out.read_text())["parts"]["tests"]
    assert code == 1 and tests["status"] == "timeout"
    r = tests["results"]
    assert r["partial"] and (r["passed"], r["failed"]) == (2, 1), r  # what finished before the budget ran out
    assert r["failures"][0].endswith("test_some.py::test_hangs")  # node ids are relative to where pytest ran


def test_bad_flags_are_refused_before_anything_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    assert gpu.main(["--tests-budget-s", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--tests-budget-s must be > 0 seconds" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_junit_counts_reads_every_outcome(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="t" name="broken"><error message="y"/></testcase>'
        '<testcase classname="t" name="gpu"><skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu.junit_counts(report) == {
        "passed": 1,
        "failed": 1,
        "skipped": 1,
        "errors": 1,
        "failures": ["t::bad", "t::broken"],
    }


def test_the_script_is_the_command(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(TESTS).parent
    # the script runs the python on PATH: this interpreter's, as in an activated environment
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [str(root / "scripts" / "gpu-check"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "dimuon bench gpu" in done.stdout and "--quick" in done.stdout


@pytest.mark.parametrize("autotune", [False, True])
def test_the_peers_part_keeps_gemms_on_cublas_unless_asked(tmp_path: Path, monkeypatch, autotune: bool) -> None:
    """heavyball asks inductor to autotune every matrix product shape (minutes for DiT-XL/2 on a first run): the
    peers part takes cuBLAS for them unless --peers-gemm-autotune, and no part autotunes dimuon's own."""
    envs: dict[str, dict[str, str]] = {}

    def fake_launch(command, log, threads, timeout_s, env_extra):
        name = "peers" if "--no-ns-rate" in command else "bench"
        envs[name] = dict(env_extra)
        return 1

    monkeypatch.setattr(gpu, "launch", fake_launch)
    flags = ["--peers-gemm-autotune"] if autotune else []
    out, work = str(tmp_path / "r.json"), str(tmp_path / "work")
    gpu.main(["--device", "cpu", "--quick", "--parts", "bench", "peers", "--out", out, "--work", work, *flags])
    assert envs["bench"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == envs["peers"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "0"
    assert "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS" not in envs["bench"]
    assert envs["peers"].get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS") == (None if autotune else "ATEN")
