"""The public Muon-family optimizers: each is the shared core plus a schedule."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency of torch
    from typing_extensions import Unpack

from torch import Tensor

from dimuon.optim.adaptive import AdaptiveRowSchedule
from dimuon.optim.core import MuonFamily, MuonOptions
from dimuon.optim.docs import CORE_OPTIONS, args_section
from dimuon.optim.schedules import BlockPeriodicSchedule, PeriodicRowSchedule, Schedule

_COMMON_DOC = args_section("Args (shared by every Muon-family optimizer)", CORE_OPTIONS)


class Muon(MuonFamily):
    """Muon: momentum orthogonalized by Newton-Schulz at every step."""

    schedule = Schedule()

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, **kwargs: Unpack[MuonOptions]) -> None:
        super().__init__(params, lr=lr, **kwargs)


class PeriodicRowMuon(MuonFamily):
    """Periodic Row-wise Muon: a spectral (Newton-Schulz) step when ``t % k == 0``, else RowNorm.

    RowNorm steps are scaled by ``gamma`` (1 = as large as a spectral step; the paper uses 0.15).
    Takes every :class:`Muon` argument plus ``k`` and ``gamma``.

    """

    schedule = PeriodicRowSchedule()

    def __init__(
        self, params: Any, lr: float | Tensor = 1e-3, k: int = 3, gamma: float = 0.15, **kwargs: Unpack[MuonOptions]
    ) -> None:
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

    """

    schedule = BlockPeriodicSchedule()

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        period: int = 5,
        blocks: int | tuple[int, int] = 1,
        block_lr_ratio: float = 1.0,
        **kwargs: Unpack[MuonOptions],
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
        signal_lag: int = 0,
        **kwargs: Unpack[MuonOptions],
    ) -> None:
        super().__init__(
            params, lr=lr, threshold=threshold, k_min=k_min, k_max=k_max, gamma=gamma, signal_lag=signal_lag, **kwargs
        )


for _cls in (Muon, PeriodicRowMuon, MuonBP, AdaptiveRowMuon):
    _own = {key: option.doc for key, option in _cls.schedule.options.items()}
    _cls.__doc__ = (_cls.__doc__ or "") + (args_section("Args (schedule)", _own) + "\n" if _own else "") + _COMMON_DOC
