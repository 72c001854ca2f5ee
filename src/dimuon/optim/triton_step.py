"""Triton kernels for the memory-bound part of a Muon-family step, each over a list of tensors in one launch.

Imported only where Triton is (:mod:`dimuon.optim.fused` decides). Every kernel takes its tensors as a table of
addresses (``int64``, one per tensor) and runs a ``(blocks, tensors)`` grid (the blocks on the axis with room for
2^31 of them): program ``(b, t)`` handles elements ``[b BLOCK, (b + 1) BLOCK)`` of tensor ``t`` and returns at once
past its end, as torch's ``_foreach`` kernels run
one launch for many tensors. All math is in fp32; each tensor is loaded once and stored once.

``MOMENTUM`` and ``UPDATE`` compile for CUDA; ``MOMENTUM_INTERPRETED`` and ``UPDATE_INTERPRETED`` are the same
code run by Triton's interpreter on CPU tensors (slow: for checking the kernels where no GPU is).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Per tensor of an update launch: how its factor indexes it (``RowScaled``: (rows, 1) or (1, cols)).
FACTOR_NONE, FACTOR_PER_ROW, FACTOR_PER_COL = 0, 1, 2


def _momentum(
    g_ptrs,
    m_ptrs,
    u_ptrs,
    sizes,
    mask,
    w_momentum,
    w_nesterov,
    BLOCK: tl.constexpr,
    G_TYPE: tl.constexpr,
    M_TYPE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NESTEROV: tl.constexpr,
    MOMENTUM_LOW: tl.constexpr,
    NESTEROV_LOW: tl.constexpr,
):
    """M <- lerp(M, G, w_momentum); with NESTEROV U <- lerp(G, M, w_nesterov) (torch's lerp: ``start + w (end -
    start)`` for w < 0.5, ``end - (1 - w)(end - start)`` above, the ``*_LOW`` flags saying which). With HAS_MASK,
    G is taken as ``where(mask, G, M)``: a failed vote leaves M as it was and U = M."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    n = tl.load(sizes + t)
    if b * BLOCK >= n:
        return
    offs = b * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_TYPE))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(M_TYPE))
    m = tl.load(m_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(M_TYPE).to(tl.float32)
    if HAS_MASK:
        ok = tl.load(mask) != 0
        g = tl.where(ok, g, m)
    m = m + w_momentum * (g - m) if MOMENTUM_LOW else g - (1.0 - w_momentum) * (g - m)
    m = m.to(M_TYPE)
    tl.store(m_ptr + offs, m, mask=inside)
    if NESTEROV:
        m32 = m.to(tl.float32)
        u = g + w_nesterov * (m32 - g) if NESTEROV_LOW else m32 - (1.0 - w_nesterov) * (m32 - g)
        u_ptr = tl.load(u_ptrs + t).to(tl.pointer_type(M_TYPE))
        tl.store(u_ptr + offs, u.to(M_TYPE), mask=inside)


def _update(
    w_ptrs,
    d_ptrs,
    f_ptrs,
    sizes,
    cols,
    modes,
    mask,
    step_ptr,
    step,
    decay,
    BLOCK: tl.constexpr,
    W_TYPE: tl.constexpr,
    D_TYPE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    STEP_IS_TENSOR: tl.constexpr,
):
    """W <- decay W - step D F, F the tensor's factor indexed per row (mode 1) or per column (mode 2) of its
    ``cols``-wide matrix, or 1 (mode 0); one rounding to W's dtype. With HAS_MASK a failed vote leaves W as it
    was; with STEP_IS_TENSOR the step is read from ``step_ptr`` (a tensor lr, on the device) instead."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    n = tl.load(sizes + t)
    if b * BLOCK >= n:
        return
    offs = b * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    w_ptr = tl.load(w_ptrs + t).to(tl.pointer_type(W_TYPE))
    d_ptr = tl.load(d_ptrs + t).to(tl.pointer_type(D_TYPE))
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    mode = tl.load(modes + t)
    if mode != 0:
        width = tl.load(cols + t).to(tl.int32)
        local = offs.to(tl.int32)  # a matrix of under 2^31 elements (fused.launchable): 32-bit division
        row = local // width
        index = tl.where(mode == 1, row, local - row * width)
        f_ptr = tl.load(f_ptrs + t).to(tl.pointer_type(tl.float32))
        d = d * tl.load(f_ptr + index, mask=inside, other=0.0)
    s = tl.load(step_ptr).to(tl.float32) if STEP_IS_TENSOR else step
    new = w * decay - s * d
    if HAS_MASK:
        ok = tl.load(mask) != 0
        new = tl.where(ok, new, w)
    tl.store(w_ptr + offs, new.to(W_TYPE), mask=inside)


MOMENTUM = triton.jit(_momentum)
UPDATE = triton.jit(_update)
MOMENTUM_INTERPRETED = InterpretedFunction(_momentum)
UPDATE_INTERPRETED = InterpretedFunction(_update)
