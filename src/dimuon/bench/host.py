"""``dimuon bench host``: the host's share of one optimizer step, on tensors so small that arithmetic is ~0.

On a GPU the host queues a step's kernels; where its Python and dispatch take longer than the kernels run, the
host time is the step. This measures that floor on any machine: DiT-like matrices (per block qkv, proj, fc1, fc2
and adaLN, with their biases in AdamW) of side ``--width`` at each count of ``--matrices``, every dimuon optimizer
in its accelerator form (:func:`~dimuon.bench.host_probe.accelerator_form`), eager and under ``torch.compile``
(whose outcome, graph breaks and first-step time are recorded; a failure is recorded, not raised), beside torch's
foreach and fused AdamW and ``torch.optim.Muon`` on the same tensors in the same process. The compiled rows step
optimizers built with ``--compile-nonfinite`` (``skip`` by default: the step compiled as the docs recommend, with
``fullgraph=True`` where it can be one graph), each timed in the same rounds as its eager twin of that setting.
The sharded rows (:mod:`~dimuon.bench.host_sharded`) step rank 0 of an FSDP2 layout of ``--sharded-world`` ranks,
in this process on torch's fake process group. Per row and size: the Python calls made inside dimuon per step and
the ops dispatched per step (counted eagerly, per step kind), and the host time per step (rounds interleaved over
every row of a size and part; medians per step kind and of the period's mean). Run ``dimuon bench host --help``.
"""

from __future__ import annotations

import contextlib
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import tyro
from torch import nn
from tqdm import tqdm

from dimuon.bench.host_probe import accelerator_form, cudagraph_skips, dimuon_calls, op_seconds
from dimuon.bench.report import machine_info, parse_or_none
from dimuon.io import write_json_atomic
from dimuon.optim import build
from dimuon.optim.build import LABELS

PROG = "dimuon bench host"
OPTIMIZERS = ("muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon")
BASELINES: dict[str, tuple[str, dict[str, Any], str]] = {
    "adamw_foreach": ("adamw", {"foreach": True}, "torch AdamW (foreach)"),
    "adamw_fused": ("adamw", {"fused": True}, "torch AdamW (fused)"),
    "torch_muon": ("torch_muon", {}, "torch.optim.Muon + AdamW (foreach)"),
}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
# A compiled row warms up for more periods, at most this many, until one compiles no new graph (torch's first
# compiled calls recompile as the state and the step counter settle; a plan made at the first step guards anew)
SETTLE_PERIODS = 4
# one graph per step kind with nonfinite="skip" (AdaptiveRowMuon reads its signals on the host: a graph break)
FULLGRAPH = ("muon", "periodic_row_muon", "muon_bp")
MATRICES_PER_BLOCK = 5  # qkv, proj, fc1, fc2, adaLN


@dataclass
class Config:
    """Python calls and host time of one optimizer step on tiny DiT-like matrices, against torch's optimizers."""

    matrices: tuple[int, ...] = (20, 140, 560)
    """Muon matrices of each model (multiples of 5: blocks of qkv, proj, fc1, fc2, adaLN)."""
    width: int = 8
    """Hidden size of the tiny blocks (qkv is 3w x w, fc1 4w x w, adaLN 6w x w)."""
    optimizers: tuple[Literal["muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon"], ...] = OPTIMIZERS
    """dimuon's optimizers to measure (each over a whole period where it has one)."""
    baselines: tuple[Literal["adamw_foreach", "adamw_fused", "torch_muon"], ...] = tuple(BASELINES)
    """torch's optimizers timed beside them on the same tensors."""
    compile_modes: tuple[str, ...] = ("default",)
    """torch.compile modes of the compiled rows (none: eager only), from: default reduce-overhead
    max-autotune-no-cudagraphs."""
    compile_matrices: tuple[int, ...] = (20,)
    """Matrix counts at which the compiled rows run (compiling a graph-broken step at 560 takes minutes)."""
    compile_nonfinite: Literal["skip", "raise"] = "skip"
    """nonfinite setting of the compiled rows and of their eager twins timed beside them (skip: the vote stays on
    the device, so Muon, PeriodicRowMuon and MuonBP compile with fullgraph=True and AdaptiveRowMuon breaks the graph
    at its signals; raise: the optimizers' default, which reads the vote on the host at every step and breaks the
    graph there, compiled without fullgraph)."""
    compile_backend: Literal["inductor", "eager"] = "inductor"
    """torch.compile backend of the compiled rows (eager: dynamo's graphs run as traced, no code generated, with
    --compile-modes default only; for checking the graphs quickly)."""
    sharded_world: tuple[int, ...] = (256,)
    """World sizes of the sharded rows: rank 0 of an FSDP2 layout of that many ranks on torch's fake process group
    (collectives move nothing), at every count of --matrices, with torch's AdamW beside them (0 or none: no
    sharded rows)."""
    sharded_refresh: Literal["owner", "gather"] = "owner"
    """Spectral refresh of the sharded rows (owner: the optimizers' default)."""
    repeats: int = 7
    """Timed periods per row and size (interleaved rounds; medians)."""
    warmup: int = 2
    """Untimed periods before timing (state made; a compiled row compiles every step kind)."""
    threads: int = 1
    """torch.set_num_threads for the run."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the tensors live (cuda: every step bracketed by a synchronize)."""
    clock: Literal["thread", "wall"] = "thread"
    """thread: this thread's CPU time (time.thread_time: what other processes on a shared machine take is not
    counted; with --threads 1 every op runs on it); wall: time.perf_counter (always on cuda, where a step's time
    includes the device's)."""
    quick: bool = False
    """Tiny run for tests: 10 and 20 matrices, 1 repeat, 1 warm-up period, compiled rows off unless named."""
    json: Path | None = None
    """Write the JSON record here."""
    out: Path | None = None
    """Write host.json, host.md and host.png into this directory."""
    progress: bool = True
    """Show a progress bar."""
    seed: int = 0
    """Seed of the tiny weights and gradients."""


def check_config(cfg: Config) -> None:
    """One error per bad flag, naming it and what it allows, before anything is measured."""
    if not cfg.matrices or any(m < MATRICES_PER_BLOCK or m % MATRICES_PER_BLOCK for m in cfg.matrices):
        raise ValueError(f"--matrices must be positive multiples of {MATRICES_PER_BLOCK}, got {cfg.matrices}")
    bad = [m for m in cfg.compile_modes if m not in COMPILE_MODES]
    if bad:
        raise ValueError(f"--compile-modes must be from {list(COMPILE_MODES)}, got {bad}")
    if cfg.compile_modes and [m for m in cfg.compile_matrices if m not in cfg.matrices]:
        raise ValueError(f"--compile-matrices must be among --matrices {cfg.matrices}, got {cfg.compile_matrices}")
    if cfg.compile_nonfinite not in ("skip", "raise"):
        raise ValueError(f"--compile-nonfinite must be skip or raise, got {cfg.compile_nonfinite!r}")
    if cfg.compile_backend not in ("inductor", "eager"):
        raise ValueError(f"--compile-backend must be inductor or eager, got {cfg.compile_backend!r}")
    if cfg.compile_backend == "eager" and set(cfg.compile_modes) - {"default"}:
        raise ValueError(f"--compile-backend eager takes --compile-modes default only, got {cfg.compile_modes}")
    if any(w == 1 or w < 0 for w in cfg.sharded_world):
        raise ValueError(f"--sharded-world must be world sizes >= 2 (0: none), got {cfg.sharded_world}")
    for name, low in (("width", 2), ("repeats", 1), ("warmup", 1), ("threads", 1)):
        if getattr(cfg, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(cfg, name)}")
    if not cfg.optimizers and not cfg.baselines:
        raise ValueError("--optimizers and --baselines are both empty: nothing to measure")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here (choose cpu)")


def resolved(cfg: Config, argv: Sequence[str]) -> Config:
    """``cfg`` with --quick's sizes where their flags were not given (10 and 20 matrices, one repeat and warm-up
    period, no compiled rows; compiled rows at the fewest matrices)."""
    if not cfg.quick:
        return cfg
    given = {a.split("=", 1)[0] for a in argv}
    quick: dict[str, Any] = {"matrices": (10, 20), "repeats": 1, "warmup": 1, "compile_modes": ()}
    picked = {k: v for k, v in quick.items() if f"--{k.replace('_', '-')}" not in given}
    if "--compile-matrices" not in given:
        picked["compile_matrices"] = (min(picked.get("matrices", cfg.matrices)),)
    return Config(**{**asdict(cfg), **picked})


class Blocks(nn.Module):
    """``blocks`` DiT-like blocks of width ``w``, named as dimuon's DiT names them (so qkv and adaLN split)."""

    def __init__(self, blocks: int, w: int) -> None:
        super().__init__()

        def block() -> nn.Module:
            b = nn.Module()
            b.attn = nn.ModuleDict({"qkv": nn.Linear(w, 3 * w), "proj": nn.Linear(w, w)})
            b.mlp = nn.ModuleDict({"fc1": nn.Linear(w, 4 * w), "fc2": nn.Linear(4 * w, w)})
            b.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 6 * w))
            return b

        self.blocks = nn.ModuleList([block() for _ in range(blocks)])


def make_model(matrices: int, cfg: Config) -> nn.Module:
    """The tiny model with seeded weights and gradients on ``cfg.device``."""
    gen = torch.Generator().manual_seed(cfg.seed + matrices)
    model = Blocks(matrices // MATRICES_PER_BLOCK, cfg.width)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        p.grad = torch.randn(p.shape, generator=gen) * 0.01
    return model.to(cfg.device)


@dataclass
class Row:
    """One optimizer, eager or compiled (``mode``), at one size: how its steps are made and what they measured."""

    name: str
    label: str
    matrices: int
    opt: Any
    step: Callable[[], Any]
    period: int
    mode: str = "eager"
    dimuon: bool = True
    kinds: list[str] = field(default_factory=list)  # the kind of each step of a timed period
    samples: list[list[float]] = field(default_factory=list)  # per timed period, seconds per step
    status: str = "ok"
    error: str | None = None
    first_s: float | None = None
    calls: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    graph_breaks: int | None = None
    graphs: int | None = None
    cudagraph_skips: int | None = None  # reduce-overhead rows: graphs inductor ran without CUDA graphs
    cudagraph_skip_reason: str | None = None  # the first reason it gave
    compiled: dict[str, Any] | None = None  # a compiled row's or eager twin's setting (recorded with it)


def period_of(name: str, opt: Any) -> int:
    """Steps in one period of the optimizer's schedule (1 for a step that is always the same)."""
    group = next((g for g in opt.param_groups if g.get("algorithm") == "muon"), {})
    return int({"periodic_row_muon": group.get("k", 1), "muon_bp": group.get("period", 1)}.get(name, 1))


def kind_of(opt: Any) -> str:
    """The kind of the next step (spectral, rownorm, block), ``step`` for a step that decides per matrix."""
    kinds = [k for k in getattr(opt, "step_kinds", lambda: [])() if k is not None]
    return kinds[0].value if kinds else "step"


def make_rows(
    cfg: Config, matrices: int, model: nn.Module, mode: str = "eager", options: dict[str, Any] | None = None
) -> list[Row]:
    """The rows at one size: dimuon's optimizers eager (built with ``options`` too) and torch's baselines, or
    dimuon's optimizers compiled in ``mode`` beside their eager twins (:func:`compiled_rows`)."""
    if mode != "eager":
        return compiled_rows(cfg, matrices, model, mode)
    rows = []
    for name in cfg.optimizers:
        opt = build(name, model, lr=1e-3, weight_decay=0.01, **(options or {}))
        rows.append(Row(name, LABELS.get(name, name), matrices, opt, opt.step, period_of(name, opt)))
    for name in cfg.baselines:
        kind, options, label = BASELINES[name]
        opt = build(kind, model, lr=1e-3, weight_decay=0.01, **options)
        rows.append(Row(name, label, matrices, opt, opt.step, 1, dimuon=False))
    return rows


def compiled_rows(cfg: Config, matrices: int, model: nn.Module, mode: str) -> list[Row]:
    """Each of dimuon's optimizers built with ``cfg.compile_nonfinite`` and compiled in ``mode`` (``fullgraph=True``
    where its step can be one graph), then its eager twin of the same setting, so both are timed in the same
    rounds."""
    nonfinite, rows = cfg.compile_nonfinite, []
    for name in cfg.optimizers:
        full = nonfinite == "skip" and name in FULLGRAPH
        opt = build(name, model, lr=1e-3, weight_decay=0.01, nonfinite=nonfinite)
        step = torch.compile(opt.step, mode=mode, fullgraph=full, backend=cfg.compile_backend)
        twin = twin_name(name, mode, nonfinite)
        label = f"{LABELS.get(name, name)} (compiled, {mode}, {nonfinite}" + (", fullgraph)" if full else ")")
        setting = {"optimizer": name, "nonfinite": nonfinite}
        compiled = {**setting, "fullgraph": full, "backend": cfg.compile_backend, "twin": twin}
        rows.append(
            Row(row_name(name, mode), label, matrices, opt, step, period_of(name, opt), mode, compiled=compiled)
        )
        eager = build(name, model, lr=1e-3, weight_decay=0.01, nonfinite=nonfinite)
        beside = "" if mode == "default" else f", beside {mode}"
        twin_label = f"{LABELS.get(name, name)} (eager, {nonfinite}{beside})"
        rows.append(Row(twin, twin_label, matrices, eager, eager.step, period_of(name, eager), compiled=setting))
    return rows


def row_name(name: str, mode: str) -> str:
    """``muon``, ``muon_compiled``, ``muon_compiled_reduce_overhead``..."""
    if mode == "eager":
        return name
    return f"{name}_compiled" + ("" if mode == "default" else "_" + mode.replace("-", "_"))


def twin_name(name: str, mode: str, nonfinite: str) -> str:
    """The eager twin timed beside a compiled row: ``muon_skip``, ``muon_skip_reduce_overhead``..."""
    return f"{name}_{nonfinite}" + ("" if mode == "default" else "_" + mode.replace("-", "_"))


def _sync(device: str) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)


def clock_of(cfg: Config) -> Callable[[], float]:
    """The clock of every sample: the thread's CPU time, or wall time (on cuda, or asked for)."""
    return time.perf_counter if cfg.device == "cuda" or cfg.clock == "wall" else time.thread_time


def warm_up(row: Row, cfg: Config) -> None:
    """``cfg.warmup`` untimed periods (the first step's time kept: state, compilation), and for a compiled row more
    periods, up to :data:`SETTLE_PERIODS`, until one compiles nothing new: the counts and timing that follow see the
    step as it runs once warm, and ``graphs`` counts every graph it took to get there. A compiled row that fails is
    recorded with its error and left out of the timing."""
    counters = torch._dynamo.utils.counters
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    sync, clock = _sync(cfg.device), time.perf_counter  # the first step's wall time: compilation included

    def steps(n: int) -> None:
        for _ in range(n):
            sync()
            start = clock()
            row.step()
            sync()
            if row.first_s is None:
                row.first_s = clock() - start

    with cudagraph_skips() as skips:
        try:
            steps(cfg.warmup * row.period)
            for _ in range(SETTLE_PERIODS if row.mode != "eager" else 0):
                before = counters["stats"]["unique_graphs"]
                steps(row.period)
                if counters["stats"]["unique_graphs"] == before:
                    break
        except Exception as exc:  # a compiled step that does not compile is a result here, not a crash
            row.status, row.error = "failed", f"{type(exc).__name__}: {exc}".strip()[:2000]
    if row.mode == "reduce-overhead":
        row.cudagraph_skips = skips["count"]
        row.cudagraph_skip_reason = skips["reasons"][0][:500] if skips["reasons"] else None
    if row.mode != "eager":
        row.graph_breaks = sum(counters["graph_break"].values()) - breaks
        row.graphs = counters["stats"]["unique_graphs"] - graphs


def count(row: Row) -> None:
    """Over one period each: the Python calls inside dimuon of every step and its kind; its dispatched ops (eager
    rows: what a GPU would launch)."""
    from dimuon.bench.traffic import count_step

    row.kinds = []
    for _ in range(row.period):
        row.kinds.append(kind_of(row.opt))
        row.calls.append(dimuon_calls(row.step))
    if row.mode == "eager":
        row.ops = [count_step(row.step).launches for _ in range(row.period)]


def time_period(row: Row, sync: Callable[[], None], clock: Callable[[], float]) -> None:
    """One timed period of the row, each step timed on its own."""
    times = []
    for _ in range(row.period):
        sync()
        start = clock()
        row.step()
        sync()
        times.append(clock() - start)
    row.samples.append(times)


def measure_size(cfg: Config, matrices: int, bar: tqdm, mode: str = "eager") -> list[Row]:
    """Every row at one size and mode: built, warmed up, counted, then timed in interleaved rounds."""
    model = make_model(matrices, cfg)
    return measure_rows(cfg, make_rows(cfg, matrices, model, mode), matrices, bar)


def measure_rows(cfg: Config, rows: list[Row], matrices: int, bar: tqdm) -> list[Row]:
    """``rows`` (of one size) warmed up, counted, then timed in interleaved rounds."""
    for row in rows:
        bar.set_postfix_str(f"{row.name} @ {matrices} (warm-up)")
        warm_up(row, cfg)
        if row.status == "ok":
            count(row)
    live = [r for r in rows if r.status == "ok"]
    sync, clock = _sync(cfg.device), clock_of(cfg)
    for _ in range(cfg.repeats):
        for row in live:
            bar.set_postfix_str(f"{row.name} @ {matrices}")
            time_period(row, sync, clock)
        bar.update(1)
    return rows


def _median_ms(values: Sequence[float]) -> float:
    return round(1e3 * statistics.median(values), 4)


def row_record(row: Row) -> dict[str, Any]:
    """One row at one size as JSON: per step kind and over the period (calls, ops, host ms)."""
    kinds: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(row.kinds):
        idx = [i for i, k in enumerate(row.kinds) if k == kind]
        kinds[kind] = {
            "steps_per_period": len(idx),
            "calls_per_step": statistics.mean(row.calls[i] for i in idx),
            "ops_per_step": statistics.mean(row.ops[i] for i in idx) if row.ops else None,
            "host_ms": _median_ms([s[i] for s in row.samples for i in idx]) if row.samples else None,
        }
    means = [statistics.mean(s) for s in row.samples]
    return {
        "name": row.name,
        "label": row.label,
        "mode": row.mode,
        "dimuon": row.dimuon,
        "matrices": row.matrices,
        "period": row.period,
        "status": row.status,
        "error": row.error,
        "first_step_ms": None if row.first_s is None else round(1e3 * row.first_s, 3),
        "graph_breaks": row.graph_breaks,
        "graphs": row.graphs,
        "cudagraph_skips": row.cudagraph_skips,
        "cudagraph_skip_reason": row.cudagraph_skip_reason,
        "calls_per_step": statistics.mean(row.calls) if row.calls else None,
        "ops_per_step": statistics.mean(row.ops) if row.ops else None,
        "host_ms": _median_ms(means) if means else None,
        "period_means_ms": [round(1e3 * m, 4) for m in means],
        "kinds": kinds,
        **(row.compiled or {}),
    }


@contextlib.contextmanager
def _recompile_limits(limit: int = 4096) -> Iterator[None]:
    """Every compiled row is the same ``step`` code on another optimizer: let dynamo keep a graph for each while
    the benchmark runs."""
    config = torch._dynamo.config
    names = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit")
    saved = {name: getattr(config, name) for name in names if hasattr(config, name)}
    for name in saved:
        setattr(config, name, limit)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def phases_of(cfg: Config) -> list[tuple[int, str, int]]:
    """(matrices, mode, world) of every part in order: eager in one process, then sharded on each world (0: one
    process), then each compile mode apart (the record written after each keeps what a hung compilation would not)."""
    eager = [(m, "eager", 0) for m in cfg.matrices]
    sharded = [(m, "eager", w) for w in cfg.sharded_world if w for m in cfg.matrices]
    return eager + sharded + [(m, c, 0) for c in cfg.compile_modes for m in cfg.compile_matrices]


def measure_phase(cfg: Config, matrices: int, mode: str, world: int, bar: tqdm) -> list[dict[str, Any]]:
    """The records of one part's rows at one size (``world``: the sharded rows on that many fake ranks)."""
    if world:
        from dimuon.bench import host_sharded

        return host_sharded.measure_size(cfg, matrices, world, bar)
    return [row_record(r) for r in measure_size(cfg, matrices, bar, mode)]


def run(
    cfg: Config, argv: Sequence[str] | None = None, on_size: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Measure every size (the record passed to ``on_size`` after each, written where --json and --out say);
    returns the JSON record."""
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    record: dict[str, Any] = {
        "benchmark": "host",
        "command": shlex.join([*PROG.split(), *(argv or [])]),
        "machine": machine_info(argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "op_us": None,
        "rows": [],
        "complete": False,
    }
    phases = phases_of(cfg)
    try:
        record["op_us"] = round(1e6 * op_seconds(cfg.device, clock=clock_of(cfg)), 3)
        bar = tqdm(total=cfg.repeats * len(phases), desc="host", disable=not cfg.progress)
        with accelerator_form(), _recompile_limits(), bar:
            for i, (matrices, mode, world) in enumerate(phases):
                torch.manual_seed(cfg.seed)
                record["rows"] += measure_phase(cfg, matrices, mode, world, bar)
                record["complete"] = i == len(phases) - 1
                if on_size is not None:
                    on_size(record)
    finally:
        torch.set_num_threads(previous)
    return record


def write(record: dict[str, Any], cfg: Config) -> None:
    """The record where --json and --out say (JSON, Markdown table, plot)."""
    from dimuon.bench import host_report

    if cfg.json is not None:
        write_json_atomic(cfg.json, record)
    if cfg.out is not None:
        host_report.write_dir(record, cfg.out)


def parse(argv: Sequence[str]) -> Config:
    """Flags parsed and checked (SystemExit(2) for one the parser refuses, ValueError naming a bad value)."""
    cfg = resolved(tyro.cli(Config, args=list(argv), prog=PROG), argv)
    check_config(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench host``."""
    from dimuon.bench import host_report

    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_or_none(parse, args, PROG)
    if cfg is None:
        return 2
    record = run(cfg, args, on_size=lambda r: write(r, cfg))
    print(host_report.render(record))
    for path in (cfg.json, cfg.out):
        if path is not None:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
