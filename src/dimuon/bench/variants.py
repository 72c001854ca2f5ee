"""One optimizer configuration of a benchmark, as ``bench comm`` and ``bench census`` tabulate them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variant:
    """A table label, the ``dimuon.optim.build`` name and options, the steps after which its schedule repeats
    (``bench comm`` averages over one such period) and the steps ``bench census`` records (1-based)."""

    label: str
    name: str
    options: dict[str, Any]
    period: int = 1
    steps: tuple[int, ...] = (1,)
