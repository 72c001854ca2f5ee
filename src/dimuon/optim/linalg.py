"""Pure direction maps: Newton-Schulz orthogonalization (standard and Gram), RowNorm, lr scales.

Everything here is stateless tensor math on batches of matrices ``(B, rows, cols)`` or single
matrices ``(rows, cols)``. No optimizer state, no distributed code, no configuration objects:
every part of dimuon that orthogonalizes or row-normalizes calls these functions, so the project
has exactly one Newton-Schulz iteration.

Orientation convention (ALGORITHMS.md section 2): a matrix with more rows than columns is
transposed before the iteration so that the iterated matrix is wide (``rows <= cols``), and
transposed back afterwards. Inputs are never modified in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "COEFFICIENT_SETS",
    "GRAM_MIN_ASPECT",
    "LR_SCALES",
    "NS_ALGORITHMS",
    "coefficient_schedule",
    "default_ns_dtype",
    "lr_scale_factor",
    "newton_schulz",
    "oriented_shape",
    "row_normalize",
]

# Quintic coefficients (a, b, c) of the reference Muon: maximal slope at zero, five steps.
QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco, Gower 2025), five-step table computed with a 1% safety
# factor; steps past the table reuse its last row.
POLAR_EXPRESS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

COEFFICIENT_SETS: tuple[str, ...] = ("quintic", "polar_express")
NS_ALGORITHMS: tuple[str, ...] = ("standard", "gram")
LR_SCALES: tuple[str, ...] = ("match_rms_adamw", "original", "none")

# The Gram iteration only pays off on clearly rectangular matrices: it trades 8 of the 10
# (rows x rows x cols) products of the standard iteration for ~15 (rows x rows x rows) ones,
# which wins once cols >= 2 * rows. Narrower matrices fall back to the standard iteration.
GRAM_MIN_ASPECT: float = 2.0

# Normalization constants: the quintic set divides by max(||X||_F, eps); Polar Express by
# ||X||_F * (1 + 2e-2) + 1e-6 (its table assumes the top singular value is a little below 1).
_EPS = 1e-7
_PE_SAFETY = 1.02
_PE_EPS = 1e-6


def coefficient_schedule(name: str, steps: int) -> list[tuple[float, float, float]]:
    """Per-step ``(a, b, c)`` coefficients for ``steps`` iterations of the named set."""
    if name == "quintic":
        return [QUINTIC] * steps
    if name == "polar_express":
        table = list(POLAR_EXPRESS)
        return [table[min(i, len(table) - 1)] for i in range(steps)]
    raise ValueError(f"ns_coefficients must be one of {COEFFICIENT_SETS}, got {name!r}")


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators (tensor cores), fp32 on CPU (bf16 matmul is far slower there)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def oriented_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the matrix the maps iterate on: ``(min, max)`` of the two sides."""
    return (min(rows, cols), max(rows, cols))


def lr_scale_factor(name: str, rows: int, cols: int) -> float:
    """Shape-dependent step-size factor of ALGORITHMS.md section 4 for a ``(rows, cols)`` matrix."""
    if name == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if name == "original":
        return math.sqrt(max(1.0, rows / cols))
    if name == "none":
        return 1.0
    raise ValueError(f"lr_scale must be one of {LR_SCALES}, got {name!r}")


def _normalize(x: Tensor, coefficients: str) -> Tensor:
    """Scale each matrix of the batch so its spectral norm is at most ~1 (Frobenius bound)."""
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    if coefficients == "polar_express":
        return x / (norm * _PE_SAFETY + _PE_EPS)
    return x / norm.clamp(min=_EPS)


def _standard_iteration(x: Tensor, schedule: Sequence[tuple[float, float, float]]) -> Tensor:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on a wide batch ``(B, r, c)``."""
    for a, b, c in schedule:
        gram = x @ x.mT  # (B, r, r)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + poly X
    return x


def _gram_iteration(
    x: Tensor, schedule: Sequence[tuple[float, float, float]], restart_every: int
) -> Tensor:
    """The same polynomial iteration run on the small ``(r, r)`` Gram matrix.

    Every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0 = X_0 X_0^T``; all these
    polynomials commute, so ``Q_{k+1} = P_k Q_k`` and ``R_{k+1} = R_k P_k^2`` with
    ``P_k = a I + b R_k + c R_k^2``. ``Q`` is applied to the wide matrix only at a restart (which
    also recomputes ``R`` from the true iterate, flushing accumulated rounding) and at the end.
    """
    rows = x.shape[-2]
    eye = torch.eye(rows, dtype=x.dtype, device=x.device).expand(x.shape[0], rows, rows)
    gram = x @ x.mT  # (B, r, r)
    q: Tensor | None = None  # None stands for the identity, saving a product on the first step
    last = len(schedule) - 1
    for i, (a, b, c) in enumerate(schedule):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c) + a * eye  # (B, r, r)
        q = poly if q is None else poly @ q
        if i == last:
            break
        if restart_every > 0 and (i + 1) % restart_every == 0:
            x = q @ x  # (B, r, c)
            q = None
            gram = x @ x.mT
        else:
            gram = poly @ (gram @ poly)  # R P^2, kept symmetric in rounding
    return x if q is None else q @ x


def newton_schulz(
    x: Tensor,
    steps: int = 5,
    coefficients: str = "quintic",
    algorithm: str = "standard",
    dtype: torch.dtype | None = None,
    gram_restart_every: int = 2,
) -> Tensor:
    """Approximate polar factor ``U V^T`` of each matrix in ``x`` (``(r, c)`` or ``(B, r, c)``).

    Tall matrices are transposed to wide and back. ``dtype`` is the compute dtype (default: bf16
    on accelerators, fp32 on CPU); the result comes back in that dtype. ``algorithm="gram"`` uses
    the Gram-matrix form when ``c >= 2r`` and the standard form otherwise (same polynomial).
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a (rows, cols) or (batch, rows, cols) tensor, got {tuple(x.shape)}")
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm must be one of {NS_ALGORITHMS}, got {algorithm!r}")
    if steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {steps}")
    schedule = coefficient_schedule(coefficients, steps)
    squeeze = x.ndim == 2
    if squeeze:
        x = x.unsqueeze(0)
    compute_dtype = dtype if dtype is not None else default_ns_dtype(x.device)
    tall = x.shape[-2] > x.shape[-1]
    # The cast (or .mT view) plus the normalization below always produce a new tensor: the caller's
    # buffer is never written.
    y = x.to(compute_dtype)
    if tall:
        y = y.mT
    y = _normalize(y, coefficients)
    rows, cols = y.shape[-2], y.shape[-1]
    if algorithm == "gram" and cols >= GRAM_MIN_ASPECT * rows:
        y = _gram_iteration(y, schedule, gram_restart_every)
    else:
        y = _standard_iteration(y, schedule)
    if tall:
        y = y.mT
    return y.squeeze(0) if squeeze else y


def row_normalize(x: Tensor, eps: float = _EPS) -> Tensor:
    """RowNorm: each oriented row divided by its L2 norm (``max(norm, eps)``).

    Oriented rows are the rows of ``x`` when it is wide or square and its columns when it is
    tall (ALGORITHMS.md section 2). Works on ``(r, c)`` and ``(B, r, c)``; the result is in fp32
    or the input dtype, whichever is wider.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"row_normalize expects a (rows, cols) or (batch, rows, cols) tensor, got {tuple(x.shape)}")
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    dim = -1 if y.shape[-2] <= y.shape[-1] else -2
    norm = torch.linalg.vector_norm(y, dim=dim, keepdim=True)
    return y / norm.clamp(min=eps)
