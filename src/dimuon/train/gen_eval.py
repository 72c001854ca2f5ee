"""Generation quality during training: FD and PRDC of the (EMA) weights at an interval, split over all ranks.

Every rank gathers the full weights (one all-gather per tensor under FSDP2), loads them into an unsharded
replica of the model and draws its contiguous slice of the evaluation samples; a sample depends only on
its index, so the set is the one a single process draws. Rank 0 gathers the features (a rank with no share
of the samples sends none) and the grid's samples, scores them and writes the entry into
``<run>/eval/results.json``: the series that ``dimuon eval`` with equal flags writes, so a later
``dimuon eval`` skips these steps and ``dimuon eval --compare`` reads them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dimuon.dit import EMA, DiT
from dimuon.metrics.eval_settings import EvalSettings, build_evaluator
from dimuon.metrics.generation import GenerationEvaluator
from dimuon.metrics.series import GRID_SAMPLES, RunEvaluation, feature_cache_dir
from dimuon.train.distributed import DistEnv, all_gather_objects, on_main

__all__ = ["TrainingEvaluator", "full_weights", "grid_share", "rank_slice"]


def rank_slice(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous index range `[lo, hi)` of `n` samples that `rank` draws (sizes differ by at most one)."""
    return n * rank // world, n * (rank + 1) // world


def grid_share(lo: int, hi: int, grid: int = GRID_SAMPLES) -> int:
    """How many of the first `grid` samples (the grid's) fall in the slice `[lo, hi)`: kept there, and
    gathered in rank order they are the grid one process draws, even where rank 0's slice is short or empty."""
    return max(0, min(hi, grid) - lo)


def full_weights(model: nn.Module, ema: EMA | None) -> dict[str, torch.Tensor]:
    """Unsharded EMA weights (or the model's own when `ema` is None), keyed like ``model.state_dict()``.

    Sharded tensors are all-gathered, so every rank must call this, in the same order.
    """
    source = ema.weights() if ema is not None else model.state_dict()
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for name, t in source.items()}


@contextlib.contextmanager
def _rng_untouched(device: torch.device) -> Iterator[None]:
    """Evaluation draws no training randomness: the global RNG state is put back afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


class TrainingEvaluator:
    """Scores the model of a training run in place, with the settings of ``--eval.*``."""

    def __init__(
        self, settings: EvalSettings, run_dir: Path, meta: dict[str, Any], env: DistEnv, progress: bool = True
    ) -> None:
        self.settings = settings
        self.env = env
        self.model_kwargs = dict(meta["model"]["kwargs"])
        self.progress = progress and env.is_main
        self.store: RunEvaluation | None = None
        with _rng_untouched(env.device):
            # Rank 0 first: it trains and caches the feature classifier and the real-set features, and
            # scores the reference; the other ranks then only read the cache.
            on_main(lambda: self._open_store(run_dir, meta), env)
            if self.store is not None:
                evaluator = self.store.evaluator
            else:
                ds = meta["dataset"]
                cache = feature_cache_dir(run_dir, settings)
                evaluator = build_evaluator(
                    settings, ds["name"], dict(ds.get("kwargs") or {}), cache, env.device, progress=False
                )
        assert evaluator is not None
        self.evaluator: GenerationEvaluator = evaluator
        self.evaluator.progress = False  # one bar, the training loop's

    def _open_store(self, run_dir: Path, meta: dict[str, Any]) -> None:
        store = RunEvaluation(run_dir, self.settings, self.env.device, progress=self.progress)
        store.setup(meta)
        store.save()
        self.store = store

    def __call__(self, model: nn.Module, ema: EMA, step: int, active_time_s: float) -> dict[str, Any]:
        """Evaluate the current weights on every rank; returns the recorded entry (on every rank)."""
        env, start = self.env, time.perf_counter()
        with _rng_untouched(env.device), torch.no_grad():
            # Built on the host as the trained model and `dimuon eval`'s are (the same fixed position table
            # to the last bit, so both evaluations of a step agree exactly), then moved.
            with torch.device("cpu"):
                replica = DiT(**self.model_kwargs)
            replica.to(env.device)
            replica.load_state_dict(full_weights(model, ema if self.settings.ema else None))
            replica.eval()
            lo, hi = rank_slice(self.settings.num_samples, env.rank, env.world)
            feats, images, timings = self.evaluator.sample_features(replica, lo, hi, keep=grid_share(lo, hi))
            del replica
            gathered = all_gather_objects((feats.cpu(), images.cpu()), env)  # (0, D) and no images from an empty slice

        def score() -> dict[str, Any]:
            assert self.store is not None
            grid = torch.cat([kept for _, kept in gathered])  # the first GRID_SAMPLES samples, in order
            row = self.evaluator.scores(torch.cat([f for f, _ in gathered]), timings)
            row["eval_s"] = round(time.perf_counter() - start, 3)
            entry = self.store.record_scores(
                step, row, grid, round(active_time_s, 4), world_size=env.world, device=str(env.device)
            )
            self.store.plot()
            return entry

        return on_main(score, env)
