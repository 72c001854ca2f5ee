"""The typed configuration of ``dimuon bench quality`` (``Config``, with ``QualityEval`` for its
``--eval.*`` group) and one point of its grid (``RunSpec``: an optimizer, or a labelled variant of one,
at a learning rate and a seed). They live in a module of their own because all three parts of the benchmark read
them, the entry point that checks flags and builds the grid (``dimuon.bench.quality``), the launcher of the
training runs (``quality_runs``) and the report (``quality_report``), and this way neither of the
latter two imports the entry point: imports point one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import tyro

from dimuon.metrics.registry import SELECTION
from dimuon.optim import OPTIMIZERS
from dimuon.train.config import EvalOptions, TrainConfig

TRAIN_DEFAULTS = TrainConfig()
SelectBy = Literal[SELECTION]  # type: ignore[valid-type]  # the --select-by choices, from the metrics registry


@dataclass
class QualityEval(EvalOptions):
    """Generation-quality evaluation inside every run (forwarded to dimuon train as --eval.*)."""

    interval: Annotated[
        int | None,
        tyro.conf.arg(help="Steps between evaluations; the last step is always evaluated (default: --steps / 4)."),
    ] = None
    cache_dir: Annotated[
        Path | None,
        tyro.conf.arg(
            help="Feature cache shared by all runs, so the classifier trains once (default: <out>/feature_cache)."
        ),
    ] = None


@dataclass
class Config:
    """Generation quality and training cost of the optimizers, side by side on one DiT task."""

    optimizers: tuple[str, ...] = tuple(OPTIMIZERS)
    """Optimizers to train, from: adamw muon periodic_row_muon muon_bp adaptive_row_muon torch_muon. NAME/LABEL
    trains NAME as a variant of its own, with the flags of --train-args-of 'NAME/LABEL=...' (e.g.
    periodic_row_muon/k2 with 'periodic_row_muon/k2=--optim.k 2'), so one optimizer can run at several settings."""
    lrs: tuple[float, ...] = (TRAIN_DEFAULTS.lr,)
    """Peak learning rates tried for every optimizer without an --lr-grid entry."""
    lr_grid: tuple[str, ...] = ()
    """Per-optimizer learning rates instead of --lrs, as NAME=LR,LR,... (e.g. --lr-grid adamw=1e-3,3e-3)."""
    seeds: tuple[int, ...] = (0,)
    """Training seeds: every (optimizer, lr) is trained once per seed."""
    model: str = TRAIN_DEFAULTS.model
    """DiT registry name (as dimuon train --model)."""
    dataset: str = TRAIN_DEFAULTS.dataset
    """Data set (as dimuon train --dataset)."""
    steps: int = TRAIN_DEFAULTS.steps
    """Optimizer steps of every run."""
    batch_size: int = TRAIN_DEFAULTS.batch_size
    """Global batch size of every run."""
    eval: QualityEval = field(default_factory=QualityEval)
    train_args: str = ""
    """Further dimuon train flags for every run, one shell-quoted string (e.g. --train-args '--ema-decay 0.99')."""
    train_args_of: tuple[str, ...] = ()
    """Further dimuon train flags for one optimizer, as NAME=FLAGS (e.g. 'periodic_row_muon=--optim.k 4')."""
    jobs: int = 1
    """Training processes at a time."""
    threads: int | None = None
    """CPU threads per training process (default: torch's with --jobs 1, else cores / jobs)."""
    out: Path = Path("bench-quality")
    """Output directory: runs/, feature_cache/, results.json, results.md, plots."""
    progress: bool = True
    """Show a progress bar over the runs."""
    report_only: bool = False
    """Launch nothing: rebuild results.json/.md and the plots from the run directories as they are (a grid
    still running elsewhere, say); unfinished runs are listed as such."""
    select_by: SelectBy = "val_loss_ema"
    """What chooses each optimizer's best lr: the lowest mean over seeds of the final EMA validation loss
    (default: its seed spread is below the gaps between lrs) or of the final FD."""
    keep_rows_of: Path | None = None
    """An earlier results.json of this grid (a published copy, say): a finished run of it whose directory is
    not here is kept from it rather than trained again, where its dimuon train command is this grid's (the
    interpreter, --out and --eval.cache-dir aside). Delete the row there to train such a run again."""


VARIANT_SEPARATOR = "/"  # --optimizers NAME/LABEL: optimizer NAME under its own label


def base_optimizer(entry: str) -> str:
    """The optimizer an ``--optimizers`` entry trains: ``NAME`` of ``NAME`` or ``NAME/LABEL``."""
    return entry.split(VARIANT_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid: an optimizer (an ``--optimizers`` entry, maybe a labelled variant) at a learning
    rate and a seed."""

    optimizer: str
    lr: float
    seed: int

    @property
    def base(self) -> str:
        """The optimizer ``dimuon train --optimizer`` gets."""
        return base_optimizer(self.optimizer)

    @property
    def name(self) -> str:
        """Directory name of the run, e.g. ``muon-lr0.01-s0`` or ``periodic_row_muon-k2-lr0.01-s0``."""
        return f"{self.optimizer.replace(VARIANT_SEPARATOR, '-')}-lr{self.lr:g}-s{self.seed}"


def run_directory(cfg: Config, spec: RunSpec) -> Path:
    """Where the run of ``spec`` lives: ``<out>/runs/<name>/``."""
    return cfg.out / "runs" / spec.name
