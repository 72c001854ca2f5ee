"""One optimizer core for Muon, Periodic Row-wise Muon and MuonBP.

The core owns everything the three share (docs/algorithms.md: "Momentum and weight decay", "Step
size", "Schedules", "AdamW group"): EMA momentum with optional Nesterov, decoupled weight decay,
the shape-dependent lr scale, the auxiliary AdamW for ``"algorithm": "adamw"`` groups, the
per-group step counter, the optimizer state (created with the groups) and ``state_dict``. What
differs is the :class:`~dimuon.optim.schedules.Schedule` (which direction map at step ``t``), and
where the maps run is the engine's business (single process or sharded).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, ClassVar, Literal, TypedDict, get_args

import torch
from torch import Tensor
from torch.optim.adamw import adamw as adamw_functional
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from dimuon.optim import devices, fused
from dimuon.optim.distributed.engine import (
    DEFAULT_BUCKET_MB,
    DEFAULT_REFRESH,
    REFRESH_STRATEGIES,
    REPLICA_REFRESH_STRATEGIES,
    DirectionEngine,
    LocalEngine,
    MapConfig,
    MatrixJob,
    Refresh,
    ReplicaRefresh,
    RowDirection,
    RowScaled,
    block_grid,
    col_split_sizes_to_ranges,
    shape_classes,
    split_sizes_to_ranges,
    stacked_ranges,
)
from dimuon.optim.distributed.experts import check_stacked_layout
from dimuon.optim.distributed.layout import derive_layout, is_dtensor, placement_words
from dimuon.optim.gradients import warn_no_gradients
from dimuon.optim.linalg import (
    COEFFICIENT_SETS,
    LR_SCALES,
    NS_ALGORITHMS,
    LrScale,
    NsAlgorithm,
    NsCoefficients,
)
from dimuon.optim.names import network_names
from dimuon.optim.schedules import Schedule, StepKind
from dimuon.optim.validation import (
    check_choice,
    check_lr,
    check_number,
    check_params,
    check_split,
    integer_options,
    take_integral_floats,
)
from dimuon.optim.workspace import Workspace

ALGORITHMS = ("muon", "adamw")
Nonfinite = Literal["raise", "skip"]
NONFINITE_POLICIES: tuple[str, ...] = get_args(Nonfinite)

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


@dataclass
class _MuonWork:
    """One Muon group's step between the momentum update and the weight update."""

    group: dict[str, Any]
    params: list[Tensor]
    jobs: list[MatrixJob]
    config: MapConfig
    keys: list[str]  # each parameter's name in refresh_stats()


@dataclass
class _Verdicts:
    """This rank's verdict per local gradient of one step: which parameter (group, index) each is, and 1/0 finite."""

    owners: list[tuple[int, int]]
    finite: Tensor


@dataclass
class _GradientPlan:
    """Which Muon parameters have a gradient on this rank, against the set every rank agreed on at the last step
    (sharded engines only: the ranks must hand the engine the same jobs, and none can see another's gradients
    without a collective). ``params`` are every Muon parameter as (group, index, parameter), in group order;
    ``held`` and ``agreed`` one flag each; ``codes`` the vote's two rows (:meth:`MuonFamily._gradient_plan`)."""

    params: list[tuple[int, int, Tensor]]
    universe: tuple[int, ...]
    held: tuple[bool, ...]
    agreed: tuple[bool, ...]
    changed: bool
    codes: tuple[Tensor, Tensor]


@dataclass
class _Vote:
    """One step's vote: ``ok`` (0-d bool on the device, the step is taken), this rank's verdicts, and under a
    sharded engine the four flags every rank AND-ed (``[taken, finite, unchanged, changed]``) and the plan."""

    ok: Tensor
    verdicts: _Verdicts
    flags: Tensor | None = None
    plan: _GradientPlan | None = None


class _StepContext:
    """What the core lends its schedule at one step (:class:`~dimuon.optim.schedules.StepContext`): the state, the
    engine, and the one host read, which carries the vote of ``nonfinite="raise"`` where the schedule reads."""

    def __init__(self, opt: MuonFamily, vote: _Vote | None) -> None:
        self.state = opt.state
        self.engine = opt._get_engine()
        self.scratch = opt._schedule_scratch
        self._opt = opt
        self._vote = vote  # read with the schedule's first read, else by settle()

    def read(self, values: Tensor) -> list[float]:
        if self._vote is None:
            return values.tolist()
        vote, self._vote = self._vote, None
        read = torch.cat([values, self._opt._vote_values(vote).to(values)]).tolist()  # one read for both
        self._opt._check_late_vote(read[len(values) :], vote)
        return read[: len(values)]

    def settle(self) -> None:
        """Read the vote now where the schedule's decision did not."""
        if self._vote is not None:
            vote, self._vote = self._vote, None
            self._opt._check_late_vote(self._opt._vote_values(vote).tolist(), vote)


class ForeignGroupKeyWarning(UserWarning):
    """A parameter group carries keys dimuon does not use (a trainer's ``fused``/``foreach``, say): kept, ignored."""


def _same_value(a: Any, b: Any) -> bool:
    """``a == b`` for option values (numbers, tuples), False where they cannot be compared."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _same_matrices(group: dict[str, Any], key: str, a: Any, b: Any) -> bool:
    """Whether values ``a`` and ``b`` of row or column split option ``key`` cut every parameter of ``group`` alike
    (a chunk count and the chunk sizes it means, ``None`` and ``1``)."""
    if key not in ("split_sizes", "col_split_sizes") or not group["params"]:
        return False
    for p in group["params"]:
        _, rows, cols = matrix_shape(p, group["stacked"])
        size = rows if key == "split_sizes" else cols
        try:
            if split_sizes_to_ranges(size, a, "", key) != split_sizes_to_ranges(size, b, "", key):
                return False
        except (TypeError, ValueError):  # a value that does not cut this parameter
            return False
    return True


def _unique_names(names: Any, count: int) -> list[str] | None:
    """``names`` as a list where they name ``count`` parameters, each once (they can match state by name); else
    None."""
    if not isinstance(names, (list, tuple)) or len(names) != count or len(set(names)) != count:
        return None
    return list(names)


def _some_names(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, quoted, and how many more there are."""
    listed = ", ".join(repr(n) for n in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def match_saved_by_name(groups: Sequence[dict[str, Any]], state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each saved group's parameters listed in the order of the optimizer's group ``groups[i]``
    wherever both name their parameters, so that torch's positional load gives every parameter its own state.

    A saved group names its parameters by ``param_names`` (as :func:`dimuon.optim.param_groups` makes them), or
    by its keys where they are names (``torch.distributed.checkpoint``'s ``set_state_dict`` keys the state by
    parameter name and has listed it in this optimizer's order already). Where both sides name every parameter
    once and the names are the same (compared as given, else as the network names them,
    :func:`dimuon.optim.names.network_names`, so that a model saved under DDP or ``torch.compile`` resumes bare and
    the other way round), the state moves with its name and the group keeps the
    optimizer's ``param_names``; other names refuse the load with a ValueError naming them (except the
    checkpoint's own keys, which may spell a name otherwise and were matched by it). Where either side has no
    (unique) names, the group loads by position, as torch loads it."""
    loaded = state_dict["param_groups"]
    matched = list(loaded)
    for gi, (group, saved) in enumerate(zip(groups, loaded)):
        keys = list(saved["params"])
        mine = _unique_names(group.get("param_names"), len(group["params"]))
        by_key = bool(keys) and all(isinstance(k, str) for k in keys)
        theirs = _unique_names(keys if by_key else saved.get("param_names"), len(keys))
        if mine is None or theirs is None or len(mine) != len(theirs):
            continue  # by position (a group of another size is refused by the caller)
        ours, others = mine, theirs
        if set(ours) != set(others):  # as the network names them: a model saved under DDP or compiled, resumed bare
            ours, others = network_names(mine, theirs)
        if set(ours) != set(others) or len(set(ours)) != len(ours) or len(set(others)) != len(others):
            if by_key:  # the checkpoint's names for the parameters, already matched to this optimizer's order
                matched[gi] = {**saved, "param_names": mine}
                continue
            missing = [n for n in mine if n not in set(theirs)]
            unexpected = [n for n in theirs if n not in set(mine)]
            raise ValueError(
                f"parameter group {gi} of the state_dict holds other parameters than this optimizer's: "
                f"missing {_some_names(missing)}; unexpected {_some_names(unexpected)} (state is matched to "
                "parameters by their names, param_names, where the state_dict and the optimizer both carry them; "
                "to load a renamed model's state by position, drop param_names from the state_dict's groups)"
            )
        if others != ours or saved.get("param_names") != mine:
            where = dict(zip(others, keys))
            matched[gi] = {**saved, "params": [where[name] for name in ours], "param_names": mine}
    if all(a is b for a, b in zip(matched, loaded)):
        return state_dict
    return {**state_dict, "param_groups": matched}


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


def group_lr(group: dict[str, Any]) -> float | Tensor:
    """A group's lr as the step uses it: a number, or a 0-d Tensor (a view of a one-element lr of any shape, so a
    scheduler's in-place ``fill_`` still reaches it)."""
    lr = group["lr"]
    return lr.view(()) if isinstance(lr, Tensor) and lr.dim() != 0 else lr


def local_tensor(t: Tensor) -> Tensor:
    """The process-local data of a (possibly DTensor) tensor."""
    return t.to_local() if is_dtensor(t) else t


def matrix_shape(p: Tensor, stacked: bool) -> tuple[int, int, int]:
    """``(count, rows, cols)`` of the matrices parameter ``p`` holds: one ``(shape[0], rest)`` matrix (a conv
    weight's flattening), or with ``stacked`` ``shape[0]`` matrices of ``(shape[1], rest)``."""
    if stacked:
        return p.shape[0], p.shape[1], math.prod(p.shape[2:])
    return 1, p.shape[0], math.prod(p.shape[1:])


# Below this many elements a gradient's masking is launch-bound on an accelerator (a launch costs more than the
# four extra passes of stacking it with its momentum): such gradients of one shape are masked in one ``where``.
MASK_BATCH_NUMEL = 1 << 20


def masked_gradients(mask: Tensor, grads: Sequence[Tensor], bufs: Sequence[Tensor]) -> list[Tensor]:
    """``where(mask, G, M)`` of each gradient and its momentum (in the momentum's dtype): one pass per gradient,
    which replaces the cast of a narrower one; on an accelerator, the small gradients of one shape and dtype
    stacked and masked together (one ``where`` per shape rather than per gradient: a sharded model's pieces are
    small and many). Exact either way: the same values, bit for bit."""
    out: list[Tensor | None] = [None] * len(grads)
    alone = [devices.cpu_path(g.device) or g.numel() > MASK_BATCH_NUMEL for g in grads]
    for i in (i for i, a in enumerate(alone) if a):
        out[i] = torch.where(mask, grads[i], bufs[i])
    for idx in shape_classes(grads, bufs, [not a for a in alone]):
        if len(idx) == 1:
            out[idx[0]] = torch.where(mask, grads[idx[0]], bufs[idx[0]])
            continue
        chosen = torch.where(mask, torch.stack([grads[i] for i in idx]), torch.stack([bufs[i] for i in idx]))
        for i, t in zip(idx, chosen.unbind(0)):
            out[i] = t
    return out  # type: ignore[return-value]


def _matrix_view(weight: Tensor, update: Tensor) -> Tensor | None:
    """The (local) weight as a view of its matrix's shape (that of its update), or None where no view is."""
    if weight.shape == update.shape:
        return weight
    try:
        return weight.view(update.shape)
    except RuntimeError:
        return None


def _as_weight(direction: Tensor, weight: Tensor) -> Tensor:
    """``direction`` shaped as ``weight`` (a view where it can be) and in its dtype (a copy only where they differ)."""
    d = direction.view(weight.shape) if direction.is_contiguous() else direction.reshape(weight.shape)
    return d if d.dtype == weight.dtype else d.to(weight.dtype)


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


class MuonFamily(torch.optim.Optimizer):
    """Muon-family optimizer: one core, a schedule picks the direction map per step.

    Groups with ``"algorithm": "muon"`` (the default) get the matrix update; groups with
    ``"algorithm": "adamw"`` get AdamW with ``adamw_betas``/``adamw_eps``. Use the subclasses
    :class:`~dimuon.optim.Muon`, :class:`~dimuon.optim.PeriodicRowMuon` and
    :class:`~dimuon.optim.MuonBP`. A subclass declares its schedule's options (after ``lr``) and forwards the
    core's as ``**kwargs: Unpack[MuonOptions]`` (typed for editors and type checkers; their defaults are this
    ``__init__``'s); :func:`dimuon.optim.build.option_parameters` lists them all.
    """

    schedule: Schedule = Schedule()
    _schedule_owners: ClassVar[dict[str, str]] = {}  # every subclass's schedule option -> the first class taking it

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        lr_scale: LrScale = "match_rms_adamw",
        ns_coefficients: NsCoefficients = "quintic",
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        ns_algorithm: NsAlgorithm = "standard",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        nonfinite: Nonfinite = "raise",
        refresh: Refresh = DEFAULT_REFRESH,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        comm_dtype: torch.dtype | None = None,
        process_group: Any = None,
        ns_compile: bool = False,
        adamw_fused: bool | None = None,
        kernels: fused.Kernels = "auto",
        replica_refresh: ReplicaRefresh = "repeat",
        engine: DirectionEngine | None = None,
        **schedule_options: Any,
    ) -> None:
        check_params(params, type(self).__name__)
        defaults: dict[str, Any] = dict(
            algorithm="muon",
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            lr_scale=lr_scale,
            ns_coefficients=ns_coefficients,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            ns_algorithm=ns_algorithm,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            split_sizes=None,
            col_split_sizes=None,
            stacked=False,
            **self._schedule_defaults(),
        )
        unknown = set(schedule_options) - set(self._schedule_defaults())
        if unknown:
            signature = inspect.signature(MuonFamily.__init__).parameters.values()
            options = {q.name for q in signature if q.kind is q.KEYWORD_ONLY or q.kind is q.POSITIONAL_OR_KEYWORD}
            options = sorted((options - {"self", "params"}) | set(self._schedule_defaults()))
            raise TypeError(
                f"{type(self).__name__} got unexpected argument(s) {sorted(unknown)}"
                + misspelling_hints(unknown, options)
                + f"; it takes {options}"
            )
        defaults.update(schedule_options)
        self._validate_options(defaults, where="")
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
        self.nonfinite = nonfinite
        self.ns_compile = ns_compile
        self.adamw_fused = adamw_fused
        self.kernels = kernels
        self._tables = fused.Tables()  # the fused kernels' address tables, kept on the device between steps
        self.engine_options = {
            "refresh": refresh,
            "bucket_mb": bucket_mb,
            "comm_dtype": comm_dtype,
            "process_group": process_group,
            "replica_refresh": replica_refresh,
        }
        self._engine: DirectionEngine | None = engine
        self._engine_params: tuple[tuple[int, bool], ...] = ()  # the parameters the engine was built for
        self._engine_given = engine is not None
        self._constructing = True
        self._flattened: list[str] = []
        self._foreign_keys: set[str] = set()
        self._refresh_counts: dict[str, list[int]] = {}  # parameter name -> [spectral steps, steps]
        # the last step's vote and the steps skipped since the last read, counted on the device; a dict that
        # ``step`` fills, not attributes it sets (dynamo compiles item stores into an optimizer's dicts everywhere)
        self._votes: dict[str, Tensor | None] = {"last": None, "pending_skips": None}
        # Under a sharded engine: the Muon parameters (by id) and which of them every rank agreed to step at the last
        # step, and the vote's constant rows per (changed, device) (:meth:`_gradient_plan`); dicts, as above.
        self._grad_sets: dict[str, Any] = {}
        self._vote_codes: dict[tuple[bool, torch.device], tuple[Tensor, Tensor]] = {}
        # Per (group, count, shape, dtype, device): the CPU's Nesterov batch buffers, kept between steps.
        self._workspace: dict[tuple[Any, ...], Tensor] = {}
        # The CPU's Newton-Schulz temporaries and directions, lent within a step and kept between steps.
        self._map_buffers: Workspace | None = Workspace()
        self._schedule_scratch: dict[str, Any] = {}  # what the schedule keeps from one step to the next (not saved)
        super().__init__(params, defaults)
        self._constructing = False
        self._warn_flattened(stacklevel=4)
        self._warn_foreign_keys(stacklevel=4)
        self._prepare_engine()

    # ----------------------------------------------------------------- configuration
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Record which optimizer first takes each of its schedule's options (for a checkpoint's error message)."""
        super().__init_subclass__(**kwargs)
        for key in cls.schedule.options:
            MuonFamily._schedule_owners.setdefault(key, cls.__name__)

    @classmethod
    def _optimizers_taking(cls, key: str, value: Any) -> list[str]:
        """The other optimizers of the family whose schedule takes option ``key`` at a value other than its
        default: a PeriodicRowMuon setting given to Muon is a mistake. At the default it is what building that
        optimizer left in a reused group dict (torch fills groups in place), kept with a warning like any
        foreign key."""
        found, todo = [], list(MuonFamily.__subclasses__())
        while todo:
            other = todo.pop()
            todo += other.__subclasses__()
            defaults = other._schedule_defaults()
            if (
                other is not cls
                and not other.__name__.startswith("_")
                and key in defaults
                and not (_same_value(value, defaults[key]))
            ):
                found.append(other.__name__)
        return sorted(set(found))

    @classmethod
    def _schedule_defaults(cls) -> dict[str, Any]:
        """Schedule hyperparameters this optimizer accepts, with their defaults (its schedule's options)."""
        return cls.schedule.defaults()

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
                layout = derive_layout(p, pname)  # a clear error now for placements the sharded engine cannot run
                if group["stacked"]:  # dimension 1 holds each matrix's rows: a split of it keeps whole rows
                    check_stacked_layout(p, pname, layout, type(self).__name__, self.schedule.whole_rows)
                    continue
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

    # ----------------------------------------------------------------- state
    def _param_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The state of ``p``, made if missing: the same zeros a lazy first step would make.

        State made at construction follows a model moved or cast before its first step (it is
        all zeros until then). Parameters on the meta device get theirs at their first step.
        """
        state = self.state[p]
        local = local_tensor(p)
        if local.device.type == "meta":
            return state
        if group["algorithm"] == "muon":
            # fp32 or the parameter dtype if wider; never aliases the gradient. Shaped (and for
            # DTensor parameters, sharded) like the parameter, so checkpoints can reshard it.
            dtype = torch.promote_types(p.dtype, torch.float32)
            buf = state.get("momentum_buffer")
            if buf is None or (group["step"] == 0 and (buf.dtype, buf.device) != (dtype, p.device)):
                state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            self.schedule.init_state(p, group, state)
            return state
        if "step" in state and not isinstance(state["step"], Tensor):  # a number in older state dicts
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device="cpu")
        avg = state.get("exp_avg")
        if avg is None or (group["step"] == 0 and (avg.dtype, avg.device) != (p.dtype, p.device)):
            # torch's AdamW keeps ``step`` on the CPU unless fused; _adamw_step moves it where the kernel wants it.
            state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (``nonfinite="skip"``); kept per group, so it is saved.

        ``step()`` counts them on the device; reading this property (or saving the state) reads that count on
        the host, once, and adds it to every group's ``skipped_steps``."""
        self._fold_skips()
        return max((g["skipped_steps"] for g in self.param_groups), default=0)

    @property
    def last_step_taken(self) -> Tensor | None:
        """The last ``step()``'s non-finite vote: a 0-d bool tensor on the parameters' device, true where the step
        was taken (None before the first step). A trainer can mask its own updates with it (an EMA, say) without a
        host read; reading it on the host waits for the device."""
        return self._votes["last"]

    def _fold_skips(self) -> None:
        """The device count of skipped steps since the last fold, added to every group's number (one host read)."""
        pending, self._votes["pending_skips"] = self._votes["pending_skips"], None
        if pending is not None:
            count = int(pending)
            for group in self.param_groups:
                group["skipped_steps"] += count

    def state_dict(self) -> dict[str, Any]:
        self._fold_skips()
        return super().state_dict()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({key: getattr(self, key) for key in _RUNTIME_DEFAULTS})
        state["engine_options"] = self.engine_options
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)  # torch's __setstate__ adds it; no group here takes it
        runtime = {
            **_RUNTIME_DEFAULTS,
            "engine_options": dict(_ENGINE_DEFAULTS),
            "_engine": None,
            "_engine_given": False,
            "_constructing": False,
            "_flattened": [],
            "_foreign_keys": set(),
            "_engine_params": (),
            "_refresh_counts": {},
            "_votes": {"last": None, "pending_skips": None},
            "_grad_sets": {},
            "_vote_codes": {},
            "_workspace": {},
            "_tables": fused.Tables(),
            "_map_buffers": Workspace(),
            "_schedule_scratch": {},
        }
        for key, value in runtime.items():
            if not hasattr(self, key):
                setattr(self, key, value)
        for group in self.param_groups:  # state dicts of earlier versions lack newer options
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            group.setdefault("step", 0)
            group.setdefault("skipped_steps", 0)
            for p in group["params"]:
                self._param_state(p, group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, refusing (with what differs) a state_dict of another optimizer,
        grouping, parameter names or shapes, or of other matrix options (``split_sizes``, ``col_split_sizes``,
        ``stacked``), and keeping the matrix state in its saved dtypes (torch casts every floating state tensor to
        its parameter's dtype: momenta and row sums stay wide, references bf16).

        Where the state_dict's groups and this optimizer's both carry ``param_names`` (as
        :func:`dimuon.optim.param_groups` makes them), state is matched to parameters by name, so parameters
        listed in another order since the save each get their own, and the groups keep this optimizer's names;
        other names are refused (:func:`match_saved_by_name`). Without names on either side it is matched by
        position, as torch does. Hyperparameters (``lr``, ``momentum``, ...) come from the state_dict, as torch's."""
        saved: list[tuple[Tensor, str, Tensor]] = []  # (parameter, key, the state tensor as loaded)

        def check(_: torch.optim.Optimizer, loaded: dict[str, Any]) -> dict[str, Any]:
            loaded = self._check_loadable(loaded)  # its groups' parameters in this optimizer's order (by name)
            self._votes["pending_skips"] = None  # the loaded counts replace this run's (a refused load keeps them)
            ids = chain.from_iterable(g["params"] for g in loaded["param_groups"])
            params = chain.from_iterable(g["params"] for g in self.param_groups)
            for key, p in zip(ids, params):
                for name, value in loaded["state"].get(key, {}).items():
                    if name in ("momentum_buffer", *self.schedule.state_dtypes):
                        saved.append((p, name, value))
            return loaded  # what torch loads, by position

        def restore(_: torch.optim.Optimizer) -> None:
            for p, name, kept in saved:
                now = self.state[p][name]
                if now.dtype != kept.dtype:
                    self.state[p][name] = kept.to(device=now.device)
            self._schedule_scratch = {}  # what the schedule kept for its next step belongs to the run before
            for group in self.param_groups:
                for key, value in self._schedule_defaults().items():
                    group.setdefault(key, value)  # an option added after the state_dict was saved
                for p in group["params"]:
                    if is_dtensor(p):
                        self._follow_placements(p)

        handles = (
            self.register_load_state_dict_pre_hook(check),  # after the user's pre-hooks
            # Before the user's post-hooks: they see (and may change) the state as it is loaded, not torch's casts.
            self.register_load_state_dict_post_hook(restore, prepend=True),
        )
        try:
            super().load_state_dict(state_dict)
        finally:
            for handle in handles:
                handle.remove()

    def _follow_placements(self, p: Tensor) -> None:
        """Lay ``p``'s state tensors out as ``p`` is laid out: a checkpoint may bring them gathered along a
        mesh dimension (DCP cannot store head-wise tensor-parallel pieces) or from another layout."""
        state = self.state[p]
        for name, value in state.items():
            if (
                is_dtensor(value)
                and value.ndim > 0
                and (value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements))
            ):
                state[name] = value.redistribute(p.device_mesh, p.placements)

    def _check_loadable(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Raise a ValueError naming what differs unless ``state_dict`` was saved by this kind of optimizer
        over parameters of the same groups, names and shapes, with the same matrix options; return it with each
        group's parameters in this optimizer's order (:func:`match_saved_by_name`)."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"state_dict is not an optimizer's state dict (it has {keys}, not 'state' and 'param_groups'); "
                "a container's state (e.g. build('torch_muon')'s) loads into the same container"
            )
        groups, loaded = self.param_groups, state_dict["param_groups"]
        if len(loaded) != len(groups):
            raise ValueError(f"state_dict has {len(loaded)} parameter groups, this optimizer {len(groups)}")
        mine = set(self._schedule_defaults())
        for gi, (group, saved) in enumerate(zip(groups, loaded)):
            if "algorithm" not in saved:
                raise ValueError(
                    f"state_dict parameter group {gi} has no 'algorithm': it was not saved by a Muon-family optimizer"
                )
            stray = sorted(k for k in set(saved) - mine if k in MuonFamily._schedule_owners)
            missing = sorted(mine - set(saved) - set(self.schedule.late_options))
            if stray or missing:
                owners = ", ".join(sorted({MuonFamily._schedule_owners[k] for k in stray}))
                found = ([f"carry {stray} (options of {owners})"] if stray else []) + (
                    [f"lack {missing}"] if missing else []
                )
                raise ValueError(
                    f"state_dict was not saved by {type(self).__name__}: its parameter groups {' and '.join(found)}"
                    f" ({type(self).__name__}'s schedule options: {sorted(mine) or 'none'})"
                )
            if saved["algorithm"] != group["algorithm"]:
                raise ValueError(
                    f"parameter group {gi} is {group['algorithm']!r} here but {saved['algorithm']!r} in the state_dict"
                )
        state_dict = match_saved_by_name(groups, state_dict)
        for gi, (group, saved) in enumerate(zip(groups, state_dict["param_groups"])):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"parameter group {gi} holds {len(group['params'])} parameters here but "
                    f"{len(saved['params'])} in the state_dict"
                )
            if group["algorithm"] == "muon":
                self._check_matrix_options(gi, group, saved)
            for i, (key, p) in enumerate(zip(saved["params"], group["params"])):
                for name, value in state_dict["state"].get(key, {}).items():
                    shape = tuple(self.schedule.state_shape(name, p, group) or p.shape)
                    if isinstance(value, Tensor) and value.ndim > 0 and tuple(value.shape) != shape:
                        expected = "" if shape == tuple(p.shape) else f"expected {shape} for "
                        raise ValueError(
                            f"state_dict does not fit parameter {self._param_name(group, i, gi)!r}: its "
                            f"{name!r} has shape {tuple(value.shape)}, {expected}the parameter {tuple(p.shape)}"
                        )
        return state_dict

    def _check_matrix_options(self, gi: int, group: dict[str, Any], saved: dict[str, Any]) -> None:
        """Refuse a saved Muon group whose matrix options (``stacked``, ``split_sizes``, ``col_split_sizes``) cut
        its parameters into other matrices than this optimizer's group does: its state belongs to those matrices
        (AdaptiveRowMuon's row sums are shaped by them), and a load that took the saved value would silently undo
        the one this optimizer was built with. Different spellings of one cut (``4`` or ``(4, 4, 4, 4)`` columns
        of 16) load."""
        for key in _MATRIX_GROUP_OPTIONS:
            then, now = saved.get(key, self.defaults[key]), group[key]
            if _same_value(then, now) or _same_matrices(group, key, then, now):
                continue
            raise ValueError(
                f"parameter group {gi} was saved with {key}={then!r} and is built here with {key}={now!r}: it "
                f"decides which matrices the saved state belongs to; construct the optimizer with {key}={then!r} "
                "to load this state_dict"
            )

    # ----------------------------------------------------------------- execution
    def _get_engine(self) -> DirectionEngine:
        """Local engine for plain tensors; sharded engine for DTensors or when a process group is given.

        Built at construction where the parameters are sharded then (:meth:`_prepare_engine`), else at the first
        step, and again when the parameters were replaced since (a wrapper that shards
        the model after the optimizer was made and points the groups at the sharded parameters): the
        engine derives each parameter's layout from the parameters it is handed, per parameter object.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        current = tuple((id(p), is_dtensor(p)) for p in params)
        if self._engine is None or (not self._engine_given and current != self._engine_params):
            self._drop_stale_state(params)
            if self.engine_options["process_group"] is not None or any(is_dtensor(p) for p in params):
                from dimuon.optim.distributed.sharded import ShardedEngine

                self._engine = ShardedEngine(**self.engine_options, params=params)
            else:
                self._engine = LocalEngine()
            self._engine_params = current
        assert self._engine is not None
        return self._engine

    def _prepare_engine(self) -> None:
        """The sharded engine built now, with every Muon parameter's layout and the process groups it talks over
        (host reads of the meshes, communicators made by every rank together): start-up work, not a step's. Plain
        parameters get the local engine now too, so that a compiled ``step`` finds it built (a wrapper that shards
        them later makes the first step build the sharded one)."""
        params = [p for g in self.param_groups for p in g["params"]]
        if self._engine_given:
            return
        if not (self.engine_options["process_group"] is not None or any(is_dtensor(p) for p in params)):
            self._get_engine()
            return
        prepare = getattr(self._get_engine(), "prepare", None)
        if prepare is None:
            return
        matrices = []
        for group in self.param_groups:
            if group["algorithm"] != "muon":
                continue
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                count, rows, cols = matrix_shape(p, group["stacked"])
                matrices.append((p, names[i] if names else f"params[{i}]", count * rows, cols))
        prepare(matrices)

    def _drop_stale_state(self, params: list[Tensor]) -> None:
        """Forget the state of tensors that are no longer parameters of any group (replaced ones): torch's
        ``state_dict`` cannot map them, and their (unsharded) zeros would only hold memory."""
        held = {id(p) for p in params}
        for stale in [p for p in self.state if id(p) not in held]:
            del self.state[stale]

    def _local_grads_finite(self) -> tuple[Tensor, _Verdicts]:
        """0-d bool on the parameters' device: every local gradient entry is finite (one pass per gradient: the
        extremes, or on an accelerator the largest magnitudes, are finite exactly when every entry is, NaN
        propagates); and the verdict per local gradient, for the error message (:meth:`_vote_values`)."""
        params = [(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        device = local_tensor(params[0][2]).device if params else torch.device("cpu")
        grads: dict[torch.device, list[tuple[int, int, Tensor]]] = {}
        for gi, i, p in params:
            g = local_tensor(p.grad) if p.grad is not None else None
            if g is not None and g.numel() > 0:  # an empty local shard has nothing to check
                grads.setdefault(g.device, []).append((gi, i, g))
        flag = torch.ones((), dtype=torch.bool, device=device)
        owners: list[tuple[int, int]] = []
        verdicts: list[Tensor] = []
        for where, entries in grads.items():
            parts = [g for _, _, g in entries]
            if devices.cpu_path(where):  # no launches to save, and aminmax is ~20x faster there than the inf-norm
                extremes = torch.cat([torch.stack(torch.aminmax(g)) for g in parts]).view(len(parts), 2)
            else:  # one list reduction for every gradient, not two launches per gradient
                wide = functools.reduce(torch.promote_types, {g.dtype for g in parts}, torch.float32)
                extremes = torch.stack(torch._foreach_norm(parts, ord=math.inf, dtype=wide)).view(len(parts), 1)
            finite = torch.isfinite(extremes).all(dim=1).to(device)
            owners += [(gi, i) for gi, i, _ in entries]
            verdicts.append(finite)
            flag = flag & finite.all()
        return flag, _Verdicts(owners, torch.cat(verdicts) if verdicts else flag[None][:0])

    @staticmethod
    def _vote_values(vote: _Vote) -> Tensor:
        """``[vote, this rank's verdict per gradient...]`` as floats (1 finite): what ``"raise"`` reads, once; under a
        sharded engine ``[vote, finite, unchanged, changed, verdicts...]`` (the flags every rank AND-ed)."""
        parts = [vote.ok.reshape(1)] + ([vote.flags[1:]] if vote.flags is not None else []) + [vote.verdicts.finite]
        return torch.cat(parts).to(torch.float32)

    # ----------------------------------------------------------------- which Muon parameters step
    def _gradient_plan(self, engine: DirectionEngine, device: torch.device) -> _GradientPlan | None:
        """Which Muon parameters have a gradient here, against the set the ranks agreed on at the last step (None for
        the local engine, whose one process decides alone).

        The ranks hand a sharded engine the same jobs, or their collectives differ (gloo aborts, NCCL hangs), and a
        rank cannot see another's gradients without communicating. So each rank compares its set with the agreed
        one (at first every Muon parameter that requires a gradient) and adds two flags to the step's vote, which
        stays one 4-byte all-reduce: ``[taken, finite, unchanged, changed]``, every flag AND-ed over the ranks
        (``taken`` is ``finite and unchanged`` of this rank, the step's ``ok`` where no rank's set changed). The
        host reads nothing for it where this rank's set did not change (:meth:`_settle_gradients`)."""
        if isinstance(engine, LocalEngine):
            return None
        params = [
            (gi, i, p)
            for gi, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon"
            for i, p in enumerate(group["params"])
        ]
        universe = tuple(id(p) for _, _, p in params)
        held = tuple(p.grad is not None for _, _, p in params)
        known = self._grad_sets.get("agreed")
        if known is not None and known[0] == universe:
            agreed = known[1]
        else:  # new parameters (the first step, a group added, parameters replaced): all that require a gradient
            agreed = tuple(p.requires_grad for _, _, p in params)
            # kept on every rank now, at the same step: a rank that reads nothing at this step must not work it out
            # again later, when requires_grad may have changed, while another rank kept it (their sets would differ)
            self._grad_sets["agreed"] = (universe, agreed)
        changed = held != agreed
        codes = self._vote_codes.get((changed, device))
        if codes is None:  # the vote's two rows, made once: where this rank's gradients are finite, and where not
            same = not changed
            codes = self._vote_codes[(changed, device)] = (
                torch.tensor([same, True, same, changed], dtype=torch.bool, device=device),
                torch.tensor([False, False, same, changed], dtype=torch.bool, device=device),
            )
        return _GradientPlan(params, universe, held, agreed, changed, codes)

    def _settle_gradients(self, vote: _Vote, values: Sequence[float], read_now: bool) -> None:
        """Agree on the Muon parameters to step from the vote as this rank read it, ``values`` (this rank's set of
        gradients changed, or ``"raise"`` reads it now anyway), the same on every rank by construction:

        - no rank's set changed: the agreed set again (a rank whose set did not change reads nothing);
        - every rank's set changed (so every rank reads this): one more all-reduce, of a has-a-gradient and a
          has-none flag per Muon parameter, and the parameters some rank has a gradient for; where the ranks
          disagree on one, the step is not taken;
        - some did and some did not: the agreed set again, and the step is not taken (the ranks whose set did not
          change cannot know it, and step masked by the vote).

        A step not taken for a parameter whose gradient is None on some ranks only raises a RuntimeError naming
        it with ``"raise"`` (on every rank: each reads the vote, here or with the schedule's signals) and warns
        with ``"skip"`` (where this rank knows it), the step then counted as skipped on every rank."""
        plan, flags = vote.plan, vote.flags
        assert plan is not None and flags is not None
        if values[0] > 0:  # taken: no rank's set changed, every gradient finite (a meta read, the census's, is inf)
            return
        unchanged, changed = values[2] > 0, values[3] > 0
        bad: list[int] | None = None  # the parameters the ranks disagree on, where every rank knows them
        if changed:  # every rank's set changed: every rank is here
            plan.agreed, bad = self._gradient_census(plan)
            # The vote again: every rank's finiteness, or (disagreeing) a false flag: no rank is unchanged here.
            vote.ok = flags[1] if not bad else flags[2]
        elif not unchanged and read_now:  # some ranks' sets changed, and every rank reads the vote now
            bad = self._disagreements(plan)
        self._grad_sets["agreed"] = (plan.universe, plan.agreed)
        if bad or (not changed and not unchanged):
            if self.nonfinite == "raise":
                if bad is not None:  # every rank knows which: each raises the same error
                    raise RuntimeError(self._missing_gradient_message(plan, bad))
                # else this rank alone knows: every rank raises when it reads the vote with the schedule's signals
            else:
                message = self._missing_gradient_message(plan, bad) if bad else self._local_mismatch_message(plan)
                warnings.warn(f"{message}; nonfinite='skip': the step is skipped on every rank", stacklevel=3)
        if read_now:
            self._check_vote([values[1], *values[4:]], vote.verdicts)  # non-finite gradients, as without flags

    def _gradient_census(self, plan: _GradientPlan) -> tuple[tuple[bool, ...], list[int]]:
        """The Muon parameters some rank has a gradient for (the set to step), and those whose gradient is None on
        some ranks only: one all-reduce of a has-a-gradient and a has-none flag per parameter and one read, where
        every rank must know (every rank calls it, at the same point)."""
        n = len(plan.held)
        if n == 0:
            return (), []
        flags = torch.tensor(plan.held + tuple(not h for h in plan.held), dtype=torch.bool, device=plan.codes[0].device)
        both = self._get_engine().all_true(flags).tolist()
        every, none = [v > 0 for v in both[:n]], [v > 0 for v in both[n:]]
        return tuple(not x for x in none), [k for k in range(n) if not (every[k] or none[k])]

    def _disagreements(self, plan: _GradientPlan) -> list[int]:
        """The Muon parameters whose gradient is None on some ranks only (a collective: every rank calls it)."""
        return self._gradient_census(plan)[1]

    def _param_label(self, gi: int, i: int) -> str:
        group = self.param_groups[gi]
        name = self._param_name(group, i, gi)
        return name if group.get("param_names") else f"{name} with shape {tuple(group['params'][i].shape)}"

    def _missing_gradient_message(self, plan: _GradientPlan, bad: Sequence[int]) -> str:
        names = [self._param_label(*plan.params[k][:2]) for k in bad]
        return (
            f"the gradient of {_some_names(names)} is None on some ranks and not on others, so the ranks would step "
            "different parameters (their collectives would not match); every rank must have a gradient for a Muon "
            "parameter, or none may. The step was not taken and the momentum is unchanged"
        )

    def _local_mismatch_message(self, plan: _GradientPlan) -> str:
        """What this rank knows where some ranks' sets of gradients changed and others' did not: the others hold the
        agreed set, so a parameter of it without a gradient here has one there, and the other way round."""
        pairs = list(zip(plan.held, plan.agreed))
        missing = [self._param_label(*plan.params[k][:2]) for k, (h, a) in enumerate(pairs) if a and not h]
        extra = [self._param_label(*plan.params[k][:2]) for k, (h, a) in enumerate(pairs) if h and not a]
        parts = []
        if missing:
            parts.append(f"this rank has no gradient for {_some_names(missing)}, which other ranks have")
        if extra:
            parts.append(f"this rank has a gradient for {_some_names(extra)}, which other ranks have not")
        return (
            f"{'; '.join(parts)}: the gradient of a Muon parameter is None on some ranks and not on others, so the "
            "ranks would step different parameters; every rank must have a gradient for it, or none may"
        )

    def _check_late_vote(self, values: Sequence[float], vote: _Vote) -> None:
        """The vote read with the schedule's signals (``"raise"``; every rank reads it there): a RuntimeError naming
        the parameter where some ranks' sets of gradients changed and others' did not, else :meth:`_check_vote`."""
        if vote.flags is None:
            self._check_vote(values, vote.verdicts)
            return
        if values[0] > 0:  # taken (a meta tensor's read, the census's plan pass, reads as inf)
            return
        if not values[2] > 0 and not values[3] > 0:  # some ranks' sets changed and others' did not
            assert vote.plan is not None
            raise RuntimeError(self._missing_gradient_message(vote.plan, self._disagreements(vote.plan)))
        self._check_vote([values[1], *values[4:]], vote.verdicts)

    def _check_vote(self, values: Sequence[float], verdicts: _Verdicts) -> None:
        """Raise, naming this rank's first non-finite gradient, where the vote read as ``values`` failed."""
        if values[0] > 0:  # a meta tensor's read (the census's plan pass) reads as inf: finite
            return
        owners = verdicts.owners
        bad = next((owners[j] for j, v in enumerate(values[1:]) if not v > 0), None)
        where = "a parameter on another rank"
        if bad is not None:
            gi, i = bad
            group = self.param_groups[gi]
            name = self._param_name(group, i, gi)
            where = name if group.get("param_names") else f"{name} with shape {tuple(group['params'][i].shape)}"
        raise FloatingPointError(
            f"non-finite gradient in {where}; the step was not taken and the "
            "momentum is unchanged (pass nonfinite='skip' to skip such steps instead)"
        )

    def _check_sparse(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    pname = self._param_name(group, i, gi)
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients (parameter {pname!r})")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step; returns the closure's loss if a closure is given.

        Every rank votes (one 4-byte all-reduce where the parameters span the world) on whether every gradient
        entry is finite, before any other collective of the step, and the result stays on the device. With
        ``nonfinite="skip"`` the step runs its usual kernels masked by the vote (weights, momenta, AdamW state and
        references unchanged where it fails) and the host reads nothing. With ``"raise"`` the host reads the vote
        once and raises before anything is touched; a per-matrix schedule reads it with its staleness signals
        (still one read), after the masked momentum update and before any weight moves.

        Under a sharded engine the same 4 bytes also tell whether any rank's set of Muon parameters with a gradient
        changed since the last step, so that every rank steps the same ones (:meth:`_settle_gradients`): a gradient
        None on every rank leaves its parameter alone, one None on some ranks only raises a RuntimeError naming it
        (``"raise"``) or skips the step on every rank (``"skip"``). Only a step where the set changes reads more.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_sparse()
        if self._map_buffers is not None and not torch.compiler.is_compiling():  # a compiled step borrows nothing
            self._map_buffers.release()  # the last step's directions and temporaries are done with
        local, verdicts = self._local_grads_finite()
        engine = self._get_engine()
        plan = self._gradient_plan(engine, local.device)
        if plan is None:
            vote = _Vote(engine.all_true(local), verdicts)
        else:  # [taken, finite, unchanged, changed], AND-ed over the ranks: still one 4-byte all-reduce
            flags = engine.all_true(torch.where(local, *plan.codes))
            vote = _Vote(flags[0], verdicts, flags, plan)
        # "raise" and a schedule that reads nothing to decide: the one read now, then the plain kernels. Otherwise
        # the step is masked (and under "raise" the vote is read with the schedule's signals).
        read_now = self.nonfinite == "raise" and not self.schedule.reads_signals
        if plan is not None and (plan.changed or read_now):  # the ranks agree on the Muon parameters to step
            # one read: the vote, its flags and this rank's verdicts
            self._settle_gradients(vote, self._vote_values(vote).tolist(), read_now)
        elif read_now:  # the vote and this rank's verdicts, one host read
            self._check_vote(self._vote_values(vote).tolist(), verdicts)
        ok = vote.ok
        mask = None if read_now else ok
        self._votes["last"] = ok
        if self.nonfinite == "skip":
            skipped = (~ok).to(torch.int64)  # a device counter: read when skipped_steps is read or the state saved
            pending = self._votes["pending_skips"]
            self._votes["pending_skips"] = skipped if pending is None else pending + skipped
        agreed: dict[int, list[Tensor]] = {}  # under a sharded engine, the Muon parameters every rank steps
        if plan is not None:
            for (gi, _, p), step_it in zip(plan.params, plan.agreed):
                if step_it:
                    agreed.setdefault(gi, []).append(p)
        stepped, works = [], []
        for gi, group in enumerate(self.param_groups):
            if plan is not None and group["algorithm"] == "muon":
                params = agreed.get(gi, [])
            else:
                params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            stepped.append(group)
            if group["algorithm"] == "adamw":
                self._adamw_step(group, params, mask)
            else:
                works.append(self._muon_work(gi, group, params, mask))
        if not stepped:  # nothing had a gradient: the parameters held are most likely not the model's
            warn_no_gradients(self, self.param_groups)
        ctx = _StepContext(self, vote if self.nonfinite == "raise" and not read_now else None)
        kinds = self.schedule.decide(works, ctx)
        ctx.settle()  # the vote, where the decision read nothing: raised on before any weight moves
        for work, work_kinds in zip(works, kinds):
            self._muon_apply(work, work_kinds, mask, ctx)
        # The schedule's step counter is host data: it counts step slots, taken or skipped ("skip" cannot know).
        for group in stepped:
            group["step"] += 1
        return loss

    def _muon_work(self, gi: int, group: dict[str, Any], params: list[Tensor], mask: Tensor | None) -> _MuonWork:
        """Momentum update of Muon group ``gi`` and its matrix jobs (the Nesterov momenta), ready for the engine.

        With a ``mask`` (the vote, a 0-d bool) each gradient is taken as ``where(mask, G, M)``
        (:func:`masked_gradients`), after which a failed vote leaves ``M`` bitwise unchanged (``lerp(M, M, w) = M``)
        and ``U = M`` finite, and a passed one computes what the unmasked step does, bit for bit. A NaN never
        reaches a kernel whose result is kept."""
        beta = group["momentum"]
        names = group.get("param_names")
        index = {id(p): i for i, p in enumerate(group["params"])}
        grads, bufs, jobs, keys = [], [], [], []
        for p in params:
            state = self.state[p]
            if group["step"] == 0 or "momentum_buffer" not in state:  # made, or remade after a move, before step 1
                state = self._param_state(p, group)
            bufs.append(local_tensor(state["momentum_buffer"]))
            # A parameter the ranks agreed to step without a gradient here: the ranks disagree on it, so the vote
            # failed on every rank and the step is masked; zeros stand in (finite, then replaced by M).
            grads.append(local_tensor(p.grad) if p.grad is not None else torch.zeros_like(bufs[-1]))
        if bufs and fused.fuses(self.kernels, bufs[0].device) and fused.launchable(*grads, *bufs):
            # One launch: M <- lerp(M, G, 1 - beta) and U <- lerp(G, M, beta), G masked by the vote in the kernel.
            flat = [b.view(b.shape[0], math.prod(b.shape[1:])) for b in bufs]
            slots = self._nesterov_slots(gi, flat) if group["nesterov"] else None
            fused.momentum_(self._tables, grads, bufs, slots, beta, mask)
            updates = slots if slots is not None else flat
        else:
            grads = [g.to(b.dtype) for g, b in zip(grads, bufs)] if mask is None else grads
            if mask is not None:
                grads = masked_gradients(mask, grads, bufs)
            # M <- beta*M + (1-beta)*G  (EMA form)
            torch._foreach_lerp_(bufs, grads, 1.0 - beta)
            updates = self._nesterov_updates(gi, grads, bufs, beta, group["nesterov"])
        stacked = group["stacked"]
        for p, u in zip(params, updates):
            count, rows, cols = matrix_shape(p, stacked)
            i = index[id(p)]
            name = names[i] if names else f"params[{i}]"
            keys.append(self._param_name(group, i, gi))
            splits = split_sizes_to_ranges(rows, group["split_sizes"], name)
            jobs.append(
                MatrixJob(
                    name=name,
                    # A stacked parameter's matrices lie one under the other: the (count*rows, cols) view.
                    update=u.reshape(-1, cols) if stacked else u,
                    rows=count * rows,
                    cols=cols,
                    splits=stacked_ranges(count, rows, splits) if stacked else splits,
                    blocks=block_grid(group.get("blocks", 1)),
                    meta={"param": p},
                    col_splits=col_split_sizes_to_ranges(cols, group["col_split_sizes"], name),
                    matrix_rows=rows if stacked else None,
                )
            )
        # The CPU keeps the maps' large buffers from step to step (a fresh one is paged in again at every step);
        # accelerators' allocators cache them already, and a compiled step allocates inside its graph.
        cpu = bool(bufs) and devices.cpu_path(bufs[0].device) and not torch.compiler.is_compiling()
        config = MapConfig(
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            ns_algorithm=group["ns_algorithm"],
            ns_dtype=group["ns_dtype"],
            lr_scale=group["lr_scale"],
            ns_compile=self.ns_compile,
            workspace=self._map_buffers if cpu else None,
        )
        return _MuonWork(group, params, jobs, config, keys)

    def _muon_apply(self, work: _MuonWork, kinds: Sequence[StepKind], mask: Tensor | None, ctx: _StepContext) -> None:
        """Directions for each kind's jobs (one engine call per kind present), then the weight update.

        With a ``mask`` the decay factor is ``where(mask, 1 - lr wd, 1)`` (the same multiply) and the directions are
        multiplied by the mask (one list op: exact, ``D * 1 = D``; finite ``D * 0 = 0``, ``U`` being finite) before
        the usual update: a passed vote moves the weights bit for bit as the unmasked step, a failed one not at all.
        """
        group, engine = work.group, self._get_engine()
        lr, wd = group_lr(group), group["weight_decay"]
        weights = [local_tensor(p) for p in work.params]
        directions: list[Tensor | None] = [None] * len(work.jobs)
        # Per kind present: one engine call, then one list update of the weights it moves (every matrix of a kind
        # shares the step size lr * mult, as the engine's directions carry their shape scale).
        chosen_by_kind = {kind: [i for i, k in enumerate(kinds) if k is kind] for kind in StepKind}
        chosen_by_kind = {kind: chosen for kind, chosen in chosen_by_kind.items() if chosen}
        row_scaled: dict[int, RowScaled] = {}  # RowNorm directions left as U * factor: folded into the update
        for kind, chosen in chosen_by_kind.items():
            jobs = [work.jobs[i] for i in chosen]
            made = (
                engine.row_directions(jobs, work.config)
                if kind is StepKind.ROWNORM and hasattr(engine, "row_directions")
                else engine.directions(jobs, kind, work.config)
            )
            for i, d in zip(chosen, made):
                if isinstance(d, RowScaled) and _matrix_view(weights[i], d.update) is None:
                    d = d.materialize()  # a weight that is no view of its matrix (non-contiguous): written out
                if isinstance(d, RowScaled):
                    row_scaled[i] = d
                directions[i] = d
        done = self._fused_apply(work, weights, directions, chosen_by_kind, mask)
        if done:  # the rest take the eager form below
            chosen_by_kind = {k: [i for i in c if i not in done] for k, c in chosen_by_kind.items()}
        if wd != 0 and len(done) < len(weights):
            decay = 1.0 - lr * wd  # decoupled, with the unscaled lr
            if mask is not None:
                decay = torch.where(mask, torch.as_tensor(decay, dtype=torch.float64, device=mask.device), 1.0)
            torch._foreach_mul_([w for i, w in enumerate(weights) if i not in done], decay)
        for kind, chosen in chosen_by_kind.items():
            step_size = lr * self.schedule.multiplier(kind, group)
            scaled = [i for i in chosen if i in row_scaled]
            if scaled:  # W <- W - step U factor: one read of U and W, one write of W, no direction written
                fs = [row_scaled[i].factor for i in scaled]
                if mask is not None:
                    fs = torch._foreach_mul(fs, mask.to(torch.float32))
                ws = [_matrix_view(weights[i], row_scaled[i].update) for i in scaled]
                us = [row_scaled[i].update for i in scaled]
                if isinstance(step_size, Tensor):  # a Tensor lr: a 0-d factor (value takes numbers only)
                    torch._foreach_addcmul_(ws, us, torch._foreach_mul(fs, -step_size))
                else:
                    torch._foreach_addcmul_(ws, us, fs, value=-step_size)
            plain = [i for i in chosen if i not in row_scaled]
            if not plain:
                continue
            ws = [weights[i] for i in plain]
            # The direction as a view of the weight's shape, cast only where the weight is narrower (bf16).
            ds = [_as_weight(directions[i], weights[i]) for i in plain]  # type: ignore[arg-type]
            if mask is not None:
                ds = torch._foreach_mul(ds, mask.to(torch.float32))
            if isinstance(step_size, Tensor):  # a Tensor lr: a 0-d factor (alpha takes numbers only)
                torch._foreach_sub_(ws, torch._foreach_mul(ds, step_size))
            else:
                torch._foreach_add_(ws, ds, alpha=-step_size)
        self._count_kinds(work, kinds)
        self.schedule.after_step(work, kinds, directions, mask, ctx)

    def _fused_apply(
        self,
        work: _MuonWork,
        weights: Sequence[Tensor],
        directions: Sequence[RowDirection | None],
        chosen_by_kind: dict[StepKind, list[int]],
        mask: Tensor | None,
    ) -> set[int]:
        """Weight decay and update of every weight the fused kernel takes, one launch per kind (and dtype pair):
        ``W <- (1 - lr wd) W - step D f``; returns the indices it moved (none where the step does not fuse)."""
        group = work.group
        lr, wd = group_lr(group), group["weight_decay"]
        if not weights or not fused.fuses(self.kernels, weights[0].device):
            return set()
        if isinstance(lr, Tensor):
            if wd != 0:  # the decay would be a device number too: the eager form takes it
                return set()
            if lr.device.type == "cpu" and weights[0].device.type != "cpu":
                lr = float(lr)  # a host number: no device read
        done: set[int] = set()
        for kind, chosen in chosen_by_kind.items():
            ws, ds, fs, idx = [], [], [], []
            for i in chosen:
                d = directions[i]
                if isinstance(d, RowScaled):
                    w, u, f = _matrix_view(weights[i], d.update), d.update, d.factor
                    if w is None or f.dtype != torch.float32 or not f.is_contiguous():
                        continue
                else:
                    w, u, f = weights[i], d, None  # type: ignore[assignment]
                    if u is None or u.numel() != w.numel():
                        continue
                if fused.launchable(w, u):
                    ws.append(w), ds.append(u), fs.append(f), idx.append(i)
            if idx:
                step = lr * self.schedule.multiplier(kind, group)
                fused.update_(self._tables, ws, ds, fs, step, 1.0 - float(lr) * wd if wd else 1.0, mask)
                done.update(idx)
        return done

    def _nesterov_updates(
        self, gi: int, grads: list[Tensor], bufs: list[Tensor], beta: float, nesterov: bool
    ) -> list[Tensor]:
        """``U`` per parameter of group ``gi`` as a 2-D ``(local_rows, cols)`` matrix (read-only downstream).

        With Nesterov, ``U = (1-beta) G + beta M`` is written straight into one ``(B, r, c)``
        buffer per shape, the batch the engine would otherwise have to stack (a copy saved). On the CPU the
        buffers are kept from step to step (a fresh large allocation there is paged in at every step, which costs
        more than the writes); elsewhere the allocator's cache does that without holding them between steps.
        """
        flat = [b.reshape(b.shape[0], math.prod(b.shape[1:])) for b in bufs]  # the local piece
        if not nesterov:
            return flat  # U = M
        out = self._nesterov_slots(gi, flat)
        gs = [g.reshape(u.shape) for g, u in zip(grads, out)]
        if devices.cpu_path(flat[0].device):  # one pass per parameter: U <- lerp(G, M, beta), read twice, written once
            for g, m, u in zip(gs, flat, out):
                torch.lerp(g, m, beta, out=u)
        else:  # two list ops (few launches): U <- G, then U <- lerp(U, M, beta), the same lerp bit for bit
            torch._foreach_copy_(out, gs)
            torch._foreach_lerp_(out, flat, beta)
        return out

    def _nesterov_slots(self, gi: int, flat: Sequence[Tensor]) -> list[Tensor]:
        """Where the Nesterov momenta of group ``gi`` go: per parameter a row of one ``(B, r, c)`` buffer per shape,
        dtype and device of its 2-D momentum view in ``flat`` (kept from step to step on the CPU). The dtype is the
        momentum's: an fp64 parameter's ``U`` is never rounded into an fp32 neighbour's buffer."""
        classes: dict[tuple[Any, ...], list[int]] = {}
        for i, b in enumerate(flat):
            classes.setdefault((tuple(b.shape), b.dtype, b.device), []).append(i)
        out: list[Tensor] = [flat[0]] * len(flat)
        for (shape, dtype, device), idx in classes.items():
            key = (gi, len(idx), shape, dtype, device)
            batch = self._workspace.get(key)
            if batch is None:
                batch = torch.empty((len(idx), *shape), dtype=dtype, device=device)
                if devices.cpu_path(device):
                    self._workspace[key] = batch
            for i, row in zip(idx, batch.unbind(0)):
                out[i] = row
        return out

    @staticmethod
    def _fused_supported(params: Sequence[Tensor]) -> bool:
        """Whether torch has a fused AdamW kernel for every one of ``params`` (device type and dtype), and they are
        contiguous: torch 2.13's fused kernel returns wrong updates for a non-contiguous parameter (and for a
        gradient or moments laid out unlike the parameter, which :meth:`_adamw_kernel` makes contiguous)."""
        devices = _get_fused_kernels_supported_devices()
        return all(
            local_tensor(p).device.type in devices and p.is_floating_point() and local_tensor(p).is_contiguous()
            for p in params
        )

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor], mask: Tensor | None) -> None:
        """torch's AdamW over the group, one kernel call per device mesh: a list kernel takes plain tensors or
        DTensors of one mesh, and tensor parallelism mixes them (layers in the plan, others outside it)."""
        by_mesh: dict[int, list[Tensor]] = {}
        for p in params:
            by_mesh.setdefault(id(p.device_mesh) if is_dtensor(p) else 0, []).append(p)
        for part in by_mesh.values():
            self._adamw_kernel(group, part, mask)

    def _adamw_kernel(self, group: dict[str, Any], params: list[Tensor], mask: Tensor | None) -> None:
        """torch's AdamW on ``params``; under a ``mask`` (the vote) torch's fused kernel is told ``found_inf`` where
        the vote failed (it then leaves parameters and moments untouched and torch takes the step counters back),
        and elsewhere :meth:`_masked_adamw` runs."""
        fused = self.adamw_fused if self.adamw_fused is not None else self._fused_supported(params)
        if mask is not None and not fused:
            self._masked_adamw(group, params, mask)
            return
        # Under torch.compile the unfused kernel needs its capturable form (tensor step sizes).
        capturable = not fused and torch.compiler.is_compiling()
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            state = self._param_state(p, group)
            # Where torch keeps the counter: on the parameter's device for the fused and capturable
            # kernels, on the CPU otherwise (a checkpoint may bring it from either).
            device = local_tensor(p).device if fused or capturable else torch.device("cpu")
            if state["step"].device != device:
                state["step"] = state["step"].to(device)
            grad = p.grad
            if fused:
                # torch's fused kernel pairs elements by memory offset: parameter, gradient and moments must share
                # one layout (contiguous parameters only take this path). A gradient autograd.grad made strided is
                # copied for the step; moments a checkpoint brought in another layout are made contiguous once.
                if not local_tensor(grad).is_contiguous():
                    grad = grad.contiguous()
                for key in ("exp_avg", "exp_avg_sq"):
                    if not local_tensor(state[key]).is_contiguous():
                        state[key] = state[key].contiguous()
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        lr = group_lr(group)
        if isinstance(lr, Tensor) and not (fused or capturable):
            lr = lr.item()  # the foreach kernel takes a number (a device sync if lr lives on an accelerator)
        beta1, beta2 = group["adamw_betas"]
        adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not fused,  # torch picks the per-tensor loop on CPU otherwise
            fused=fused,
            capturable=capturable,
            amsgrad=False,
            found_inf=None if mask is None else (~mask).to(torch.float32),
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )

    def _masked_adamw(self, group: dict[str, Any], params: list[Tensor], mask: Tensor) -> None:
        """AdamW (decoupled weight decay) where torch's fused kernel is not used (``adamw_fused=False``, a
        non-contiguous parameter, a device without it), masked by the vote without a host read.

        torch's other kernels cannot be masked: the foreach one keeps its step counters on the CPU and computes the
        bias corrections on the host, and neither takes ``found_inf``. So this is the single-tensor loop with the
        counters on the parameter's device (as torch's capturable form keeps them) and masked factors, the cheapest
        correct masking found: the first moment lerped towards ``where(mask, G, m)`` (``lerp(m, m, w) = m``), the second
        scaled by ``where(mask, beta2, 1)`` and added ``G'^2`` with ``G' = where(mask, G, 0)`` (``0 * NaN`` would
        leak), the decay by ``where(mask, 1 - lr wd, 1)``, the step ``where(mask, m / denom, 0) lr / (1 - beta1^t)``
        (selected, not multiplied by the mask: with ``adamw_eps=0`` a skipped first step's ``m / denom`` is
        ``0 / 0``): a failed vote leaves the parameter, both moments and the counter bitwise unchanged. It rounds
        as torch's unfused kernels do, to within an ulp (not bit for bit), on every step: a run's kernel does not
        change with its votes."""
        beta1, beta2 = group["adamw_betas"]
        lr, wd, eps = group_lr(group), group["weight_decay"], group["adamw_eps"]
        for p in params:
            state = self._param_state(p, group)
            param, grad = local_tensor(p), local_tensor(p.grad)
            if state["step"].device != param.device:
                state["step"] = state["step"].to(param.device)
            step, exp_avg, exp_avg_sq = state["step"], local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
            ok = mask.to(param.device)
            okf = ok.to(torch.float32)
            g = torch.where(ok, grad, 0)
            step.add_(okf)
            t = step.clamp_min(1)  # a skipped first step: finite corrections, multiplied by 0
            if wd != 0:
                param.mul_(torch.where(ok, 1.0 - lr * wd, 1.0))
            exp_avg.lerp_(torch.where(ok, grad, exp_avg), 1.0 - beta1)  # lerp(m, m, w) = m
            exp_avg_sq.mul_(torch.where(ok, beta2, 1.0)).addcmul_(g, g, value=1.0 - beta2)
            denom = (exp_avg_sq.sqrt() / (1.0 - beta2**t).sqrt()).add_(eps)
            param.sub_(torch.where(ok, exp_avg / denom, 0.0) * (lr / (1.0 - beta1**t)))

    # ----------------------------------------------------------------- introspection
    def step_kinds(self) -> list[StepKind | None]:
        """The kind the *next* step takes in each group (``None`` for AdamW groups, and for every group of a
        schedule that decides per matrix at the step: see :meth:`refresh_stats` for what it decided)."""
        return [self.schedule.kind(g["step"], g) if g["algorithm"] == "muon" else None for g in self.param_groups]

    def _count_kinds(self, work: _MuonWork, kinds: Sequence[StepKind]) -> None:
        for key, kind in zip(work.keys, kinds):
            counts = self._refresh_counts.setdefault(key, [0, 0])
            counts[0] += kind is StepKind.SPECTRAL
            counts[1] += 1

    def refresh_stats(self) -> dict[str, Any]:
        """Spectral steps since the last reset: per matrix (parameter name) and overall, as counts and fractions.

        ``{"spectral_fraction": f, "spectral": n, "steps": m, "matrices": {name: {"spectral": n, "steps": m,
        "fraction": f}}}``, where ``steps`` counts the matrix steps taken (a parameter's step counts once).
        """
        matrices = {key: {"spectral": s, "steps": n, "fraction": s / n} for key, (s, n) in self._refresh_counts.items()}
        spectral = sum(m["spectral"] for m in matrices.values())
        steps = sum(m["steps"] for m in matrices.values())
        return {
            "spectral_fraction": spectral / steps if steps else 0.0,
            "spectral": spectral,
            "steps": steps,
            "matrices": matrices,
        }

    def reset_refresh_stats(self) -> None:
        self._refresh_counts = {}

    def comm_stats(self, by_mesh_dim: bool = False) -> dict[str, dict[str, Any]]:
        """Calls, logical bytes and exposed seconds per collective kind since the last reset (empty in one
        process); with ``by_mesh_dim=True`` the same per mesh dimension first: ``{dim: {kind: {...}}}``."""
        return self._engine.comm_stats(by_mesh_dim=by_mesh_dim) if self._engine is not None else {}

    def reset_comm_stats(self) -> None:
        if self._engine is not None:
            self._engine.reset_comm_stats()
