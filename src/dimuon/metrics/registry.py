"""Every metric the records and reports name: its key, its label, which way is better and its unit.

One table so that the evaluators, the training loop and the reports agree on what a key such as ``fd`` or
``opt_ms`` means and whether the lowest or the highest value wins, instead of each spelling it out again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

__all__ = [
    "DIRECTIONS",
    "GENERATION",
    "METRICS",
    "SELECTION",
    "Direction",
    "Kind",
    "Metric",
]

Direction = Literal["lower", "higher"]
Kind = Literal["generation", "loss", "cost"]
DIRECTIONS: tuple[str, ...] = get_args(Direction)
T = TypeVar("T")


@dataclass(frozen=True)
class Metric:
    """One metric: its record key, its label in tables, which way is better, its unit ("" when unitless), what it
    measures and its kind (a generation score, a loss or a cost)."""

    name: str
    label: str
    direction: Direction
    unit: str
    doc: str
    kind: Kind

    @property
    def heading(self) -> str:
        """The label with its unit, as a table column: ``active time (s)``, ``FD``."""
        return f"{self.label} ({self.unit})" if self.unit else self.label

    @property
    def superlative(self) -> str:
        """The word for the best value: ``lowest`` or ``highest``."""
        return "lowest" if self.direction == "lower" else "highest"

    @property
    def axis_note(self) -> str:
        """Which way is better, as a plot axis says it: ``lower is better``."""
        return f"{self.direction} is better"

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return a < b if self.direction == "lower" else a > b

    def reaches(self, value: float, target: float) -> bool:
        """Whether ``value`` is as good as ``target`` or better (FD <= target)."""
        return value <= target if self.direction == "lower" else value >= target

    def pick(self, items: Iterable[T], key: Callable[[T], float]) -> T:
        """The first item of ``items`` whose ``key`` is the best."""
        return min(items, key=key) if self.direction == "lower" else max(items, key=key)

    def best(self, values: Iterable[float]) -> float:
        """The best of ``values`` (the lowest or the highest, by direction)."""
        return min(values) if self.direction == "lower" else max(values)

    def worst(self, values: Iterable[float]) -> float:
        """The worst of ``values`` (the highest or the lowest, by direction)."""
        return max(values) if self.direction == "lower" else min(values)


def _table(*metrics: Metric) -> dict[str, Metric]:
    """Metrics keyed by name, in the order given (the order reports list them in)."""
    return {m.name: m for m in metrics}


METRICS: dict[str, Metric] = _table(
    Metric("fd", "FD", "lower", "", "Fréchet distance of generated to real image features", "generation"),
    Metric("precision", "precision", "higher", "", "share of generated samples inside the real manifold", "generation"),
    Metric("recall", "recall", "higher", "", "share of real samples inside the generated manifold", "generation"),
    Metric(
        "density", "density", "higher", "", "real neighbourhoods a generated sample falls in, on average", "generation"
    ),
    Metric("coverage", "coverage", "higher", "", "share of real samples with a generated one nearby", "generation"),
    Metric("val_loss", "validation loss", "lower", "", "flow-matching loss on the validation set", "loss"),
    Metric("val_loss_ema", "EMA validation loss", "lower", "", "validation loss of the EMA weights", "loss"),
    Metric("opt_ms", "optimizer time", "lower", "ms", "optimizer milliseconds per step (median over records)", "cost"),
    Metric("step_ms", "step time", "lower", "ms", "training step milliseconds (median over records)", "cost"),
    Metric("active_time_s", "active time", "lower", "s", "seconds spent in training steps, over resumptions", "cost"),
    Metric(
        "target_active_time_s", "time to target", "lower", "s", "active time at which FD first reached a target", "cost"
    ),
    Metric(
        "spectral_fraction",
        "spectral steps",
        "lower",
        "",
        "share of the Muon matrices' steps that were spectral (Newton-Schulz)",
        "cost",
    ),
    Metric("eval_s", "eval", "lower", "s", "seconds one generation-quality evaluation took", "cost"),
)
"""Every metric by record key."""

GENERATION: tuple[str, ...] = tuple(name for name, m in METRICS.items() if m.kind == "generation")
"""The scores of one generation-quality evaluation, in the order tables list them."""

SELECTION: tuple[str, ...] = ("val_loss_ema", "fd")
"""The metrics that may choose between trained models (a learning rate, say): one score of a whole model."""
