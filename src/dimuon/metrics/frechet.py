"""Frechet distance between two feature sets, each summarised by a Gaussian (mean, covariance).

`FD = ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^{1/2})` with unbiased covariances in float64. The trace of the
matrix square root is taken as the sum of the square roots of the eigenvalues of `S1 S2` (real part): the
product of two PSD matrices has real non-negative eigenvalues, so no explicit `sqrtm` is needed.
"""

from __future__ import annotations

import numpy as np
import torch

# Added to both covariances when the trace term comes out non-finite (ill-conditioned products).
FALLBACK_EPS = 1e-6

ArrayLike = np.ndarray | torch.Tensor


def feature_matrix(x: ArrayLike, arg: str, min_rows: int = 1) -> np.ndarray:
    """Return `x` as a finite float64 `(N, D)` array, or raise a ValueError that names the argument `arg`."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{arg} must be a 2-D (N, D) feature matrix, got shape {tuple(arr.shape)}")
    if arr.shape[0] < min_rows:
        raise ValueError(f"{arg} needs at least {min_rows} samples (rows), got {arr.shape[0]}")
    if arr.shape[1] < 1:
        raise ValueError(f"{arg} has no feature columns (shape {tuple(arr.shape)})")
    if not np.isfinite(arr).all():
        raise ValueError(f"{arg} contains NaN or infinite values")
    return arr


def gaussian_stats(feats: ArrayLike, arg: str = "feats") -> tuple[np.ndarray, np.ndarray]:
    """Mean `(D,)` and unbiased covariance `(D, D)` of a feature set, in float64 (cacheable for a reference set)."""
    x = feature_matrix(feats, arg, min_rows=2)
    mu = x.mean(axis=0)
    sigma = np.atleast_2d(np.cov(x, rowvar=False, ddof=1))
    return mu, sigma


def _trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """`Tr((S1 S2)^{1/2})` as the real part of the summed square roots of the eigenvalues of `S1 S2`."""
    try:
        eig = np.linalg.eigvals(sigma1 @ sigma2)
    except np.linalg.LinAlgError:
        return float("nan")
    # Round-off can give tiny negative or complex eigenvalues; their complex roots add ~0 to the real part.
    return float(np.sqrt(eig.astype(np.complex128)).real.sum())


def frechet_distance_from_stats(
    mu1: ArrayLike, sigma1: ArrayLike, mu2: ArrayLike, sigma2: ArrayLike, eps: float = FALLBACK_EPS
) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2); retries with `eps * I` added if not finite."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = (
        np.atleast_2d(np.asarray(sigma1, np.float64)),
        np.atleast_2d(np.asarray(sigma2, np.float64)),
    )
    d = mu1.shape[0]
    if mu1.ndim != 1 or mu2.shape != mu1.shape:
        raise ValueError(f"mu1 and mu2 must be vectors of the same length, got {mu1.shape} and {mu2.shape}")
    if sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(
            f"sigma1 and sigma2 must be ({d}, {d}) to match the means, got {sigma1.shape} and {sigma2.shape}"
        )
    diff = mu1 - mu2
    tr_sqrt = _trace_sqrt_product(sigma1, sigma2)
    if not np.isfinite(tr_sqrt):
        offset = eps * np.eye(d)
        tr_sqrt = _trace_sqrt_product(sigma1 + offset, sigma2 + offset)
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_sqrt)


def frechet_distance(a: ArrayLike, b: ArrayLike) -> float:
    """Frechet distance between two `(N, D)` feature sets (FID when the features are Inception's)."""
    xa = feature_matrix(a, "a", min_rows=2)
    xb = feature_matrix(b, "b", min_rows=2)
    if xa.shape[1] != xb.shape[1]:
        raise ValueError(f"a and b must have the same feature dimension, got {xa.shape[1]} and {xb.shape[1]}")
    mu1, sigma1 = gaussian_stats(xa, "a")
    mu2, sigma2 = gaussian_stats(xb, "b")
    return frechet_distance_from_stats(mu1, sigma1, mu2, sigma2)
