"""Precision/recall (Kynkaanniemi et al. 2019) and density/coverage (Naeem et al. 2020) of a generated set.

Both families compare points to k-nearest-neighbour balls around samples. Precision and recall count a point
as inside a ball when its distance is `<=` the radius (k = 3); density and coverage use a strict `<` (k = 5).
Distances are squared Euclidean in float64 from `|a|^2 + |b|^2 - 2 a.b`, computed in row chunks so that the
full `N x M` matrix never exists at once; comparing squared values keeps ties exact on integer-valued data.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from dimuon.metrics.frechet import ArrayLike, feature_matrix

# Largest float64 distance block held at once (rows x columns x 8 bytes).
DEFAULT_CHUNK_BYTES = 128 * 2**20


def _row_chunks(n_rows: int, n_cols: int, chunk_bytes: int) -> Iterator[slice]:
    """Row slices whose float64 blocks against `n_cols` columns stay within `chunk_bytes`."""
    rows = max(1, chunk_bytes // (8 * max(n_cols, 1)))
    for start in range(0, n_rows, rows):
        yield slice(start, min(start + rows, n_rows))


def _sq_dists(x: torch.Tensor, x_sq: torch.Tensor, y: torch.Tensor, y_sq: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances `(n, m)` between the rows of `x` and `y`, clamped at zero (one allocation)."""
    d2 = torch.addmm(y_sq[None, :], x, y.T, beta=1.0, alpha=-2.0)  # |y|^2 - 2 x.y, (n, m)
    return d2.add_(x_sq[:, None]).clamp_min_(0.0)


def knn_sq_radii(
    x: torch.Tensor, ks: tuple[int, ...], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> dict[int, torch.Tensor]:
    """Squared distance of every row of `x` to its k-th nearest other row, for each k in `ks`."""
    n = x.shape[0]
    sq = (x * x).sum(dim=1)
    out = {k: torch.empty(n, dtype=x.dtype, device=x.device) for k in ks}
    kmax = max(ks)
    for rows in _row_chunks(n, n, chunk_bytes):
        d2 = _sq_dists(x[rows], sq[rows], x, sq)  # (c, n)
        # Mark each row's distance to itself below every other, so the (k+1)-th smallest is the k-th nearest
        # *other* point (exact duplicates of the row still count as neighbours at distance zero).
        own = torch.arange(rows.start, rows.stop, device=x.device)
        d2[own - rows.start, own] = -1.0
        smallest = torch.topk(d2, kmax + 1, dim=1, largest=False, sorted=True).values  # (c, kmax+1)
        for k in ks:
            out[k][rows] = smallest[:, k]
        del d2  # free this block before the next one is computed
    return out


K_PR = 3  # precision/recall: the k-th nearest neighbour radius (Kynkaanniemi et al. 2019)
K_DC = 5  # density/coverage (Naeem et al. 2020)


def _check_k(k: int, n: int, k_arg: str, set_arg: str) -> None:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{k_arg} must be a positive integer, got {k!r}")
    if k >= n:
        raise ValueError(f"{k_arg}={k} needs more than {k} samples in {set_arg} (k-th neighbour of each), got {n}")


def prdc(
    real: ArrayLike,
    fake: ArrayLike,
    k_pr: int = K_PR,
    k_dc: int = K_DC,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, float]:
    """Precision, recall, density and coverage of `fake` against `real` (`(N, D)` and `(M, D)` features)."""
    r_np = feature_matrix(real, "real")
    f_np = feature_matrix(fake, "fake")
    if r_np.shape[1] != f_np.shape[1]:
        raise ValueError(f"real and fake must have the same feature dimension, got {r_np.shape[1]} and {f_np.shape[1]}")
    n, m = r_np.shape[0], f_np.shape[0]
    _check_k(k_pr, n, "k_pr", "real")
    _check_k(k_pr, m, "k_pr", "fake")
    _check_k(k_dc, n, "k_dc", "real")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")

    r, f = torch.from_numpy(r_np), torch.from_numpy(f_np)
    real_radii = knn_sq_radii(r, (k_pr, k_dc), chunk_bytes)
    fake_radii_pr = knn_sq_radii(f, (k_pr,), chunk_bytes)[k_pr]
    r_sq, f_sq = (r * r).sum(dim=1), (f * f).sum(dim=1)

    fake_in_real_manifold = torch.zeros(m, dtype=torch.bool, device=f.device)  # precision: inside some real k_pr-ball
    ball_hits = 0  # density: (real k_dc-ball, fake point inside it) pairs
    real_in_fake_manifold = torch.zeros(n, dtype=torch.bool, device=r.device)  # recall: inside some fake k_pr-ball
    real_covered = torch.zeros(n, dtype=torch.bool, device=r.device)  # coverage: its k_dc-ball holds some fake point
    for rows in _row_chunks(n, m, chunk_bytes):
        d2 = _sq_dists(r[rows], r_sq[rows], f, f_sq)  # (c, m): real rows against all fake points
        rad_pr = real_radii[k_pr][rows, None]  # (c, 1)
        rad_dc = real_radii[k_dc][rows, None]  # (c, 1)
        fake_in_real_manifold |= (d2 <= rad_pr).any(dim=0)
        ball_hits += int(torch.count_nonzero(d2 < rad_dc))  # a full count; sum(dim) would copy to int64
        real_in_fake_manifold[rows] = (d2 <= fake_radii_pr[None, :]).any(dim=1)
        real_covered[rows] = d2.min(dim=1).values < rad_dc[:, 0]
        del d2  # free this block before the next one is computed

    return {
        "precision": fake_in_real_manifold.double().mean().item(),
        "recall": real_in_fake_manifold.double().mean().item(),
        "density": ball_hits / (k_dc * m),
        "coverage": real_covered.double().mean().item(),
    }
