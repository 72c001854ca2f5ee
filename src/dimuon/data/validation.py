"""Checking a data set once before training: every item decodable and finite, named when it is not.

A corrupt image or a NaN found only when a step draws it stops a run hours in, and again on every
resume (the batch order is fixed). :func:`find_problems` reads every item once instead: image files
are fully decoded, floating arrays checked for NaN and inf (labels are checked when a data set is
built). Several processes split the items (``part``/``parts``) and put their findings together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

__all__ = ["PROGRESS_DELAY_S", "DataError", "describe_item", "find_problems", "problems_message"]

# A check still running after this many seconds shows a progress bar: decoding a folder of images does, an
# in-memory array (MNIST: milliseconds) never does, so no bar reports a rate for work that takes no time.
PROGRESS_DELAY_S = 2.0
_CHUNK = 256
_SHOWN = 10


class DataError(ValueError):
    """A data set with items that cannot be used; the message names them (file, or row of an array file)."""


def describe_item(dataset: Any, i: int) -> str:
    """Where item ``i`` of ``dataset`` comes from (its file, or its row), as precisely as the data set knows."""
    describe = getattr(dataset, "describe", None)
    return describe(i) if describe is not None else f"item {i}"


def _generic_problems(dataset: Any, positions: Sequence[int]) -> list[str]:
    """Items of a data set without its own check that fail to load or hold non-finite values."""
    found = []
    for i in positions:
        try:
            x, _ = dataset[int(i)]
        except Exception as e:  # any failure to produce the item is what this check is for
            found.append(f"{describe_item(dataset, int(i))} cannot be read ({type(e).__name__}: {e})")
            continue
        if not torch.isfinite(torch.as_tensor(x)).all():
            found.append(f"{describe_item(dataset, int(i))} holds NaN or inf values")
    return found


def find_problems(dataset: Any, part: int = 0, parts: int = 1, progress: bool = False, what: str = "data") -> list[str]:
    """One line per unusable item of this process's share (``part`` of ``parts`` contiguous shares).

    A progress bar (``progress``) appears once the check has run for :data:`PROGRESS_DELAY_S` seconds.
    """
    n = len(dataset)
    positions = np.arange(n * part // parts, n * (part + 1) // parts)
    check = getattr(dataset, "find_problems", None) or (lambda pos: _generic_problems(dataset, pos))
    found: list[str] = []
    with tqdm(
        total=len(positions),
        desc=f"checking {what}",
        unit="item",
        dynamic_ncols=True,
        delay=PROGRESS_DELAY_S,
        disable=not progress,
    ) as bar:
        for start in range(0, len(positions), _CHUNK):
            chunk = positions[start : start + _CHUNK]
            found += check(chunk)
            bar.update(len(chunk))
    return found


def problems_message(problems: Sequence[str], what: str) -> str:
    """One message for every problem found: the count, then the first few of them."""
    shown = "; ".join(problems[:_SHOWN])
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    noun = "item" if len(problems) == 1 else "items"
    return f"{len(problems)} {noun} of {what} cannot be used: {shown}{more}"
