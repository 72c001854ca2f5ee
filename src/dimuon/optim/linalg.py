"""Pure direction maps: Newton-Schulz orthogonalization (standard and Gram), RowNorm, lr scales.

Everything here is stateless tensor math on batches of matrices ``(B, rows, cols)`` or single
matrices ``(rows, cols)``. No optimizer state, no distributed code, no configuration objects:
every part of dimuon that orthogonalizes or row-normalizes calls these functions, so the project
has exactly one Newton-Schulz iteration.

Orientation convention (docs/algorithms.md, "Orientation"): a matrix with more rows than columns is
transposed before the iteration so that the iterated matrix is wide (``rows <= cols``), and
transposed back afterwards. Inputs are never modified in place.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, get_args

import torch
from torch import Tensor

from dimuon.optim import devices

__all__ = [
    "COEFFICIENT_SETS",
    "GRAM_MIN_ASPECT",
    "GRAM_RESTART_EVERY",
    "LR_SCALES",
    "NS_ALGORITHMS",
    "Buffers",
    "CompiledNewtonSchulz",
    "LrScale",
    "NsAlgorithm",
    "NsCoefficients",
    "coefficient_schedule",
    "compiled_newton_schulz",
    "default_ns_dtype",
    "lr_scale_factor",
    "newton_schulz",
    "newton_schulz_products",
    "oriented_shape",
    "row_factors",
    "row_normalize",
    "square_sums",
    "uses_gram",
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

# The named choices, as types (so signatures and command lines can list them) and as tuples.
NsCoefficients = Literal["quintic", "polar_express"]
NsAlgorithm = Literal["standard", "gram"]
LrScale = Literal["match_rms_adamw", "original", "none"]
COEFFICIENT_SETS: tuple[str, ...] = get_args(NsCoefficients)
NS_ALGORITHMS: tuple[str, ...] = get_args(NsAlgorithm)
LR_SCALES: tuple[str, ...] = get_args(LrScale)

# The Gram iteration only pays off on clearly rectangular matrices: with five steps and one
# restart it trades 6 of the 10 (rows x rows x cols) products of the standard iteration for 9 more
# (rows x rows x rows) ones (see ``newton_schulz_products``), a FLOP win once cols > 1.5 * rows;
# from 2 * rows on the saving (>= 12%) outweighs the extra small products. Narrower matrices fall
# back to the standard iteration.
GRAM_MIN_ASPECT: float = 2.0

# Restart the Gram iteration (recompute R from the true iterate) after this many steps. In fp32 one
# restart after step 3 of 5 matches the standard iteration's error (about 1e-5 relative on DiT-like
# shapes, 6e-5 on near-low-rank input) and so does a restart every 2 steps, which costs two more
# (rows x rows x cols) products; without restarts the error on ill-conditioned input grows 4-16x
# in fp32 and blows up in bf16.
GRAM_RESTART_EVERY: int = 3

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


class Buffers(Protocol):
    """Where :func:`newton_schulz` takes its large temporaries from instead of allocating them
    (:class:`dimuon.optim.workspace.Workspace`): contiguous buffers by shape, dtype and device, given back when the
    iteration is done with them."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Tensor: ...

    def give_back(self, *buffers: Tensor) -> None: ...


Allocate = Callable[[Sequence[int], torch.dtype, torch.device], Tensor]


def _allocate(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators (CUDA tensor cores and the like), fp32 on CPU (bf16 matmul is far slower there)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def oriented_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the matrix the maps iterate on: ``(min, max)`` of the two sides."""
    return (min(rows, cols), max(rows, cols))


def lr_scale_factor(name: str, rows: int, cols: int) -> float:
    """Shape-dependent step-size factor (docs/algorithms.md, "Step size") for a ``(rows, cols)`` matrix."""
    if name == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if name == "original":
        return math.sqrt(max(1.0, rows / cols))
    if name == "none":
        return 1.0
    raise ValueError(f"lr_scale must be one of {LR_SCALES}, got {name!r}")


def _norm_divisor(frob_sq: Tensor, coefficients: str) -> Tensor:
    """What a matrix with squared Frobenius norm ``frob_sq`` is divided by to bring its spectral norm to <= ~1."""
    norm = frob_sq.clamp(min=0).sqrt()
    if coefficients == "polar_express":
        return norm * _PE_SAFETY + _PE_EPS
    return norm.clamp(min=_EPS)


def _first_gram(
    x: Tensor, coefficients: str, owned: bool = False, empty: Allocate = _allocate
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(x, R, s)``: the Gram matrix ``R`` of the normalized ``x`` and the factor ``s`` still owed to ``x``.

    In fp32/fp64, ``||X||_F^2`` is the trace of ``X X^T``, so the Gram matrix of the raw input gives
    the norm for free and ``s^2 X X^T`` is the Gram matrix of ``s X``: the iterations fold ``s`` into
    the first ``(r, r)`` factor they apply to ``x`` instead of writing a normalized copy of it. Half
    precision (where the raw ``X X^T`` can overflow fp16 and every extra rounding shows) returns a
    normalized ``x`` and ``s = None``: divided in place where ``x`` is the caller's own contiguous copy
    (``owned``: the cast of a wider input), else into a new contiguous tensor (the same values either way). New
    tensors come from ``empty``.
    """
    batch, rows, _ = x.shape
    if not _is_wide_float(x.dtype):
        frob_sq = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32).square()
        divisor = _norm_divisor(frob_sq, coefficients)
        if torch.finfo(x.dtype).max > 1e5:  # bf16 (fp32's range): divided as bf16, as it always was
            divisor = divisor.to(x.dtype)
        # fp16 divides by the fp32 divisor (computed in fp32, rounded once): a norm past 65504 would be inf in fp16
        if owned and x.is_contiguous():
            x = x.div_(divisor)
        else:
            x = torch.div(x, divisor, out=empty(x.shape, x.dtype, x.device))  # contiguous
        return x, torch.bmm(x, x.mT, out=empty((batch, rows, rows), x.dtype, x.device)), None
    gram = torch.bmm(x, x.mT, out=empty((batch, rows, rows), x.dtype, x.device))  # (B, r, r)
    frob_sq = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    scale = 1.0 / _norm_divisor(frob_sq, coefficients)[:, None, None]  # (B, 1, 1)
    gram.mul_(scale * scale)
    return x, gram, scale


def _is_wide_float(dtype: torch.dtype) -> bool:
    """fp32 or wider: rounding the small factor ``a I + b A + c A^2`` costs nothing measurable."""
    return torch.finfo(dtype).eps < 1e-6


def _polynomial(gram: Tensor, coefficients: tuple[float, float, float], out: Tensor) -> Tensor:
    """``P = a I + b R + c R^2`` into ``out``: the iteration's update is then the plain product ``P X``."""
    a, b, c = coefficients
    torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=out)
    out.diagonal(dim1=-2, dim2=-1).add_(a)
    return out


def _product(p: Tensor, x: Tensor, out: Tensor, tall_out: bool) -> Tensor:
    """``P X`` into ``out`` (``(B, r, c)``), or when ``tall_out`` its transpose ``X^T P^T`` laid out as
    ``(B, c, r)`` in ``out``'s memory (returned as that tall tensor)."""
    if not tall_out:
        return torch.bmm(p, x, out=out)
    batch, rows, cols = x.shape
    return torch.bmm(x.mT, p.mT, out=out.view(batch, cols, rows))


def _standard_iteration(
    x: Tensor,
    gram: Tensor,
    scale: Tensor | None,
    schedule: Sequence[tuple[float, float, float]],
    tall_out: bool = False,
    empty: Allocate = _allocate,
) -> Tensor:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on a wide batch ``(B, r, c)``.

    ``gram`` is ``A`` of the first (normalized) iterate. With ``scale`` (fp32/fp64) ``x`` is the raw
    input, only read, and the step is the single product ``(a I + b A + c A^2) X``: it saves the
    copy and re-read of the wide matrix that ``baddbmm``'s ``a X`` term costs, and ``scale`` rides
    in the first factor. Without it (half precision) ``x`` is this function's normalized copy and
    the step keeps the ``baddbmm`` form, whose single rounding of ``a X + P X`` is twice as accurate
    in bf16. Two ``(B, r, c)`` buffers alternate and every product writes with ``out=``: no large
    tensor is allocated per step (on CPU each fresh one costs page faults). With ``tall_out`` the
    last step writes the transpose, ``(B, c, r)`` contiguous, so callers with tall matrices get
    their own layout back instead of a strided view (elementwise work on those is 3x slower). Buffers come from
    ``empty``.
    """
    poly = empty(gram.shape, gram.dtype, gram.device)
    x_is_owned = scale is None  # the half-precision path hands over its normalized copy
    spare: Tensor | None = None
    last = len(schedule) - 1
    for i, (a, b, c) in enumerate(schedule):
        if i > 0:
            torch.bmm(x, x.mT, out=gram)  # A = X X^T  (B, r, r)
        if spare is None:
            spare = empty(x.shape, x.dtype, x.device)
        transpose = tall_out and i == last
        if scale is not None:
            _polynomial(gram, (a, b, c), out=poly)  # a I + b A + c A^2
            if i == 0:
                poly.mul_(scale)
            new = _product(poly, x, spare, transpose)  # (B, r, c), or (B, c, r) at the end
        else:
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)  # b A + c A^2
            if transpose:  # a X^T + X^T poly^T
                new = torch.baddbmm(x.mT, x.mT, poly.mT, beta=a, out=spare.view(x.shape[0], x.shape[2], x.shape[1]))
            else:
                new = torch.baddbmm(x, poly, x, beta=a, out=spare)  # a X + poly X  (B, r, c)
        x, spare = new, (x if x_is_owned else None)
        x_is_owned = True
    return x


def _gram_iteration(
    x: Tensor,
    gram: Tensor,
    scale: Tensor | None,
    schedule: Sequence[tuple[float, float, float]],
    restart_every: int,
    tall_out: bool = False,
    empty: Allocate = _allocate,
) -> Tensor:
    """The same polynomial iteration run on the small ``(r, r)`` Gram matrix; ``x`` is only read.

    Every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0 = X_0 X_0^T``; all these
    polynomials commute, so ``Q_{k+1} = P_k Q_k`` and ``R_{k+1} = R_k P_k^2`` with
    ``P_k = a I + b R_k + c R_k^2``. ``Q`` is applied to the wide matrix only at a restart (which
    also recomputes ``R`` from the true iterate, flushing accumulated rounding) and at the end;
    the normalization ``scale`` owed to ``x`` rides along in the first ``Q`` applied. Products
    write into preallocated buffers (``out=``, from ``empty``) that change roles between steps. ``tall_out`` as in
    :func:`_standard_iteration`.
    """
    free = [empty(gram.shape, gram.dtype, gram.device) for _ in range(3)]
    p, scratch = free.pop(), free.pop()
    owned: list[Tensor] = []  # (B, r, c) buffers of this function not holding the current iterate
    x_is_owned = scale is None  # the half-precision path hands over its normalized copy
    q: Tensor | None = None  # None stands for the identity, saving a product on the first step
    last = len(schedule) - 1
    for i, coefficients in enumerate(schedule):
        _polynomial(gram, coefficients, out=p)
        if q is None:
            q, p_next = p, free.pop()  # Q = P: they share a buffer, P is only read from here on
        else:
            torch.bmm(p, q, out=scratch)  # Q <- P Q
            q, scratch, p_next = scratch, q, p
        if i == last:
            break
        if restart_every > 0 and (i + 1) % restart_every == 0:
            if scale is not None:
                q.mul_(scale)
                scale = None
            new = owned.pop() if owned else empty(x.shape, x.dtype, x.device)
            torch.bmm(q, x, out=new)  # X <- Q X  (B, r, c)
            if x_is_owned:
                owned.append(x)
            x, x_is_owned = new, True
            torch.bmm(x, x.mT, out=gram)
            free.append(q)
            q = None
        else:
            torch.bmm(gram, p, out=scratch)  # R P
            torch.bmm(p, scratch, out=gram)  # P R P = R P^2, kept symmetric in rounding
        p = p_next
    assert q is not None  # the last step always leaves a Q to apply
    if scale is not None:
        q.mul_(scale)
    out = owned.pop() if owned else empty(x.shape, x.dtype, x.device)
    return _product(q, x, out, tall_out)


def newton_schulz(
    x: Tensor,
    steps: int = 5,
    coefficients: str = "quintic",
    algorithm: str = "standard",
    dtype: torch.dtype | None = None,
    gram_restart_every: int = GRAM_RESTART_EVERY,
    buffers: Buffers | None = None,
) -> Tensor:
    """Approximate polar factor ``U V^T`` of each matrix in ``x`` (``(r, c)`` or ``(B, r, c)``).

    Tall matrices are iterated as their (wide) transpose and come back tall and contiguous. ``dtype`` is the compute
    dtype (default: bf16 on accelerators, fp32 on CPU); the result comes back in that dtype. ``algorithm="gram"`` uses
    the Gram-matrix form when ``c >= 2r`` and the standard form otherwise (same polynomial);
    ``gram_restart_every`` steps between its restarts (0: never). ``x`` is never written. With ``buffers`` every
    temporary is taken from there and given back before returning, but the one the result lies in (the caller gives
    that back); the values are the same.
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
    taken: list[Tensor] = []

    def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        if buffers is None:
            return _allocate(shape, dtype, device)
        taken.append(buffers.empty(shape, dtype, device))
        return taken[-1]

    cast = x.dtype != compute_dtype  # a copy of this function's own, which the half-precision path may normalize
    y = empty(x.shape, compute_dtype, x.device).copy_(x) if cast else x  # else ``x`` itself: only read
    if tall:
        y = y.mT  # a view: the products read it transposed, nothing is copied
    y, gram, scale = _first_gram(y, coefficients, owned=cast, empty=empty)
    if uses_gram(algorithm, y.shape[-2], y.shape[-1]):
        y = _gram_iteration(y, gram, scale, schedule, gram_restart_every, tall_out=tall, empty=empty)
    else:
        y = _standard_iteration(y, gram, scale, schedule, tall_out=tall, empty=empty)
    if buffers is not None:
        kept = y.untyped_storage().data_ptr()
        buffers.give_back(*(t for t in taken if t.untyped_storage().data_ptr() != kept))
    return y.squeeze(0) if squeeze else y


class CompiledNewtonSchulz:
    """:func:`newton_schulz` through ``torch.compile``, one static-shape graph per call signature (shape, dtype,
    device and the iteration's options), each compiled once.

    Each signature gets its own copy of the function's code, so its graph has a dynamo cache of its own: a model
    with more distinct matrix shapes than dynamo's recompile limit (8) never falls back to eager, and no graph
    is shape-generic (``dynamic=False``: the shape branches of the iteration are resolved at compile time).
    ``compiles`` counts the signatures compiled so far.
    """

    def __init__(self, backend: Any = "inductor") -> None:
        self.backend = backend
        self._graphs: dict[tuple, Callable[..., Tensor]] = {}

    @property
    def compiles(self) -> int:
        return len(self._graphs)

    def __call__(
        self,
        x: Tensor,
        steps: int = 5,
        coefficients: str = "quintic",
        algorithm: str = "standard",
        dtype: torch.dtype | None = None,
        gram_restart_every: int = GRAM_RESTART_EVERY,
    ) -> Tensor:
        key = (tuple(x.shape), x.dtype, x.device, steps, coefficients, algorithm, dtype, gram_restart_every)
        graph = self._graphs.get(key)
        if graph is None:
            code = newton_schulz.__code__.replace()  # a code object of its own: its own dynamo cache
            copy = types.FunctionType(
                code,
                newton_schulz.__globals__,
                newton_schulz.__name__,
                newton_schulz.__defaults__,
                newton_schulz.__closure__,
            )
            graph = self._graphs[key] = torch.compile(copy, dynamic=False, backend=self.backend)
        return graph(x, steps, coefficients, algorithm, dtype, gram_restart_every)


@functools.cache
def compiled_newton_schulz() -> CompiledNewtonSchulz:
    """The process's :class:`CompiledNewtonSchulz` (same arguments as :func:`newton_schulz`, same results
    within rounding; the first call on a new shape compiles, seconds)."""
    return CompiledNewtonSchulz()


def uses_gram(algorithm: str, rows: int, cols: int) -> bool:
    """Whether ``newton_schulz(algorithm=algorithm)`` runs the Gram form on a ``(rows, cols)`` matrix."""
    short, long = oriented_shape(rows, cols)
    return algorithm == "gram" and long >= GRAM_MIN_ASPECT * short


def newton_schulz_products(
    rows: int,
    cols: int,
    steps: int = 5,
    algorithm: str = "standard",
    gram_restart_every: int = GRAM_RESTART_EVERY,
) -> list[tuple[int, int, int]]:
    """The ``(m, k, n)`` matrix products ``newton_schulz`` issues per matrix (FLOPs: ``2 m k n`` each).

    Mirrors the iterations above so that benchmarks count the work actually done, restarts and
    the skipped first ``Q`` product included; elementwise work (normalization, diagonals) is left out.
    """
    r, c = oriented_shape(rows, cols)
    gram, poly, apply = (r, c, r), (r, r, r), (r, r, c)
    if not uses_gram(algorithm, rows, cols):
        return [gram, poly, apply] * steps
    products = [gram]
    q_is_identity = True
    for i in range(steps):
        products.append(poly)  # P from R
        if not q_is_identity:
            products.append(poly)  # Q <- P Q
        q_is_identity = False
        if i == steps - 1:
            break
        if gram_restart_every > 0 and (i + 1) % gram_restart_every == 0:
            products += [apply, gram]  # X <- Q X, R <- X X^T
            q_is_identity = True
        else:
            products += [poly, poly]  # R <- P (R P)
    if not q_is_identity:
        products.append(apply)
    return products


def row_factors(x: Tensor, eps: float = _EPS, scale: float = 1.0) -> Tensor:
    """The factor RowNorm multiplies ``x`` by: ``scale / max(norm, eps)`` per oriented row, shaped ``(..., r, 1)``
    for a wide or square ``x`` (row norms) and ``(..., 1, c)`` for a tall one (column norms), in fp32 or ``x``'s
    dtype, whichever is wider; ``x * row_factors(x)`` is :func:`row_normalize`. One read of ``x``: a caller that
    folds the factor into the weight update (``addcmul``) never writes the direction."""
    if x.ndim not in (2, 3):
        raise ValueError(f"row_factors expects a (rows, cols) or (batch, rows, cols) tensor, got {tuple(x.shape)}")
    wide = torch.promote_types(x.dtype, torch.float32)
    if x.shape[-2] <= x.shape[-1]:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=wide)
    elif _cpu_chunk_rows(x) is not None:
        norm = square_sums(x if x.dtype == wide else x.to(wide), dim=-2).sqrt_()
    else:  # one read of x (squares summed by a separate op would be written and read again: 3 passes)
        norm = torch.linalg.vector_norm(x, dim=-2, keepdim=True, dtype=wide)
    return scale / norm.clamp(min=eps)


# On the CPU, squares are taken this many elements at a time: a squared copy of a whole batch of matrices is a
# fresh allocation the kernel pages in 4 KiB at a time (~7x slower than the reduction), a chunk's stays in cache.
_CPU_SQUARE_CHUNK = 1 << 16


def _cpu_chunk_rows(x: Tensor) -> int | None:
    """Rows per chunk where ``x``'s squares are summed in chunks (on the CPU, a matrix larger than one chunk);
    None where one reduction takes it."""
    rows = x.shape[-2]
    per = max(1, _CPU_SQUARE_CHUNK // max(1, x.numel() // max(rows, 1)))
    return per if devices.cpu_path(x.device) and per < rows else None


def square_sums(x: Tensor, dim: int) -> Tensor:
    """Sums of squares of a ``(r, c)`` or ``(B, r, c)`` tensor along ``dim`` (-1: per row, -2: per column), the
    reduced dimension kept. One reduction (the norm, squared) on accelerators: one read of ``x``, where squaring
    and summing would write the squares and read them again; on the CPU in chunks of rows (see
    ``_CPU_SQUARE_CHUNK``), which runs several times faster than one square of the whole and than
    ``vector_norm(dim=-2)``."""
    per = _cpu_chunk_rows(x)
    if per is None:
        return torch.linalg.vector_norm(x, dim=dim, keepdim=True).square_()
    chunks = [c.square().sum(dim=dim, keepdim=True) for c in x.split(per, dim=-2)]
    if dim in (-1, x.ndim - 1):
        return torch.cat(chunks, dim=-2)
    total = chunks[0]
    for c in chunks[1:]:
        total.add_(c)
    return total


def row_normalize(x: Tensor, eps: float = _EPS, scale: float = 1.0) -> Tensor:
    """RowNorm: each oriented row divided by its L2 norm (``max(norm, eps)``), times ``scale``.

    Oriented rows are the rows of ``x`` when it is wide or square and its columns when it is
    tall (docs/algorithms.md, "Orientation"). Works on ``(r, c)`` and ``(B, r, c)``; the result is in fp32
    or the input dtype, whichever is wider. ``scale`` is folded into the per-row factor (:func:`row_factors`), so
    the matrix is read twice and written once.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"row_normalize expects a (rows, cols) or (batch, rows, cols) tensor, got {tuple(x.shape)}")
    return x * row_factors(x, eps, scale)
