"""The public Muon-family optimizers: each is the shared core plus a schedule."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dimuon.optim.adaptive import AdaptiveRowSchedule
from dimuon.optim.core import MuonFamily
from dimuon.optim.schedules import BlockPeriodicSchedule, PeriodicRowSchedule, Schedule

_COMMON_DOC = """
    Args (shared by every Muon-family optimizer):
        params: parameters, named parameters or parameter groups (see :func:`param_groups`);
            a group with ``"algorithm": "adamw"`` is updated by AdamW.
        lr: learning rate (shared by the AdamW groups unless a group sets its own); a number or a
            one-element Tensor (lets a compiled step follow an LR schedule without recompiling).
        momentum: EMA momentum coefficient ``beta`` in [0, 1).
        nesterov: use ``U = (1-beta) G + beta M`` instead of ``U = M``.
        weight_decay: decoupled weight decay, ``W <- W (1 - lr wd)``.
        lr_scale: ``"match_rms_adamw"`` (0.2 sqrt(max(m, n))), ``"original"`` (sqrt(max(1, m/n)))
            or ``"none"``.
        ns_coefficients: ``"quintic"`` or ``"polar_express"``.
        ns_steps: Newton-Schulz iterations.
        ns_dtype: compute dtype of Newton-Schulz; ``None`` = fp32 on CPU, bf16 on accelerators.
        ns_algorithm: ``"standard"`` or ``"gram"`` (Gram Newton-Schulz on matrices with cols >= 2 rows).
        adamw_betas, adamw_eps: AdamW hyperparameters of the ``"adamw"`` groups.
        nonfinite: ``"raise"`` (default) or ``"skip"`` a step whose gradients hold inf/nan; either
            way no state tensor is touched by such a step. The ranks vote on the device (one 4-byte
            all-reduce where the parameters span the world); ``"skip"`` masks the step with the vote and
            reads nothing on the host (a skipped step still takes its slot in the schedule: ``t`` advances;
            ``skipped_steps`` is read when asked for or saved), ``"raise"`` reads the vote once.
        refresh: spectral steps on sharded parameters: ``"owner"`` (default: one owner rank per matrix,
            buckets of same-shape matrices, one all-to-all there and one back per bucket; ``2/W`` of gather's
            bytes and no repeated Newton-Schulz) or ``"gather"`` (all-gather the momentum, every rank
            orthogonalizes every matrix).
        bucket_mb: size of the communication buckets that overlap with Newton-Schulz, in MiB.
        comm_dtype: dtype of the communicated momentum/directions (e.g. ``torch.bfloat16``); math
            stays in the compute dtype. None: the Newton-Schulz dtype where it is narrower than the momentum
            (bf16 on CUDA), which gives the same directions as fp32 payloads for half the bytes.
        process_group: for plain parameters replicated across ranks (DDP): split the Newton-Schulz
            work over this group and broadcast the results. DTensor parameters need nothing.
        ns_compile: run Newton-Schulz through ``torch.compile`` (the first step on each new matrix
            shape compiles, seconds each; same results within rounding).
        adamw_fused: the AdamW groups' kernel: ``True`` fused, ``False`` foreach, ``None`` (default)
            fused wherever torch has a fused AdamW for the parameters' device and dtype.
        replica_refresh: spectral steps of parameters that mesh dimensions replicate (HSDP):
            ``"repeat"`` (every replica refreshes every matrix; no bytes across replicas) or
            ``"split"`` (each matrix refreshed by one replica, its pieces broadcast to the others).
        engine: where the direction maps run (tests); ``None`` picks the single-process or the
            sharded engine from the parameters.
"""


class Muon(MuonFamily):
    """Muon: momentum orthogonalized by Newton-Schulz at every step."""

    schedule = Schedule()

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, **kwargs)


class PeriodicRowMuon(MuonFamily):
    """Periodic Row-wise Muon: a spectral (Newton-Schulz) step when ``t % k == 0``, else RowNorm.

    RowNorm steps are scaled by ``gamma`` (1 = as large as a spectral step; the paper uses 0.15).
    Takes every :class:`Muon` argument plus ``k`` and ``gamma``.

    Args (schedule):
        k: a spectral (Newton-Schulz) step every ``k`` steps, RowNorm steps in between (``k=1`` is Muon).
        gamma: step multiplier of the RowNorm steps (1 = as large as a spectral step).
    """

    schedule = PeriodicRowSchedule()

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, k: int = 3, gamma: float = 0.15, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, k=k, gamma=gamma, **kwargs)


class MuonBP(MuonFamily):
    """MuonBP: full orthogonalization when ``t % period == 0``, block-wise otherwise.

    Blocks are each rank's piece of the matrix for sharded (DTensor) parameters (its rows under
    FSDP, its columns under a row-wise tensor-parallel ``Shard(1)``, a sub-block under FSDP x TP), and
    for unsharded ones the grid ``blocks`` cuts (as ``torch.chunk`` cuts each side): an int ``B`` means
    ``B`` row blocks, a pair ``(R, C)`` means ``R`` row blocks times ``C`` column blocks, so one process
    can reproduce any sharded layout. Block steps use the step size ``lr * block_lr_ratio`` and the
    shape scale of the block. Takes every :class:`Muon` argument plus ``period``, ``blocks`` and
    ``block_lr_ratio``.

    Args (schedule):
        period: a full spectral step every ``period`` steps, block steps in between.
        blocks: blocks of a block step on unsharded parameters (sharded ones use their pieces): row blocks, or
            a pair (row blocks, column blocks); a 1-tuple is row blocks.
        block_lr_ratio: step multiplier of the block steps.
    """

    schedule = BlockPeriodicSchedule()

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        period: int = 5,
        blocks: int | tuple[int, int] = 1,
        block_lr_ratio: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr=lr, period=period, blocks=blocks, block_lr_ratio=block_lr_ratio, **kwargs)


class AdaptiveRowMuon(MuonFamily):
    """Adaptive Row-wise Muon: each matrix takes a spectral (Newton-Schulz) step when the direction of its last
    spectral step has gone stale, else a RowNorm step scaled by ``gamma``.

    Staleness is ``1 - cos(U_t, O_s) / cos(U_s, O_s)``: how much of the Nesterov momentum's alignment with the
    direction ``O_s`` of the matrix's last spectral step ``s`` has been lost since (docs/algorithms.md,
    "Adaptive refresh"). Every matrix decides on its own, at least ``k_min`` and at most ``k_max`` steps after
    its last spectral step; ``k_min = k_max = k`` is :class:`PeriodicRowMuon` with that ``k``. The decisions
    are counted by :meth:`refresh_stats`. Takes every :class:`Muon` argument plus ``threshold``, ``k_min``,
    ``k_max`` and ``gamma``.

    Args (schedule):
        threshold: staleness above which a matrix takes a spectral step (0 = at every step the bounds allow).
        k_min: fewest steps from one spectral step of a matrix to its next (1 allows consecutive ones).
        k_max: most steps from one spectral step of a matrix to its next (the refresh is forced then).
        gamma: step multiplier of the RowNorm steps (1 = as large as a spectral step).
    """

    schedule = AdaptiveRowSchedule()

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        threshold: float = 0.35,
        k_min: int = 1,
        k_max: int = 8,
        gamma: float = 0.15,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr=lr, threshold=threshold, k_min=k_min, k_max=k_max, gamma=gamma, **kwargs)


for _cls in (Muon, PeriodicRowMuon, MuonBP, AdaptiveRowMuon):
    _cls.__doc__ = (_cls.__doc__ or "") + _COMMON_DOC
