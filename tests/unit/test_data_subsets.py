"""Class-balanced subsets: the items that stand for a class-ordered split where only some are used."""

from __future__ import annotations

import numpy as np
import pytest

from dimuon.data import build_dataset
from dimuon.data.subsets import balanced_subset


def test_the_classes_in_turn_in_split_order_within_each():
    labels = np.array([2, 0, 1, 0, 0, 2, 1, 0])
    assert balanced_subset(labels, 3).tolist() == [0, 1, 2]  # the first of each class
    assert balanced_subset(labels, 5).tolist() == [0, 1, 2, 3, 6]  # then the second of class 0, then of 1
    assert balanced_subset(labels, 8).tolist() == list(range(8))
    assert balanced_subset(labels, 100).tolist() == list(range(8))
    assert balanced_subset(labels, 0).tolist() == []


@pytest.mark.parametrize("n", [1, 7, 10, 256, 499])
def test_a_class_ordered_split_gives_every_class_its_share(n):
    labels = np.repeat(np.arange(10), [63, 53, 59, 41, 50, 59, 43, 36, 43, 53])  # sorted by class, as MNIST's are
    counts = np.bincount(labels[balanced_subset(labels, n)], minlength=10)
    assert counts.sum() == n
    short = counts < np.bincount(labels)  # a class with items left over never has fewer than another's share - 1
    assert not short.any() or counts[short].max() - counts[short].min() <= 1
    assert counts.min() >= min(n // 10, 36)


def test_mnist_validation_split_is_class_ordered_and_the_subset_is_not():
    val = build_dataset("mnist", split="val")
    first = np.bincount(val.labels[:256], minlength=10)
    assert (first == 0).sum() >= 4  # why the first items will not do
    assert np.bincount(val.labels[balanced_subset(val.labels, 256)], minlength=10).min() >= 25
