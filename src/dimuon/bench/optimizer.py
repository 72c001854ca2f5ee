"""``dimuon bench optimizer``: the time of one optimizer step on the parameter shapes of a DiT.

Builds a registry DiT (optionally with fewer blocks) on ``--device``, gives every parameter a seeded
random gradient, groups it with :func:`dimuon.optim.param_groups` exactly as training does, and times
``opt.step()`` for AdamW (foreach and fused), the fp32 per-tensor reference Muon, dimuon's Muon
(standard and Gram Newton-Schulz, per attention head, compiled with ``ns_compile=True``, and standard in bf16),
PeriodicRowMuon and MuonBP, and for the peers (other installable Muon packages, :mod:`dimuon.bench.peers`:
``torch.optim.Muon``, muon-fsdp2, dtensor-muon, heavyball) built over the same matrices; a peer that cannot run
here gets a row that says why. Every sample starts from the same gradients. Periodic optimizers are timed over
whole periods and reported per step. A second part measures the FLOP rate of the batched Newton-Schulz iteration
on the model's stacked Muon shapes against bare ``torch.bmm`` calls of the same products, in the dtype Newton-Schulz
computes in on the device (fp32 on a CPU, bf16 on a GPU). On a GPU every sample is bracketed by
``torch.cuda.synchronize``; each optimizer's first (warm-up) step, which holds state allocation and,
for the compiled row, compilation, is reported apart. Prints tables and writes a JSON record, after every round of
samples too (marked partial); ``--time-last`` times the rows it names (a peer that compiles its step, the compiled
row) after all the others, one at a time, so that a time limit reached in their first step keeps every other row.

Run ``dimuon bench optimizer --help`` (or ``python -m dimuon.bench.optimizer --help``).
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import tyro
from torch import Tensor, nn

import dimuon
from dimuon.bench.peers import (
    PEERS,
    GradientSnapshot,
    PeerStatus,
    bf16_note,
    check_names,
    muon_and_rest,
    start_peer,
)
from dimuon.bench.peers.registry import Paired, adamw_for_rest
from dimuon.bench.report import format_markdown_table, format_table, gpu_info, load_average, machine_info, print_report
from dimuon.bench.timing import Candidate, Timing, interleave, synchronizer
from dimuon.bench.variants import Variant, check_lr
from dimuon.dit import DIT_MODELS
from dimuon.dit.model import DiT, dit_arch
from dimuon.io import write_json_atomic
from dimuon.optim import build, linalg, param_groups, per_head_splits
from dimuon.optim.build import LABELS
from dimuon.optim.distributed.engine import split_sizes_to_ranges
from dimuon.optim.reference import ReferenceMuon

# Every optimizer of dimuon and the baselines, in table order: its configuration (a ``dimuon.optim.build`` name and
# options; ``reference`` for the fp32 per-tensor reference) and table label (the peers follow them). Options and
# steps per sample that depend on the run's flags are filled in by :func:`variants`.
VARIANTS: dict[str, Variant] = {
    "adamw_foreach": Variant("AdamW (foreach)", "adamw", {"foreach": True}),
    "adamw_fused": Variant("AdamW (fused)", "adamw", {"fused": True}),
    "reference_muon": Variant("reference Muon (fp32, per tensor) + AdamW", "reference", {}),
    "muon": Variant(f"dimuon {LABELS['muon']} (standard NS)", "muon", {}),
    # every attention head its own matrix (dimuon.optim.per_head_splits)
    "muon_per_head": Variant(
        f"dimuon {LABELS['muon']} (standard NS, per head: qkv rows, proj columns)", "muon", {}, groups="per_head"
    ),
    "muon_gram": Variant(f"dimuon {LABELS['muon']} (Gram NS)", "muon", {"ns_algorithm": "gram"}),
    # its first step compiles (reported apart as the first step)
    "muon_compiled": Variant(f"dimuon {LABELS['muon']} (standard NS, compiled)", "muon", {"ns_compile": True}),
    # the Newton-Schulz dtype the peers hard-code, for a like-for-like row
    "muon_bf16": Variant(f"dimuon {LABELS['muon']} (standard NS in bf16)", "muon", {"ns_dtype": torch.bfloat16}),
    # what runs on a GPU (bf16) with the faster algorithm: the row held against the fastest peer
    "muon_gram_bf16": Variant(
        f"dimuon {LABELS['muon']} (Gram NS in bf16)", "muon", {"ns_algorithm": "gram", "ns_dtype": torch.bfloat16}
    ),
    "periodic_row_muon": Variant(f"dimuon {LABELS['periodic_row_muon']}", "periodic_row_muon", {}),
    "muon_bp": Variant(f"dimuon {LABELS['muon_bp']}", "muon_bp", {}),
    # the memory-bound steps alone, beside fused AdamW: the spectral first step taken untimed, never again
    "rownorm_step": Variant(
        f"dimuon {LABELS['periodic_row_muon']}, RowNorm steps only", "periodic_row_muon", {}, untimed_steps=1
    ),
    "block_step": Variant(f"dimuon {LABELS['muon_bp']}, block steps only", "muon_bp", {}, untimed_steps=1),
    # the same steps in torch's eager list ops: beside the rows above on CUDA, where those take the fused kernels
    # (dimuon.optim.fused); on a CPU both rows run the eager form, so these are left out there
    "rownorm_step_eager": Variant(
        f"dimuon {LABELS['periodic_row_muon']}, RowNorm steps only, eager kernels",
        "periodic_row_muon",
        {"kernels": "torch"},
        untimed_steps=1,
    ),
    "block_step_eager": Variant(
        f"dimuon {LABELS['muon_bp']}, block steps only, eager kernels", "muon_bp", {"kernels": "torch"}, untimed_steps=1
    ),
}
# Rows that differ from another only where the fused kernels run (CUDA).
FUSED_ONLY = ("rownorm_step_eager", "block_step_eager")
OPTIMIZERS: dict[str, str] = {key: v.label for key, v in VARIANTS.items()}
# A schedule whose refresh never comes back after the first step (taken untimed): every timed step is of one kind.
NEVER = 2**31 - 1
BASELINE = "adamw_foreach"
REFERENCE = "reference_muon"
MUON = "muon"


@dataclass
class Config:
    """Time one optimizer step on DiT parameter shapes and the Newton-Schulz FLOP rate."""

    model: str = "DiT-S/2"
    """Registry name of the DiT whose parameter shapes are used (e.g. DiT-S/2, DiT-B/2, DiT-XL/2)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where parameters, gradients and optimizer state live (cuda: the current GPU, bf16 Newton-Schulz)."""
    depth: Annotated[int | None, tyro.conf.arg(aliases=("--blocks",))] = None
    """Number of transformer blocks (default: the registry's; 2 for a quick run)."""
    hidden_size: int | None = None
    """Override the hidden size (tiny test configurations)."""
    num_heads: int | None = None
    """Override the number of attention heads (must divide the hidden size)."""
    input_size: int = 32
    """Latent side length (only the position embedding, which has no parameters, depends on it)."""
    num_classes: int = 1000
    """Label-embedding rows (an AdamW parameter)."""
    repeats: int = 5
    """Timed samples per optimizer; the median is reported."""
    warmup: int = 1
    """Untimed samples per optimizer before timing (state allocation, allocator warm-up)."""
    repeats_of: tuple[str, ...] = ("torch_muon=2",)
    """Per-optimizer (or peer) repeats as NAME=N, overriding --repeats (torch.optim.Muon's bf16 NS is very
    slow on CPUs without bf16 matrix units; on AMX CPUs it is fast, so raise it there)."""
    warmup_of: tuple[str, ...] = ()
    """Per-optimizer (or peer) warm-up samples as NAME=N, overriding --warmup (e.g. torch_muon=0)."""
    skip: tuple[str, ...] = ()
    """Optimizers or peers to leave out, e.g. --skip adamw_fused heavyball."""
    peers: tuple[str, ...] = tuple(PEERS)
    """Peers to run beside dimuon, from: torch_muon muon_fsdp2 dtensor_muon heavyball (default: all; one
    that is not installed or cannot run here gets a row saying why)."""
    no_peers: bool = False
    """Leave every peer out."""
    time_last: tuple[str, ...] = ()
    """Optimizers or peers timed after all the others and the FLOP rate, one at a time, in this order, with the
    record written before each starts and as each is timed; a peer is built and takes its first step only then. A
    row whose first step compiles for long (heavyball, the compiled row) can then neither hold back nor take with it
    the rows timed before it when a time limit stops the run; its samples are not interleaved with the others'."""
    k: int = 3
    """PeriodicRowMuon period K (timed over whole periods)."""
    period: int = 5
    """MuonBP period P (timed over whole periods)."""
    bp_blocks: int = 4
    """MuonBP row blocks per matrix in one process (stand-in for the row shards of that many ranks)."""
    lr: float = 1e-4
    """Learning rate of every optimizer (irrelevant for time; small so weights stay finite)."""
    ns_rate: bool = True
    """Also measure the Newton-Schulz FLOP rate against bare torch.bmm on the same products."""
    ns_repeats: int = 5
    """Timed samples per shape in the FLOP-rate measurement."""
    threads: int | None = None
    """torch.set_num_threads (default: torch's own choice); recorded in the JSON either way."""
    seed: int = 0
    """Seed of the model initialization and the random gradients."""
    out: Path = Path("runs/bench/optimizer.json")
    """Where the JSON record goes (written atomically)."""
    markdown: Path | None = None
    """Also write the report as Markdown tables to this file (for docs)."""
    progress: bool = True
    """Show tqdm progress bars on stderr."""


# ----------------------------------------------------------------------------------------- setup


def parse_overrides(items: Sequence[str], flag: str, minimum: int = 0) -> dict[str, int]:
    """``("name=3", ...)`` -> ``{"name": 3}``, naming the flag, the valid names and the least N on a mistake."""
    names = [*OPTIMIZERS, *PEERS]
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names or not value.strip().isdigit() or int(value) < minimum:
            raise ValueError(f"{flag} expects NAME=N with NAME in {names} and N >= {minimum}, got {item!r}")
        out[name] = int(value)
    return out


def build_model(cfg: Config) -> DiT:
    """The registry DiT with the requested overrides on ``cfg.device``, with seeded random gradients on every
    parameter (built and drawn on the device itself: no host copy of a large model)."""
    arch = dit_arch(cfg.model)
    for key in ("depth", "hidden_size", "num_heads"):
        if getattr(cfg, key) is not None:
            arch[key] = getattr(cfg, key)
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        model = DiT(**arch, input_size=cfg.input_size, num_classes=cfg.num_classes)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype, device=cfg.device)
    return model


def engine_batches(model: nn.Module) -> list[tuple[int, int, int]]:
    """The ``(B, rows, cols)`` stacks the local engine hands to ``newton_schulz`` on a spectral step.

    Per Muon group, every logical matrix (fused parameters split by ``split_sizes``) is oriented
    wide and matrices of one oriented shape are stacked, as ``apply_map_batched`` does.
    """
    batches: list[tuple[int, int, int]] = []
    for group in param_groups(model):
        if group["algorithm"] != "muon":
            continue
        shapes: Counter[tuple[int, int]] = Counter()
        for name, p in group["params"]:
            rows, cols = p.shape[0], math.prod(p.shape[1:])
            ranges = split_sizes_to_ranges(rows, group.get("split_sizes"), name) or ((0, rows),)
            for lo, hi in ranges:
                shapes[linalg.oriented_shape(hi - lo, cols)] += 1
        batches += [(n, r, c) for (r, c), n in shapes.items()]
    return batches


def variants(cfg: Config) -> dict[str, Variant]:
    """:data:`VARIANTS` with the options and steps per sample that this run's flags set (K, P, blocks)."""
    flagged = {
        "periodic_row_muon": ({"k": cfg.k}, cfg.k),
        "muon_bp": ({"period": cfg.period, "blocks": cfg.bp_blocks}, cfg.period),
        "rownorm_step": ({"k": NEVER}, 1),
        "block_step": ({"period": NEVER, "blocks": cfg.bp_blocks}, 1),
        "rownorm_step_eager": ({"k": NEVER}, 1),
        "block_step_eager": ({"period": NEVER, "blocks": cfg.bp_blocks}, 1),
    }
    out = dict(VARIANTS)
    for key, (options, period) in flagged.items():
        out[key] = replace(VARIANTS[key], options={**VARIANTS[key].options, **options}, period=period)
    return out


def make_steps(cfg: Config, model: nn.Module, names: Sequence[str]) -> dict[str, tuple[Callable[[], None], int]]:
    """For each of dimuon's optimizers and the baselines: a function taking one step, and how many steps
    make one sample."""
    table = variants(cfg)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise ValueError(f"unknown optimizer {unknown[0]!r}; choose from {list(OPTIMIZERS)}")
    muon_params, rest = muon_and_rest(model)
    steps: dict[str, tuple[Callable[[], None], int]] = {}
    for name in names:
        v = table[name]
        if v.name == "reference":
            ref = ReferenceMuon(muon_params, lr=cfg.lr, lr_scale="match_rms_adamw")
            steps[name] = (Paired(ref, adamw_for_rest(rest, cfg.lr)).step, v.period)
            continue
        target: Any = model
        if v.groups == "per_head":
            heads = per_head_splits(model)
            target = param_groups(model, rules=heads.rules, split_sizes=heads.split_sizes)
        opt = build(v.name, target, lr=cfg.lr, **v.options)
        for _ in range(v.untimed_steps):  # the gradients are the snapshot's, put back before each sample
            opt.step()
        steps[name] = (opt.step, v.period)
    return steps


def make_peer_steps(
    cfg: Config, model: nn.Module, names: Sequence[str], snapshot: GradientSnapshot
) -> tuple[dict[str, tuple[Callable[[], None], int]], dict[str, PeerStatus]]:
    """The peers that run here (one untimed first step each), and every named peer's status."""
    muon_params, rest = muon_and_rest(model)
    steps: dict[str, tuple[Callable[[], None], int]] = {}
    statuses: dict[str, PeerStatus] = {}
    for name in names:
        opt, status, error = start_peer(name, muon_params, rest, cfg.lr, snapshot, cfg.device, "local")
        if opt is not None:
            steps[name] = (opt.step, 1)
        statuses[name] = status.failed(error) if error else status
    return steps, statuses


def identity(name: str, device: torch.device | str = "cpu") -> tuple[str, str]:
    """(package and version, Newton-Schulz dtype) of one of dimuon's or the baselines' rows on ``device``."""
    if name.startswith("adamw"):
        return f"torch {torch.__version__}", "-"
    if name == REFERENCE:
        return f"dimuon {dimuon.__version__}", "float32"
    if name in ("muon_bf16", "muon_gram_bf16"):
        return f"dimuon {dimuon.__version__}", "bfloat16"
    return f"dimuon {dimuon.__version__}", str(linalg.default_ns_dtype(torch.device(device))).removeprefix("torch.")


def label(cfg: Config, name: str) -> str:
    """Table label, with the schedule hyperparameters that matter for the time."""
    if name in PEERS:
        return PEERS[name].label
    if name == "periodic_row_muon":
        return f"{OPTIMIZERS[name]} K={cfg.k} (per step)"
    if name == "muon_bp":
        return f"{OPTIMIZERS[name]} P={cfg.period}, blocks={cfg.bp_blocks} (per step)"
    if name == "muon_per_head":
        heads = cfg.num_heads if cfg.num_heads is not None else dit_arch(cfg.model)["num_heads"]
        return f"{OPTIMIZERS[name].removesuffix(')')}, H={heads})"
    return OPTIMIZERS[name]


# ------------------------------------------------------------------------------ FLOP rate of NS


def _bmm_operands(batch: int, product: tuple[int, int, int], wide: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Operands and output buffer of one bare batched product, laid out as the NS iteration has them (on
    ``wide``'s device, in its dtype)."""
    m, k, n = product
    _, r, c = wide.shape
    like = {"dtype": wide.dtype, "device": wide.device}
    if (m, k, n) == (r, c, r):  # X X^T reads X twice, the second time transposed
        a, bb = wide, wide.mT
    elif (m, k, n) == (r, r, c):  # (r, r) @ X
        a, bb = torch.randn(batch, r, r, **like), wide
    else:  # (r, r) @ (r, r)
        a, bb = torch.randn(batch, m, k, **like), torch.randn(batch, k, n, **like)
    return a, bb, torch.empty(batch, m, n, **like)


def measure_ns_rate(
    batches: Sequence[tuple[int, int, int]],
    repeats: int,
    progress: bool,
    seed: int,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Achieved FLOP/s of ``newton_schulz`` (standard and Gram) vs bare ``torch.bmm`` of its products.

    FLOPs are those of the products the iteration issues (``linalg.newton_schulz_products``): per
    standard step on a wide ``(r, c)`` matrix ``2 r^2 c`` (Gram) + ``2 r^3`` (polynomial) +
    ``2 r^2 c`` (update). The bmm time of an algorithm on a stack is the sum of the median times of
    its products issued as bare ``torch.bmm(..., out=...)`` calls on operands of the same shapes. Both
    run in the dtype Newton-Schulz computes in on ``device`` (``linalg.default_ns_dtype``: fp32 on a
    CPU, bf16 on a GPU), so the rate is held against the device's own matmul rate in that dtype.
    """
    device = torch.device(device)
    dtype = linalg.default_ns_dtype(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = {shape: torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in batches}
    candidates: list[Candidate] = []
    for shape, x in inputs.items():
        for algorithm in linalg.NS_ALGORITHMS:
            candidates.append(
                Candidate(
                    f"ns/{algorithm}/{shape}",
                    lambda x=x, a=algorithm: linalg.newton_schulz(x, algorithm=a),
                    repeats=repeats,
                )
            )
        products = {p for a in linalg.NS_ALGORITHMS for p in linalg.newton_schulz_products(*shape[1:], algorithm=a)}
        for product in sorted(products):
            a, b, out = _bmm_operands(shape[0], product, x)
            candidates.append(
                Candidate(f"bmm/{product}/{shape}", lambda a=a, b=b, out=out: torch.bmm(a, b, out=out), repeats=repeats)
            )
    timings = interleave(candidates, progress=progress, desc="NS FLOP rate", sync=synchronizer(device))
    result: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    for algorithm in linalg.NS_ALGORITHMS:
        rows, total_flops, total_ns, total_mm = [], 0.0, 0.0, 0.0
        for shape in batches:
            products = linalg.newton_schulz_products(*shape[1:], algorithm=algorithm)
            flops = shape[0] * sum(2.0 * m * k * n for m, k, n in products)
            ns_s = timings[f"ns/{algorithm}/{shape}"].median
            mm_s = sum(timings[f"bmm/{p}/{shape}"].median for p in products)
            rows.append(
                {
                    "batch": list(shape),
                    "uses_gram": linalg.uses_gram(algorithm, *shape[1:]),
                    "gflop": flops / 1e9,
                    "ns_ms": 1e3 * ns_s,
                    "bmm_ms": 1e3 * mm_s,
                    "ns_gflops": flops / ns_s / 1e9,
                    "bmm_gflops": flops / mm_s / 1e9,
                    "ratio": mm_s / ns_s,
                }
            )
            total_flops, total_ns, total_mm = total_flops + flops, total_ns + ns_s, total_mm + mm_s
        result[algorithm] = {
            "per_batch": rows,
            "gflop": total_flops / 1e9,
            "ns_ms": 1e3 * total_ns,
            "bmm_ms": 1e3 * total_mm,
            "ns_gflops": total_flops / total_ns / 1e9,
            "bmm_gflops": total_flops / total_mm / 1e9,
            "ratio": total_mm / total_ns,
        }
    return result


def ns_algorithms(ns: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-algorithm results of :func:`measure_ns_rate` (without its ``dtype`` entry)."""
    return {k: v for k, v in ns.items() if k in linalg.NS_ALGORITHMS}


# ----------------------------------------------------------------------------------- reporting


def summarize(
    cfg: Config, timings: dict[str, Timing], peers: dict[str, PeerStatus] | None = None, cpu_flags: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """Per optimizer: times (ms per step), ratios to AdamW (foreach), to the reference Muon and to dimuon's
    Muon, package version and Newton-Schulz dtype (with a word on bf16 on this CPU)."""
    peers = peers or {}

    def median(name: str) -> float | None:
        return timings[name].median if name in timings else None

    base, ref, muon = median(BASELINE), median(REFERENCE), median(MUON)
    device_type = torch.device(cfg.device).type
    out = {}
    for name, t in timings.items():
        if name in peers:
            status = peers[name]
            version, ns_dtype = f"{status.package} {status.version}", status.ns_dtype
        else:
            version, ns_dtype = identity(name, cfg.device)
        out[name] = {
            "label": label(cfg, name),
            "peer": name in peers,
            "version": version,
            "ns_dtype": ns_dtype,
            "note": bf16_note(cpu_flags, device_type) if ns_dtype == "bfloat16" else "",
            **t.to_dict(),
            "ratio_to_adamw": t.median / base if base else None,
            "ratio_to_reference": t.median / ref if ref else None,
            "ratio_to_muon": t.median / muon if muon else None,
        }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(record: dict[str, Any], markdown: bool = False) -> str:
    """The human-readable report (plain text, or Markdown for docs): step times and the NS FLOP rate."""
    table = format_markdown_table if markdown else format_table
    m, machine = record["model"], record["machine"]
    gpu = machine.get("gpu")
    where = (
        f"{gpu['name']} (driver {gpu['driver']}, CUDA {gpu['cuda']})"
        if gpu
        else f"{machine['torch_threads']} thread{'' if machine['torch_threads'] == 1 else 's'}, {machine['cpu_model']}"
    )
    lines = [
        f"{m['name']} with {m['depth']} blocks (hidden {m['hidden_size']}): {m['params'] / 1e6:.1f}M parameters, "
        f"{m['muon_params'] / 1e6:.1f}M in {m['muon_matrices']} Muon matrices; "
        f"torch {machine['torch']}, {where}; "
        f"load average {machine.get('load_average_at_start')} at start, {machine.get('load_average')} "
        + ("when this partial record was written" if record.get("partial") else "at end"),
        "",
    ]
    rows = []
    for r in record["optimizers"].values():
        rows.append(
            [
                r["label"],
                r.get("version", ""),
                r.get("ns_dtype", ""),
                f"{r['median_ms']:.1f}",
                f"{r['min_ms']:.1f}",
                f"{r['repeats']}x{r['calls_per_sample']}",
                _fmt(r["ratio_to_adamw"], ".2f"),
                _fmt(r["ratio_to_reference"], ".2f"),
                _fmt(r.get("ratio_to_muon"), ".2f"),
                _fmt(r.get("first_ms"), ".0f"),
                r.get("note", ""),
            ]
        )
    for p in record.get("peers", {}).values():
        if not p["runnable"]:
            rows.append([p["label"], f"{p['package']} {p['version'] or '-'}", p["ns_dtype"], *["-"] * 7, p["reason"]])
    lines.append(
        table(
            [
                "optimizer",
                "version",
                "NS dtype",
                "ms/step (median)",
                "min",
                "samples x steps",
                "x AdamW",
                "x reference",
                "x Muon",
                "first ms",
                "note",
            ],
            rows,
            right=[False, False, False, *[True] * 7, False],
        )
    )
    lines += ["", "first ms: the first (warm-up) sample, per step: state allocation and, compiled, the compilation."]
    return "\n".join(lines + _ns_rate_lines(record, table))


def _ns_rate_lines(record: dict[str, Any], table: Callable[..., str]) -> list[str]:
    """The Newton-Schulz FLOP rate table of a record (none where it was not measured): one row per stacked batch and
    a total per algorithm, in TFLOP/s on a GPU and GFLOP/s on a CPU."""
    lines: list[str] = []
    ns = record.get("ns_flop_rate")
    if ns:
        tera = record["machine"].get("gpu") is not None  # GPU rates read better in TFLOP/s
        unit, scale = ("TFLOP/s", 1e-3) if tera else ("GFLOP/s", 1.0)
        lines += [
            "",
            f"Newton-Schulz (5 quintic steps, {ns.get('dtype', 'float32')}) on the stacked Muon shapes "
            f"vs bare torch.bmm in the same dtype:",
            "",
        ]
        rows = []
        for algorithm, res in ns_algorithms(ns).items():
            for b in res["per_batch"]:
                form = "gram" if b["uses_gram"] else "standard"
                rows.append(
                    [
                        algorithm,
                        "x".join(map(str, b["batch"])),
                        form,
                        f"{b['gflop']:.1f}",
                        f"{b['ns_ms']:.2f}",
                        f"{b['ns_gflops'] * scale:.1f}",
                        f"{b['bmm_gflops'] * scale:.1f}",
                        f"{b['ratio']:.2f}",
                    ]
                )
            rows.append(
                [
                    algorithm,
                    "total",
                    "",
                    f"{res['gflop']:.1f}",
                    f"{res['ns_ms']:.2f}",
                    f"{res['ns_gflops'] * scale:.1f}",
                    f"{res['bmm_gflops'] * scale:.1f}",
                    f"{res['ratio']:.2f}",
                ]
            )
        lines.append(
            table(
                ["ns_algorithm", "stack BxRxC", "form", "GFLOP", "ms", unit, f"bmm {unit}", "NS/bmm rate"],
                rows,
                right=[False, False, False, True, True, True, True, True],
            )
        )
    return lines


# ----------------------------------------------------------------------------------------- main


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``; returns the JSON record (also written to ``cfg.out``)."""
    previous_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, argv)
    finally:
        torch.set_num_threads(previous_threads)


def check_config(cfg: Config) -> None:
    """One clear error per bad flag, before anything is built."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here (choose --device cpu)")
    unknown = set(cfg.skip) - set(OPTIMIZERS) - set(PEERS)
    if unknown:
        raise ValueError(f"--skip got unknown name(s) {sorted(unknown)}; choose from {[*OPTIMIZERS, *PEERS]}")
    check_names(cfg.peers)
    unknown = set(cfg.time_last) - set(OPTIMIZERS) - set(PEERS)
    if unknown:
        raise ValueError(f"--time-last got unknown name(s) {sorted(unknown)}; choose from {[*OPTIMIZERS, *PEERS]}")
    check_lr(cfg.lr)
    parse_overrides(cfg.repeats_of, "--repeats-of", minimum=1)
    parse_overrides(cfg.warmup_of, "--warmup-of")
    if cfg.model not in DIT_MODELS:
        raise ValueError(f"--model must be one of: {', '.join(DIT_MODELS)}; got {cfg.model!r}")
    for flag, value, low in (
        ("--repeats", cfg.repeats, 1),
        ("--warmup", cfg.warmup, 0),
        ("--ns-repeats", cfg.ns_repeats, 1),
        ("--threads", cfg.threads, 1),
        ("--k", cfg.k, 1),
        ("--period", cfg.period, 1),
        ("--bp-blocks", cfg.bp_blocks, 1),
        ("--depth", cfg.depth, 1),
        ("--hidden-size", cfg.hidden_size, 1),
        ("--num-heads", cfg.num_heads, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be an integer >= {low}, got {value}")


def _record_fields(
    cfg: Config, model: nn.Module, batches: list[tuple[int, int, int]], machine: dict[str, Any]
) -> dict[str, Any]:
    """What every write of the record shares, gathered once: the machine, the flags and the model's sizes."""
    muon_params, _ = muon_and_rest(model)
    arch = dit_arch(cfg.model)
    return {
        "benchmark": "optimizer",
        "machine": {**machine, "gpu": gpu_info(cfg.device)},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": {
            "name": cfg.model,
            "depth": cfg.depth if cfg.depth is not None else arch["depth"],
            "hidden_size": cfg.hidden_size if cfg.hidden_size is not None else arch["hidden_size"],
            "params": sum(p.numel() for p in model.parameters()),
            "muon_params": sum(p.numel() for p in muon_params),
            "muon_matrices": len(muon_params),
            "ns_batches": [list(b) for b in batches],
        },
    }


def _run(cfg: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    """The benchmark itself: the rows timed interleaved, the FLOP rate, then the rows timed last one at a time."""
    check_config(cfg)
    repeats_of = parse_overrides(cfg.repeats_of, "--repeats-of", minimum=1)
    warmup_of = parse_overrides(cfg.warmup_of, "--warmup-of")
    names = [n for n in OPTIMIZERS if n not in cfg.skip and (cfg.device == "cuda" or n not in FUSED_ONLY)]
    peer_names = [] if cfg.no_peers else [n for n in cfg.peers if n not in cfg.skip]
    # the rows timed after the others (and the FLOP rate), one at a time: see Config.time_last
    last = [n for n in dict.fromkeys(cfg.time_last) if n in names or n in peer_names]
    machine = machine_info(argv)
    load_at_start = machine["load_average"]  # the record's load_average is read again as each write is made
    model = build_model(cfg)
    snapshot = GradientSnapshot(model.parameters())
    sync = synchronizer(cfg.device)
    steps = make_steps(cfg, model, names)
    peers: dict[str, PeerStatus] = {}
    started: dict[str, float] = {}  # per peer: seconds to import, build and take its untimed first step

    def start(name: str) -> dict[str, tuple[Callable[[], None], int]]:
        """One peer built and its first step taken (and timed, its compilation included); its status recorded."""
        sync()
        begin = time.perf_counter()
        peer_steps, status = make_peer_steps(cfg, model, [name], snapshot)
        sync()
        started[name] = time.perf_counter() - begin
        peers.update(status)
        return peer_steps

    def candidate(name: str, fn: Callable[[], None], calls: int) -> Candidate:
        return Candidate(
            name,
            fn,
            repeats=repeats_of.get(name, cfg.repeats),
            warmup=warmup_of.get(name, cfg.warmup),
            calls=calls,
            setup=snapshot.restore,
        )

    first_steps = {name: steps[name] for name in names if name not in last}
    for name in peer_names:
        if name not in last:
            first_steps.update(start(name))
    candidates = [candidate(name, fn, calls) for name, (fn, calls) in first_steps.items()]
    batches = engine_batches(model)
    fixed = _record_fields(cfg, model, batches, {**machine, "load_average_at_start": load_at_start})
    timed: dict[str, Timing] = {}  # the rows whose timing has finished
    pending = list(last)  # the rows still to be timed after the others, the one being timed included

    def record_of(timings: dict[str, Timing], ns: dict[str, Any] | None, partial: bool) -> dict[str, Any]:
        ordered = {n: timings[n] for n in [*names, *peer_names] if n in timings}  # table order, late rows too
        optimizers = summarize(cfg, ordered, peers, machine["cpu_flags"])
        return {
            **fixed,
            # read as this record is written: the end of the run in the final record (the start is kept apart)
            "machine": {**fixed["machine"], "load_average": load_average()},
            "peers": {name: {**s.to_dict(), "start_s": started.get(name)} for name, s in peers.items()},
            "partial": partial,
            "pending": list(pending),
            "optimizers": optimizers,
            "ns_flop_rate": ns,
        }

    def write_partial(done: dict[str, Timing], ns: dict[str, Any] | None = None) -> None:
        write_json_atomic(cfg.out, record_of({**timed, **done}, ns, True))

    # every round's rows written as they are measured (marked partial): a run stopped at a time limit keeps them
    if candidates:
        timed.update(
            interleave(candidates, progress=cfg.progress, desc="optimizer steps", sync=sync, on_round=write_partial)
        )
    ns = measure_ns_rate(batches, cfg.ns_repeats, cfg.progress, cfg.seed, cfg.device) if cfg.ns_rate else None
    for name in last:
        write_partial({}, ns)  # what is done, before a step that may compile for longer than the time left
        if name in peer_names:
            late = start(name)
            if name not in late:  # it cannot run here: its status says why
                pending.remove(name)
                continue
            fn, calls = late[name]
            write_partial({}, ns)  # its first step's time (compilation included) and status
        else:
            fn, calls = steps[name]
        done = interleave(
            [candidate(name, fn, calls)],
            progress=cfg.progress,
            desc=name,
            sync=sync,
            on_round=lambda d: write_partial(d, ns),
        )
        timed.update(done)
        pending.remove(name)
    record = record_of(timed, ns, False)
    write_json_atomic(cfg.out, record)
    return record


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed and checked by :func:`check_config` (which asks torch whether CUDA is here), nothing
    built: SystemExit(2) for a flag the parser refuses, ValueError for a value the check refuses."""
    cfg = tyro.cli(Config, args=list(argv), prog="dimuon bench optimizer")
    check_config(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench optimizer`` and ``python -m dimuon.bench.optimizer``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse(args)
    except ValueError as err:
        print(f"dimuon bench optimizer: {err}", file=sys.stderr)
        return 2
    record = run(cfg, args)
    print_report(record, render, cfg.out, cfg.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
