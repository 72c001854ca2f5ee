"""Class-balanced subsets of a split: which items stand for the whole where only some are used.

A split's items are usually in class order (array files sorted by label, folders read class by class), so its
first ``n`` items hold the first few classes only. The validation loss and the real set of a generation metric
take their ``n`` items from :func:`balanced_subset` instead: the classes in turn, as the generated samples' labels
cycle through them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BALANCED_SUBSET", "balanced_subset"]

# How a subset is chosen, recorded beside results measured on one (a subset chosen otherwise is another real set).
BALANCED_SUBSET = "class-balanced"


def balanced_subset(labels: np.ndarray, n: int) -> np.ndarray:
    """Indices `(min(n, N),)`, ascending, of `n` of the `N` items labelled `labels`: the first item of every class,
    then the second of every class, and so on (classes in label order, items in split order within a class), so
    each class gets `n // C` items or one more where it has that many. ``n >= N`` gives every item."""
    labels = np.asarray(labels).reshape(-1)
    total = len(labels)
    if n >= total:
        return np.arange(total)
    by_class = np.argsort(labels, kind="stable")  # items grouped by class, in split order within each
    sorted_labels = labels[by_class]
    starts = np.searchsorted(sorted_labels, sorted_labels, side="left")
    rank = np.empty(total, dtype=np.int64)
    rank[by_class] = np.arange(total) - starts  # each item's place within its class
    turn = np.lexsort((labels, rank))  # by place within the class, then by class
    return np.sort(turn[: max(n, 0)])
