"""The options of the Muon family: the keys a group may carry, the runtime and engine defaults, the typed keyword
options, and the checks of a parameter group (each error naming the option and the parameter).

:class:`GroupOptions` is the part of :class:`~dimuon.optim.core.MuonFamily` that adds and checks parameter groups.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable
from typing import Any, TypedDict

import torch
from torch import Tensor

from dimuon.optim import fused
from dimuon.optim.common import ALGORITHMS, NONFINITE_POLICIES, Nonfinite, StepKind, local_tensor, matrix_shape
from dimuon.optim.distributed.engine import (
    DEFAULT_BUCKET_MB,
    DEFAULT_REFRESH,
    REFRESH_STRATEGIES,
    REPLICA_REFRESH_STRATEGIES,
    DirectionEngine,
    Refresh,
    ReplicaRefresh,
    col_split_sizes_to_ranges,
    split_sizes_to_ranges,
)
from dimuon.optim.distributed.experts import check_stacked_layout
from dimuon.optim.distributed.layout import derive_layout, is_dtensor, placement_words
from dimuon.optim.linalg import COEFFICIENT_SETS, LR_SCALES, NS_ALGORITHMS, LrScale, NsAlgorithm, NsCoefficients
from dimuon.optim.validation import (
    check_choice,
    check_lr,
    check_number,
    check_split,
    integer_options,
    take_integral_floats,
)

# Keys a parameter group may carry besides its options: "params", torch's "param_names", the keys torch's LR
# schedulers write into every group (OneCycleLR's and CyclicLR's among them), a free "name", and the counters
# this core keeps per group. Other keys (what
# trainers and containers add, e.g. torchtitan's "fused"/"foreach") are kept and ignored with one
# ForeignGroupKeyWarning, as torch's optimizers keep them; a key close to one of dimuon's options is a typo
# that would otherwise be silently ignored, and is refused naming the option it resembles.
_SCHEDULER_KEYS = {"initial_lr", "max_lr", "min_lr", "base_lr", "max_momentum", "base_momentum", "swa_lr"}

_EXTRA_GROUP_KEYS = {"params", "param_names", "name", "step", "skipped_steps"} | _SCHEDULER_KEYS

_TYPO_CUTOFF = 0.8  # difflib ratio above which an unknown key reads as a misspelt option

# Options that say how a 'muon' group's parameters become matrices: in an 'adamw' group they are a mistake. They
# are structural: the state is kept per matrix, so a state_dict loads only under the values it was saved with
# (checked in this order: the splits cut the matrices that ``stacked`` makes).
_MATRIX_GROUP_OPTIONS = ("stacked", "split_sizes", "col_split_sizes")

# The group options the constructor takes as arguments, in the order a group holds them (then the matrix options,
# set per group only, then the schedule's).
GROUP_ARGUMENTS = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "lr_scale",
    "ns_coefficients",
    "ns_steps",
    "ns_dtype",
    "ns_algorithm",
    "adamw_betas",
    "adamw_eps",
)
MATRIX_DEFAULTS: dict[str, Any] = {"split_sizes": None, "col_split_sizes": None, "stacked": False}

# Options of the optimizer as a whole (not of a parameter group): how it runs, not what it computes,
# so they are not part of ``state_dict`` and a resumed run takes them from its constructor.
_RUNTIME_DEFAULTS: dict[str, Any] = {"nonfinite": "raise", "ns_compile": False, "adamw_fused": None, "kernels": "auto"}

_ENGINE_DEFAULTS: dict[str, Any] = {
    "refresh": DEFAULT_REFRESH,
    "bucket_mb": DEFAULT_BUCKET_MB,
    "comm_dtype": None,
    "process_group": None,
    "replica_refresh": "repeat",
}


class ForeignGroupKeyWarning(UserWarning):
    """A parameter group carries keys dimuon does not use (a trainer's ``fused``/``foreach``, say): kept, ignored."""


def _same_value(a: Any, b: Any) -> bool:
    """``a == b`` for option values (numbers, tuples), False where they cannot be compared."""
    try:
        return bool(a == b)
    except Exception:
        return False


# torch.optim.AdamW's names for what dimuon's groups call adamw_*: in a dimuon group they would be ignored.
_TORCH_NAMES = {"betas": "adamw_betas", "eps": "adamw_eps"}


def misspelt_option(key: str, options: Iterable[str]) -> str | None:
    """The option ``key`` reads as a misspelling of (same name but for case, torch's name for it, or a close
    match), or None."""
    options = sorted(options)
    if _TORCH_NAMES.get(key) in options:
        return _TORCH_NAMES[key]
    same = [o for o in options if o.lower() == key.lower()]
    close = same or difflib.get_close_matches(key.lower(), options, n=1, cutoff=_TYPO_CUTOFF)
    return close[0] if close else None


def misspelling_hints(unknown: Iterable[str], options: Iterable[str]) -> str:
    """`` ('weight_decy': did you mean 'weight_decay'?)`` for the unknown names that read as an option, or ``""``."""
    options = sorted(options)
    meant = {k: misspelt_option(k, options) for k in sorted(unknown)}
    hints = "; ".join(f"{k!r}: did you mean {m!r}?" for k, m in meant.items() if m)
    return f" ({hints})" if hints else ""


class FlattenedParameterWarning(UserWarning):
    """A parameter with more than two dimensions in a "muon" group is updated as one (out, rest) matrix."""


class MuonOptions(TypedDict, total=False):
    """The keyword options every Muon-family optimizer takes after its schedule's (their defaults are
    :class:`MuonFamily`'s ``__init__``'s, their text :data:`dimuon.optim.docs.CORE_OPTIONS`; a test keeps the three
    in step)."""

    momentum: float
    nesterov: bool
    weight_decay: float
    lr_scale: LrScale
    ns_coefficients: NsCoefficients
    ns_steps: int
    ns_dtype: torch.dtype | None
    ns_algorithm: NsAlgorithm
    adamw_betas: tuple[float, float]
    adamw_eps: float
    nonfinite: Nonfinite
    refresh: Refresh
    bucket_mb: float
    comm_dtype: torch.dtype | None
    process_group: Any
    ns_compile: bool
    adamw_fused: bool | None
    kernels: fused.Kernels
    replica_refresh: ReplicaRefresh
    engine: DirectionEngine | None


class GroupOptions:
    """The parameter groups' share of the optimizer: adding a group, checking its options and parameters."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]

    def _validate_options(self, g: dict[str, Any], where: str) -> None:
        """One clear error per bad hyperparameter, naming it (``where`` names the group)."""
        take_integral_floats(g, integer_options(self._schedule_defaults()))
        check_choice(f"algorithm{where}", g["algorithm"], ALGORITHMS)
        check_lr(g["lr"], where)
        check_number(f"weight_decay{where}", g["weight_decay"], low=0.0)
        check_number(f"momentum{where}", g["momentum"], low=0.0, high=1.0, high_open=True)
        if not isinstance(g["nesterov"], bool):
            raise TypeError(f"nesterov{where} must be a bool, got {g['nesterov']!r}")
        check_choice(f"lr_scale{where}", g["lr_scale"], LR_SCALES)
        check_choice(f"ns_coefficients{where}", g["ns_coefficients"], COEFFICIENT_SETS)
        check_choice(f"ns_algorithm{where}", g["ns_algorithm"], NS_ALGORITHMS)
        check_number(f"ns_steps{where}", g["ns_steps"], low=1, high=100, integer=True)
        if g["ns_dtype"] is not None and not (
            isinstance(g["ns_dtype"], torch.dtype) and g["ns_dtype"].is_floating_point
        ):
            raise TypeError(f"ns_dtype{where} must be None or a floating torch.dtype, got {g['ns_dtype']!r}")
        betas = g["adamw_betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"adamw_betas{where} must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            check_number(f"adamw_betas[{i}]{where}", b, low=0.0, high=1.0, high_open=True)
        check_number(f"adamw_eps{where}", g["adamw_eps"], low=0.0)
        check_split(f"split_sizes{where}", g["split_sizes"])
        check_split(f"col_split_sizes{where}", g["col_split_sizes"])
        if not isinstance(g["stacked"], bool):
            raise TypeError(f"stacked{where} must be a bool, got {g['stacked']!r}")
        self.schedule.check(g, where)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        unknown = set(param_group) - set(self.defaults) - _EXTRA_GROUP_KEYS
        elsewhere = {
            key: owners for key in sorted(unknown) if (owners := self._optimizers_taking(key, param_group[key]))
        }
        if elsewhere:
            whose = [
                f"{key!r} (" + ", ".join(f"{owner}'s" for owner in owners) + ")" for key, owners in elsewhere.items()
            ]
            raise ValueError(
                f"parameter-group option(s) of other optimizers: {', '.join(whose)}, not "
                f"{type(self).__name__}'s; its options: {sorted(self.defaults)}"
            )
        typos = {key: option for key in sorted(unknown) if (option := misspelt_option(key, self.defaults))}
        if typos:
            raise ValueError(
                "unknown parameter-group option(s) "
                + ", ".join(f"{key!r} (did you mean {option!r}?)" for key, option in typos.items())
                + f"; {type(self).__name__}'s options: {sorted(self.defaults)}"
            )
        algorithm = param_group.get("algorithm", self.defaults.get("algorithm"))
        matrix_only = [k for k in _MATRIX_GROUP_OPTIONS if param_group.get(k) not in (None, False)]
        if algorithm == "adamw" and matrix_only:
            raise ValueError(
                f"parameter-group option(s) {matrix_only} shape a 'muon' group's matrices; this group's "
                "algorithm is 'adamw' (set 'algorithm': 'muon' to orthogonalize its parameters)"
            )
        if getattr(self, "_votes", {}).get("pending_skips") is not None:
            self._fold_skips()  # the skips so far are the existing groups'
        super().add_param_group(param_group)
        flattened = len(getattr(self, "_flattened", ()))
        try:
            self._check_group(len(self.param_groups) - 1)
        except (TypeError, ValueError):
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            del self._flattened[flattened:]  # its parameters are not flattened: no warning about them
            raise
        group = self.param_groups[-1]
        group.setdefault("step", 0)
        group.setdefault("skipped_steps", 0)
        for p in group["params"]:
            self._param_state(p, group)
        self._foreign_keys |= unknown
        if not self._constructing:
            if not self._engine_given:
                self._engine = None  # the engine learns the new parameters' process groups
                self._prepare_engine()
            self._make_plans()
            self._warn_flattened(stacklevel=3)
            self._warn_foreign_keys(stacklevel=3)

    def _check_group(self, gi: int) -> None:
        """Options, parameter dtypes and shapes of group ``gi``, each error naming the parameter."""
        group = self.param_groups[gi]
        self._validate_options(group, f" (parameter group {gi})")
        for i, p in enumerate(group["params"]):
            pname = self._param_name(group, i, gi)
            if p.is_complex():
                raise ValueError(
                    f"parameter {pname!r} is complex ({p.dtype}); dimuon's optimizers take real parameters "
                    "(optimize torch.view_as_real of it instead)"
                )
            if group["algorithm"] == "adamw":
                if self.adamw_fused and not self._fused_supported([p]):
                    layout = "" if local_tensor(p).is_contiguous() else ", not contiguous"
                    raise ValueError(
                        f"adamw_fused=True, but torch has no fused AdamW for parameter {pname!r} "
                        f"({p.dtype} on {local_tensor(p).device.type}{layout}); pass adamw_fused=None or False"
                    )
                continue
            if p.ndim < 2:
                raise ValueError(
                    f"parameter {pname!r} with shape {tuple(p.shape)} is in a 'muon' group, but Muon "
                    "updates matrices (ndim >= 2; conv weights are flattened to (out, in*k*k)); "
                    "put it in an 'adamw' group (dimuon.optim.param_groups does this)"
                )
            if group["stacked"] and p.ndim < 3:
                raise ValueError(
                    f"stacked=True for parameter {pname!r} with shape {tuple(p.shape)}: a stacked parameter holds "
                    "matrices along its leading dimension, (count, rows, cols), so it needs at least 3 dimensions; "
                    "put the parameter in a group without stacked=True"
                )
            if p.ndim > 2 and not group["stacked"]:
                self._flattened.append(f"{pname} {tuple(p.shape)}")
            _, rows, cols = matrix_shape(p, group["stacked"])
            split_sizes_to_ranges(rows, group["split_sizes"], pname)
            col_split_sizes_to_ranges(cols, group["col_split_sizes"], pname)
            if is_dtensor(p):
                self._check_sharded(p, pname, group, cols)

    def _check_sharded(self, p: Tensor, pname: str, group: dict[str, Any], cols: int) -> None:
        """A DTensor parameter's placements against its group's options and the schedule (a clear error now, not
        at the first step)."""
        layout = derive_layout(p, pname)  # a clear error now for placements the sharded engine cannot run
        if group["stacked"]:  # dimension 1 holds each matrix's rows: a split of it keeps whole rows
            check_stacked_layout(p, pname, layout, type(self).__name__, self.schedule.whole_rows)
            return
        col_split = col_split_sizes_to_ranges(cols, group["col_split_sizes"], pname)
        if col_split and layout.col_dims and set(self.schedule.kinds) != {StepKind.SPECTRAL}:
            raise ValueError(
                f"col_split_sizes for parameter {pname!r} under {type(self).__name__}: its "
                f"{placement_words(p)} split its columns, and {type(self).__name__}'s "
                f"{'/'.join(k.value for k in self.schedule.kinds if k is not StepKind.SPECTRAL)} steps cut "
                "column chunks out of each rank's rows, so they need whole rows on every rank (FSDP, HSDP, "
                "Shard(0) tensor parallelism); use muon for it (its spectral steps assemble whole "
                "matrices), drop col_split_sizes, or a layout that keeps its rows whole"
            )
        if self.schedule.whole_rows and layout.col_dims:
            raise ValueError(
                f"{type(self).__name__} {self.schedule.whole_rows}, so its matrices may be "
                f"sharded by rows only (FSDP, HSDP, Shard(0) tensor parallelism); parameter {pname!r} is "
                f"split by columns ({tuple(p.placements)}): use periodic_row_muon for it, or a row-wise "
                "plan for its layer"
            )

    def _warn_foreign_keys(self, stacklevel: int) -> None:
        """One warning for the group keys dimuon ignores, gathered since the last one."""
        if self._foreign_keys:
            warnings.warn(
                f"{type(self).__name__} ignores these parameter-group keys (kept in param_groups, as torch's "
                f"optimizers keep them): {sorted(self._foreign_keys)}",
                ForeignGroupKeyWarning,
                stacklevel=stacklevel,
            )
            self._foreign_keys = set()

    def _warn_flattened(self, stacklevel: int) -> None:
        """One warning for the parameters flattened since the last one (``stacklevel`` reaches the caller)."""
        if self._flattened:
            warnings.warn(
                f"{type(self).__name__} updates these parameters as (shape[0], rest) matrices, as it does conv "
                f"weights (out, in, *kernel): {', '.join(self._flattened)}; if a leading dimension stacks separate "
                "matrices (heads, experts), give its group stacked=True, split the parameter or put it in an "
                "'adamw' group",
                FlattenedParameterWarning,
                stacklevel=stacklevel,
            )
            self._flattened = []

    @staticmethod
    def _param_name(group: dict[str, Any], i: int, gi: int) -> str:
        names = group.get("param_names")
        return names[i] if names else f"params[{i}] of group {gi}"


def check_runtime_options(
    nonfinite: Any,
    refresh: Any,
    replica_refresh: Any,
    bucket_mb: Any,
    comm_dtype: Any,
    ns_compile: Any,
    adamw_fused: Any,
    kernels: Any,
) -> None:
    """The options of the optimizer as a whole (:data:`_RUNTIME_DEFAULTS`, :data:`_ENGINE_DEFAULTS`), each error
    naming the option."""
    check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
    check_choice("refresh", refresh, REFRESH_STRATEGIES)
    check_choice("replica_refresh", replica_refresh, REPLICA_REFRESH_STRATEGIES)
    check_number("bucket_mb", bucket_mb, low=0.0, low_open=True)
    if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
        raise TypeError(f"comm_dtype must be None or a floating torch.dtype, got {comm_dtype!r}")
    if not isinstance(ns_compile, bool):
        raise TypeError(f"ns_compile must be a bool, got {ns_compile!r}")
    if adamw_fused is not None and not isinstance(adamw_fused, bool):
        raise TypeError(f"adamw_fused must be None, True or False, got {adamw_fused!r}")
    fused.check_kernels(kernels)
