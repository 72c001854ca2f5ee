"""``dimuon bench gpu`` (``scripts/gpu-check``): the GPU check of dimuon in one command.

Four parts, each a process of its own with its own time budget, so that a failure or an overrun in one
is recorded and the others still run:

1. ``tests``: the CUDA-marked tests (``pytest -m cuda``; they skip themselves without a GPU);
2. ``bench``: ``dimuon bench optimizer --device cuda`` on DiT-XL/2 parameter shapes (every optimizer
   row beside ``torch.optim.Muon``, compiled Newton-Schulz with its compile time apart, the Newton-Schulz
   FLOP rate against ``torch.bmm`` in bf16 on the same shapes);
3. ``peers``: the other Muon packages (heavyball) on the same shapes beside dimuon's Muon and
   ``torch.optim.Muon``, in one run of their own: heavyball compiles its step with inductor's GEMM autotuning
   (its default mode), about 30 s per matrix product shape on a first run, which would leave the ``bench``
   part no time for its own rows;
4. ``train``: ``dimuon train`` on the demo task under bf16 autocast for a few hundred steps: steps per
   second and where a step's time goes (data, forward/backward, optimizer);

then one JSON record (GPU, driver, torch, CUDA, cuDNN and NCCL versions, CPU, each part's status, time
and results) under ``docs/results/``, and the README rows printed.

The budgets (120 + 170 + 240 + 50 s) keep the check within 10 minutes on one GPU. A part that overruns its
budget keeps what it finished: every test's outcome as it ends (and each test has a time limit of its own,
``--test-timeout-s``: a hung test fails, the rest run), the benchmark's rows of every round sampled so far, the
training run's records. The parts share one compile cache (``<work>/compile-cache``: inductor's and triton's), so
kernels the tests compiled are not compiled again by the benchmark or the training run, nor by the next check.
``--device cpu --quick`` runs every part on tiny sizes in well under a minute: the dry run the test suite keeps
working.

Run ``dimuon bench gpu --help`` (or ``python -m dimuon.bench.gpu --help``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dimuon.bench.optimizer import ns_algorithms
from dimuon.bench.quality_runs import launch, log_tail
from dimuon.bench.report import (
    format_markdown_table,
    gpu_info,
    machine_info,
    parse_bench_flags,
    train_results,
)
from dimuon.io import write_json_atomic

PARTS = ("tests", "bench", "peers", "train")
# dimuon's rows that the peers part times beside the other packages: the baselines of its ratio columns and Muon
PEER_PART_ROWS = ("adamw_foreach", "muon", "muon_bf16", "muon_gram_bf16")
TRAIN_STEPS = 300


@dataclass
class Config:
    """Run the CUDA tests, the optimizer benchmark on DiT-XL/2 shapes and a bf16 training run; one JSON record."""

    device: Literal["cuda", "cpu"] = "cuda"
    """Where the benchmark and the training run go (cpu: a dry run of the whole check, with --quick)."""
    quick: bool = False
    """Tiny sizes and few steps everywhere (a dry run: every part runs, no figure means anything)."""
    parts: tuple[Literal["tests", "bench", "peers", "train"], ...] = PARTS
    """Which parts to run (the others are recorded as not run)."""
    out: Path = Path("docs/results/gpu-check.json")
    """The JSON record (written atomically)."""
    work: Path = Path("runs/gpu-check")
    """Each part's log and outputs (the benchmark's JSON, the training run)."""
    tests: Path = Path("tests")
    """The test directory that pytest -m cuda collects."""
    tests_budget_s: float = 120.0
    """Seconds the tests part may take before it is stopped."""
    bench_budget_s: float = 170.0
    """Seconds the benchmark part may take before it is stopped."""
    peers_budget_s: float = 240.0
    """Seconds the peers part may take before it is stopped (a first run compiles heavyball's step)."""
    peers_gemm_autotune: bool = False
    """Let a peer's compiled step autotune its matrix products as it asks (heavyball: every shape, about 25 s each
    on an H200, minutes for DiT-XL/2's shapes); off, inductor takes cuBLAS (ATen) for them, as dimuon and
    torch.optim.Muon use."""
    train_budget_s: float = 50.0
    """Seconds the training part may take before it is stopped."""
    test_timeout_s: float = 60.0
    """Seconds one CUDA test may take before it fails (the others still run)."""
    model: str = "DiT-XL/2"
    """DiT whose parameter shapes the benchmark uses (ignored with --quick)."""
    train_steps: int = TRAIN_STEPS
    """Training steps of the demo run (--quick: 4)."""


@dataclass
class Part:
    """One part's outcome: ``ok``, ``failed`` (non-zero exit or unreadable results), ``timeout`` or ``not run``."""

    status: str
    seconds: float = 0.0
    budget_s: float = 0.0
    command: list[str] = field(default_factory=list)
    log: str = ""
    tail: str = ""
    results: dict[str, Any] = field(default_factory=dict)


def check_config(cfg: Config) -> None:
    """One clear error per bad flag, before anything runs."""
    for name in ("tests_budget_s", "bench_budget_s", "peers_budget_s", "train_budget_s", "test_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(cfg, name)}")
    if cfg.train_steps < 1:
        raise ValueError(f"--train-steps must be >= 1, got {cfg.train_steps}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here (--device cpu --quick is the dry run)")


# ------------------------------------------------------------------------------------ the parts


def tests_command(cfg: Config, junit: Path) -> list[str]:
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
        str(cfg.tests),
    ]


def bench_command(cfg: Config, out: Path, peers: bool = False) -> list[str]:
    """The optimizer benchmark: dimuon's rows beside ``torch.optim.Muon``, or (``peers``) every other Muon package
    beside dimuon's Muon rows and ``torch.optim.Muon``."""
    from dimuon.bench.optimizer import OPTIMIZERS, PEERS

    cmd = [sys.executable, "-m", "dimuon.bench.optimizer", "--device", cfg.device, "--out", str(out), "--no-progress"]
    if peers:  # a dry run times torch's alone: another package's first (compiling) step outlasts it
        others = ["torch_muon"] if cfg.quick else list(PEERS)
        cmd += ["--no-ns-rate", "--peers", *others, "--skip", *(n for n in OPTIMIZERS if n not in PEER_PART_ROWS)]
    else:
        cmd += ["--peers", "torch_muon"]
    if cfg.quick:  # one block of width 64; the compiled row compiles for longer than the rest runs on a CPU
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
        if not peers and cfg.device == "cpu":
            cmd += ["--skip", "muon_compiled"]
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


def run_part(name: str, plan: Plan, work: Path, threads: int | None) -> Part:
    """Run one part's command within its budget and read its results; every failure becomes the part's status.

    The part's log and its output file from an earlier check are removed first, so that nothing an earlier
    check wrote can pass for this one's results.
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
    except OSError as exc:
        status, results = "failed", {"error": f"could not start: {exc}"}
    else:
        if code != 0:
            status, results = "failed", {"error": f"exited with status {code}"}
    seconds = time.perf_counter() - start
    if status == "timeout":  # what the part finished before its budget ran out, marked partial
        try:
            results = {**(plan.partial or plan.read)(), "partial": True}
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
    lines += [
        f"{title}, {m['name']} parameter shapes ({m['params'] / 1e6:.1f}M parameters, "
        f"{m['muon_matrices']} Muon matrices)"
        + (" (partial: the rows done within its budget)" if r.get("partial") else "")
        + ":",
        "",
        format_markdown_table(["optimizer", "ms/step", "x AdamW (foreach)", "x dimuon Muon", "first step ms"], rows),
        "",
    ]
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
    failed = [f"{name} ({p['status']})" for name, p in parts.items() if p["status"] not in ("ok", "not run")]
    if failed:
        lines.append(f"Did not complete: {', '.join(failed)}; see each part's log and tail in {record['out']}.")
    return "\n".join(lines).rstrip()


def run(cfg: Config, argv: list[str] | None = None) -> dict[str, Any]:
    """Run the requested parts in order and write the record; returns it."""
    check_config(cfg)
    work = cfg.work
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    bench_out, run_dir, junit = work / "optimizer.json", work / "train", work / "tests.xml"
    peers_out = work / "peers.json"
    test_log = work / "tests.jsonl"
    cache = (work / "compile-cache").resolve()
    # torch.compile's default mode everywhere: an environment that turns on inductor's GEMM autotuning makes the
    # compiled row autotune every Newton-Schulz product shape (about 30 s each) and time what users do not run
    shared = {
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCHINDUCTOR_MAX_AUTOTUNE": "0",
        "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "0",
    }
    plans = {
        "tests": Plan(
            tests_command(cfg, junit),
            cfg.tests_budget_s,
            lambda: junit_counts(junit),
            junit,
            {**shared, "DIMUON_TEST_TIMEOUT_S": f"{cfg.test_timeout_s:g}", "DIMUON_TEST_LOG": str(test_log)},
            partial=lambda: test_log_counts(test_log),
        ),
        "bench": Plan(
            bench_command(cfg, bench_out), cfg.bench_budget_s, lambda: bench_results(bench_out), bench_out, shared
        ),
        "peers": Plan(
            bench_command(cfg, peers_out, peers=True),
            cfg.peers_budget_s,
            lambda: bench_results(peers_out),
            peers_out,
            {**shared, **({} if cfg.peers_gemm_autotune else {"TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS": "ATEN"})},
        ),
        "train": Plan(
            train_command(cfg, run_dir),
            cfg.train_budget_s,
            lambda: train_results(run_dir),
            run_dir / "metrics.jsonl",
            shared,
        ),
    }
    parts: dict[str, Part] = {}
    for name, plan in plans.items():
        if name not in cfg.parts:
            parts[name] = Part("not run")
            continue
        if name == "tests" and not cfg.tests.is_dir():
            parts[name] = Part("failed", results={"error": f"no test directory {cfg.tests}"})
            continue
        print(f"dimuon bench gpu: {name} (budget {plan.budget_s:.0f} s) ...", flush=True)
        parts[name] = run_part(name, plan, work, 1 if cfg.quick else None)
        print(f"dimuon bench gpu: {name}: {parts[name].status} in {parts[name].seconds:.0f} s", flush=True)
    record: dict[str, Any] = {
        "benchmark": "gpu-check",
        "command": "dimuon bench gpu " + " ".join(argv or []),
        "out": str(cfg.out),
        "machine": {**machine_info(argv), "gpu": gpu_info(cfg.device)},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "total_s": round(time.perf_counter() - started, 1),
        "parts": {name: asdict(p) for name, p in parts.items()},
    }
    record["readme"] = readme_rows(record)
    write_json_atomic(cfg.out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench gpu``: 0 when every part that ran is ok, 1 otherwise, 2 on bad flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_bench_flags(Config, args, "dimuon bench gpu", check_config)
    if cfg is None:
        return 2
    record = run(cfg, args)
    print("\n" + record["readme"] + f"\n\nwrote {cfg.out} ({record['total_s']:.0f} s)")
    return 0 if all(p["status"] in ("ok", "not run") for p in record["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
