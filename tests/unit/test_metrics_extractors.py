"""How images reach a feature extractor: frozen extractors, streamed real and reference sets, empty rank slices."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.eval_runs import tiny_dit
from torch import nn

from dimuon.data import build_dataset, get_batch
from dimuon.metrics import build_extractor, extract_features
from dimuon.metrics import generation as generation_mod
from dimuon.metrics.eval_settings import EvalSettings
from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.generation import GenerationEvaluator, SampleSettings, load_images
from dimuon.metrics.series import GRID_SAMPLES
from dimuon.train import gen_eval
from dimuon.train.distributed import DistEnv
from dimuon.train.gen_eval import grid_share, rank_slice

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 64


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("extractor-cache")


@pytest.fixture(scope="module")
def streamed(cache_dir: Path) -> tuple[GenerationEvaluator, list[dict[str, Any]]]:
    """The digits evaluator (classifier trained and cached here), and what reached extract_features meanwhile."""
    calls: list[dict[str, Any]] = []
    real_extract = generation_mod.extract_features

    def spy(extractor: FeatureExtractor, images: Any, **kwargs: Any) -> torch.Tensor:
        call: dict[str, Any] = {"tensor": isinstance(images, torch.Tensor), "batches": []}
        calls.append(call)

        def seen(batches: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
            for x in batches:
                call["batches"].append(x.shape[0])
                yield x

        return real_extract(extractor, images if call["tensor"] else seen(images), **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation_mod, "extract_features", spy)
        ev = GenerationEvaluator.for_dataset(
            "digits", {}, SampleSettings(num_samples=300), cache_dir, batch_size=BATCH, progress=False
        )
        ev.reference(300)
    return ev, calls


def fresh_classifier(cache_dir: Path) -> FeatureExtractor:
    """A newly built classifier extractor (from the weights the `streamed` fixture trained and cached)."""
    x, y = load_images(build_dataset("digits", split="train"))
    xt, yt = load_images(build_dataset("digits", split="val"))
    return build_extractor(
        "classifier", images=x, labels=y, test_images=xt, test_labels=yt, cache_dir=cache_dir, dataset_name="digits8"
    )


def assert_frozen(ex: nn.Module) -> None:
    assert not any(m.training for m in ex.modules()), [type(m).__name__ for m in ex.modules() if m.training]


def assert_batch_independent(ex: FeatureExtractor, x: torch.Tensor) -> None:
    alone = torch.cat([ex(x[i : i + 1]) for i in range(4)])
    in_batch = ex(x)[:4]
    torch.testing.assert_close(alone, in_batch, rtol=0, atol=1e-5)  # train-mode BatchNorm differs by ~1


# --------------------------------------------------------------------------------------------------
# Frozen extractors (#4)
# --------------------------------------------------------------------------------------------------


def test_classifier_extractor_stays_frozen_through_extract_features_and_train(streamed, cache_dir) -> None:
    ex = fresh_classifier(cache_dir)
    xt = load_images(build_dataset("digits", split="val"))[0]
    assert_frozen(ex)
    assert_batch_independent(ex, xt[:BATCH])
    before = extract_features(ex, xt, batch_size=BATCH, progress=False)
    assert_frozen(ex)
    assert_batch_independent(ex, xt[:BATCH])
    assert ex.train() is ex and ex.train(True) is ex
    assert_frozen(ex)
    stats = {k: v.clone() for k, v in ex.state_dict().items()}
    assert_batch_independent(ex, xt[:BATCH])  # direct calls leave the running statistics alone
    assert all(torch.equal(v, ex.state_dict()[k]) for k, v in stats.items())
    assert torch.equal(extract_features(ex, xt, batch_size=BATCH, progress=False), before)


def test_a_network_assigned_in_training_mode_is_frozen_with_its_extractor() -> None:
    class Custom(FeatureExtractor):
        def __init__(self) -> None:
            super().__init__("custom", 8)
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)).train()

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.net(images.flatten(1))

    ex = Custom()
    assert_frozen(ex)
    x = torch.rand(16, 1, 8, 8) * 2 - 1
    ex.train()
    assert_frozen(ex)
    assert_batch_independent(ex, x)
    torch.testing.assert_close(extract_features(ex, x, batch_size=3, progress=False), ex(x), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Real set and reference streamed batch by batch (#6)
# --------------------------------------------------------------------------------------------------


def test_real_set_and_reference_reach_the_extractor_in_batches(streamed) -> None:
    _, calls = streamed
    assert len(calls) == 2  # the real set, then the reference row
    for call, n in zip(calls, (180, 300)):
        assert not call["tensor"]
        assert call["batches"] and max(call["batches"]) <= BATCH and sum(call["batches"]) == n


def test_streamed_real_features_and_reference_equal_the_whole_tensor_way(streamed) -> None:
    ev, _ = streamed
    val = build_dataset("digits", split="val")
    whole = extract_features(ev.extractor, load_images(val)[0], batch_size=BATCH, progress=False)
    assert torch.equal(ev.real_feats, whole)

    train = build_dataset("digits", split="train")
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randperm(len(train), generator=gen, device="cpu")[:300].sort().values
    images, _ = get_batch(train, idx.numpy())
    assert ev.reference(300) == ev.score(images.float())  # bit-identical scores


# --------------------------------------------------------------------------------------------------
# More ranks than samples (#7)
# --------------------------------------------------------------------------------------------------


def test_an_empty_sample_range_gives_no_features_of_the_right_width(streamed) -> None:
    ev, _ = streamed
    model = tiny_dit(0)
    for lo in (0, 7, 300):
        feats, images, timings = ev.sample_features(model, lo, lo, keep=GRID_SAMPLES)
        assert feats.shape == (0, ev.extractor.feature_dim) and feats.dtype == torch.float32
        assert images.shape == (0, 1, 8, 8) and timings == {"sample_s": 0.0, "features_s": 0.0}
    with pytest.raises(ValueError, match=r"sample range \[5, 4\)"):
        ev.sample_features(model, 5, 4)


@pytest.mark.parametrize(("n", "world"), [(6, 8), (250, 3), (13, 1)])
def test_grid_shares_tile_the_first_grid_samples(n: int, world: int) -> None:
    shares = [grid_share(*rank_slice(n, r, world)) for r in range(world)]
    assert sum(shares) == min(n, GRID_SAMPLES) and all(s >= 0 for s in shares)


def test_in_training_evaluation_with_more_ranks_than_samples(streamed, monkeypatch) -> None:
    base, _ = streamed
    settings = EvalSettings(num_samples=6, sample_steps=1, cfg=1.0, ema=False)
    ev = GenerationEvaluator(
        base.extractor, base.real_feats, settings.settings(), (1, 8, 8), 10, batch_size=4, progress=False
    )
    model, world = tiny_dit(0), 8
    sent: dict[int, Any] = {}
    recorded: dict[str, Any] = {}

    class Store:
        def record_scores(self, step: int, row: dict, images: torch.Tensor, active_time_s: float, **extra: Any):
            recorded.update(row=row, images=images, extra=extra)
            return {"step": step, **row}

        def plot(self) -> list:
            return []

    def gather(obj: Any, env: DistEnv) -> list[Any]:  # ranks run one after the other, rank 0 last
        sent[env.rank] = obj
        return [sent.get(r) for r in range(env.world)]

    monkeypatch.setattr(gen_eval, "all_gather_objects", gather)
    monkeypatch.setattr(gen_eval, "on_main", lambda fn, env: fn() if env.is_main else None)
    for rank in reversed(range(world)):
        te = object.__new__(gen_eval.TrainingEvaluator)
        te.settings, te.env, te.progress = settings, DistEnv(rank, world, torch.device("cpu")), False
        te.model_kwargs, te.evaluator, te.store = dict(model.config), ev, Store() if rank == 0 else None
        te(model, None, step=5, active_time_s=1.0)
    assert [sent[r][0].shape[0] for r in range(world)] == [0, 1, 1, 1, 0, 1, 1, 1]

    feats, images, _ = ev.sample_features(model, keep=GRID_SAMPLES)  # one process
    torch.testing.assert_close(recorded["images"], images, rtol=1e-5, atol=1e-6)
    expected = ev.scores(feats, {"sample_s": 0.0, "features_s": 0.0})
    assert recorded["row"]["fd"] == pytest.approx(expected["fd"], rel=1e-4)
    assert recorded["row"]["n_fake"] == 6 and recorded["extra"]["world_size"] == world
    assert np.isfinite(recorded["row"]["fd"])
