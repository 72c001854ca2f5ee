"""The options of the Muon family: one table of the core's options (:data:`CORE_TABLE`: default, check, where each
lives, text), from which the group, runtime and engine defaults, their checks and the option texts are derived; the
keys a group may carry besides, the typed keyword options, and the checks of a parameter group (each error naming
the option and the parameter).

:class:`GroupOptions` is the part of :class:`~dimuon.optim.core.MuonFamily` that adds and checks parameter groups."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

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

Where = Literal["argument", "group", "matrix", "runtime", "engine"]


@dataclass(frozen=True)
class CoreOption:
    """One option of the Muon family's core, declared once: the defaults, the checks, what a group, the optimizer
    or its engine holds, old pickles' defaults and the documentation (:data:`dimuon.optim.docs.CORE_OPTIONS`) all
    come from :data:`CORE_TABLE`.

    ``where``: ``"argument"`` (taken by the constructor itself), ``"group"`` (a parameter-group option, a
    constructor argument too), ``"matrix"`` (set per group only: how a group's parameters become matrices),
    ``"runtime"`` (of the optimizer as a whole: how it runs, not in ``state_dict``) or ``"engine"`` (handed to the
    sharded engine). ``check(name, where, value)`` raises naming the option (``where`` names the group)."""

    name: str
    default: Any
    where: Where
    check: Callable[[str, str, Any], None] | None
    doc: str = ""


def _choice(choices: Iterable[Any]) -> Callable[[str, str, Any], None]:
    def check(name: str, where: str, value: Any) -> None:
        check_choice(f"{name}{where}", value, choices)

    return check


def _number(**bounds: Any) -> Callable[[str, str, Any], None]:
    def check(name: str, where: str, value: Any) -> None:
        check_number(f"{name}{where}", value, **bounds)

    return check


def _bool(name: str, where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}{where} must be a bool, got {value!r}")


def _lr(name: str, where: str, value: Any) -> None:
    check_lr(value, where)


def _floating_dtype(name: str, where: str, value: Any) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"{name}{where} must be None or a floating torch.dtype, got {value!r}")


def _betas(name: str, where: str, value: Any) -> None:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"{name}{where} must be a pair (beta1, beta2), got {value!r}")
    for i, b in enumerate(value):
        check_number(f"{name}[{i}]{where}", b, low=0.0, high=1.0, high_open=True)


def _split(name: str, where: str, value: Any) -> None:
    check_split(f"{name}{where}", value)


def _bool_or_none(name: str, where: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None, True or False, got {value!r}")


def _kernels(name: str, where: str, value: Any) -> None:
    fused.check_kernels(value)


_NONFINITE_DOC = (
    '``"raise"`` (default) or ``"skip"`` a step whose gradients hold inf/nan; either way no state tensor is touched '
    "by such a step. The ranks vote on the device (one 4-byte all-reduce where the parameters span the world); "
    '``"skip"`` masks the step with the vote and reads nothing on the host (a skipped step still takes its slot in '
    'the schedule: ``t`` advances; ``skipped_steps`` is read when asked for or saved), ``"raise"`` reads the vote '
    "once."
)

# Every option of the core, in the constructor's order (a test holds MuonFamily.__init__ and MuonOptions to it).
CORE_TABLE: tuple[CoreOption, ...] = (
    CoreOption(
        "params",
        None,
        "argument",
        None,
        "parameters, named parameters or parameter groups (see :func:`param_groups`); a group with "
        '``"algorithm": "adamw"`` is updated by AdamW.',
    ),
    CoreOption(
        "lr",
        1e-3,
        "group",
        _lr,
        "learning rate (shared by the AdamW groups unless a group sets its own); a number or a one-element "
        "Tensor (lets a compiled step follow an LR schedule without recompiling).",
    ),
    CoreOption(
        "momentum",
        0.95,
        "group",
        _number(low=0.0, high=1.0, high_open=True),
        "EMA momentum coefficient ``beta`` in [0, 1).",
    ),
    CoreOption("nesterov", True, "group", _bool, "use ``U = (1-beta) G + beta M`` instead of ``U = M``."),
    CoreOption("weight_decay", 0.0, "group", _number(low=0.0), "decoupled weight decay, ``W <- W (1 - lr wd)``."),
    CoreOption(
        "lr_scale",
        "match_rms_adamw",
        "group",
        _choice(LR_SCALES),
        '``"match_rms_adamw"`` (0.2 sqrt(max(m, n))), ``"original"`` (sqrt(max(1, m/n))) or ``"none"``.',
    ),
    CoreOption(
        "ns_coefficients", "quintic", "group", _choice(COEFFICIENT_SETS), '``"quintic"`` or ``"polar_express"``.'
    ),
    CoreOption("ns_steps", 5, "group", _number(low=1, high=100, integer=True), "Newton-Schulz iterations."),
    CoreOption(
        "ns_dtype",
        None,
        "group",
        _floating_dtype,
        "compute dtype of Newton-Schulz; ``None`` = fp32 on CPU, bf16 on accelerators.",
    ),
    CoreOption(
        "ns_algorithm",
        "standard",
        "group",
        _choice(NS_ALGORITHMS),
        '``"standard"`` or ``"gram"`` (Gram Newton-Schulz on matrices with cols >= 2 rows).',
    ),
    CoreOption("adamw_betas", (0.9, 0.95), "group", _betas, 'AdamW\'s betas in the ``"adamw"`` groups.'),
    CoreOption("adamw_eps", 1e-8, "group", _number(low=0.0), 'AdamW\'s eps in the ``"adamw"`` groups.'),
    CoreOption("nonfinite", "raise", "runtime", _choice(NONFINITE_POLICIES), _NONFINITE_DOC),
    CoreOption(
        "refresh",
        DEFAULT_REFRESH,
        "engine",
        _choice(REFRESH_STRATEGIES),
        'spectral steps on sharded parameters: ``"owner"`` (default: one owner rank per matrix, buckets of '
        "same-shape matrices, one all-to-all there and one back per bucket; ``2/W`` of gather's bytes and no "
        'repeated Newton-Schulz) or ``"gather"`` (all-gather the momentum, every rank orthogonalizes every matrix).',
    ),
    CoreOption(
        "bucket_mb",
        DEFAULT_BUCKET_MB,
        "engine",
        _number(low=0.0, low_open=True),
        "size of the communication buckets that overlap with Newton-Schulz, in MiB.",
    ),
    CoreOption(
        "comm_dtype",
        None,
        "engine",
        _floating_dtype,
        "dtype of the communicated momentum/directions (e.g. ``torch.bfloat16``); math stays in the compute "
        "dtype. None: the Newton-Schulz dtype where it is narrower than the momentum (bf16 on CUDA), which gives "
        "the same directions as fp32 payloads for half the bytes.",
    ),
    CoreOption(
        "process_group",
        None,
        "engine",
        None,
        "for plain parameters replicated across ranks (DDP): split the Newton-Schulz work over this group and "
        "broadcast the results. DTensor parameters need nothing.",
    ),
    CoreOption(
        "ns_compile",
        False,
        "runtime",
        _bool,
        "run Newton-Schulz through ``torch.compile`` (the first step on each new matrix shape compiles, seconds "
        "each; same results within rounding).",
    ),
    CoreOption(
        "adamw_fused",
        None,
        "runtime",
        _bool_or_none,
        "the AdamW groups' kernel: ``True`` fused, ``False`` foreach, ``None`` (default) fused wherever torch has "
        "a fused AdamW for the parameters' device and dtype.",
    ),
    CoreOption(
        "kernels",
        "auto",
        "runtime",
        _kernels,
        'the momentum and weight-update passes: ``"auto"`` (default) one fused Triton launch per pass on CUDA '
        "where Triton imports (a RowNorm step reads and writes each element 9 times rather than 15), "
        '``"torch"`` the eager list ops everywhere, ``"triton"`` the fused kernels always (on CPU tensors through '
        "Triton's interpreter: slow, for checking them).",
    ),
    CoreOption(
        "replica_refresh",
        "repeat",
        "engine",
        _choice(REPLICA_REFRESH_STRATEGIES),
        'spectral steps of parameters that mesh dimensions replicate (HSDP): ``"repeat"`` (every replica '
        'refreshes every matrix; no bytes across replicas) or ``"split"`` (each matrix refreshed by one replica, '
        "its pieces broadcast to the others).",
    ),
    CoreOption(
        "engine",
        None,
        "argument",
        None,
        "where the direction maps run (tests); ``None`` picks the single-process or the sharded engine from the "
        "parameters.",
    ),
    CoreOption("split_sizes", None, "matrix", _split),
    CoreOption("col_split_sizes", None, "matrix", _split),
    CoreOption("stacked", False, "matrix", _bool),
)


def _where(*places: Where) -> dict[str, Any]:
    return {o.name: o.default for o in CORE_TABLE if o.where in places}


# The group options the constructor takes as arguments, in the order a group holds them (then the matrix options,
# set per group only, then the schedule's).
GROUP_ARGUMENTS = tuple(_where("group"))
GROUP_DEFAULTS: dict[str, Any] = _where("group")
MATRIX_DEFAULTS: dict[str, Any] = _where("matrix")

# Options of the optimizer as a whole (not of a parameter group): how it runs, not what it computes,
# so they are not part of ``state_dict`` and a resumed run takes them from its constructor.
_RUNTIME_DEFAULTS: dict[str, Any] = _where("runtime")

_ENGINE_DEFAULTS: dict[str, Any] = _where("engine")


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
    """The keyword options every Muon-family optimizer takes after its schedule's, typed for editors and type
    checkers (their defaults and texts are :data:`CORE_TABLE`'s; a test holds this, :class:`MuonFamily`'s
    ``__init__`` and the table to the same names in the same order)."""

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
        for option in CORE_TABLE:
            if option.where in ("group", "matrix") and option.check is not None:
                option.check(option.name, where, g[option.name])
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


def check_runtime_options(given: Mapping[str, Any]) -> None:
    """The options of the optimizer as a whole (:data:`_RUNTIME_DEFAULTS`, :data:`_ENGINE_DEFAULTS`) in ``given``,
    each error naming the option."""
    for option in CORE_TABLE:
        if option.where in ("runtime", "engine") and option.check is not None:
            option.check(option.name, "", given[option.name])
