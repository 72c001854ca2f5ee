"""``dimuon bench gpu`` (``scripts/gpu-check``): the GPU check of dimuon in one command.

Five parts, each a process of its own with its own time budget, so that a failure or an overrun in one
is recorded and the others still run. The timings come first, so that they are on disk within the first
3 minutes of one GPU (110 + 50 s of budget):

1. ``bench``: ``dimuon bench optimizer --device cuda`` on DiT-XL/2 parameter shapes (every optimizer
   row beside ``torch.optim.Muon``, the Newton-Schulz FLOP rate against ``torch.bmm`` in bf16 on the same shapes,
   then compiled Newton-Schulz, timed last so that its compilation cannot take the other rows with it);
2. ``host``: ``dimuon bench host`` on the device: Python calls and host time per step on tiny matrices (20, 140,
   560), eager, then ``torch.compile(opt.step)`` at 20 matrices, on CUDA first with ``mode="reduce-overhead"``
   (CUDA graphs), then in its default mode, in one process (a compilation that fails is recorded with its error;
   the record is written after each size and mode);
3. ``tests``: the CUDA-marked tests (``pytest -m cuda``; they skip themselves without a GPU) of an explicit list
   of files, most GPU-specific first (:data:`CUDA_TEST_FILES`), so that a part stopped at its budget loses the
   least specific ones;
4. ``peers``: the other Muon packages (heavyball) on the same shapes beside dimuon's Muon and
   ``torch.optim.Muon``, in one run of their own: dimuon's rows and ``torch.optim.Muon`` are timed and written
   first, then each other package is started (heavyball compiles its step, with inductor's autotuning of its
   elementwise kernels: minutes for DiT-XL/2's shapes on a fresh machine) and timed alone, the record written again
   after each, so that a first step that outlasts the budget keeps every row timed before it;
5. ``train``: ``dimuon train`` on the demo task under bf16 autocast for a few hundred steps: steps per
   second and where a step's time goes (data, forward/backward, optimizer);

then one JSON record (GPU, driver, torch, CUDA, cuDNN and NCCL versions, CPU, each part's status, time
and results) under ``docs/results/`` (``--out``), and the README rows printed.

The record is written before the first part, as each part starts and after each part (the parts not yet run
marked ``pending``, the one under way ``running``, the record's ``status`` ``in progress``), and once more at the
end (``complete``), so that a check stopped from outside keeps every part finished before. A SIGTERM or SIGINT stops
the part under way (its whole process group), keeps what it finished (marked ``interrupted``) and writes the record
(``status``: ``interrupted``). ``--pack DIR`` also packs every part's log and outputs into ``DIR/gpu-check-logs.tgz``
after each part and at the end, whatever the outcome. The budgets (110 + 50 + 120 + 130 + 40 s = 450 s) leave room
within a 10-minute limit on one GPU for start-up, installing the wheels and the machine's own overhead; ``--budget-s``
(540 s by default) bounds the whole check: each part gets at most what is left, a part that would start with less
than 5 s left is recorded as ``skipped`` and the record's status is ``budget spent``. A part that
overruns its budget keeps what it finished: every test's outcome as it ends (and each test has a time limit of its
own, ``--test-timeout-s``: a hung test fails, the rest run), the benchmark's rows of every round sampled so far, the
training run's records. The parts share one compile cache (``<work>/compile-cache``: inductor's and triton's), so
kernels one part compiled are not compiled again by the later parts (a fresh machine starts without it).
``--device cpu --quick`` runs every part on tiny sizes in well under a minute: the dry run the test suite keeps
working.

Run ``dimuon bench gpu --help`` (or ``python -m dimuon.bench.gpu --help``).
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from dimuon.bench import host_report
from dimuon.bench.optimizer import ns_algorithms
from dimuon.bench.quality_runs import launch, log_tail
from dimuon.bench.report import (
    format_markdown_table,
    gpu_info,
    machine_info,
    parse_bench_flags,
    parse_or_none,
    train_results,
)
from dimuon.io import atomic_path, write_json_atomic

# In this order: the optimizer and host timings first (within the first 3 minutes of one GPU), then the rest.
PARTS = ("bench", "host", "tests", "peers", "train")
# A part is started only with at least this many seconds of --budget-s left (else it is recorded as skipped).
MIN_PART_S = 5.0
# dimuon's rows that the peers part times beside the other packages: the baselines of its ratio columns and Muon
PEER_PART_ROWS = ("adamw_foreach", "muon", "muon_bf16", "muon_gram_bf16")
# the peers timed together with dimuon's rows in the peers part; every other one is started (its first step may
# compile for minutes) and timed after them, one at a time (``dimuon bench optimizer --time-last``)
EARLY_PEERS = ("torch_muon",)
# the peers of a dry run (--quick): another package's first (compiling) step outlasts it
QUICK_PEERS = ("torch_muon",)
# rows that are another row on CUDA, where bf16 is Newton-Schulz's default dtype: left out where that row is timed
CUDA_ALIASES = {"muon_bf16": "muon", "muon_gram_bf16": "muon_gram"}
# The files of the CUDA-marked tests, relative to --tests, in the order they run: most GPU-specific first (the
# Triton kernels, the optimizer's CUDA paths, NCCL), so that a part stopped at its budget loses the least specific.
CUDA_TEST_FILES = (
    "unit/test_optim_fused.py",
    "unit/test_optim_cuda.py",
    "multirank/test_sharded_devices.py",
    "unit/test_harness_on_device.py",
    "unit/test_harness_devices.py",
    "unit/test_bench_optimizer.py",  # one test of a tiny model, which the bench part covers at full size
)
TRAIN_STEPS = 300
# --pack: the tarball, and what goes in it from <work> (every part's log and outputs, not the compile cache)
PACK_NAME = "gpu-check-logs.tgz"
PACKED = ("*.log", "*.json", "*.jsonl", "*.xml", "train/*.jsonl", "train/*.json", "train/*.log", "train/*.txt")
PACKED_MAX_BYTES = 8 << 20  # a longer file keeps its last 8 MiB (as NAME.tail)


@dataclass
class Config:
    """Run the CUDA tests, the optimizer benchmark on DiT-XL/2 shapes and a bf16 training run; one JSON record."""

    device: Literal["cuda", "cpu"] = "cuda"
    """Where the benchmark and the training run go (cpu: a dry run of the whole check, with --quick)."""
    quick: bool = False
    """Tiny sizes and few steps everywhere (a dry run: every part runs, no figure means anything)."""
    parts: tuple[Literal["bench", "host", "tests", "peers", "train"], ...] = PARTS
    """Which parts to run (the others are recorded as not run)."""
    out: Path = Path("docs/results/gpu-check.json")
    """The JSON record (written atomically before the first part, as each part starts, after each and at the end;
    on a machine with a time limit, point it at storage that outlives the machine: a check stopped from outside still
    leaves every part it finished)."""
    work: Path = Path("runs/gpu-check")
    """Each part's log and outputs (the benchmark's JSON, the training run) and the compile cache (thousands of
    files: keep it out of what is copied back from a machine; --pack gathers the logs and outputs)."""
    pack: Path | None = None
    """Also pack every part's log and outputs (not the compile cache) into DIR/gpu-check-logs.tgz after each part
    and at the end, whatever the outcome (a directory that outlives the machine)."""
    tests: Path = Path("tests")
    """The test directory, which --test-files are relative to."""
    test_files: tuple[str, ...] = CUDA_TEST_FILES
    """The test files to run, relative to --tests, in this order (most GPU-specific first: a part stopped at its
    budget loses the last; a file that is missing fails the part, the others still run; none: the whole --tests
    directory)."""
    budget_s: float | None = 540.0
    """Seconds the whole check may take: each part gets at most what is left, and the parts that would start with
    less than 5 s left are recorded as skipped (the record kept; none: each part's own budget only)."""
    tests_budget_s: float = 120.0
    """Seconds the tests part may take before it is stopped."""
    bench_budget_s: float = 110.0
    """Seconds the benchmark part may take before it is stopped."""
    host_budget_s: float = 50.0
    """Seconds the host part (``dimuon bench host``, eager and compiled) may take before it is stopped."""
    peers_budget_s: float = 130.0
    """Seconds the peers part may take before it is stopped (heavyball's first step compiles; the rows timed
    before it are kept if it overruns)."""
    peers_gemm_autotune: bool = False
    """Let a peer's compiled step autotune its matrix products as it asks (heavyball: every shape, about 25 s each
    on an H200, minutes for DiT-XL/2's shapes); off, inductor takes cuBLAS (ATen) for them, as dimuon and
    torch.optim.Muon use."""
    train_budget_s: float = 40.0
    """Seconds the training part may take before it is stopped."""
    test_timeout_s: float = 60.0
    """Seconds one CUDA test may take before it fails (the others still run)."""
    model: str = "DiT-XL/2"
    """DiT whose parameter shapes the benchmark uses (ignored with --quick)."""
    train_steps: int = TRAIN_STEPS
    """Training steps of the demo run (--quick: 4)."""


@dataclass
class Part:
    """One part's outcome: ``ok``, ``failed`` (non-zero exit or unreadable results), ``timeout`` (stopped at its
    budget), ``interrupted`` (stopped by a signal to the check) or ``not run``; while the check runs, ``pending``
    (not started yet) or ``running``."""

    status: str
    seconds: float = 0.0
    budget_s: float = 0.0
    command: list[str] = field(default_factory=list)
    log: str = ""
    tail: str = ""
    results: dict[str, Any] = field(default_factory=dict)


def check_config(cfg: Config) -> None:
    """One clear error per bad flag, before anything runs."""
    budgets = ("tests_budget_s", "bench_budget_s", "host_budget_s", "peers_budget_s", "train_budget_s")
    if cfg.budget_s is not None and cfg.budget_s <= 0:
        raise ValueError(f"--budget-s must be > 0 seconds (or omitted), got {cfg.budget_s}")
    for name in (*budgets, "test_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(cfg, name)}")
    if cfg.train_steps < 1:
        raise ValueError(f"--train-steps must be >= 1, got {cfg.train_steps}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here (--device cpu --quick is the dry run)")


# ------------------------------------------------------------------------------------ the parts


def test_paths(cfg: Config) -> tuple[list[Path], list[str]]:
    """The test files of --test-files under --tests that exist, in their order (the test directory itself when
    none are named), and the names of those missing."""
    if not cfg.test_files:
        return [cfg.tests], []
    paths = [cfg.tests / name for name in cfg.test_files]
    return [p for p in paths if p.is_file()], [n for n, p in zip(cfg.test_files, paths, strict=True) if not p.is_file()]


def tests_command(cfg: Config, junit: Path) -> list[str]:
    """pytest on the CUDA-marked tests of the listed files, in their order (it collects those files alone)."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *(str(p) for p in test_paths(cfg)[0]),
    ]


def bench_command(cfg: Config, out: Path, peers: bool = False) -> list[str]:
    """The optimizer benchmark: dimuon's rows beside ``torch.optim.Muon``, or (``peers``) every other Muon package
    beside dimuon's Muon rows and ``torch.optim.Muon``."""
    from dimuon.bench.optimizer import OPTIMIZERS, PEERS

    cmd = [sys.executable, "-m", "dimuon.bench.optimizer", "--device", cfg.device, "--out", str(out), "--no-progress"]
    skip: list[str] = []
    if peers:  # a dry run times torch's alone: another package's first (compiling) step outlasts it
        others = list(QUICK_PEERS if cfg.quick else PEERS)
        skip += [n for n in OPTIMIZERS if n not in PEER_PART_ROWS]
        cmd += ["--no-ns-rate", "--peers", *others]
        # dimuon's rows and torch's first, written; then each other package, its first step compiling
        last = [n for n in others if n not in EARLY_PEERS]
    else:
        cmd += ["--peers", "torch_muon"]
        last = ["muon_compiled"]  # its first step compiles: after the other rows and the FLOP rate
        if cfg.quick and cfg.device == "cpu":  # the compiled row compiles for longer than the rest runs on a CPU
            skip.append("muon_compiled")
    if cfg.device == "cuda":  # the same step as another row there: timed once
        skip += [alias for alias, row in CUDA_ALIASES.items() if row not in skip and alias not in skip]
    last = [n for n in last if n not in skip]
    if skip:
        cmd += ["--skip", *skip]
    if last:
        cmd += ["--time-last", *last]
    if cfg.quick:  # one block of width 64
        cmd += [
            "--depth",
            "1",
            "--hidden-size",
            "64",
            "--num-heads",
            "2",
            "--input-size",
            "8",
            "--num-classes",
            "10",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--ns-repeats",
            "1",
            "--threads",
            "1",
        ]
    else:
        cmd += [
            "--model",
            cfg.model,
            "--repeats",
            "10",
            "--warmup",
            "2",
            "--repeats-of",
            "torch_muon=10",
            "--ns-repeats",
            "10",
        ]
    return cmd


def host_command(cfg: Config, out: Path) -> list[str]:
    """``dimuon bench host``: Python calls and host time per step on tiny matrices, eager at 20, 140 and 560
    matrices, then compiled at 20 (on CUDA also with ``mode="reduce-overhead"``, CUDA graphs), in one process
    (its sharded rows left out: the part's time budget is the one-process rows')."""
    cmd = [sys.executable, "-m", "dimuon.bench.host", "--device", cfg.device, "--json", str(out), "--no-progress"]
    cmd += ["--sharded-world", "0"]
    if cfg.quick:
        return [*cmd, "--quick"]
    modes = ["reduce-overhead", "default"] if cfg.device == "cuda" else ["default"]  # CUDA graphs checked first
    return [*cmd, "--repeats", "5", "--compile-matrices", "20", "--compile-modes", *modes]


def train_command(cfg: Config, run_dir: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "dimuon.train.run",
        "--device",
        cfg.device,
        "--precision",
        "bf16",
        "--out",
        str(run_dir),
        "--overwrite",
        "--no-progress",
        "--ckpt-interval",
        "0",
        "--val-interval",
        "0",
    ]
    if cfg.quick:
        return [
            *cmd,
            "--model",
            "DiT-T/4",
            "--steps",
            "4",
            "--batch-size",
            "8",
            "--warmup-steps",
            "1",
            "--log-interval",
            "2",
            "--val-samples",
            "16",
            "--sample-count",
            "10",
            "--sample-steps",
            "2",
            "--threads",
            "1",
        ]
    return [*cmd, "--steps", str(cfg.train_steps), "--log-interval", str(max(1, cfg.train_steps // 6))]


def junit_counts(path: Path) -> dict[str, Any]:
    """Passed, failed, skipped and errored tests of a JUnit XML report, with the names of those that failed."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def test_log_counts(path: Path) -> dict[str, Any]:
    """The same counts as :func:`junit_counts` from the lines the tests wrote as each finished (what an overrun
    leaves: pytest writes its JUnit report only at the end)."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": []}
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        key = {"passed": "passed", "failed": "failed", "skipped": "skipped"}.get(entry["outcome"], "errors")
        counts[key] += 1
        if key in ("failed", "errors"):
            counts["failures"].append(entry["test"])
    return counts


def bench_results(path: Path) -> dict[str, Any]:
    """The benchmark's own JSON record (every row, the FLOP rate, the machine)."""
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass
class Plan:
    """What one part runs, for how long at most, how its results are read, and the output it rewrites."""

    command: list[str]
    budget_s: float
    read: Callable[[], dict[str, Any]]
    output: Path
    env: dict[str, str] = field(default_factory=dict)
    partial: Callable[[], dict[str, Any]] | None = None  # what an overrun leaves (default: ``read``)


class Interrupted(BaseException):
    """A signal asked the check to stop (raised by the handler :func:`stop_on_signals` installs; a BaseException,
    so that no ``except Exception`` on the way takes it)."""


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the check runs: SIGTERM and SIGINT raise :class:`Interrupted` (once: the handlers before are put back
    at the first, so a second signal acts as it would have). Only in the main thread, where Python runs handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kinds = (signal.SIGTERM, signal.SIGINT)
    before = {kind: signal.getsignal(kind) for kind in kinds}

    def restore() -> None:
        for kind, handler in before.items():
            signal.signal(kind, handler)

    def stop(signum: int, frame: object) -> None:
        restore()
        raise Interrupted(signal.Signals(signum).name)

    for kind in kinds:
        signal.signal(kind, stop)
    try:
        yield
    finally:
        restore()


def run_part(name: str, plan: Plan, work: Path, threads: int | None) -> Part:
    """Run one part's command within its budget and read its results; every failure becomes the part's status.

    The part's log and its output file from an earlier check are removed first, so that nothing an earlier
    check wrote can pass for this one's results. A signal to the check (:class:`Interrupted`) stops the part's
    process group, and the part keeps what it finished, as at its budget, as ``interrupted``.
    """
    log = work / f"{name}.log"
    for stale in (log, plan.output, *(Path(v) for k, v in plan.env.items() if k == "DIMUON_TEST_LOG")):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    status, results = "ok", {}
    try:
        code = launch(plan.command, log, threads, timeout_s=plan.budget_s, env_extra=plan.env)
    except subprocess.TimeoutExpired:
        status = "timeout"
    except Interrupted as exc:  # launch has stopped the part's process group
        status, results = "interrupted", {"error": f"the check was stopped by {exc}"}
    except OSError as exc:
        status, results = "failed", {"error": f"could not start: {exc}"}
    else:
        if code != 0:
            status, results = "failed", {"error": f"exited with status {code}"}
    seconds = time.perf_counter() - start
    if status in ("timeout", "interrupted"):  # what the part finished before it was stopped, marked partial
        try:
            results = {**results, **(plan.partial or plan.read)(), "partial": True}
        except Exception as exc:
            results = {"partial": True, "error": f"nothing finished: {type(exc).__name__}: {exc}"}
    else:
        try:
            results = {**plan.read(), **results}
        except Exception as exc:  # missing or unreadable output is this part's failure, not the check's
            status = "failed"
            results.setdefault("error", f"no results: {type(exc).__name__}: {exc}")
    return Part(status, round(seconds, 1), plan.budget_s, plan.command, str(log), log_tail(log, 40), results)


# ------------------------------------------------------------------------------------ the record


def optimizer_rows(r: dict[str, Any], title: str, on_gpu: bool) -> list[str]:
    """The Markdown lines of one optimizer benchmark record: its rows and, where measured, the Newton-Schulz FLOP
    rate."""
    lines: list[str] = []
    rows = [
        [
            o["label"],
            f"{o['median_ms']:.2f}",
            f"{o['ratio_to_adamw']:.2f}" if o["ratio_to_adamw"] else "-",
            f"{o['ratio_to_muon']:.2f}" if o.get("ratio_to_muon") else "-",
            "-" if o.get("first_ms") is None else f"{o['first_ms']:.0f}",
        ]
        for o in r["optimizers"].values()
    ]
    m = r["model"]
    pending = r.get("pending") or []
    lines += [
        f"{title}, {m['name']} parameter shapes ({m['params'] / 1e6:.1f}M parameters, "
        f"{m['muon_matrices']} Muon matrices)"
        + (" (partial: the rows done within its budget)" if r.get("partial") else "")
        + ":",
        "",
        format_markdown_table(["optimizer", "ms/step", "x AdamW (foreach)", "x dimuon Muon", "first step ms"], rows),
        "",
    ]
    if pending:
        lines += [f"Not timed within its budget: {', '.join(pending)}.", ""]
    starts = [
        f"{p['label']} {p['start_s']:.3g} s"
        for p in r.get("peers", {}).values()
        if p.get("runnable") and p.get("start_s") is not None
    ]
    if starts:
        lines += [f"Peers' start (import, build, first step with any compilation): {', '.join(starts)}.", ""]
    ns = r.get("ns_flop_rate")
    if ns:
        unit, scale = ("TFLOP/s", 1e-3) if on_gpu else ("GFLOP/s", 1.0)
        rates = ", ".join(
            f"{alg} {res['ns_gflops'] * scale:.1f} {unit} ({res['ratio']:.2f}x bmm's {res['bmm_gflops'] * scale:.1f})"
            for alg, res in ns_algorithms(ns).items()
        )
        lines += [f"Newton-Schulz in {ns['dtype']} on the stacked Muon shapes: {rates}.", ""]
    return lines


def readme_rows(record: dict[str, Any]) -> str:
    """The Markdown the README takes from this check: the optimizer rows, the FLOP rate, the training speed."""
    parts = record["parts"]
    gpu = record["machine"].get("gpu") or {}
    where = gpu.get("name") or record["machine"]["cpu_model"]
    lines = [
        f"Measured on {where} (driver {gpu.get('driver')}, CUDA {gpu.get('cuda')}, torch "
        f"{record['machine']['torch']}) by `{record['command']}`:",
        "",
    ]
    tests = parts["tests"]
    if tests["status"] != "not run":
        r = tests["results"]
        lines += [
            f"- CUDA-marked tests: {tests['status']}: {r.get('passed', '-')} passed, {r.get('failed', '-')} failed, "
            f"{r.get('errors', '-')} errors, {r.get('skipped', '-')} skipped ({tests['seconds']:.0f} s)",
            "",
        ]

    def shown(part: dict[str, Any], key: str) -> bool:
        """A part that finished, or one that overran its budget with some results to show (marked partial)."""
        return part["status"] == "ok" or (part["results"].get("partial", False) and key in part["results"])

    for name, title in (("bench", "Optimizer step"), ("peers", "Other Muon packages, optimizer step")):
        if shown(parts[name], "optimizers"):
            lines += optimizer_rows(parts[name]["results"], title, bool(gpu))
        if name == "bench" and shown(parts["host"], "rows"):
            lines += [host_report.render(parts["host"]["results"], markdown=True), ""]
    train = parts["train"]
    if shown(train, "steps"):
        r = train["results"]
        lines += [
            format_markdown_table(
                ["training (demo task, bf16 autocast)", "steps/s", "ms/step", "data ms", "fwd+bwd ms", "optimizer ms"],
                [
                    [
                        f"{r['steps']} steps on {r['device']}" + (" (partial)" if r.get("partial") else ""),
                        f"{r['steps_per_s']:.1f}",
                        f"{r['step_ms']:.1f}",
                        f"{r['data_ms']:.2f}",
                        f"{r['fwd_bwd_ms']:.1f}",
                        f"{r['opt_ms']:.1f}",
                    ]
                ],
            ),
            "",
        ]
    waiting = ("pending", "running")
    failed = [f"{name} ({p['status']})" for name, p in parts.items() if p["status"] not in ("ok", "not run", *waiting)]
    if failed:
        lines.append(f"Did not complete: {', '.join(failed)}; see each part's log and tail in {record['out']}.")
    unfinished = [f"{name} ({p['status']})" for name, p in parts.items() if p["status"] in waiting]
    if unfinished:
        lines.append(f"Not finished when this record was written ({record['status']}): {', '.join(unfinished)}.")
    return "\n".join(lines).rstrip()


def pack_logs(work: Path, dest: Path) -> Path:
    """Every part's log and outputs under ``work`` (:data:`PACKED`; not the compile cache) in one gzipped tarball
    at ``dest``, written atomically; a file longer than :data:`PACKED_MAX_BYTES` keeps its end."""
    files = sorted({f for pattern in PACKED for f in work.glob(pattern) if f.is_file()})
    with atomic_path(dest) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            arcname = f"gpu-check/{f.relative_to(work).as_posix()}"
            size = f.stat().st_size
            if size <= PACKED_MAX_BYTES:
                tar.add(f, arcname=arcname)
                continue
            with open(f, "rb") as src:
                src.seek(size - PACKED_MAX_BYTES)
                data = src.read()
            info = tarfile.TarInfo(f"{arcname}.tail")
            info.size, info.mtime = len(data), int(f.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return dest


def part_plans(cfg: Config, work: Path) -> dict[str, Plan]:
    """What every part runs, its budget, how its results are read and the output it rewrites, in :data:`PARTS`
    order."""
    bench_out, host_out, run_dir, junit = (
        work / "optimizer.json",
        work / "host.json",
        work / "train",
        work / "tests.xml",
    )
    peers_out = work / "peers.json"
    test_log = (work / "tests.jsonl").resolve()  # absolute: a test that changes directory still finds it
    cache = (work / "compile-cache").resolve()
    # torch.compile's default mode everywhere: an environment that turns on inductor's GEMM autotuning makes the
    # compiled row autotune every Newton-Schulz product shape (about 30 s each) and time what users do not run
    shared = {
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCHINDUCTOR_MAX_AUTOTUNE": "0",
        "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "0",
    }
    aten = {} if cfg.peers_gemm_autotune else {"TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS": "ATEN"}
    test_env = {**shared, "DIMUON_TEST_TIMEOUT_S": f"{cfg.test_timeout_s:g}", "DIMUON_TEST_LOG": str(test_log)}
    return {
        "bench": Plan(
            bench_command(cfg, bench_out), cfg.bench_budget_s, lambda: bench_results(bench_out), bench_out, shared
        ),
        "host": Plan(host_command(cfg, host_out), cfg.host_budget_s, lambda: bench_results(host_out), host_out, shared),
        "tests": Plan(
            tests_command(cfg, junit),
            cfg.tests_budget_s,
            lambda: junit_counts(junit),
            junit,
            test_env,
            partial=lambda: test_log_counts(test_log),
        ),
        "peers": Plan(
            bench_command(cfg, peers_out, peers=True),
            cfg.peers_budget_s,
            lambda: bench_results(peers_out),
            peers_out,
            {**shared, **aten},
        ),
        "train": Plan(
            train_command(cfg, run_dir),
            cfg.train_budget_s,
            lambda: train_results(run_dir),
            run_dir / "metrics.jsonl",
            shared,
        ),
    }


@dataclass
class Check:
    """One run of the check: its flags, its parts as they stand, and the record written from them."""

    cfg: Config
    argv: list[str] | None
    parts: dict[str, Part]
    machine: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)

    def left_s(self) -> float | None:
        """Seconds of --budget-s left (None: no overall budget)."""
        return None if self.cfg.budget_s is None else self.cfg.budget_s - (time.perf_counter() - self.started)

    def write(self, status: str, pack: bool = True) -> dict[str, Any]:
        """The record as it stands (``status``: ``in progress``, ``complete``, ``budget spent`` or ``interrupted``),
        and the tarball."""
        cfg = self.cfg
        record: dict[str, Any] = {
            "benchmark": "gpu-check",
            "command": "dimuon bench gpu " + " ".join(self.argv or []),
            "out": str(cfg.out),
            "status": status,
            "running": next((name for name, p in self.parts.items() if p.status == "running"), None),
            "machine": self.machine,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "total_s": round(time.perf_counter() - self.started, 1),
            "parts": {name: asdict(p) for name, p in self.parts.items()},
        }
        record["readme"] = readme_rows(record)
        write_json_atomic(cfg.out, record)
        if pack and cfg.pack is not None:
            try:
                pack_logs(cfg.work, cfg.pack / PACK_NAME)
            except OSError as exc:  # the record matters more than the tarball
                print(f"dimuon bench gpu: could not pack the logs into {cfg.pack}: {exc}", file=sys.stderr)
        return record


def budgeted(check: Check, plan: Plan) -> Plan | None:
    """``plan`` with its budget cut to what --budget-s leaves, None when too little is left to start it."""
    left = check.left_s()
    if left is None:
        return plan
    if left < MIN_PART_S:
        return None
    return replace(plan, budget_s=round(min(plan.budget_s, left), 1))


def run_one(check: Check, name: str, plan: Plan) -> Part:
    """Run one part (or record why it did not start: no test files, the check's budget spent) and write the
    record as it starts and after it."""
    cfg, work = check.cfg, check.cfg.work
    files, missing = test_paths(cfg) if name == "tests" else ([], [])
    if name == "tests" and (not cfg.tests.is_dir() or not files):
        error = f"no test directory {cfg.tests}" if not cfg.tests.is_dir() else f"no test file {missing}"
        return Part("failed", budget_s=plan.budget_s, results={"error": error})
    cut = budgeted(check, plan)
    if cut is None:
        print(f"dimuon bench gpu: {name}: skipped (--budget-s {cfg.budget_s:g} spent)", flush=True)
        return Part("skipped", budget_s=plan.budget_s, results={"error": f"--budget-s {cfg.budget_s:g} was spent"})
    check.parts[name] = Part("running", budget_s=cut.budget_s, command=cut.command, log=str(work / f"{name}.log"))
    check.write("in progress", pack=False)
    print(f"dimuon bench gpu: {name} (budget {cut.budget_s:.0f} s) ...", flush=True)
    part = run_part(name, cut, work, 1 if cfg.quick else None)
    if missing:  # the listed files that are there ran; a renamed or lost one must not pass unseen
        part.results["missing_files"] = missing
        if part.status == "ok":
            part.status = "failed"
            part.results["error"] = f"test files not found under {cfg.tests}: {missing}"
    print(f"dimuon bench gpu: {name}: {part.status} in {part.seconds:.0f} s", flush=True)
    return part


def run(cfg: Config, argv: list[str] | None = None) -> dict[str, Any]:
    """Run the requested parts in order and write the record before the first, as each starts, after each and at
    the end (and the --pack tarball after each and at the end); returns the last record."""
    check_config(cfg)
    cfg.work.mkdir(parents=True, exist_ok=True)
    plans = part_plans(cfg, cfg.work)
    parts = {
        name: Part("pending", budget_s=plan.budget_s, command=plan.command) if name in cfg.parts else Part("not run")
        for name, plan in plans.items()
    }
    check = Check(cfg, argv, parts, {**machine_info(argv), "gpu": gpu_info(cfg.device)})
    status = "complete"
    with stop_on_signals():
        try:
            check.write("in progress", pack=False)
            for name, plan in plans.items():
                if name not in cfg.parts:
                    continue
                parts[name] = run_one(check, name, plan)
                if parts[name].status == "interrupted":
                    status = "interrupted"
                    break
                check.write("in progress")
        except Interrupted:  # between two parts, or while the record was written: the part under way stops here
            status = "interrupted"
    if status == "interrupted":
        for p in parts.values():
            if p.status == "running":
                p.status = "interrupted"
        print("dimuon bench gpu: interrupted; the parts after it are recorded as pending", flush=True)
    elif any(p.status == "skipped" for p in parts.values()):
        status = "budget spent"
    return check.write(status)  # with the signal handlers of before: a second signal acts as it would have


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed and checked by :func:`check_config` (which asks torch whether CUDA is here), nothing run:
    SystemExit(2) for a flag the parser refuses, ValueError for a value the check refuses."""
    return parse_bench_flags(Config, argv, "dimuon bench gpu", check_config)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench gpu``: 0 when every part that ran is ok (a part skipped because --budget-s was
    spent counts as not run), 1 otherwise (a part failed, overran its budget, or the check was interrupted), 2 on
    bad flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_or_none(parse, args, "dimuon bench gpu")
    if cfg is None:
        return 2
    record = run(cfg, args)
    print("\n" + record["readme"] + f"\n\nwrote {cfg.out} ({record['total_s']:.0f} s)")
    return 0 if all(p["status"] in ("ok", "not run", "skipped") for p in record["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
