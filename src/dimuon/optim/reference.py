"""Readable per-tensor reference of the Muon-family update, kept as a test oracle and benchmark baseline.

Deliberately plain: one matrix at a time, no batching, no engine, explicit orientation, its own
Newton-Schulz loop written out (so it checks :mod:`dimuon.optim.linalg` rather than reusing it).
Follows the update of ``torch.optim.Muon`` in the compute dtype you give it (fp32 by default)
and extends it with the RowNorm and block steps of docs/algorithms.md ("Direction maps", "Step size", "Schedules")
and the per-matrix decisions of the adaptive schedule ("Adaptive refresh"), with its own staleness signal. Fused
matrices split by rows (``split_sizes``) and by columns (``col_split_sizes``) and stacked matrices
(``stacked=True``) are cut apart here with plain slicing, one logical matrix at a time ("Fused, per-head and
stacked matrices").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dimuon.optim.schedules import StepKind

_QUINTIC = (3.4445, -4.7750, 2.0315)


def reference_orthogonalize(u: Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> Tensor:
    """Quintic Newton-Schulz on one matrix, as ``torch.optim.Muon`` does it, in ``dtype``."""
    a, b, c = _QUINTIC
    x = u.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.T if tall else x


def reference_rownorm(u: Tensor) -> Tensor:
    """Each oriented row (rows if wide, columns if tall) divided by its norm."""
    x = u.float()
    dim = 1 if x.shape[0] <= x.shape[1] else 0
    return x / x.norm(dim=dim, keepdim=True).clamp(min=1e-7)


def reference_scale(name: str, rows: int, cols: int) -> float:
    return {
        "original": math.sqrt(max(1.0, rows / cols)),
        "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
        "none": 1.0,
    }[name]


def reference_direction(
    u: Tensor, kind: StepKind, lr_scale: str, blocks: int | tuple[int, int] = 1, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Scaled direction of one ``(rows, cols)`` momentum matrix at one step kind (``blocks``: row blocks, or a
    pair of row and column blocks, cut as ``torch.chunk`` cuts)."""
    rows, cols = u.shape
    if kind is StepKind.ROWNORM:
        return reference_rownorm(u) * reference_scale(lr_scale, rows, cols)
    if kind is StepKind.BLOCK:
        row_blocks, col_blocks = (blocks, 1) if isinstance(blocks, int) else (*blocks, 1)[:2]
        return torch.cat(
            [
                torch.cat(
                    [
                        reference_orthogonalize(block, dtype=dtype).float() * reference_scale(lr_scale, *block.shape)
                        for block in torch.chunk(band, col_blocks, dim=1)
                    ],
                    dim=1,
                )
                for band in torch.chunk(u, row_blocks, dim=0)
            ],
            dim=0,
        )
    return reference_orthogonalize(u, dtype=dtype).float() * reference_scale(lr_scale, rows, cols)


def _chunks(size: int, sizes: int | tuple[int, ...] | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk: a chunk count (equal chunks) or chunk sizes; None is one chunk."""
    if sizes is None:
        sizes = 1
    if isinstance(sizes, int):
        sizes = [size // sizes] * sizes
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    assert start == size, (size, sizes)
    return bounds


def _torch_chunks(size: int, n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each piece ``torch.chunk`` cuts ``size`` indices into."""
    return [(int(c[0]), int(c[-1]) + 1) for c in torch.chunk(torch.arange(size), n)]


def reference_split_direction(
    u: Tensor,
    kind: StepKind,
    lr_scale: str,
    blocks: int | tuple[int, int] = 1,
    split_sizes: int | tuple[int, ...] | None = None,
    col_split_sizes: int | tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Scaled direction of one ``(rows, cols)`` momentum matrix made of logical matrices: every row chunk
    (``split_sizes``) times every column chunk (``col_split_sizes``) gets its own direction and scale. On block
    steps the ``blocks`` grid is cut from the whole matrix (``torch.chunk`` on each side) and each grid cell
    that overlaps a logical matrix is orthogonalized on that overlap."""
    rows, cols = u.shape
    out = torch.empty(rows, cols, dtype=torch.float32, device=u.device)
    row_blocks, col_blocks = (blocks, 1) if isinstance(blocks, int) else (*blocks, 1)[:2]
    for a, b in _chunks(rows, split_sizes):
        for c, d in _chunks(cols, col_split_sizes):
            if kind is not StepKind.BLOCK:
                out[a:b, c:d] = reference_direction(u[a:b, c:d], kind, lr_scale, dtype=dtype)
                continue
            for r0, r1 in _torch_chunks(rows, row_blocks):
                for c0, c1 in _torch_chunks(cols, col_blocks):
                    lo, hi, left, right = max(a, r0), min(b, r1), max(c, c0), min(d, c1)
                    if lo < hi and left < right:
                        block = u[lo:hi, left:right]
                        out[lo:hi, left:right] = reference_orthogonalize(block, dtype=dtype).float() * reference_scale(
                            lr_scale, *block.shape
                        )
    return out


def _cosine(a: Tensor, b: Tensor) -> float:
    return float((a.double() * b.double()).sum() / (a.double().norm() * b.double().norm()))


class ReferenceMuon:
    """Per-tensor fp32 Muon-family loop over a list of matrices (no AdamW, no groups)."""

    def __init__(
        self,
        params: list[Tensor],
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        lr_scale: str = "original",
        schedule: str = "muon",
        k: int = 3,
        gamma: float = 0.15,
        period: int = 5,
        blocks: int | tuple[int, int] = 1,
        block_lr_ratio: float = 1.0,
        threshold: float = 0.5,
        k_min: int = 2,
        k_max: int = 6,
        signal_lag: int = 0,
        dtype: torch.dtype = torch.float32,
        split_sizes: int | tuple[int, ...] | None = None,
        col_split_sizes: int | tuple[int, ...] | None = None,
        stacked: bool = False,
    ) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.nesterov, self.wd = lr, momentum, nesterov, weight_decay
        self.lr_scale, self.schedule, self.dtype = lr_scale, schedule, dtype
        self.k, self.gamma, self.period, self.blocks, self.block_lr_ratio = k, gamma, period, blocks, block_lr_ratio
        self.threshold, self.k_min, self.k_max, self.signal_lag = threshold, k_min, k_max, signal_lag
        self.stale_before: list[bool | None] = [None] * len(self.params)  # signal_lag=1: the previous step's verdict
        self.split_sizes, self.col_split_sizes, self.stacked = split_sizes, col_split_sizes, stacked
        self.bufs = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
        self.t = 0
        # Adaptive schedule: per matrix, the direction of its last spectral step (bf16), cos(U_s, O_s) of each of its
        # logical matrices then, and s.
        self.refs: list[Tensor | None] = [None] * len(self.params)
        self.ref_cos: list[list[float]] = [[] for _ in self.params]
        self.last_spectral: list[int | None] = [None] * len(self.params)
        self.decisions: list[list[StepKind]] = []  # per step, each matrix's kind (adaptive schedule)

    def kind(self) -> StepKind:
        if self.schedule == "periodic_row_muon" and self.t % self.k:
            return StepKind.ROWNORM
        if self.schedule == "muon_bp" and self.t % self.period:
            return StepKind.BLOCK
        return StepKind.SPECTRAL

    def matrices(self, u: Tensor) -> list[Tensor]:
        """The ``(rows, cols)`` matrices a parameter-shaped tensor holds: one, or each stacked one."""
        if self.stacked:
            return [x.reshape(x.shape[0], -1) for x in u.unbind(0)]
        return [u.reshape(u.shape[0], -1)]

    def logical(self, u: Tensor) -> list[Tensor]:
        """Every logical matrix of a parameter-shaped tensor: per matrix, each row chunk x column chunk."""
        return [
            x[a:b, c:d]
            for x in self.matrices(u)
            for a, b in _chunks(x.shape[0], self.split_sizes)
            for c, d in _chunks(x.shape[1], self.col_split_sizes)
        ]

    def stale(self, i: int, u: Tensor) -> bool:
        """Whether any logical matrix of ``u`` has lost more than ``threshold`` of its alignment with matrix ``i``'s
        last spectral direction: ``1 - cos(U, O_s) / cos(U_s, O_s) > threshold``."""
        for x, o, then in zip(self.logical(u), self.logical(self.refs[i].float()), self.ref_cos[i]):
            if then <= 0 or x.norm() == 0 or 1 - _cosine(x, o) / then > self.threshold:
                return True
        return False

    def adaptive_kind(self, i: int, u: Tensor) -> StepKind:
        """Matrix ``i``'s kind: spectral if never refreshed or ``k_max`` steps on, RowNorm before ``k_min`` steps,
        else spectral when it is stale: now, or with ``signal_lag=1`` at the previous step (RowNorm where the
        previous step was its refresh)."""
        last = self.last_spectral[i]
        if last is None or self.t - last >= self.k_max:
            return StepKind.SPECTRAL
        if self.t - last < self.k_min:
            return StepKind.ROWNORM
        stale = self.stale_before[i] if self.signal_lag else self.stale(i, u)
        return StepKind.SPECTRAL if stale else StepKind.ROWNORM

    def direction(self, u: Tensor, kind: StepKind) -> Tensor:
        """The scaled direction of one parameter-shaped momentum, matrix by matrix."""
        return torch.stack(
            [
                reference_split_direction(
                    x, kind, self.lr_scale, self.blocks, self.split_sizes, self.col_split_sizes, self.dtype
                )
                for x in self.matrices(u)
            ]
        ).view(u.shape)

    @torch.no_grad()
    def step(self) -> None:
        kinds = []
        for i, (p, buf) in enumerate(zip(self.params, self.bufs)):
            if p.grad is None:
                continue
            g = p.grad.float()
            buf.lerp_(g, 1 - self.momentum)
            u = g.lerp(buf, self.momentum) if self.nesterov else buf
            kind = self.adaptive_kind(i, u) if self.schedule == "adaptive_row_muon" else self.kind()
            kinds.append(kind)
            if self.schedule == "adaptive_row_muon" and self.signal_lag:  # the verdict the next step decides by
                self.stale_before[i] = self.stale(i, u) if kind is StepKind.ROWNORM else None
            mult = {StepKind.SPECTRAL: 1.0, StepKind.ROWNORM: self.gamma, StepKind.BLOCK: self.block_lr_ratio}[kind]
            d = self.direction(u, kind)
            if self.schedule == "adaptive_row_muon" and kind is StepKind.SPECTRAL:
                ref = d.view(u.shape).to(torch.bfloat16)
                self.refs[i], self.last_spectral[i] = ref, self.t
                self.ref_cos[i] = [
                    _cosine(x, o) if x.norm() > 0 else 0.0 for x, o in zip(self.logical(u), self.logical(ref.float()))
                ]
            p.mul_(1 - self.lr * self.wd)
            p.add_(d.view(p.shape).to(p.dtype), alpha=-self.lr * mult)
        self.decisions.append(kinds)
        self.t += 1
