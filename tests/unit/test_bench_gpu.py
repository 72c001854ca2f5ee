"""The GPU check, dry-run on the CPU (every part on tiny sizes), so that it works the day a GPU is at hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
import tyro

from dimuon.bench import gpu
from dimuon.bench import optimizer as bench
from dimuon.bench.optimizer import FUSED_ONLY, OPTIMIZERS
from dimuon.bench.peers import PEERS, Peer
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
            "--pack",
            str(tmp_path / "out"),
            *flags,
        ]
    )
    return code, json.loads(out.read_text())


def packed(tmp_path: Path) -> set[str]:
    with tarfile.open(tmp_path / "out" / gpu.PACK_NAME) as tar:
        return set(tar.getnames())


def test_the_dry_run_runs_every_part_and_records_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, record = dry_run(tmp_path)
    assert code == 0, {name: (p["status"], p["tail"]) for name, p in record["parts"].items()}
    assert record["status"] == "complete" and record["running"] is None
    parts = record["parts"]
    assert {name: p["status"] for name, p in parts.items()} == {
        "bench": "ok",
        "host": "ok",
        "tests": "ok",
        "peers": "ok",
        "train": "ok",
    }
    assert list(parts) == ["bench", "host", "tests", "peers", "train"]  # the timings first
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
    # the listed test files alone, most GPU-specific first; every part's log and outputs packed, no compile cache
    assert parts["tests"]["command"][-len(gpu.CUDA_TEST_FILES) :] == [f"{TESTS}/{f}" for f in gpu.CUDA_TEST_FILES]
    names = packed(tmp_path)
    assert {f"gpu-check/{n}.log" for n in gpu.PARTS} <= names
    assert {"gpu-check/optimizer.json", "gpu-check/peers.json", "gpu-check/tests.xml"} <= names
    assert "gpu-check/train/metrics.jsonl" in names and not any("compile-cache" in n for n in names)


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


def test_a_short_budget_runs_the_timings_first_and_keeps_the_record(tmp_path: Path, capsys) -> None:
    """The whole check held to --budget-s on the real parts: the optimizer and host timings run first, the parts
    keep their order, each gets at most what is left, and those that would start with too little are skipped and
    recorded so (how many fit depends on the machine: the skipping itself is pinned by the test below)."""
    budget = 20.0
    code, record = dry_run(tmp_path, "--budget-s", str(budget), "--parts", "bench", "host", "tests", "peers", "train")
    parts = record["parts"]
    ran = [name for name, p in parts.items() if p["status"] != "skipped"]
    skipped = [name for name, p in parts.items() if p["status"] == "skipped"]
    assert ran[:1] == ["bench"] and ran + skipped == list(gpu.PARTS)  # the timings first; skipped: the last ones
    bench = parts["bench"]
    assert bench["status"] in ("ok", "timeout")  # a loaded machine may stop it at the budget: partial then
    assert bench["results"].get("optimizers") if bench["status"] == "ok" else bench["results"]["partial"]
    for i, name in enumerate(ran):  # every part cut to what was left when it started
        assert parts[name]["budget_s"] <= budget - sum(parts[n]["seconds"] for n in ran[:i]) + 0.2
    assert record["config"]["budget_s"] == budget
    assert (record["status"] == "budget spent") == bool(skipped)
    assert all("--budget-s 20 was spent" in parts[name]["results"]["error"] for name in skipped)
    assert code == (0 if all(parts[name]["status"] == "ok" for name in ran) else 1)
    assert all(f"{name}: skipped (--budget-s 20 spent)" in capsys.readouterr().out for name in skipped[:1])


def test_parts_that_would_start_with_too_little_budget_are_skipped(tmp_path: Path, monkeypatch, capsys) -> None:
    """With parts that each take 3 s and a 10 s budget, the first two run and the last three are skipped (a part
    needs gpu.MIN_PART_S left to start), in that order, and the record says the budget was spent."""
    started: list[str] = []

    def three_seconds(name: str, plan, work: Path, threads: int | None) -> gpu.Part:
        started.append(name)
        time.sleep(3.0)
        return gpu.Part("timeout", seconds=3.0, budget_s=plan.budget_s, command=plan.command)  # no results to show

    monkeypatch.setattr(gpu, "run_part", three_seconds)
    code, record = dry_run(tmp_path, "--budget-s", "10", "--parts", "bench", "host", "tests", "peers", "train")
    parts = record["parts"]
    assert started[0] == "bench" and started == [name for name in gpu.PARTS if parts[name]["status"] == "timeout"]
    assert [name for name in gpu.PARTS if parts[name]["status"] == "skipped"] == list(gpu.PARTS[len(started) :])
    assert {"tests", "peers", "train"} <= {name for name in gpu.PARTS if parts[name]["status"] == "skipped"}
    assert parts["bench"]["budget_s"] <= 10.0
    assert record["status"] == "budget spent" and code == 1  # the parts that ran timed out
    assert "train: skipped (--budget-s 10 spent)" in capsys.readouterr().out


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
            "--test-files",
            "test_some.py",
            "test_gone.py",
            "--parts",
            "tests",
            "--test-timeout-s",
            "2",
            "--tests-budget-s",
            "12",
        ]
    )
    tests = json.loads(out.read_text())["parts"]["tests"]
    assert code == 1 and tests["status"] == "timeout"
    r = tests["results"]
    assert r["partial"] and (r["passed"], r["failed"]) == (2, 1), r  # what finished before the budget ran out
    assert r["failures"][0].endswith("test_some.py::test_hangs")  # node ids are relative to where pytest ran
    assert r["missing_files"] == ["test_gone.py"]  # a listed file that is not there: the others still ran


def test_bad_flags_are_refused_before_anything_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    assert gpu.main(["--tests-budget-s", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--tests-budget-s must be > 0 seconds" in capsys.readouterr().err
    assert gpu.main(["--budget-s", "-1", "--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    assert "--budget-s must be > 0 seconds" in capsys.readouterr().err
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


# ------------------------------------------------------------------ a check stopped from outside keeps what it measured


def test_the_default_budgets_leave_room_within_ten_minutes() -> None:
    cfg = gpu.Config()
    parts = cfg.tests_budget_s + cfg.bench_budget_s + cfg.host_budget_s + cfg.peers_budget_s + cfg.train_budget_s
    assert parts <= 450 and cfg.budget_s is not None and cfg.budget_s <= 540
    assert cfg.bench_budget_s + cfg.host_budget_s <= 180  # the timings on disk within the first 3 minutes


class Killed(BaseException):
    """What a SIGKILL from outside leaves: nothing after it runs (no handler, no further write)."""


def test_the_record_is_written_after_each_part_and_kept_when_a_later_part_is_killed(tmp_path: Path, monkeypatch):
    out, work, pack = tmp_path / "r.json", tmp_path / "work", tmp_path / "out"
    seen: list[dict[str, str]] = []  # each part's status in the record on disk as each part starts

    def fake_launch(command, log, threads, timeout_s, env_extra):
        seen.append({name: p["status"] for name, p in json.loads(out.read_text())["parts"].items()})
        log.write_text("$ " + " ".join(command) + "\n")
        if "pytest" in command:
            (work / "tests.xml").write_text(
                '<testsuites><testsuite><testcase classname="t" name="ok"/></testsuite></testsuites>'
            )
            return 0
        raise Killed  # the bench part: the whole check dies here

    monkeypatch.setattr(gpu, "launch", fake_launch)
    flags = ["--device", "cpu", "--quick", "--parts", "tests", "peers", "train"]
    with pytest.raises(Killed):
        gpu.main([*flags, "--out", str(out), "--work", str(work), "--tests", TESTS, "--pack", str(pack)])
    idle = {"bench": "not run", "host": "not run"}
    assert seen == [
        {**idle, "tests": "running", "peers": "pending", "train": "pending"},
        {**idle, "tests": "ok", "peers": "running", "train": "pending"},
    ]
    record = json.loads(out.read_text())  # as written when the peers part started
    assert record["status"] == "in progress" and record["running"] == "peers"
    parts = record["parts"]
    assert parts["tests"]["status"] == "ok" and parts["tests"]["results"]["passed"] == 1
    assert parts["peers"]["status"] == "running" and parts["peers"]["budget_s"] == gpu.Config.peers_budget_s
    assert parts["train"]["status"] == "pending" and parts["train"]["command"]
    assert (
        "Not finished when this record was written (in progress): peers (running), train (pending)"
        in (record["readme"])
    )
    with tarfile.open(pack / gpu.PACK_NAME) as tar:  # packed after the tests part
        assert {"gpu-check/tests.log", "gpu-check/tests.xml"} <= set(tar.getnames())


def test_a_signal_stops_the_part_under_way_and_the_record_keeps_what_finished(tmp_path: Path) -> None:
    """SIGTERM (what a time limit sends first): the part under way is stopped with its results so far, the parts
    after it stay pending, and the record and the tarball are written before the check exits (status 1)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(Path(TESTS, "conftest.py").read_text())
    (suite / "test_some.py").write_text(
        "import time, pytest\npytestmark = pytest.mark.cuda\ndef test_quick(): pass\ndef test_long(): time.sleep(600)\n"
    )
    out, work, pack = tmp_path / "r.json", tmp_path / "work", tmp_path / "out"
    command = [sys.executable, "-m", "dimuon.bench.gpu", "--device", "cpu", "--quick", "--parts", "tests", "train"]
    command += ["--tests", str(suite), "--test-files", "test_some.py", "--out", str(out), "--work", str(work)]
    proc = subprocess.Popen([*command, "--pack", str(pack)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        test_log = work / "tests.jsonl"
        while not (test_log.exists() and test_log.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "the first test did not finish"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        printed = proc.communicate(timeout=60)[0].decode()
    finally:
        proc.kill()
    assert proc.returncode == 1, printed
    record = json.loads(out.read_text())
    assert record["status"] == "interrupted" and record["running"] is None
    tests, train = record["parts"]["tests"], record["parts"]["train"]
    assert tests["status"] == "interrupted" and tests["seconds"] < 100
    assert tests["results"]["partial"] and tests["results"]["passed"] == 1, tests["results"]
    assert tests["results"]["error"] == "the check was stopped by SIGTERM"
    assert train["status"] == "pending"
    with tarfile.open(pack / gpu.PACK_NAME) as tar:
        assert {"gpu-check/tests.log", "gpu-check/tests.jsonl"} <= set(tar.getnames())


# ------------------------------------------------------------------ what each part runs, and in which order


def test_the_tests_part_runs_the_listed_cuda_test_files_in_order() -> None:
    root = Path(TESTS)
    command = gpu.tests_command(gpu.Config(tests=root), root.parent / "tests.xml")
    assert command[command.index("cuda") - 1] == "-m"  # the CUDA-marked tests of those files
    assert command[-len(gpu.CUDA_TEST_FILES) :] == [str(root / f) for f in gpu.CUDA_TEST_FILES]  # no whole tree
    assert gpu.CUDA_TEST_FILES[:2] == ("unit/test_optim_fused.py", "unit/test_optim_cuda.py")  # most GPU-specific
    # every file that holds a CUDA-marked test is listed (this one only writes the marker into a suite of its own)
    marked = {
        f.relative_to(root).as_posix()
        for f in root.rglob("test_*.py")
        if "pytest.mark.cuda" in f.read_text(encoding="utf-8") and f.resolve() != Path(__file__).resolve()
    }
    assert marked == set(gpu.CUDA_TEST_FILES)


def test_the_cuda_commands_time_compiling_rows_last_and_each_row_once(tmp_path: Path) -> None:
    """On CUDA: the compiled row after the others; every peer but torch.optim.Muon after dimuon's rows and torch's;
    the bf16 rows that are another row there (bf16 is its default) timed once. The flags parse as intended."""
    cfg = gpu.Config(device="cuda")

    def parsed(command: list[str]) -> bench.Config:
        return tyro.cli(bench.Config, args=command[command.index("dimuon.bench.optimizer") + 1 :])

    rows = parsed(gpu.bench_command(cfg, tmp_path / "b.json"))
    assert rows.time_last == ("muon_compiled",) and set(rows.skip) == {"muon_bf16", "muon_gram_bf16"}
    assert rows.peers == ("torch_muon",) and rows.ns_rate
    peers = parsed(gpu.bench_command(cfg, tmp_path / "p.json", peers=True))
    assert peers.peers == tuple(PEERS) and peers.time_last == tuple(p for p in PEERS if p != "torch_muon")
    timed = [n for n in OPTIMIZERS if n not in peers.skip]
    assert timed == ["adamw_foreach", "muon", "muon_gram_bf16"] and not peers.ns_rate


SLOW_HEAVYBALL = """
import os, sys, time
from pathlib import Path
from dimuon.bench.peers import PEERS, Peer

class Compiling:  # heavyball's first step, compiling for longer than the part's budget
    def step(self):
        Path(os.environ["FIRST_STEP_MARK"]).write_text("compiling")
        time.sleep(600)

PEERS["heavyball"] = Peer("heavyball", "heavyball (slow)", "torch", "torch", "bfloat16", "t", "t",
                          lambda mod, muon, rest, lr: Compiling(), "0")
from dimuon.bench.optimizer import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_peer_whose_first_step_overruns_keeps_the_rows_timed_before_it(tmp_path: Path, monkeypatch) -> None:
    """The peers part times dimuon's rows and torch.optim.Muon and writes them before it starts heavyball: a first
    step of heavyball's that outlasts the budget stops the part, and the record keeps every row timed before."""
    mark = tmp_path / "first-step"

    def launch_until_the_first_step(command, log, threads, timeout_s, env_extra):
        """The part run for real, with heavyball's first step standing in for one that compiles past the budget:
        stopped (its process group) as launch stops it at the budget, once that step has begun."""
        assert command[1:3] == ["-m", "dimuon.bench.optimizer"]
        env = {**os.environ, **env_extra, "FIRST_STEP_MARK": str(mark), "OMP_NUM_THREADS": "1"}
        with open(log, "a") as out:
            proc = subprocess.Popen(
                [command[0], "-c", SLOW_HEAVYBALL, *command[3:]],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            deadline = time.monotonic() + 120
            while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert mark.exists(), log.read_text()
        raise subprocess.TimeoutExpired(command, timeout_s)

    monkeypatch.setattr(gpu, "launch", launch_until_the_first_step)
    monkeypatch.setattr(gpu, "QUICK_PEERS", ("torch_muon", "heavyball"))
    out, work = tmp_path / "r.json", tmp_path / "work"
    assert gpu.main(["--device", "cpu", "--quick", "--parts", "peers", "--out", str(out), "--work", str(work)]) == 1
    peers = json.loads(out.read_text())["parts"]["peers"]
    assert peers["status"] == "timeout" and "--time-last" in peers["command"]
    r = peers["results"]
    assert r["partial"] and r["pending"] == ["heavyball"]
    assert set(r["optimizers"]) == {*gpu.PEER_PART_ROWS, "torch_muon"}  # every row but heavyball's
    assert all(row["median_ms"] > 0 for row in r["optimizers"].values())
    assert "Not timed within its budget: heavyball." in json.loads(out.read_text())["readme"]


def test_a_row_timed_last_is_written_before_and_after_it_and_keeps_its_place(tmp_path: Path, monkeypatch) -> None:
    """--time-last: the other rows first (written), then the peer started (written, with its first step's time),
    then timed alone (written); the final table keeps the table order."""
    order: list[str] = []

    class Late:
        def step(self):
            order.append("late")

    monkeypatch.setitem(
        PEERS, "late", Peer("late", "late peer", "torch", "torch", "bfloat16", "t", "t", lambda *a: Late(), "0")
    )
    seen: list[tuple[list[str], list[str], bool]] = []
    real_write = bench.write_json_atomic

    def spy(path, record):
        seen.append((list(record["optimizers"]), record["pending"], "late" in record["peers"]))
        return real_write(path, record)

    monkeypatch.setattr(bench, "write_json_atomic", spy)
    out = tmp_path / "o.json"
    tiny = ["--depth", "1", "--hidden-size", "64", "--num-heads", "2", "--input-size", "8", "--num-classes", "10"]
    only = ["--skip", *(n for n in OPTIMIZERS if n not in ("adamw_foreach", "muon")), "--peers", "late", "torch_muon"]
    argv = [*tiny, *only, "--time-last", "late", "--repeats", "1", "--repeats-of", "torch_muon=1", "--warmup", "0"]
    argv += ["--no-ns-rate", "--no-progress"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    rows = ["adamw_foreach", "muon", "torch_muon"]
    assert (
        seen
        == [
            (rows, ["late"], False),  # the round of the other rows
            (rows, ["late"], False),  # before the late peer starts
            (rows, ["late"], True),  # after its first step
            ([*rows[:2], "late", "torch_muon"], ["late"], True),  # its round
            ([*rows[:2], "late", "torch_muon"], [], True),  # the end, in table order (--peers order)
        ]
    )
    record = json.loads(out.read_text())
    assert record["partial"] is False and record["peers"]["late"]["start_s"] >= 0
    assert order == ["late", "late"]  # its untimed first step, then its one sample
