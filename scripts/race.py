"""The papers' claims re-measured on the demo task: the optimizer race and its ablations, as ``dimuon bench quality``
invocations, each resumable (run it again after an interruption: finished runs are skipped, interrupted ones
resume from their newest checkpoint).

Parts, in the order they depend on each other (``--part all`` runs them in this order):

- ``sweep``: AdamW, ``torch.optim.Muon``, Muon, PeriodicRowMuon (K=3, gamma 0.15), MuonBP (P=5, the row blocks
  of 4 ranks) over an lr grid each, seed 0. A best lr on the edge of its grid is reported: widen the grid.
- ``select``: the lr selection that can resolve the optimizers: every optimizer of ``sweep`` on one grid no
  coarser than factors of 2 around the bests (3e-3, 5e-3, 1e-2, 2e-2) with seeds 0 and 1, the best lr the lowest
  mean EMA validation loss over the seeds (its seed spread is below the gaps that FD's is not), reported flat
  where a neighbour's seed range overlaps the best's. The runs ``sweep`` and ``seeds`` already trained there are
  linked (or kept from their published records), not trained again. Once it exists, every later part takes its
  best lrs from here rather than from the sweep's final FD of one seed.
- ``seeds``: every optimizer (``--only``: those named) at its best lr with seeds 0, 1, 2: at ``select``'s chosen
  lrs with seeds 0 and 1 its runs (linked, or kept from its published record), or before it at the sweep's bests
  with seed 0 the sweep's run; only the others are trained.
- ``step``: each optimizer's training-step time on the race's model and batch, measured side by side in one
  ``dimuon bench step`` (one process, ``--threads`` threads, three runs each taken in rounds, nothing else
  training): the time basis of the
  report's time to quality (the runs' own step times are inflated, unevenly, by the run beside them).
- ``inception``: the last checkpoint of every ``seeds`` run scored again in Inception space (FID's network),
  with ``dimuon eval`` and the same samples' settings; per optimizer the mean and spread over seeds in
  ``<out>/inception.json``.
- ``fd``: FD that can resolve: the last checkpoint of every ``select`` run at its optimizer's chosen lr scored
  with 2000 samples (4x the race's; the real side is the whole held-out split, 500 images on the demo set) in both
  feature spaces, two sampling seeds each; per optimizer the mean, the
  training seeds' and the sampling seeds' half ranges, and per pair whether the gap exceeds the training seeds'
  ranges (``<out>/fd.json``, each score kept as it is measured and not measured again, across checkouts from
  the published copy; chosen runs whose checkpoints are gone are trained again first).
- ``long``: every optimizer at its best lr for twice the steps (4000), seed 0: has FD flattened at 2000 steps,
  and does the ranking there hold with a longer budget (cosine schedule stretched to it)?
- ``k``: PeriodicRowMuon K in {1, 2, 3, 4, 6} at gamma 0.15; ``gamma``: gamma in {0.05, 0.1, 0.15, 0.3, 0.6, 1}
  at K=3, at PeriodicRowMuon's best lr and at half of it; ``bp``: MuonBP P in {2, 5, 10} x block lr ratio in
  {0.5, 1}; ``ns``: Muon with quintic 5 / 4 / 3 steps, Polar Express and Gram Newton-Schulz. All with seeds 0
  and 1, at their optimizer's chosen lr (``select``, else ``sweep``). The variant that trains exactly as the main
  race does (K=3, gamma 0.15, P=5 with ratio 1, quintic 5: the optimizers' defaults, no flag added) is linked
  from the ``select`` (or ``seeds``) runs at that lr, or kept from their published records in a checkout without
  them, not trained again.
- ``scale``: does PeriodicRowMuon's loss gap to Muon shrink with the model? Both at DiT-T/4, DiT-XS/4 (the
  race's model: the selection's runs, linked or kept) and DiT-S/4 over lrs 5e-3, 1e-2, 2e-2 with seeds 0 and 1,
  each optimizer's lr chosen per size by the mean EMA validation loss (a best on the grid's edge gets the next
  factor of 2 past it, for that optimizer alone, up to twice per size); ``<out>/scale.json`` and
  ``gap_vs_params.png`` (the gap against the parameters, whiskers over the seed pairings). ``--scale-models``
  names the sizes to train now (DiT-S/4's runs take hours each on a CPU: the small sizes first). A size larger
  than the race's model scores FD at its last step only (the choice reads the loss; an FD evaluation of
  DiT-S/4 takes about 16 minutes on a CPU core).
- ``report``: from the parts finished so far, ``<report-dir>/race.json`` and ``race.md`` (each optimizer's FD,
  precision, recall, loss and time to AdamW's quality with the spread over seeds; the sweep; every ablation;
  the FD cost of K=2->3 and 3->4), the plots (FD against time with bands over seeds, time-to-quality bars, FD
  against each ablation's variable, a sample grid per optimizer) and a copy of every part's record.

Every part writes ``<out>/<part>/`` (runs, results.json/.md, plots); the feature classifier and the real-set
features are shared in ``<out>/feature_cache``. ``--quick`` runs the same parts on the digits set with a tiny
DiT and a handful of steps: minutes, for checking the plumbing, not for reading.

    python scripts/race.py --part all --out runs/race            # the full race (many CPU hours; resumable)
    python scripts/race.py --part sweep --out runs/race --report-only  # a part's record so far, launching nothing
    python scripts/race.py --part report --out runs/race --report-dir docs/results/race  # publish what is done
    python scripts/race.py --part sweep --quick --out /tmp/race  # the plumbing in minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAIN = ("adamw", "torch_muon", "muon", "periodic_row_muon", "muon_bp")
MUON_BP_BLOCKS = "muon_bp=--optim.blocks 4"  # one process takes the row blocks of 4 FSDP ranks
# Widened where a sweep's best lr sat on an edge (PeriodicRowMuon at 3e-3; MuonBP at 1e-3, then at 1e-2)
SWEEP_LRS = {
    "adamw": (1e-3, 3e-3, 1e-2),
    "periodic_row_muon": (1e-3, 3e-3, 1e-2, 2e-2),
    "muon_bp": (3e-4, 1e-3, 3e-3, 1e-2, 2e-2),
}
SWEEP_DEFAULT_LRS = (3e-3, 1e-2, 2e-2)
# The selection's grid: factors of at most 2 around every optimizer's best of the sweep (by loss or by FD)
SELECT_LRS = (3e-3, 5e-3, 1e-2, 2e-2)
SELECT_SEEDS = (0, 1)


@dataclass(frozen=True)
class Ablation:
    """An ablation: the optimizer it varies, and per variant label its place on the plot (x value, line) and
    its flags."""

    base: str
    xlabel: str
    variants: dict[str, tuple[float | str, str, str]]
    log_x: bool = False
    main: str | None = None  # the variant that trains exactly as the main race does (its runs are linked)
    lr_of: str | None = None  # whose chosen lr it runs at (default: base's)


# The main race's variant of each ablation trains with exactly the main race's flags (PeriodicRowMuon's defaults
# K=3, gamma 0.15; MuonBP's P=5, ratio 1 with the row blocks of 4 ranks), so its runs are the selection's.
DEFAULT_K, DEFAULT_GAMMA = 3, 0.15
GAMMAS = (0.05, 0.1, 0.15, 0.3, 0.6, 1.0)  # the gamma ablation's grid
LR_GAMMA_GAMMAS = (0.025, *GAMMAS, 2.0)  # the lr x gamma grid's gammas: the gamma grid, one step past either end


def gamma_variants(gammas: Sequence[float]) -> dict[str, tuple[float | str, str, str]]:
    """PeriodicRowMuon at each gamma, as an ablation's variants (label ``g<gamma>``)."""
    return {f"g{g:g}": (g, "", "" if g == DEFAULT_GAMMA else f"--optim.gamma {g:g}") for g in gammas}


ABLATIONS = {
    "k": Ablation(
        "periodic_row_muon",
        "K: a Newton-Schulz step every K steps, RowNorm between",
        {f"k{k}": (k, "", "" if k == DEFAULT_K else f"--optim.k {k}") for k in (1, 2, 3, 4, 6)},
        main="k3",
    ),
    "gamma": Ablation(
        "periodic_row_muon",
        "gamma: the RowNorm steps' scale (K=3)",
        gamma_variants(GAMMAS),
        log_x=True,
        main="g0.15",
    ),
    # The best gamma and the best lr are not independent: the gamma ablation's best and its two neighbours, at the
    # chosen lr and a factor of 2 either side (a 3 x 3 grid; the chosen lr's row is the gamma ablation's own runs).
    "lr_gamma": Ablation(
        "periodic_row_muon",
        "lr x gamma: the RowNorm steps' scale at three lrs (K=3)",
        gamma_variants(LR_GAMMA_GAMMAS),
        log_x=True,
        main="g0.15",
    ),
    # AdaptiveRowMuon's thresholds at PeriodicRowMuon's chosen lr: against the K ablation's fixed periods there.
    "adaptive": Ablation(
        "adaptive_row_muon",
        "AdaptiveRowMuon's staleness threshold (gamma 0.15, k_min 1, k_max 8)",
        {f"t{t:g}": (t, "", f"--optim.threshold {t:g}") for t in (0.25, 0.35, 0.5)},
        lr_of="periodic_row_muon",
    ),
    "bp": Ablation(
        "muon_bp",
        "P: a full-matrix step every P steps, block steps between (4 blocks)",
        {
            f"p{p}_r{r:g}": (
                p,
                f"block lr ratio {r:g}",
                "--optim.blocks 4"
                + ("" if (p, r) == (5, 1.0) else f" --optim.period {p} --optim.block-lr-ratio {r:g}"),
            )
            for p in (2, 5, 10)
            for r in (0.5, 1.0)
        },
        main="p5_r1",
    ),
    "ns": Ablation(
        "muon",
        "Newton-Schulz variant of Muon",
        {
            "quintic5": ("quintic 5", "", "--optim.ns-steps 5"),
            "quintic4": ("quintic 4", "", "--optim.ns-steps 4"),
            "quintic3": ("quintic 3", "", "--optim.ns-steps 3"),
            "polar5": ("Polar Express 5", "", "--optim.ns-coefficients polar_express"),
            "gram5": ("Gram 5", "", "--optim.ns-algorithm gram"),
        },
        main="quintic5",
    ),
}
ABLATION_SEEDS = (0, 1)
# Does PeriodicRowMuon's loss gap to Muon shrink with the model? Each size its own lr choice (mean EMA validation
# loss over 2 seeds) on a grid of factors of 2 around the race's choice; the race's model is the selection's runs.
SCALE_OPTIMIZERS = ("periodic_row_muon", "muon")
SCALE_MODELS = ("DiT-T/4", "DiT-XS/4", "DiT-S/4")
SCALE_LRS = (5e-3, 1e-2, 2e-2)
# An optimizer whose best lr at a size sits on an edge of its grid gets the next factor of 2 past that edge, and is
# chosen again, at most this many times per size (the best strictly inside the grid, as the selection rule asks).
SCALE_WIDENINGS = 2
DATA_SHAPES = {"mnist": ((1, 28, 28), 10), "digits": ((1, 8, 8), 10)}  # (channels, height, width), classes
LONG_FACTOR = 2  # the ``long`` part trains this many times the race's steps
PARTS = ("sweep", "select", "seeds", "step", "inception", "fd", "long", *ABLATIONS, "scale", "report")
FULL = [
    "--model",
    "DiT-XS/4",
    "--dataset",
    "mnist",
    "--steps",
    "2000",
    "--batch-size",
    "32",
    "--eval.interval",
    "500",
    "--eval.num-samples",
    "500",
    "--eval.sample-steps",
    "20",
]
QUICK = [
    "--model",
    "DiT-T/2",
    "--dataset",
    "digits",
    "--steps",
    "6",
    "--batch-size",
    "16",
    "--eval.interval",
    "3",
    "--eval.num-samples",
    "40",
    "--eval.sample-steps",
    "2",
    "--eval.batch-size",
    "40",
]


def published(args: argparse.Namespace, name: str) -> Path | None:
    """``<report-dir>/<name>`` where ``--report-dir`` is given and the file is there (a published copy)."""
    path = args.report_dir / name if args.report_dir is not None else None
    return path if path is not None and path.is_file() else None


def bench(
    args: argparse.Namespace,
    part: str,
    flags: list[str],
    steps_factor: int = 1,
    keep_rows_of: list[str] | None = None,
    model: str | None = None,
    final_eval_only: bool = False,
) -> int:
    """One ``dimuon bench quality`` invocation for ``part`` (the race's steps x ``steps_factor``; ``model`` in place
    of the race's; with ``final_eval_only`` generation quality scored at the last step alone), its output streamed;
    the finished runs of the part's published record (``<report-dir>/<part>.json``) whose directories are not here
    are kept from it, not trained again."""
    settings = list(QUICK if args.quick else FULL)
    settings[settings.index("--steps") + 1] = str(int(settings[settings.index("--steps") + 1]) * steps_factor)
    if model is not None:
        settings[settings.index("--model") + 1] = model
    if final_eval_only:
        settings[settings.index("--eval.interval") + 1] = settings[settings.index("--steps") + 1]
    earlier = published(args, f"{part}.json")
    keep = keep_rows_of if keep_rows_of is not None else ["--keep-rows-of", str(earlier)] if earlier else []
    cmd = [
        sys.executable,
        "-m",
        "dimuon.cli",
        "bench",
        "quality",
        *settings,
        *flags,
        "--out",
        str(args.out / part),
        "--eval.cache-dir",
        str(args.out / "feature_cache"),
        "--jobs",
        str(args.jobs),
        "--threads",
        str(args.threads),
        "--no-progress",
        *keep,
        *(["--report-only"] if args.report_only else []),
    ]
    print("$ " + " ".join(cmd), flush=True)
    return run_child(cmd)


def run_child(cmd: Sequence[str]) -> int:
    """Run one dimuon command in a session of its own and return its exit status; an interrupt of this script
    (Ctrl-C, SIGTERM, SIGHUP) is passed on to it as SIGINT, once per interrupt: at the first, ``dimuon bench
    quality`` starts no further run and waits for the running ones to save a checkpoint; at the second it kills
    them. After an interrupt, KeyboardInterrupt is raised once the command has ended."""
    proc = subprocess.Popen(list(cmd), start_new_session=True)  # the terminal's Ctrl-C reaches this script alone
    interrupted = False
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:
            interrupted = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                print("race: interrupted: passed on; interrupt again to stop the running training at once", flush=True)
    if interrupted:  # the part stopped on request: no further part starts
        raise KeyboardInterrupt
    return code


def best_lrs(args: argparse.Namespace) -> dict[str, float]:
    """Each optimizer's best lr: from the ``select`` part's record where there is one (it must be finished), else
    from the sweep's (its published copy ``<report-dir>/<part>.json`` in a checkout without the runs); an lr on
    its grid's edge is reported."""
    chosen = args.out / "select" / "results.json"
    if not chosen.is_file():
        chosen = published(args, "select.json") or chosen
    if chosen.is_file():
        record = json.loads(chosen.read_text(encoding="utf-8"))
        unfinished = [r["name"] for r in record["runs"] if r["status"] != "ok"]
        if unfinished or len(record["runs"]) < len(MAIN) * len(SELECT_LRS) * len(SELECT_SEEDS):
            raise SystemExit(
                f"race: the selection ({chosen}) is not finished ({len(unfinished)} runs unfinished "
                "or missing): run --part select again"
            )
        path = chosen
    else:
        path = args.out / "sweep" / "results.json"
        if not path.is_file():
            path = published(args, "sweep.json") or path
        if not path.is_file():
            raise SystemExit(
                f"race: {path} is missing: run --part sweep first (or pass --report-dir with its published sweep.json)"
            )
        print(
            "race: note: best lrs from the sweep (seed 0); --part select chooses by the mean EMA validation loss "
            "of 2 seeds",
            flush=True,
        )
    summary = json.loads(path.read_text(encoding="utf-8"))["optimizers"]
    missing = [name for name in MAIN if summary.get(name, {}).get("lr") is None]
    if missing:
        raise SystemExit(f"race: {path} has no finished run of {missing}: run its part again")
    for name in MAIN:
        lr, tried = summary[name]["lr"], summary[name]["lrs_tried"]
        if lr in (min(tried), max(tried)):
            print(f"race: warning: {name}'s best lr {lr:g} is on the edge of its grid {tried}: widen it", flush=True)
    return {name: summary[name]["lr"] for name in MAIN}


def select(args: argparse.Namespace) -> int:
    """The selection grid, seeds 0 and 1; the runs of ``sweep`` and ``seeds`` on it linked where they are here, or
    kept from their published records (one merged record, ``<out>/select/earlier.json``), not trained again."""
    runs = args.out / "select" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    names = {f"{name}-lr{lr:g}-s{seed}" for name in MAIN for lr in SELECT_LRS for seed in SELECT_SEEDS}
    for name in sorted(names):
        for part in ("sweep", "seeds"):
            link(runs / name, args.out / part / "runs" / name)
    earlier: dict[str, dict] = {}
    for part in ("select", "sweep", "seeds"):  # the selection's own published rows first
        rec = _record(args.out / part / "results.json") if part != "select" else None
        rec = rec or (_record(p) if (p := published(args, f"{part}.json")) else None)
        for r in (rec or {}).get("runs", []):
            if r["name"] in names and r.get("status") == "ok" and r["name"] not in earlier:
                earlier[r["name"]] = {**r, "machine": r.get("machine") or rec.get("machine")}
    keep = []
    if earlier:
        from dimuon.io import write_json_atomic

        keep = [
            "--keep-rows-of",
            str(write_json_atomic(args.out / "select" / "earlier.json", {"runs": list(earlier.values())})),
        ]
    trained = args.only or MAIN
    return bench(
        args,
        "select",
        [
            "--optimizers",
            *trained,
            "--lrs",
            *(f"{lr:g}" for lr in SELECT_LRS),
            "--seeds",
            *map(str, SELECT_SEEDS),
            "--select-by",
            "val_loss_ema",
            *(["--train-args-of", MUON_BP_BLOCKS] if "muon_bp" in trained else []),
        ],
        keep_rows_of=keep,
    )


def sweep(args: argparse.Namespace) -> int:
    grid = [f"{name}={','.join(f'{lr:g}' for lr in lrs)}" for name, lrs in SWEEP_LRS.items()]
    return bench(
        args,
        "sweep",
        [
            "--optimizers",
            *MAIN,
            "--lr-grid",
            *grid,
            "--lrs",
            *(f"{lr:g}" for lr in SWEEP_DEFAULT_LRS),
            "--seeds",
            "0",
            "--train-args-of",
            MUON_BP_BLOCKS,
        ],
    )


def seeds(args: argparse.Namespace) -> int:
    """Every optimizer (``--only``: those named) at its best lr with seeds 0, 1, 2. Once the selection exists: at
    its chosen lrs, seeds 0 and 1 its runs there (linked, or kept from its published record), seed 2 trained;
    before it, at the sweep's bests, seed 0 the sweep's run (linked)."""
    names = list(args.only or MAIN)
    selection = _record(args.out / "select" / "results.json")
    if selection is None and (published_select := published(args, "select.json")) is not None:
        selection = _record(published_select)
    if selection is not None:
        lrs, reused, reused_seeds = selected_lrs(selection, names), "select", SELECT_SEEDS
    else:
        best = best_lrs(args)
        lrs, reused, reused_seeds = {name: best[name] for name in names}, "sweep", (0,)
    runs = args.out / "seeds" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    kept: list[dict[str, Any]] = []
    for name, lr in lrs.items():
        for seed in reused_seeds:
            kept += link_or_keep(args, runs, reused, f"{name}-lr{lr:g}-s{seed}")
    return bench(
        args,
        "seeds",
        [
            "--optimizers",
            *names,
            "--lr-grid",
            *(f"{n}={lr:g}" for n, lr in lrs.items()),
            "--seeds",
            "0",
            "1",
            "2",
            *(["--train-args-of", MUON_BP_BLOCKS] if "muon_bp" in names else []),
        ],
        keep_rows_of=keep_rows(args, "seeds", kept),
    )


def long(args: argparse.Namespace) -> int:
    """Every optimizer at its best lr for twice the race's steps, seed 0: does the ranking hold?"""
    lrs = best_lrs(args)
    return bench(
        args,
        "long",
        [
            "--optimizers",
            *MAIN,
            "--lr-grid",
            *(f"{n}={lr:g}" for n, lr in lrs.items()),
            "--seeds",
            "0",
            "--train-args-of",
            MUON_BP_BLOCKS,
        ],
        steps_factor=LONG_FACTOR,
    )


def link_or_keep(args: argparse.Namespace, runs: Path, source: str, run: str) -> list[dict[str, Any]]:
    """Reuse ``source``'s run ``run`` in ``runs``: linked when its directory is here, else its rows from the
    published ``source`` record (none when neither exists, and the run is trained)."""
    link(runs / run, args.out / source / "runs" / run)
    return [] if (runs / run).exists() else published_rows(args, (source,), run, run)


def link(link_path: Path, target: Path) -> None:
    """``link_path`` -> ``target`` (resolved), when the target exists and nothing is at ``link_path`` yet."""
    target = target.resolve()
    if not link_path.exists() and not link_path.is_symlink() and target.is_dir():
        link_path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link_path, target_is_directory=True)


def base_lr(args: argparse.Namespace, base: str) -> float:
    """The lr an ablation of ``base`` runs at: ``base``'s choice in the ``select`` record (its own runs finished,
    whatever the other optimizers' state), else the sweep's best (:func:`best_lrs`)."""
    record = _record(args.out / "select" / "results.json")
    if record is None and (published_select := published(args, "select.json")) is not None:
        record = _record(published_select)
    if record is not None:
        return selected_lrs(record, [base])[base]
    return best_lrs(args)[base]


def ablation(args: argparse.Namespace, part: str) -> int:
    """One ablation at its optimizer's chosen lr, seeds 0 and 1; the variant that trains as the main race does is
    linked to the ``select`` (or ``seeds``) runs at that lr, not trained again."""
    spec = ABLATIONS[part]
    lr = base_lr(args, spec.lr_of or spec.base)
    return train_ablation(args, part, list(spec.variants), [lr])


def train_ablation(
    args: argparse.Namespace,
    part: str,
    labels: Sequence[str],
    lrs: Sequence[float],
    kept: Sequence[dict[str, Any]] = (),
) -> int:
    """``labels`` of ablation ``part`` at ``lrs``, seeds 0 and 1; the main race's variant linked to the runs the
    ``select`` (or ``seeds``) part trained at each lr, or, where those runs are not here, kept from their
    published records (same command, renamed), not trained again; ``kept``: other rows taken as this part's."""
    spec = ABLATIONS[part]
    main_rows: list[dict[str, Any]] = list(kept)
    if spec.main in labels:  # the variant the main race already trained: its runs, linked or kept
        for lr in lrs:
            for seed in ABLATION_SEEDS:
                name = f"{spec.base}-{spec.main}-lr{lr:g}-s{seed}"
                for trained in ("select", "seeds"):
                    link(args.out / part / "runs" / name, args.out / trained / "runs" / f"{spec.base}-lr{lr:g}-s{seed}")
                if not (args.out / part / "runs" / name).exists():
                    main_rows += published_rows(args, ("select", "seeds"), f"{spec.base}-lr{lr:g}-s{seed}", name)
    return bench(
        args,
        part,
        [
            "--optimizers",
            *(f"{spec.base}/{label}" for label in labels),
            "--lrs",
            *(f"{lr:g}" for lr in lrs),
            "--seeds",
            *map(str, ABLATION_SEEDS),
            *train_args_of(spec, labels),
        ],
        keep_rows_of=keep_rows(args, part, main_rows),
    )


def keep_rows(args: argparse.Namespace, part: str, rows: Sequence[dict[str, Any]]) -> list[str] | None:
    """``--keep-rows-of`` a merged record, ``<out>/<part>/earlier.json``: the part's own published finished rows
    (with ``--curves`` those carrying their curve), then ``rows`` (another part's, taken as this part's) under names
    it has not; None without ``rows`` and without ``--curves`` (the part's published record is kept as it is)."""
    if not rows and not args.curves:
        return None
    from dimuon.io import write_json_atomic

    own = _record(p) if (p := published(args, f"{part}.json")) else None
    merged = {
        r["name"]: {**r, "machine": r.get("machine") or own.get("machine")}
        for r in (own or {}).get("runs", [])
        if keepable(args, r)
    }
    merged.update({r["name"]: r for r in rows if r["name"] not in merged})
    return ["--keep-rows-of", str(write_json_atomic(args.out / part / "earlier.json", {"runs": list(merged.values())}))]


def train_args_of(spec: Ablation, labels: Sequence[str]) -> list[str]:
    """``--train-args-of`` for the variants ``labels`` that add flags to the main race's (none where none does)."""
    pairs = [f"{spec.base}/{label}={spec.variants[label][2]}" for label in labels if spec.variants[label][2]]
    return ["--train-args-of", *pairs] if pairs else []


def keepable(args: argparse.Namespace, row: Mapping[str, Any]) -> bool:
    """Whether a published run row is kept rather than trained again: finished, and with ``--curves`` carrying its
    per-evaluation curve (FD and EMA validation loss by step)."""
    return row.get("status") == "ok" and (bool(row.get("curve")) or not args.curves)


def published_rows(args: argparse.Namespace, parts: Sequence[str], name: str, as_name: str) -> list[dict[str, Any]]:
    """Run ``name``'s finished row from the first published record of ``parts`` that has it, renamed ``as_name``
    (``trained_as`` keeps its name there), with the machine it trained on; empty where none has it."""
    for part in parts:
        record = _record(p) if (p := published(args, f"{part}.json")) else None
        for r in (record or {}).get("runs", []):
            if r["name"] == name and keepable(args, r):
                machine = r.get("machine") or record.get("machine")
                renamed = {"trained_as": r.get("trained_as") or name} if as_name != name else {}
                return [{**r, "name": as_name, **renamed, "machine": machine}]
    return []


def lr_gamma(args: argparse.Namespace) -> int:
    """The lr x gamma grid: the gamma ablation's best gamma (lowest mean EMA validation loss over its seeds) and
    its two neighbours on :data:`LR_GAMMA_GAMMAS`, at PeriodicRowMuon's chosen lr and half and twice it; the chosen
    lr's runs are the gamma ablation's, linked (or kept from its published record, gamma.json)."""
    lr = base_lr(args, "periodic_row_muon")
    record = _record(args.out / "gamma" / "results.json")
    if record is None and (published_gamma := published(args, "gamma.json")) is not None:
        record = _record(published_gamma)
    expected = {f"periodic_row_muon-g{g:g}-lr{lr:g}-s{s}" for g in GAMMAS for s in ABLATION_SEEDS}
    done = {r["name"]: r for r in (record or {}).get("runs", []) if r["status"] == "ok"}
    if not expected <= set(done):
        raise SystemExit(
            f"race: the gamma ablation at lr {lr:g} is not finished ({len(expected & set(done))} of "
            f"{len(expected)} runs): run --part gamma"
        )
    means = {
        g: statistics.fmean(done[f"periodic_row_muon-g{g:g}-lr{lr:g}-s{s}"]["val_loss_ema"] for s in ABLATION_SEEDS)
        for g in GAMMAS
    }
    best = min(means, key=means.__getitem__)
    i = LR_GAMMA_GAMMAS.index(best)
    gammas = LR_GAMMA_GAMMAS[i - 1 : i + 2]
    print(f"race: lr x gamma around gamma {best:g} (mean EMA validation loss {means[best]:.4f} at lr {lr:g})")
    kept: list[dict[str, Any]] = []
    for g in gammas:  # the chosen lr's row: the gamma ablation's runs, linked or kept from its published record
        for seed in ABLATION_SEEDS:
            kept += link_or_keep(
                args, args.out / "lr_gamma" / "runs", "gamma", f"periodic_row_muon-g{g:g}-lr{lr:g}-s{seed}"
            )
    return train_ablation(args, "lr_gamma", [f"g{g:g}" for g in gammas], [lr / 2, lr, lr * 2], kept)


def scale_models(args: argparse.Namespace) -> tuple[str, ...]:
    """The model sizes of the ``scale`` part: ``--scale-models``, else :data:`SCALE_MODELS`, or with ``--quick`` the
    quick race's model and one other."""
    if getattr(args, "scale_models", None):
        return tuple(args.scale_models)
    return ("DiT-T/2", "DiT-T/4") if args.quick else SCALE_MODELS


def scale_part(model: str) -> str:
    """The part name (out directory, published record) of one size of the ``scale`` part: ``scale-dit-xs4``."""
    return "scale-" + model.lower().replace("/", "")


def scale(args: argparse.Namespace) -> int:
    """PeriodicRowMuon and Muon at each size of :func:`scale_models` over :data:`SCALE_LRS`, seeds 0 and 1, each
    optimizer's lr chosen per size by the mean EMA validation loss, its grid widened by a factor of 2 past the
    edge where its best sits (:func:`widened`, at most :data:`SCALE_WIDENINGS` times); the race's own model takes
    the selection's runs there (linked, or kept from its published record), not trained again. Then
    ``<out>/scale.json`` and ``gap_vs_params.png``: the loss gap against the model's parameters."""
    race_model = setting("--model", args)
    race_params = model_params(race_model, setting("--dataset", args))
    for model in scale_models(args):
        part = scale_part(model)
        # A size past the race's scores generation quality at its last step only: the selection reads the EMA
        # validation loss, and one FD evaluation of DiT-S/4 takes a quarter of an hour on a CPU.
        larger = model_params(model, setting("--dataset", args)) > race_params
        grids = {name: tuple(SCALE_LRS) for name in SCALE_OPTIMIZERS}
        for widening in range(SCALE_WIDENINGS + 1):
            grids = widened(_record(args.out / part / "results.json"), grids) if widening else grids
            if widening and grids is None:
                break
            kept: list[dict[str, Any]] = []
            if model == race_model:
                runs = args.out / part / "runs"
                runs.mkdir(parents=True, exist_ok=True)
                for name, grid in grids.items():
                    for lr in grid:
                        for seed in SELECT_SEEDS:
                            kept += link_or_keep(args, runs, "select", f"{name}-lr{lr:g}-s{seed}")
            own = [f"{name}={','.join(f'{lr:g}' for lr in grid)}" for name, grid in grids.items() if grid != SCALE_LRS]
            code = bench(
                args,
                part,
                [
                    "--optimizers",
                    *SCALE_OPTIMIZERS,
                    "--lrs",
                    *(f"{lr:g}" for lr in SCALE_LRS),
                    *(["--lr-grid", *own] if own else []),
                    "--seeds",
                    *map(str, SELECT_SEEDS),
                    "--select-by",
                    "val_loss_ema",
                ],
                keep_rows_of=keep_rows(args, part, kept),
                model=model,
                final_eval_only=larger,
            )
            if code != 0:
                return code
            if args.report_only:
                break
    return scale_report(args)


Grids = Mapping[str, tuple[float, ...]]  # optimizer -> its lrs


def widened(record: dict[str, Any] | None, grids: Grids) -> dict[str, tuple[float, ...]] | None:
    """``grids`` with, for each optimizer whose best lr in ``record`` (mean EMA validation loss over its finished
    runs in its grid) sits on an edge, the next factor of 2 past that edge; None where none needs it (every best
    inside, or its next point already tried: a run that did not finish)."""
    if record is None:
        return None
    from dimuon.bench.quality_report import selection

    out, grew = dict(grids), False
    for name, grid in grids.items():
        rows = [r for r in record.get("runs", []) if r.get("optimizer") == name and r.get("status") == "ok"]
        chosen = selection([r for r in rows if any(math.isclose(r["lr"], lr) for lr in grid)], "val_loss_ema")
        best = chosen["best"]
        if best is None or not chosen["on_edge"]:
            continue
        step = 2.0 if math.isclose(best, max(grid)) else 0.5
        nxt = float(f"{best * step:g}")
        if any(math.isclose(nxt, lr) for lr in grid):
            continue
        out[name], grew = tuple(sorted((*grid, nxt))), True
    return out if grew else None


def model_params(model: str, dataset: str) -> int:
    """Parameters of a registry DiT on one of the race's data sets, as ``dimuon train`` builds it."""
    from dimuon.train.plan import ModelSpec

    shape, classes = DATA_SHAPES[dataset]
    return sum(p.numel() for p in ModelSpec(model, 0.1).build(shape, classes).parameters())


def scale_report(args: argparse.Namespace) -> int:
    """``<out>/scale.json`` (per size: parameters, each optimizer's chosen lr and its EMA validation loss over the
    seeds, the gap PeriodicRowMuon - Muon with its range over seed pairs) and ``gap_vs_params.png``, from the
    sizes whose selections are finished."""
    from dimuon.io import write_json_atomic

    dataset = setting("--dataset", args)
    sizes = []
    for model in scale_models(args):
        record = _record(args.out / scale_part(model) / "results.json")
        if record is None:
            continue
        summary = record["optimizers"]
        done = {
            name: [r for r in record["runs"] if r["optimizer"] == name and r["status"] == "ok"]
            for name in SCALE_OPTIMIZERS
        }
        if any(len(done[n]) < len(SCALE_LRS) * len(SELECT_SEEDS) for n in SCALE_OPTIMIZERS):
            print(f"race: scale: {model}'s selection is not finished; left out of scale.json", flush=True)
            continue
        per = {}
        for name in SCALE_OPTIMIZERS:
            lr = summary[name]["lr"]
            losses = [r["val_loss_ema"] for r in done[name] if r["lr"] == lr]
            per[name] = {
                "lr": lr,
                "on_edge": summary[name]["selection"]["on_edge"],
                "flat_with": summary[name]["selection"].get("flat_with", []),
                "lrs": summary[name]["selection"].get("lrs", {}),  # per lr tried: mean, min, max over the seeds
                "val_loss_ema": statistics.fmean(losses),
                "min": min(losses),
                "max": max(losses),
            }
        for name, chosen in per.items():
            if chosen["on_edge"]:
                tried = sorted({r["lr"] for r in done[name]})
                print(
                    f"race: warning: scale: {name}'s lr {chosen['lr']:g} at {model} is on the edge of its grid "
                    f"{[float(f'{lr:g}') for lr in tried]} after {SCALE_WIDENINGS} widenings: an upper bound",
                    flush=True,
                )
        prm, muon = per["periodic_row_muon"], per["muon"]
        sizes.append(
            {
                "model": model,
                "params": model_params(model, dataset),
                "optimizers": per,
                "gap": prm["val_loss_ema"] / muon["val_loss_ema"] - 1,
                "gap_min": prm["min"] / muon["max"] - 1,
                "gap_max": prm["max"] / muon["min"] - 1,
                "machine": record.get("machine"),
            }
        )
    out = {"benchmark": "race scale", "dataset": dataset, "steps": setting("--steps", args), "sizes": sizes}
    write_json_atomic(args.out / "scale.json", out)
    plot = _race_report().plot_gap_vs_params(sizes, args.out / "gap_vs_params.png", dataset)
    for size in sizes:
        print(
            f"race: scale: {size['model']} ({size['params'] / 1e6:.2f}M parameters): PeriodicRowMuon - Muon "
            f"{100 * size['gap']:+.2f}% ({100 * size['gap_min']:+.2f}..{100 * size['gap_max']:+.2f}%)",
            flush=True,
        )
    print(f"wrote {args.out / 'scale.json'}" + (f", {plot}" if plot else ""), flush=True)
    return 0


def setting(name: str, args: argparse.Namespace) -> str:
    """The value of one of the race's ``dimuon train`` settings (``--model``, ``--batch-size``, ...)."""
    settings = QUICK if args.quick else FULL
    return settings[settings.index(name) + 1]


def step_time(args: argparse.Namespace) -> int:
    """The race's optimizers timed side by side on its model and batch; skipped once every row is measured."""
    record = _record(args.out / "step" / "results.json")
    if record is not None and all(r["status"] == "ok" for r in record["rows"]):
        print(f"race: {args.out / 'step'} is measured; delete it to measure again", flush=True)
        return 0
    if args.report_only:
        print(f"race: {args.out / 'step'} is not measured yet (--report-only launches nothing)", flush=True)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "dimuon.cli",
        "bench",
        "step",
        "--model",
        setting("--model", args),
        "--dataset",
        setting("--dataset", args),
        "--batch-size",
        setting("--batch-size", args),
        "--worlds",
        "1",
        "--threads",
        str(args.threads),
        "--optimizers",
        *MAIN,
        "--train-args-of",
        MUON_BP_BLOCKS,
        *(["--window", "2", "--windows", "2"] if args.quick else ["--window", "30", "--windows", "3"]),
        "--repeats",
        "3",
        "--out",
        str(args.out / "step"),
        "--no-progress",
    ]
    print("$ " + " ".join(cmd), flush=True)
    return run_child(cmd)


def selected_lrs(record: dict[str, Any], names: Sequence[str]) -> dict[str, float]:
    """The chosen lr of each of ``names`` from a ``select`` record, each of whose runs (every lr and seed of the
    grid) must be finished."""
    lrs = {}
    for name in names:
        done = [r for r in record["runs"] if r["optimizer"] == name and r["status"] == "ok"]
        if len(done) < len(SELECT_LRS) * len(SELECT_SEEDS) or record["optimizers"].get(name, {}).get("lr") is None:
            raise SystemExit(f"race: the selection of {name} is not finished ({len(done)} runs): run --part select")
        lrs[name] = record["optimizers"][name]["lr"]
    return lrs


def rescore(
    args: argparse.Namespace, run_dir: Path, features: str, samples: str, seed: int | None = None
) -> dict[str, Any] | None:
    """``dimuon eval`` of a run's last checkpoint in ``features`` space with ``samples`` samples (and sampling
    seed ``seed``; None: eval's default), the race's sampler settings and every job's threads (one evaluation at
    a time; one already scored is not scored again; samples already drawn for another feature space are reused);
    its last scored entry, None where the evaluation failed."""
    steps = setting("--eval.sample-steps", args)
    cmd = [
        sys.executable,
        "-m",
        "dimuon.cli",
        "eval",
        "--run",
        str(run_dir),
        "--features",
        features,
        "--num-samples",
        samples,
        "--sample-steps",
        steps,
        *(["--seed", str(seed)] if seed is not None else []),
        "--cache-dir",
        str(args.out / "feature_cache"),  # the race's feature classifier and real-set features, shared
        "--samples-cache",
        str(args.out / "sample_cache"),  # a checkpoint's samples drawn once for both feature spaces
        "--latest",
        "--threads",
        str(args.jobs * args.threads),
        "--no-progress",
    ]
    print("$ " + " ".join(cmd), flush=True)
    if run_child(cmd) != 0:
        return None
    results = json.loads((run_dir / "eval" / "results.json").read_text(encoding="utf-8"))["evaluations"]
    series = [
        ev
        for ev in results.values()
        if ev["settings"]["feature_space"].startswith(features)
        and str(ev["settings"]["num_samples"]) == samples
        and str(ev["settings"]["sample_steps"]) == steps
        and (seed is None or ev["settings"].get("seed") == seed)
    ]
    return max((e for ev in series for e in ev["entries"] if e["status"] == "ok"), key=lambda e: e["step"])


def inception(args: argparse.Namespace) -> int:
    """Every ``seeds`` run's last checkpoint in Inception space, then the per-optimizer summary."""
    from dimuon.io import write_json_atomic

    record_path = args.out / "seeds" / "results.json"
    if not record_path.is_file():
        raise SystemExit(f"race: {record_path} is missing: run --part seeds first")
    runs = [r for r in json.loads(record_path.read_text(encoding="utf-8"))["runs"] if r["status"] == "ok"]
    samples = setting("--eval.num-samples", args)
    summary: dict[str, list[dict]] = {}
    for r in runs:
        last = rescore(args, args.out / "seeds" / "runs" / r["name"], "inception", samples)
        if last is None:
            return 1
        summary.setdefault(r["optimizer"], []).append(
            {
                "run": r["name"],
                "step": last["step"],
                "fd": last["fd"],
                "precision": last["precision"],
                "recall": last["recall"],
            }
        )
    table = {
        name: {
            "fd_mean": sum(e["fd"] for e in rows) / len(rows),
            "fd_min": min(e["fd"] for e in rows),
            "fd_max": max(e["fd"] for e in rows),
            "runs": rows,
        }
        for name, rows in summary.items()
    }
    write_json_atomic(args.out / "inception.json", table)
    for name, t in table.items():
        print(f"{name:20s} Inception FD {t['fd_mean']:.2f} (seeds {t['fd_min']:.2f} .. {t['fd_max']:.2f})")
    return 0


FD_SPACES = ("classifier", "inception")
FD_SAMPLE_SEEDS = (0, 1)  # two sampling seeds per checkpoint: the sampling noise beside the training seeds'
FD_SAMPLES = {False: "2000", True: "60"}  # --quick: the plumbing only


def fd_spread(args: argparse.Namespace) -> int:
    """FD that can resolve: the last checkpoint of every ``select`` run at its optimizer's chosen lr (2 training
    seeds) scored with more samples than the race's (``FD_SAMPLES``), in both feature spaces, with 2 sampling seeds
    each; per optimizer and space the mean, the training seeds' range and the sampling seeds' range, and per pair
    of optimizers whether the gap between the means is larger than both ranges (``<out>/fd.json``). With
    ``--only``, those optimizers alone, once their own selection is finished (the rest may still be training).

    Resumable across checkouts: each score is written to ``fd.json``'s rows as it is measured, and a row of the
    local or the published (``<report-dir>/fd.json``) record is not measured again. A chosen run is scored from
    ``<out>/select/runs``, else from ``<out>/seeds/runs`` (the same command, trained again there for its curve);
    one whose checkpoints are in neither (a fresh checkout has the selection's rows, not its runs) is trained again
    first, with the same command, under ``<out>/fd/runs``, where a later call finds it."""
    selection = _record(args.out / "select" / "results.json")
    if selection is None and (published_select := published(args, "select.json")) is not None:
        selection = _record(published_select)
    if selection is None:
        raise SystemExit(f"race: {args.out / 'select' / 'results.json'} is missing: run --part select first")
    names = list(args.only or MAIN)
    lrs = selected_lrs(selection, names)
    samples = FD_SAMPLES[args.quick]
    earlier = _record(args.out / "fd.json") or (_record(p) if (p := published(args, "fd.json")) else None) or {}
    rows = {
        (r["run"], r["space"], r["sample_seed"]): r
        for r in earlier.get("rows", [])
        if earlier.get("samples") == int(samples)
    }
    chosen = {f"{name}-lr{lr:g}-s{seed}": (name, lr, seed) for name, lr in lrs.items() for seed in SELECT_SEEDS}
    # sampling seed by sampling seed, so that a part stopped half way has every run scored once (the training seeds'
    # spread for every optimizer) before any run is scored twice; a checkpoint's samples serve both spaces
    wanted = [(run, space, s) for s in FD_SAMPLE_SEEDS for run in chosen for space in FD_SPACES]
    todo = [key for key in wanted if key not in rows]
    # the selection's run, else the seeds part's of the same command (it trained seeds 0 and 1 again for curves),
    # else this part's own, trained again by an earlier call
    where = {
        run: next(
            (path for part in ("select", "seeds", "fd") if _has_checkpoint(path := args.out / part / "runs" / run)),
            args.out / "select" / "runs" / run,
        )
        for run, _, _ in todo
    }
    gone = sorted({run for run, path in where.items() if not _has_checkpoint(path)})
    if gone:
        retrain = sorted({chosen[run][0] for run in gone})
        print(f"race: fd: training again the chosen runs not here: {', '.join(gone)}", flush=True)
        code = bench(
            args,
            "fd",
            [
                "--optimizers",
                *retrain,
                "--lr-grid",
                *(f"{n}={lrs[n]:g}" for n in retrain),
                "--seeds",
                *map(str, SELECT_SEEDS),
                *(["--train-args-of", MUON_BP_BLOCKS] if "muon_bp" in retrain else []),
            ],
            keep_rows_of=[],  # their checkpoints are what is scored: trained here, never kept
        )
        if code != 0:
            return code
        where.update({run: args.out / "fd" / "runs" / run for run in gone})
    for run, space, seed in todo:
        last = rescore(args, where[run], space, samples, seed)
        if last is None:
            return 1
        name, lr, train_seed = chosen[run]
        rows[(run, space, seed)] = {
            "run": run,
            "optimizer": name,
            "lr": lr,
            "train_seed": train_seed,
            "sample_seed": seed,
            "space": space,
            "step": last["step"],
            "fd": last["fd"],
            "scored_from": str(where[run]),
        }
        write_fd(args, samples, rows, lrs)
    result = write_fd(args, samples, rows, lrs)
    fmt_2f = _race_report().fmt_2f
    for name, spaces in result["optimizers"].items():
        for space, t in spaces.items():
            print(
                f"{name:20s} {space:10s} FD {t['mean']:.2f} (training seeds +-{fmt_2f(t['train_half_range'])}, "
                f"sampling seeds +-{fmt_2f(t['sample_half_range'])})"
            )
    return 0


def _has_checkpoint(run_dir: Path) -> bool:
    """Whether a run directory holds a checkpoint to score."""
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


def write_fd(
    args: argparse.Namespace, samples: str, rows: dict[tuple, dict[str, Any]], lrs: dict[str, float]
) -> dict[str, Any]:
    """``<out>/fd.json`` from every score so far: its rows, and per optimizer (every one scored, the chosen lrs of
    those scored now) and space the summary, and the gaps between them."""
    chosen = {**{r["optimizer"]: r["lr"] for r in rows.values()}, **lrs}
    table: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in rows.values():
        if row["lr"] == chosen[row["optimizer"]]:  # a row of an lr no longer chosen is kept, not summarized
            table.setdefault(row["optimizer"], {}).setdefault(row["space"], []).append(row)
    result: dict[str, Any] = {
        "samples": int(samples),
        "sample_seeds": list(FD_SAMPLE_SEEDS),
        "lrs": chosen,
        "optimizers": {n: {space: fd_summary(rs) for space, rs in spaces.items()} for n, spaces in table.items()},
        "rows": sorted(rows.values(), key=lambda r: (r["optimizer"], r["train_seed"], r["space"], r["sample_seed"])),
    }
    result["gaps"] = fd_gaps(result["optimizers"])
    from dimuon.io import write_json_atomic

    write_json_atomic(args.out / "fd.json", result)
    return result


def fd_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean FD of an optimizer's checkpoints (the mean of each training seed's mean over its sampling seeds, so a
    seed scored more often weighs no more); half the range over training seeds of those means (None with one
    training seed scored) and the largest half range over sampling seeds of one checkpoint (None while no
    checkpoint has been scored with two): a part stopped half way has no spread to show, not a zero one."""
    by_train: dict[int, list[float]] = {}
    for row in rows:
        by_train.setdefault(row["train_seed"], []).append(row["fd"])
    means = [sum(v) / len(v) for v in by_train.values()]
    return {
        "mean": sum(means) / len(means),
        "train_half_range": (max(means) - min(means)) / 2 if len(means) > 1 else None,
        "sample_half_range": max(((max(v) - min(v)) / 2 for v in by_train.values() if len(v) > 1), default=None),
        "rows": rows,
    }


def fd_gaps(optimizers: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per feature space and pair of optimizers: the gap between their mean FDs, and whether it resolves (larger
    than the sum of their training-seed half ranges; None, undecided, while either has one training seed)."""
    gaps = []
    names = sorted(optimizers)
    for space in FD_SPACES:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if space not in optimizers[a] or space not in optimizers[b]:
                    continue
                ta, tb = optimizers[a][space], optimizers[b][space]
                gap = tb["mean"] - ta["mean"]
                halves = (ta["train_half_range"], tb["train_half_range"])
                noise = None if None in halves else halves[0] + halves[1]
                resolved = None if noise is None else abs(gap) > noise
                gaps.append({"space": space, "a": a, "b": b, "gap": gap, "noise": noise, "resolved": resolved})
    return gaps


def _record(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def sweep_summary(record: dict) -> dict[str, dict]:
    """Per optimizer of the sweep: final FD at each lr tried (mean over seeds), the best lr, whether it sits on
    the edge of the grid."""
    out = {}
    for name, s in record["optimizers"].items():
        fds: dict[str, list[float]] = {}
        for r in record["runs"]:
            if r["optimizer"] == name and r["status"] == "ok":
                fds.setdefault(f"{r['lr']:g}", []).append(r["fd"])
        tried = s["lrs_tried"]
        out[name] = {
            "lr": s["lr"],
            "lrs_tried": tried,
            "fd_by_lr": {lr: sum(v) / len(v) for lr, v in fds.items()},
            "on_edge": s["lr"] is not None and len(tried) > 1 and s["lr"] in (min(tried), max(tried)),
        }
    return out


def _race_report():
    """scripts/race_report.py, the module beside this script: its directory put on ``sys.path`` if it is not there
    (it is when the script runs as ``python scripts/race.py``; not when it is loaded from its file)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import race_report

    return race_report


def step_command(record: Mapping[str, Any]) -> str:
    """The command that made a ``dimuon bench step`` record, shell-quoted from its argv where the record keeps it
    (records made before the command was quoted wrote ``--train-args-of muon_bp=--optim.blocks 4`` bare)."""
    argv = record.get("machine", {}).get("argv")
    return "dimuon bench step " + shlex.join(argv) if isinstance(argv, list) else record["command"]


def report(args: argparse.Namespace) -> int:
    """``<report-dir>``: the race's numbers (race.json, race.md), its plots and a copy of every part's record,
    from whatever parts have finished (the main table from ``seeds``, or from ``sweep``'s seed 0 before it).

    A checkout without some parts' runs (a fresh clone of the published report, say) takes those parts' records
    from their copies in ``<report-dir>`` and the FD curves of runs whose directories are gone from the
    published race.json; a plot that needs files no longer here (the sample grids) is kept as published."""
    rr = _race_report()
    from dimuon.io import write_bytes_atomic, write_json_atomic, write_text_atomic

    dest = args.report_dir or args.out / "report"
    previous = _record(dest / "race.json") or {}
    records, carried = {}, []
    for part in ("sweep", "select", "seeds", "long", *ABLATIONS, *map(scale_part, scale_models(args))):
        rec = _record(args.out / part / "results.json")
        if rec is None and (rec := _record(dest / f"{part}.json")) is not None:
            carried.append(f"{part}.json")
        if rec is not None:
            records[part] = rec
    main_part = "seeds" if "seeds" in records else "sweep"
    if main_part not in records:
        raise SystemExit(f"race: no {args.out}/sweep/results.json yet: run --part sweep first")
    main_record = records[main_part]
    step_record = _record(args.out / "step" / "results.json")
    if step_record is None and (step_record := _record(dest / "step.json")) is not None:
        carried.append("step.json")
    times = rr.step_times(step_record)
    same_main = previous.get("main_part") == main_part
    curves, filled = rr.fill_curves(
        rr.load_curves(main_record, args.out / main_part), main_record, previous.get("curves", {}) if same_main else {}
    )
    curves, basis = rr.timed_by(curves, times)
    main = rr.optimizer_summary(main_record, curves, side_by_side=times if basis == "side by side" else None)
    inception = _record(args.out / "inception.json")
    if inception is None and (inception := previous.get("inception")) is not None:
        inception = rr.inception_of_runs(inception, {r["name"] for r in main_record["runs"] if r["status"] == "ok"})
        if inception:
            carried.append("race.json's Inception FDs")
    ablations = {part: rr.ablation_summary(rec) for part, rec in records.items() if part in ABLATIONS}
    c = main_record["config"]
    task = f"{c['model']} on {c['dataset']}, batch {c['batch_size']}, {c['steps']} steps"
    space = next((r["feature_space"] for r in main_record["runs"] if r.get("feature_space")), "?")

    def kept(plot: Path | None, path: Path, missing: bool) -> Path | None:
        """The plot just drawn, or the published one where files it needs are gone."""
        if missing and path.is_file():
            carried.append(path.name)
            return path
        return plot

    outputs = [
        rr.plot_fd_vs_time(
            curves,
            dest / "fd_vs_time.png",
            main["target_fd"],
            f"{task}: FD in {space}, mean over seeds and band from the lowest to the highest",
            basis,
        ),
        rr.plot_time_to_quality(
            main, dest / "time_to_quality.png", f"{task}: time to AdamW's quality (its worst seed's best FD)"
        ),
    ]
    grids_gone = any(not (cs[0].grid and Path(cs[0].grid).is_file()) for cs in curves.values())
    outputs.append(
        kept(
            None
            if grids_gone
            else rr.plot_sample_grids(curves, dest / "samples.png", f"{task}: the last evaluation's samples"),
            dest / "samples.png",
            grids_gone,
        )
    )
    levels = rr.time_to_levels(curves)
    loss_levels = rr.time_to_levels(curves, metric="val_loss_ema")
    for lv, name, what in ((levels, "time_to_levels.png", "FD"), (loss_levels, "time_to_loss_levels.png", "loss")):
        outputs.append(
            rr.plot_time_to_levels(
                rr.time_to_levels(
                    curves, levels=rr.dense_levels(lv["levels"], metric=lv["metric"]), metric=lv["metric"]
                ),
                dest / name,
                f"{task}: time to each {what} AdamW has reached on every seed",
                basis,
            )
        )
    longer, long_curves = None, {}
    if "long" in records:
        long_curves, long_filled = rr.fill_curves(
            rr.load_curves(records["long"], args.out / "long"), records["long"], previous.get("long_curves") or {}
        )
        long_curves, _ = rr.timed_by(long_curves, times)
        filled += long_filled
        lc = records["long"]["config"]
        if long_curves or not previous.get("long"):
            longer = rr.optimizer_summary(
                records["long"], long_curves, side_by_side=times if basis == "side by side" else None
            )
            longer["steps"] = lc["steps"]
        else:  # published before its curves were: its summary and plot as they are
            longer = previous["long"]
            carried.append("race.json's long summary")
        outputs.append(
            kept(
                rr.plot_fd_vs_time(
                    long_curves,
                    dest / "fd_vs_time_long.png",
                    longer["target_fd"],
                    f"{lc['model']} on {lc['dataset']}, batch {lc['batch_size']}, "
                    f"{lc['steps']} steps (seed 0): FD in {space}",
                    basis,
                )
                if long_curves
                else None,
                dest / "fd_vs_time_long.png",
                not long_curves,
            )
        )
    if filled:
        carried.append(f"race.json's FD curves of {', '.join(filled)}")
    k_costs = {}
    for part, summary in ablations.items():
        spec = ABLATIONS[part]
        points = {f"{spec.base}/{label}": (x, line) for label, (x, line, _) in spec.variants.items()}
        outputs.append(
            rr.plot_ablation(
                summary,
                points,
                dest / f"fd_vs_{part}.png",
                spec.xlabel,
                f"{task}: {spec.base}'s final FD and EMA validation loss, mean over seeds "
                "and whiskers from the lowest to the highest",
                spec.log_x,
            )
        )
        if part == "k":
            for lr in {lr for by_lr in summary.values() for lr in by_lr}:
                for a, b in ((2, 3), (3, 4)):
                    k_costs.setdefault(lr, {})[f"K={a}->{b}"] = {
                        key: rr.relative_change(summary, f"{spec.base}/k{a}", f"{spec.base}/k{b}", lr, key)
                        for key in rr.ABLATION_METRICS
                    }
    frontier = refresh_frontier(ablations)
    if frontier:
        outputs.append(
            rr.plot_frontier(
                frontier,
                dest / "loss_vs_refresh.png",
                f"{task}: EMA validation loss against the share of Newton-Schulz steps, fixed K against "
                "AdaptiveRowMuon's thresholds at the same lr",
            )
        )
    for part, rec in {**records, **({"step": step_record} if step_record else {})}.items():
        outputs.append(write_json_atomic(dest / f"{part}.json", rec))
    for name in ("scale.json", "gap_vs_params.png", "fd.json"):  # the scale and fd parts' records, as they are
        if (args.out / name).is_file() and args.out.resolve() != dest.resolve():
            outputs.append(dest / name)
            write_bytes_atomic(dest / name, (args.out / name).read_bytes())
    fd_record = _record(dest / "fd.json")  # the run's own, copied just above, else the published one
    if fd_record is not None and not fd_record.get("rows"):
        fd_record = None
    if fd_record is not None:
        outputs.append(
            rr.plot_fd_spread(
                fd_record,
                dest / "fd_spread.png",
                f"{task}: FD of each optimizer's chosen runs, final checkpoint, {fd_record['samples']} samples; a "
                "point per training and sampling seed",
            )
        )
    result = {
        "benchmark": "race",
        "task": task,
        "feature_space": space,
        "main_part": main_part,
        "settings": QUICK if args.quick else FULL,
        "eval_settings": main_record["eval_settings"],
        "machine": main_record["machine"],
        "sweep": sweep_summary(records["sweep"]) if "sweep" in records else None,
        "selection": (
            {
                name: {
                    **s["selection"],
                    "machines": rr.run_machines(
                        {
                            "runs": [r for r in records["select"]["runs"] if r["optimizer"] == name],
                            "machine": records["select"]["machine"],
                        }
                    ),
                }
                for name, s in records["select"]["optimizers"].items()
            }
            if "select" in records
            else None
        ),
        "main": main,
        "levels": levels,
        "loss_levels": loss_levels,
        "curves": {n: [c.to_dict() for c in cs] for n, cs in curves.items()},
        "inception": inception,
        "long": longer,
        "long_curves": {n: [c.to_dict() for c in cs] for n, cs in long_curves.items()},
        "ablations": ablations,
        "ablation_machines": {part: rr.run_machines(records[part]) for part in ablations},
        "k_costs": k_costs,
        "refresh_frontier": frontier,
        "step_command": step_command(step_record) if step_record and basis == "side by side" else None,
        "fd_spread": fd_record,
    }
    outputs += [dest / "race.json", dest / "race.md"]
    result["outputs"] = [str(p) for p in outputs if p is not None]
    write_json_atomic(dest / "race.json", result)
    write_text_atomic(dest / "race.md", render(result) + "\n")
    print(render(result), flush=True)
    if carried:
        print(
            f"race: taken as published in {dest} (their runs are not under {args.out}): {'; '.join(carried)}",
            flush=True,
        )
    print("wrote " + ", ".join(result["outputs"]), flush=True)
    return 0


# The schedules of the refresh frontier: the fixed periods first (the line the adaptive settings are held against).
FRONTIER = {"k": ("PeriodicRowMuon (fixed K)", "K={x:g}"), "adaptive": ("AdaptiveRowMuon", "threshold {x:g}")}


def refresh_frontier(ablations: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]] | None:
    """AdaptiveRowMuon's thresholds against PeriodicRowMuon's fixed periods at the lrs both ran at (EMA validation
    loss against the share of Newton-Schulz steps); None until both ablations have rows."""
    if not set(FRONTIER) <= set(ablations):
        return None
    settings = {
        f"{ABLATIONS[part].base}/{label}": fmt.format(x=x)
        for part, (_, fmt) in FRONTIER.items()
        for label, (x, _, _) in ABLATIONS[part].variants.items()
    }
    frontier = _race_report().refresh_frontier(
        {schedule: ablations[part] for part, (schedule, _) in FRONTIER.items()}, settings
    )
    return frontier if any(frontier.values()) else None


def render(result: dict) -> str:
    """race.md: the main table, the sweep, each ablation and the K costs."""
    rr = _race_report()

    m = result["machine"]
    main = result["main"]
    lines = [
        "# The optimizer race",
        "",
        f"{result['task']}; FD in `{result['feature_space']}`; {m.get('cpu_model') or m.get('cuda')}, torch "
        f"{m.get('torch')}. Time: {rr.TIME_BASES[main['time_basis']]}"
        + (
            " (two runs sharing two cores)."
            if main["time_basis"] == "run medians"
            else ", one process alone on the machine, as the race's runs train."
        )
        + (f" Step times: [step.json](step.json), `{result['step_command']}`." if result.get("step_command") else ""),
        "",
        f"## Main race ({result['main_part']}: each optimizer at its best lr, mean (lowest..highest) over seeds)",
        "",
        (
            f"Target: FD {main['target_fd']:.3f}, the best FD of AdamW's worst seed; time to it: the step FD "
            "first gets there (interpolated between evaluations) x the step time. "
            if main["target_fd"]
            else ""
        )
        + "Last FD change: between the last two evaluations (has FD flattened?).",
        "",
        rr.render_main(main, result["inception"]),
    ]
    for key, title, intro in (
        (
            "levels",
            "Time to each of AdamW's quality levels",
            "The FD AdamW has reached on every seed by each of its evaluations (the last is the target above); "
            "per optimizer the mean time to it and the ratio to AdamW's own, where every seed got there.",
        ),
        (
            "loss_levels",
            "Time to each of AdamW's EMA validation losses",
            "The same by the EMA validation loss (a validation pass every 250 steps), whose seed spread is far below "
            "FD's: the loss AdamW has reached on every seed by each pass.",
        ),
    ):
        if result.get(key, {}).get("levels"):
            lines += ["", f"### {title}", "", intro, "", rr.render_levels(result[key])]
    if result.get("long"):
        longer = result["long"]
        lines += [
            "",
            f"## Twice the steps (long: {longer['steps']} steps, seed 0, the same best lrs)",
            "",
            "Has FD flattened at the race's length, and does its ranking hold with a longer budget (the cosine "
            "schedule stretched to it)? Target here: AdamW's best FD in this longer run.",
            "",
            rr.render_main(longer),
            "",
            f"Ranking by final FD: at {result['task'].split(', ')[-1]} (main table) "
            f"{' < '.join(rr.ranking(main))}; at {longer['steps']} steps {' < '.join(rr.ranking(longer))}.",
        ]
    if result["sweep"]:
        lines += ["", "## Learning-rate sweep (seed 0, final FD)", ""]
        for name, s in result["sweep"].items():
            cells = ", ".join(f"{lr}: {fd:.2f}" for lr, fd in sorted(s["fd_by_lr"].items(), key=lambda x: float(x[0])))
            edge = " (on the grid's edge)" if s["on_edge"] else ""
            lines.append(f"- {name}: best lr {s['lr']:g}{edge}; {cells}")
    if result.get("selection"):
        from dimuon.bench.quality_report import selection_lines

        lines += [
            "",
            "## Learning-rate selection (select: lowest mean EMA validation loss over seeds 0 and 1)",
            "",
            "Per lr the mean (lowest..highest) over seeds; bold: the chosen lr. Flat: a neighbour's seed range "
            "overlaps the chosen one's, so the loss cannot tell them apart.",
            "",
            *selection_lines({n: {"selection": sel} for n, sel in result["selection"].items()}),
        ]
        machines: dict[str, int] = {}
        for sel in result["selection"].values():
            for label, n in (sel.get("machines") or {}).items():
                machines[label] = machines.get(label, 0) + n
        lines += ["", "Trained on " + "; ".join(f"{label} ({n} runs)" for label, n in machines.items()) + "."]
    for part, summary in result["ablations"].items():
        best = "; ".join(
            f"lr {lr}: "
            + ", ".join(f"{rr.ABLATION_METRICS[key]} {name.split('/')[-1]}" for key, name in by_key.items())
            for lr, by_key in rr.best_entries(summary).items()
        )
        lines += ["", f"## Ablation: {ABLATIONS[part].xlabel}", ""]
        machines = (result.get("ablation_machines") or {}).get(part) or {}
        if set(machines) - {rr.machine_label(m)}:
            where = (
                next(iter(machines))
                if len(machines) == 1
                else "; ".join(f"{label} ({n} run{'s' * (n > 1)})" for label, n in machines.items())
            )
            lines += [f"Measured on {where}, not the main race's machine.", ""]
        lines += [rr.render_ablation(summary), "", f"Lowest mean over seeds: {best}."]
    if result.get("refresh_frontier"):
        lines += [
            "",
            "## AdaptiveRowMuon against fixed K (the same lr)",
            "",
            "Each threshold's EMA validation loss beside the fixed periods' at the same share of Newton-Schulz steps "
            "(linear between the two neighbouring K; range from their seeds' lowest and highest). Below or above: the "
            "seed ranges are apart; else the loss cannot tell the schedules apart at that share.",
            "",
            rr.render_frontier(result["refresh_frontier"]),
        ]
    if result.get("fd_spread"):
        record = result["fd_spread"]
        lines += [
            "",
            f"## FD that can resolve (fd: final checkpoints, {record['samples']} samples, both feature spaces)",
            "",
            "Each optimizer's chosen runs (its selected lr, training seeds 0 and 1), scored with sampling seeds "
            f"{', '.join(map(str, record['sample_seeds']))} where done. A gap resolves where it is larger than the two "
            "training-seed half ranges summed.",
            "",
            rr.render_fd_spread(record),
        ]
    for lr, costs in result["k_costs"].items():
        cells = "; ".join(
            f"{k}: "
            + ", ".join(
                f"{rr.ABLATION_METRICS[key]} {'-' if v is None else f'{100 * v:+.1f}%'}" for key, v in change.items()
            )
            for k, change in costs.items()
        )
        lines += ["", f"Cost of a longer period at lr {lr} (change of the means over seeds): {cells}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all", help="which part to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("runs/race"), help="output root (default: runs/race)")
    parser.add_argument("--jobs", type=int, default=2, help="training processes at a time (default: 2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per training process (default: 1)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: the plumbing in minutes")
    parser.add_argument(
        "--curves",
        action="store_true",
        help="train again the runs whose published rows carry no per-evaluation curve (kept from records made "
        "before curves were kept) rather than keep them: the time-to-quality tables need every seed's curve",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="the parts' records rebuilt from their run directories, launching nothing (a part "
        "still training elsewhere)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=MAIN,
        default=None,
        help="--part select: train these optimizers' runs first (their record alone; a later run "
        "without --only completes the part and its record); --part fd: score these optimizers alone; --part seeds: "
        "these optimizers alone (their selection finished)",
    )
    parser.add_argument(
        "--report-dir", type=Path, default=None, help="where --part report writes (default: <out>/report)"
    )
    parser.add_argument(
        "--scale-models",
        nargs="+",
        default=None,
        metavar="MODEL",
        help=f"--part scale (and report): these registry DiTs, smallest first (default: {' '.join(SCALE_MODELS)}); "
        "a size left out now keeps its finished runs for a later invocation",
    )
    args = parser.parse_args(argv)
    if args.scale_models:
        from dimuon.dit.model import DIT_MODELS

        unknown = [m for m in args.scale_models if m not in DIT_MODELS]
        if unknown:
            parser.error(f"--scale-models: unknown model {unknown[0]!r}; choose from {' '.join(DIT_MODELS)}")
    # A scheduler's stop, and the terminal closing (the parts run in sessions of their own, out of its reach), are
    # a Ctrl-C: passed on to the running part (run_child).
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run_parts(args)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # the terminal may be gone
            print("race: interrupted; the same command continues where it stopped", flush=True)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_parts(args: argparse.Namespace) -> int:
    """Run the parts ``--part`` names, in order; the first that fails ends the call with its status."""
    for part in PARTS if args.part == "all" else (args.part,):
        steps = {
            "sweep": sweep,
            "select": select,
            "seeds": seeds,
            "step": step_time,
            "inception": inception,
            "fd": fd_spread,
            "long": long,
            "lr_gamma": lr_gamma,
            "scale": scale,
            "report": report,
        }
        code = steps[part](args) if part in steps else ablation(args, part)
        if code != 0:
            print(f"race: part {part} ended with status {code}; run it again to resume", flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
