"""The fused form of a Muon-family step's memory-bound passes: one Triton launch over many tensors each.

On a GPU the eager RowNorm step makes about 15 memory transfers per element of a matrix (the vote's finiteness
read 1, momentum lerp 3, Nesterov copy and lerp 5, row factors 1, weight decay 2, update 3), fused AdamW 7. Two
kernels bring it to 9 (:mod:`dimuon.optim.triton_step`):

- **momentum**: ``M <- lerp(M, G, 1 - beta)`` and the Nesterov ``U <- lerp(G, M, beta)``, the vote's mask
  applied to ``G``: reads G and M, writes M and U (4; every step kind takes it);
- **update**: ``W <- (1 - lr wd) W - step D f``, ``f`` a RowNorm step's per-row or per-column factor (1 for the
  other kinds' directions): reads W and D, writes W (3), decay and update in one rounding.

The row factors stay torch's (one read of U, region by region), and so do the spectral maps. ``kernels`` picks
the form: ``"auto"`` (the default) fuses on CUDA wherever Triton imports, ``"torch"`` never, ``"triton"``
always (on CPU tensors through Triton's interpreter: slow, for checking the kernels without a GPU). Tensors that
a launch cannot take (not contiguous, an unsupported dtype, a factor wider than fp32) take the eager form.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, get_args

import torch
from torch import Tensor

Kernels = Literal["auto", "torch", "triton"]
KERNEL_CHOICES: tuple[str, ...] = get_args(Kernels)

_BLOCK = 1024  # elements per program: a few KiB per tensor read, enough to hide the loads' latency
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_NUMEL = 2**31
_MAX_TENSORS = 65535  # a launch's tensors lie on the grid's second axis, which CUDA caps here
_TABLE_CACHE = 64  # address tables kept on the device (parameters and state keep their addresses step to step)


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it comes with torch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def check_kernels(kernels: str) -> None:
    """Refuse an unknown ``kernels`` value, and ``"triton"`` where Triton cannot be imported, at construction."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNEL_CHOICES))}, got {kernels!r}")
    if kernels == "triton" and not triton_available():
        raise ValueError(
            "kernels='triton' needs the triton package (pip install triton; torch's CUDA wheels bring it); "
            "kernels='auto' uses it where it imports and the eager kernels elsewhere"
        )


def fuses(kernels: str, device: torch.device) -> bool:
    """Whether a step on ``device`` takes the fused kernels under the ``kernels`` choice."""
    if kernels == "torch" or torch.compiler.is_compiling():  # a compiled step fuses by itself
        return False
    if kernels == "triton":
        return device.type in ("cuda", "cpu")
    return device.type == "cuda" and triton_available()


@functools.cache
def _module() -> ModuleType:
    from dimuon.optim import triton_step

    return triton_step


def launchable(*tensors: Tensor) -> bool:
    """Whether a launch can take these tensors: contiguous, of a dtype the kernels load, on one device, each under
    2^31 elements (the update kernel indexes a matrix's rows and columns in 32 bits)."""
    device = tensors[0].device
    return all(
        t.is_contiguous() and t.dtype in _DTYPES and t.device == device and t.numel() < _MAX_NUMEL for t in tensors
    )


def _tl_type(dtype: torch.dtype) -> object:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


class Tables:
    """Address tables (``int64``, one entry per tensor) on the device, kept by their contents: the parameters,
    momenta and Nesterov buffers keep their addresses from step to step, so a step mostly copies nothing. A new
    table goes up from pinned memory without waiting for the device."""

    def __init__(self) -> None:
        self._kept: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}

    def get(self, values: Sequence[int], device: torch.device) -> Tensor:
        key = (device, tuple(values))
        table = self._kept.pop(key, None)  # kept most recently used last: a gradient's fresh table each step
        if table is None:  # evicts the oldest, not the parameters' tables used every step
            host = torch.tensor(key[1], dtype=torch.int64, device="cpu")  # pinned, whatever the default device
            table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
            if len(self._kept) >= _TABLE_CACHE:
                self._kept.pop(next(iter(self._kept)))
        self._kept[key] = table
        return table


def _launch(kernel: Any, grid: tuple[int, int], device: torch.device) -> Callable[..., None]:
    """``kernel[grid]`` launched on ``device`` (Triton launches on the current CUDA device, which need not be the
    tensors'), whose call names the way out where Triton cannot compile or launch it here."""
    launcher = kernel[grid]

    def call(*args: Any, **kwargs: Any) -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                launcher(*args, **kwargs)
        except Exception as e:  # a compiler or driver error
            raise RuntimeError(
                f"dimuon's fused step kernel {getattr(kernel, '__name__', 'kernel')} failed on this device ({e}); "
                "build the optimizer with kernels='torch' to take the eager ops"
            ) from e

    return call


def _dtype_pairs(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[tuple[tuple[torch.dtype, torch.dtype], list[int]]]:
    """The indices of each (``a[i]``'s dtype, ``b[i]``'s dtype) pair, at most ``_MAX_TENSORS`` at a time: one launch
    each."""
    pairs: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (x, y) in enumerate(zip(a, b)):
        pairs.setdefault((x.dtype, y.dtype), []).append(i)
    return [(key, idx[s : s + _MAX_TENSORS]) for key, idx in pairs.items() for s in range(0, len(idx), _MAX_TENSORS)]


def _grid(sizes: Sequence[int]) -> tuple[int, int]:
    return (max(1, math.ceil(max(sizes) / _BLOCK)), len(sizes))


def momentum_(
    tables: Tables,
    grads: Sequence[Tensor],
    bufs: Sequence[Tensor],
    outs: Sequence[Tensor] | None,
    beta: float,
    mask: Tensor | None,
) -> None:
    """``M <- lerp(M, G, 1 - beta)`` for every pair, and with ``outs`` the Nesterov ``U <- lerp(G, M, beta)``
    written there; ``G`` taken as ``where(mask, G, M)`` under a ``mask`` (a 0-d bool). One launch per (gradient
    dtype, momentum dtype); every tensor :func:`launchable`, ``outs[i]`` shaped and typed as ``bufs[i]``."""
    mod = _module()
    device = bufs[0].device
    kernel = mod.MOMENTUM if device.type == "cuda" else mod.MOMENTUM_INTERPRETED
    flag = mask if mask is not None else bufs[0]  # any device pointer where no mask is read
    for (g_dtype, m_dtype), idx in _dtype_pairs(grads, bufs):
        sizes = [bufs[i].numel() for i in idx]
        u = [outs[i].data_ptr() for i in idx] if outs is not None else [0] * len(idx)
        _launch(kernel, _grid(sizes), device)(
            tables.get([grads[i].data_ptr() for i in idx], device),
            tables.get([bufs[i].data_ptr() for i in idx], device),
            tables.get(u, device),
            tables.get(sizes, device),
            flag,
            1.0 - beta,
            beta,
            BLOCK=_BLOCK,
            G_TYPE=_tl_type(g_dtype),
            M_TYPE=_tl_type(m_dtype),
            HAS_MASK=mask is not None,
            NESTEROV=outs is not None,
            MOMENTUM_LOW=abs(1.0 - beta) < 0.5,
            NESTEROV_LOW=abs(beta) < 0.5,
        )


def update_(
    tables: Tables,
    weights: Sequence[Tensor],
    directions: Sequence[Tensor],
    factors: Sequence[Tensor | None],
    step: float | Tensor,
    decay: float,
    mask: Tensor | None,
) -> None:
    """``W <- decay W - step D f`` for every weight (``D`` its direction viewed as its matrix, ``f`` that
    direction's RowNorm factor shaped ``(rows, 1)`` or ``(1, cols)``, or None for 1); a failed ``mask`` leaves
    every W as it was. ``step`` a number, or a 0-d tensor on the weights' device (read there). One launch per
    (weight dtype, direction dtype); every tensor :func:`launchable`, factors fp32."""
    mod = _module()
    device = weights[0].device
    kernel = mod.UPDATE if device.type == "cuda" else mod.UPDATE_INTERPRETED
    flag = mask if mask is not None else weights[0]
    tensor_step = isinstance(step, Tensor)
    for (w_dtype, d_dtype), idx in _dtype_pairs(weights, directions):
        sizes = [weights[i].numel() for i in idx]
        modes, widths, fptrs = [], [], []
        for i in idx:
            f, d = factors[i], directions[i]
            if f is None:
                modes.append(mod.FACTOR_NONE)
                widths.append(1)
                fptrs.append(0)
            else:
                # (rows, 1): per row; (1, cols): per column (a (1, 1) factor of a one-row matrix is per row)
                per_row = f.shape[-1] == 1 and f.shape[-2] == d.shape[-2]
                modes.append(mod.FACTOR_PER_ROW if per_row else mod.FACTOR_PER_COL)
                widths.append(d.shape[-1])
                fptrs.append(f.data_ptr())
        _launch(kernel, _grid(sizes), device)(
            tables.get([weights[i].data_ptr() for i in idx], device),
            tables.get([directions[i].data_ptr() for i in idx], device),
            tables.get(fptrs, device),
            tables.get(sizes, device),
            tables.get(widths, device),
            tables.get(modes, device),
            flag,
            step if tensor_step else flag,
            0.0 if tensor_step else float(step),
            float(decay),
            BLOCK=_BLOCK,
            W_TYPE=_tl_type(w_dtype),
            D_TYPE=_tl_type(d_dtype),
            HAS_MASK=mask is not None,
            STEP_IS_TENSOR=tensor_step,
        )
