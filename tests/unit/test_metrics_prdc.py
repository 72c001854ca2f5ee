"""PRDC on constructed sets with known answers, the identical-distribution closed forms, and chunking."""

from __future__ import annotations

import importlib
from math import comb

import numpy as np
import pytest
import scipy.spatial.distance
import torch

from dimuon.metrics import prdc
from dimuon.metrics.prdc import knn_sq_radii

# `dimuon.metrics.prdc` the attribute is the function; the module is reached through the import system.
prdc_mod = importlib.import_module("dimuon.metrics.prdc")


def line(*xs: float) -> np.ndarray:
    """Points on the x axis of a 2-D feature space."""
    return np.array([[x, 0.0] for x in xs])


def brute_force(real: np.ndarray, fake: np.ndarray, k_pr: int, k_dc: int) -> dict[str, float]:
    """Full-matrix reference written straight from the definitions."""
    drr = scipy.spatial.distance.cdist(real, real)
    dff = scipy.spatial.distance.cdist(fake, fake)
    drf = scipy.spatial.distance.cdist(real, fake)  # (N, M)
    # Column 0 of each sorted row is the point itself, so column k is its k-th nearest other point.
    r_pr, r_dc = np.sort(drr, axis=1)[:, k_pr], np.sort(drr, axis=1)[:, k_dc]
    f_pr = np.sort(dff, axis=1)[:, k_pr]
    return {
        "precision": float((drf <= r_pr[:, None]).any(axis=0).mean()),
        "recall": float((drf <= f_pr[None, :]).any(axis=1).mean()),
        "density": float((drf < r_dc[:, None]).sum() / (k_dc * fake.shape[0])),
        "coverage": float((drf.min(axis=1) < r_dc).mean()),
    }


def test_ties_count_for_precision_recall_but_not_density_coverage() -> None:
    # Real points 0..9 on a line: every 1-NN radius is 1. Fake 10 sits exactly on the ball of 9.
    real = line(*range(10))
    fake = line(10, 11, 30)  # fake 1-NN radii: 1, 1, 19
    out = prdc(real, fake, k_pr=1, k_dc=1)
    assert out["precision"] == pytest.approx(1 / 3)  # only 10: |10 - 9| = 1 <= 1
    assert out["recall"] == pytest.approx(1 / 10)  # only real 9: |9 - 10| = 1 <= 1 (11 and 30 reach no real)
    assert out["density"] == 0.0  # |10 - 9| = 1 is not < 1
    assert out["coverage"] == 0.0  # nearest fake of 9 is at 1, not < 1


def test_density_and_coverage_on_a_hand_counted_set() -> None:
    # Real 0..9 with k = 2: interior radii 1, end points (0 and 9) radius 2.
    real = line(*range(10))
    fake = line(4.5, 4.5, 9.5)
    out = prdc(real, fake, k_pr=2, k_dc=2)
    # 4.5 lies strictly inside the balls of 4 and 5 (distance 0.5 < 1): 2 each; 9.5 inside the balls of 9
    # (0.5 < 2) only (8 is 1.5 > 1 away): density = (2 + 2 + 1) / (k * M) = 5 / 6.
    assert out["density"] == pytest.approx(5 / 6)
    assert out["coverage"] == pytest.approx(3 / 10)  # reals 4, 5, 9
    assert out["precision"] == 1.0
    # Fake 2-NN radii: 4.5 -> 5 (its twin at 0, then 9.5 at 5), 9.5 -> 5: balls [-0.5, 9.5] hold every real.
    assert out["recall"] == 1.0


def test_identical_sets_and_disjoint_sets() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 5))
    same = prdc(x, x)
    assert same["precision"] == same["recall"] == same["coverage"] == 1.0
    far = prdc(x, x + 1e3)
    assert far == {"precision": 0.0, "recall": 0.0, "density": 0.0, "coverage": 0.0}


def test_identical_distributions_match_naeem_expectations() -> None:
    # For i.i.d. real and fake from one continuous law, exchangeability gives E[density] = 1 and
    # E[coverage] = 1 - C(N-1, k) / C(N+M-1, k) (a real point is uncovered iff its k nearest of the other
    # N-1+M points are all real), in any dimension. Spread over 100 seeds at N = M = 1000 was 0.045
    # (density) and 0.0073 (coverage); at N = M = 2000 about 0.032 and 0.0052. Tolerance: 5 of those.
    n = m = 2000
    k = 5
    rng = np.random.default_rng(1)
    out = prdc(rng.standard_normal((n, 16)), rng.standard_normal((m, 16)), k_pr=3, k_dc=k)
    assert out["density"] == pytest.approx(1.0, abs=5 * 0.032)
    assert out["coverage"] == pytest.approx(1 - comb(n - 1, k) / comb(n + m - 1, k), abs=5 * 0.0052)
    # Precision and recall have no closed form here, but are symmetric in law: same spread (0.016).
    assert out["precision"] == pytest.approx(out["recall"], abs=5 * 0.016 * np.sqrt(2))


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_brute_force_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    real = rng.standard_normal((120, 7))
    fake = rng.standard_normal((90, 7)) * 1.3 + 0.2
    fake[:10] = real[:10]  # exact duplicates across the sets
    real[20:25] = real[30:35]  # and within the real set
    got = prdc(real, fake, k_pr=3, k_dc=5)
    ref = brute_force(real, fake, 3, 5)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_chunking_changes_nothing_and_bounds_the_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    real, fake = rng.standard_normal((200, 4)), rng.standard_normal((150, 4))
    full = prdc(real, fake)
    budget = 8 * 200 * 7  # seven rows of the widest (200-column) block
    largest = []
    inner = prdc_mod._sq_dists

    def spy(*args: torch.Tensor) -> torch.Tensor:
        out = inner(*args)
        largest.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(prdc_mod, "_sq_dists", spy)
    assert prdc(real, fake, chunk_bytes=budget) == full
    assert max(largest) <= budget
    assert prdc(real, fake, chunk_bytes=1) == full  # one row at a time


def test_knn_radii_are_kth_nearest_other_point() -> None:
    x = torch.tensor([[0.0], [1.0], [3.0], [3.0], [7.0]], dtype=torch.float64)
    radii = knn_sq_radii(x, (1, 2))
    # 1-NN distances: 1, 1, 0 (twin), 0 (twin), 4; 2-NN: 3, 2, 2, 2, 4.
    torch.testing.assert_close(radii[1], torch.tensor([1.0, 1.0, 0.0, 0.0, 16.0], dtype=torch.float64))
    torch.testing.assert_close(radii[2], torch.tensor([9.0, 4.0, 4.0, 4.0, 16.0], dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"real": np.zeros((5, 2)), "fake": np.zeros((9, 2)), "k_pr": 5},
            "k_pr=5 needs more than 5 samples in real",
        ),
        ({"real": np.zeros((9, 2)), "fake": np.zeros((3, 2))}, "k_pr=3 needs more than 3 samples in fake"),
        (
            {"real": np.zeros((5, 2)), "fake": np.zeros((9, 2)), "k_pr": 2},
            "k_dc=5 needs more than 5 samples in real",
        ),
        ({"real": np.zeros((9, 2)), "fake": np.zeros((9, 3))}, "same feature dimension"),
        ({"real": np.zeros((9, 2)), "fake": np.zeros((9, 2)), "k_dc": 0}, "k_dc must be a positive integer"),
        ({"real": np.zeros(9), "fake": np.zeros((9, 2))}, "real must be a 2-D"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prdc(**kwargs)
