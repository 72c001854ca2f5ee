"""Provenance and output shared by the benchmarks: machine facts and plain-text / Markdown tables."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import tyro

from dimuon.dit.checkpoint import CheckpointError
from dimuon.io import read_jsonl, write_text_atomic
from dimuon.train.config import ConfigError
from dimuon.train.plan import TrainPlan, resolve
from dimuon.train.run import parse_config

C = TypeVar("C")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where that is missing)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# CPU features that decide which matmul kernels run (bf16 units make bf16 GEMMs fast on CPU).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of the matmul-relevant CPU features in ``_CPU_FLAGS`` ``/proc/cpuinfo`` lists."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in _CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def load_average() -> list[float] | None:
    """1-, 5- and 15-minute load averages: on a shared machine they tell how noisy a timing is."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def nvidia_driver() -> str | None:
    """The NVIDIA driver version ``nvidia-smi`` reports (torch does not expose it), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def gpu_info(device: torch.device | str = "cuda") -> dict[str, Any] | None:
    """The GPU a CUDA number was measured on: name, memory, capability, driver, CUDA, cuDNN and NCCL versions."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "count": torch.cuda.device_count(),
        "driver": nvidia_driver(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


def machine_info(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What a reader needs to reproduce a number: versions, CPU, threads, load, date and command line."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if argv is not None:
        info["argv"] = list(argv)
    return info


def _alignments(headers: Sequence[str], right: Sequence[bool] | None) -> list[bool]:
    """One alignment per column (numbers, every column but the first, right-aligned by default); a list of another
    length is refused: Markdown renders no table whose rule has fewer cells than its header."""
    if right is None:
        return [i > 0 for i in range(len(headers))]
    if len(right) != len(headers):
        raise ValueError(f"{len(right)} column alignments for {len(headers)} columns: {list(headers)}")
    return list(right)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None) -> str:
    """A plain-text table with aligned columns (numbers right-aligned by default)."""
    right = _alignments(headers, right)
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(row, widths, right)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def format_markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None
) -> str:
    """The same table as :func:`format_table`, as GitHub-flavoured Markdown (for docs)."""
    right = _alignments(headers, right)
    rule = ["---:" if r else "---" for r in right]
    cells = [list(map(str, headers)), rule] + [["" if v is None else str(v) for v in row] for row in rows]
    return "\n".join("| " + " | ".join(row) + " |" for row in cells)


def train_results(run_dir: Path) -> dict[str, Any]:
    """Steps per second and the step-time split of a ``dimuon train`` run (medians over its training records
    after the first, which holds the warm-up), its optimizer's logical bytes per step, the final losses and the
    run's wall time, from its ``metrics.jsonl``."""
    records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no training record")
    steady = train[1:] or train

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in steady)

    start = next((r for r in records if r.get("kind") == "start"), {})
    val = [r for r in records if r.get("kind") == "val"]
    step_ms = median("step_ms")
    return {
        "steps": train[-1]["step"],
        "device": start.get("device"),
        "world_size": start.get("world_size"),
        "params": start.get("params"),
        "steps_per_s": 1e3 / step_ms,
        "step_ms": step_ms,
        "data_ms": median("data_ms"),
        "fwd_bwd_ms": median("fwd_bwd_ms"),
        "opt_ms": median("opt_ms"),
        "comm_bytes_per_step": median("comm_bytes_per_step"),
        "samples_per_s": median("samples_per_s"),
        "records_used": len(steady),
        "train_loss": train[-1]["loss"],
        "val_loss": val[-1]["val_loss"] if val else None,
        "val_loss_ema": val[-1]["val_loss_ema"] if val else None,
        "wall_s": train[-1].get("wall_s"),
    }


def named_values(items: Sequence[str], flag: str, names: Sequence[str], form: str) -> dict[str, str]:
    """``("NAME=VALUE", ...)`` -> ``{NAME: VALUE}``; a mistake (ValueError) names the flag, its form and the
    allowed names."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names or not value.strip():
            raise ValueError(f"{flag} expects {form} with NAME one of {list(names)}, got {item!r}")
        if name in out:
            raise ValueError(f"{flag} names {name} twice")
        out[name] = value
    return out


def join_flag_values(args: Sequence[str], flags: Sequence[str] = ("--train-args",)) -> list[str]:
    """``--train-args '--x 1'`` -> ``--train-args=--x 1``: the word after one of ``flags`` is that flag's value,
    even when it starts with -- (which the flag parser would otherwise read as the next flag)."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        out.append(arg)
        if arg in flags:
            value = next(it, None)
            if value is not None:
                out[-1] = f"{arg}={value}"
    return out


def check_train_flags(argv: Sequence[str], where: str) -> TrainPlan:
    """``dimuon train`` flags as that command reads them at start-up: parsed by its
    :func:`~dimuon.train.run.parse_config` and checked by :func:`~dimuon.train.plan.resolve`. ValueError
    starting with ``where`` (the benchmark's flags that supplied them) names the bad flag as ``dimuon train`` does
    (a flag its parser refuses: in the parser's message, printed just before)."""
    try:
        return resolve(parse_config(list(argv)))
    except SystemExit:
        raise ValueError(f"{where}: dimuon train refuses these flags (its message above names the flag)") from None
    except (ConfigError, CheckpointError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_bench_flags(config: type[C], args: Sequence[str], prog: str, check: Callable[[C], None]) -> C:
    """A benchmark's flags parsed into ``config`` and checked by ``check``: SystemExit(2) for a flag the parser
    refuses, ValueError (naming the flag) for a value ``check`` refuses."""
    cfg = tyro.cli(config, args=list(args), prog=prog)
    check(cfg)
    return cfg


def parse_or_none(parse: Callable[[Sequence[str]], C], args: Sequence[str], prog: str) -> C | None:
    """``parse(args)``, or None after printing ``<prog>: error: ...`` for a value its checks refuse (the caller
    exits with status 2)."""
    try:
        return parse(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return None


def print_report(record: dict[str, Any], render: Callable[..., str], out: Path, markdown: Path | None) -> None:
    """A benchmark's table on stdout, where its JSON record went, and the same table as Markdown to ``markdown``
    (for docs) where one is given."""
    print(render(record))
    print(f"\nwrote {out}")
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(markdown, render(record, markdown=True) + "\n")
        print(f"wrote {markdown}")
