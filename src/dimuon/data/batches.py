"""A deterministic, resumable, rank-sharded batch order: the indices of every step from ``(seed, step)``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["BatchSchedule"]


@dataclass(frozen=True)
class BatchSchedule:
    """The index batch of every global step, as a pure function of ``(seed, step)``.

    Epoch ``e`` visits the items in the permutation drawn from ``(seed, e)``; step ``s`` takes the
    ``s % steps_per_epoch``-th run of ``global_batch_size`` items of epoch ``s // steps_per_epoch``
    (the incomplete tail of each permutation is dropped). Rank ``r`` of ``world_size`` gets the ``r``-th
    contiguous slice of ``global_batch_size / world_size`` items. A resumed run that asks for the same
    steps sees the same data.
    """

    num_samples: int
    global_batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"data set has {self.num_samples} items, fewer than one global batch of {self.global_batch_size}"
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}")
        if self.global_batch_size % self.world_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not divisible by world_size {self.world_size}"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The item order of ``epoch`` (the same on every rank)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_indices(self, step: int) -> np.ndarray:
        """All ``global_batch_size`` indices of ``step``, across ranks."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        j = step % self.steps_per_epoch
        perm = self.permutation(self.epoch_of(step))
        return perm[j * self.global_batch_size : (j + 1) * self.global_batch_size]

    def indices(self, step: int) -> np.ndarray:
        """This rank's ``local_batch_size`` indices of ``step``."""
        b = self.local_batch_size
        return self.global_indices(step)[self.rank * b : (self.rank + 1) * b]

    def iter_from(self, start_step: int = 0, stop_step: int | None = None) -> Iterator[np.ndarray]:
        """This rank's index batches for steps ``start_step, start_step + 1, ...`` (up to ``stop_step``)."""
        step = start_step
        epoch, perm = -1, np.empty(0, dtype=np.int64)
        b, g = self.local_batch_size, self.global_batch_size
        while stop_step is None or step < stop_step:
            if self.epoch_of(step) != epoch:
                epoch = self.epoch_of(step)
                perm = self.permutation(epoch)
            j = step % self.steps_per_epoch
            yield perm[j * g + self.rank * b : j * g + (self.rank + 1) * b]
            step += 1

    def num_epochs(self, steps: int) -> float:
        """How many passes over the data ``steps`` global steps make."""
        return steps * self.global_batch_size / self.num_samples
