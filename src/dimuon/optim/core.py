"""One optimizer core for Muon, Periodic Row-wise Muon and MuonBP.

The core owns everything the three share (docs/algorithms.md: "Momentum and weight decay", "Step
size", "Schedules", "AdamW group"): EMA momentum with optional Nesterov, decoupled weight decay,
the shape-dependent lr scale, the auxiliary AdamW for ``"algorithm": "adamw"`` groups, the
per-group step counter, the optimizer state (created with the groups) and ``state_dict``. What
differs is the :class:`~dimuon.optim.schedules.Schedule` (which direction map at step ``t``), and
where the maps run is the engine's business (single process or sharded).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dimuon.optim import classes, devices, fused
from dimuon.optim.adamw_group import AdamWGroup
from dimuon.optim.checkpoints import Checkpoints
from dimuon.optim.checkpoints import match_saved_by_name as match_saved_by_name  # re-exported
from dimuon.optim.common import ALGORITHMS as ALGORITHMS  # re-exported, as the names below
from dimuon.optim.common import (
    NONFINITE_POLICIES,
    Nonfinite,
    StepKind,
    group_lr,
    local_tensor,
    matrix_shape,
)
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
from dimuon.optim.distributed.layout import is_dtensor
from dimuon.optim.linalg import (
    LrScale,
    NsAlgorithm,
    NsCoefficients,
)
from dimuon.optim.options import FlattenedParameterWarning as FlattenedParameterWarning  # re-exported
from dimuon.optim.options import ForeignGroupKeyWarning as ForeignGroupKeyWarning
from dimuon.optim.options import (
    GroupOptions,
    _same_value,
    misspelling_hints,
)
from dimuon.optim.options import MuonOptions as MuonOptions
from dimuon.optim.options import misspelt_option as misspelt_option
from dimuon.optim.schedules import Schedule
from dimuon.optim.validation import check_choice, check_number
from dimuon.optim.vote import NonfiniteVote, _Vote
from dimuon.optim.workspace import Workspace


@dataclass
class _MuonWork:
    """One Muon group's step between the momentum update and the weight update."""

    group: dict[str, Any]
    params: list[Tensor]
    jobs: list[MatrixJob]
    config: MapConfig
    keys: list[str]  # each parameter's name in refresh_stats()
    plan: classes.GroupPlan | None = None  # where the step takes the class path: the plan and its U batches
    batches: list[Tensor] | None = None


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


class MuonFamily(GroupOptions, Checkpoints, NonfiniteVote, AdamWGroup, torch.optim.Optimizer):
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
        self._engine_params: tuple[tuple[int, ...], tuple[type, ...]] | tuple[()] = ()  # what the engine was built for
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
        # Per Muon group: its plan by shape class (dimuon.optim.classes), made with the group, remade where a load
        # or a replaced parameter changes it; None where the group takes the per-job path.
        self._plans: dict[int, classes.GroupPlan | None] = {}
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
        self._make_plans()

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

    # ----------------------------------------------------------------- execution
    def _get_engine(self) -> DirectionEngine:
        """Local engine for plain tensors; sharded engine for DTensors or when a process group is given.

        Built at construction where the parameters are sharded then (:meth:`_prepare_engine`), else at the first
        step, and again when the parameters were replaced since (a wrapper that shards
        the model after the optimizer was made and points the groups at the sharded parameters): the
        engine derives each parameter's layout from the parameters it is handed, per parameter object.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        current = (tuple(map(id, params)), tuple(map(type, params)))  # which tensors, and which are DTensors
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
        plan = self._group_plan(gi, group, params)
        if plan is not None:
            return self._class_work(group, plan, mask)
        if group["step"] == 0:
            self._plans.pop(gi, None)  # the first step may remake the momenta: the plan is made again after it
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
        return _MuonWork(group, params, jobs, self._map_config(group, bufs[0].device if bufs else None), keys)

    def _map_config(self, group: dict[str, Any], device: torch.device | None) -> MapConfig:
        """The maps' options of ``group``. The CPU keeps the maps' large buffers from step to step (a fresh one is
        paged in again at every step); accelerators' allocators cache them; a compiled step allocates in its graph."""
        cpu = device is not None and devices.cpu_path(device) and not torch.compiler.is_compiling()
        return MapConfig(
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            ns_algorithm=group["ns_algorithm"],
            ns_dtype=group["ns_dtype"],
            lr_scale=group["lr_scale"],
            ns_compile=self.ns_compile,
            workspace=self._map_buffers if cpu else None,
        )

    # ----------------------------------------------------------------- the class path (dimuon.optim.classes)
    def _make_plans(self) -> None:
        """Every Muon group's plan by shape class, where the step can take the class path: a single process (the
        local engine), the eager kernels, contiguous plain parameters (a schedule that decides per matrix takes
        the momenta and jobs from it, then maps job by job)."""
        self._plans = {}
        for gi, group in enumerate(self.param_groups):
            if group["algorithm"] == "muon" and group["params"]:
                self._plans[gi] = self._make_plan(gi, group)

    def _make_plan(self, gi: int, group: dict[str, Any]) -> classes.GroupPlan | None:
        params = group["params"]
        schedule = type(self.schedule)
        fixed = schedule.decide is Schedule.decide and schedule.after_step is Schedule.after_step
        if type(self._engine) is not LocalEngine or fused.fuses(self.kernels, params[0].device):
            return None
        states = [self.state.get(p, {}) for p in params]
        if any("momentum_buffer" not in st or not p.is_contiguous() for p, st in zip(params, states)):
            return None  # parameters on the meta device, or not laid out as their matrices
        names = group.get("param_names")
        return classes.make_plan(
            group,
            [st["momentum_buffer"] for st in states],
            [names[i] if names else f"params[{i}]" for i in range(len(params))],
            [self._param_name(group, i, gi) for i in range(len(params))],
            fixed,
        )

    def _group_plan(self, gi: int, group: dict[str, Any], params: list[Tensor]) -> classes.GroupPlan | None:
        """Group ``gi``'s plan where this step takes the class path (every parameter has a gradient, the state is
        made), else None; made here only after the first step (which may remake the momenta), and where parameters
        were replaced or matrix options changed since."""
        if group["step"] == 0 or len(params) != len(group["params"]):
            return None
        plan = self._plans[gi] if gi in self._plans else self._make_plan(gi, group)  # made after the first step
        if plan is not None and (plan.ids != tuple(map(id, params)) or plan.options != classes.plan_options(group)):
            plan = self._make_plan(gi, group)
        self._plans[gi] = plan
        return plan

    def _class_work(self, group: dict[str, Any], plan: classes.GroupPlan, mask: Tensor | None) -> _MuonWork:
        """:meth:`_muon_work` by shape class: the momenta in one list op, ``U`` in one batch per class."""
        beta = group["momentum"]
        grads = [p.grad for p in plan.params]
        if mask is None:
            grads = [g.to(b.dtype) for g, b in zip(grads, plan.bufs)]
        else:
            grads = classes.masked_gradients(plan, mask, grads)
        # M <- beta*M + (1-beta)*G  (EMA form)
        torch._foreach_lerp_(plan.bufs, grads, 1.0 - beta)
        batches = classes.nesterov_batches(plan, grads, beta, group["nesterov"])
        config = self._map_config(group, plan.classes[0].device)
        if plan.fixed:
            return _MuonWork(group, plan.params, plan.jobs, config, plan.keys, plan, batches)
        for job, u in zip(plan.jobs, [u for batch in batches for u in batch.unbind(0)]):
            job.update = u  # a schedule that decides per matrix: the engine maps job by job
        return _MuonWork(group, plan.params, plan.jobs, config, plan.keys)

    def _class_apply(self, work: _MuonWork, kind: StepKind, mask: Tensor | None) -> None:
        """:meth:`_muon_apply` by shape class: directions per class, then the decay and one list update."""
        group, plan, batches = work.group, work.plan, work.batches
        assert plan is not None and batches is not None
        lr, wd = group_lr(group), group["weight_decay"]
        if wd != 0:
            decay = 1.0 - lr * wd  # decoupled, with the unscaled lr
            if mask is not None:
                decay = torch.where(mask, torch.as_tensor(decay, dtype=torch.float64, device=mask.device), 1.0)
            torch._foreach_mul_(plan.params, decay)
        step_size = lr * self.schedule.multiplier(kind, group)
        keep = mask.to(torch.float32) if mask is not None else None
        ws, us, fs, plain_ws, ds = [], [], [], [], []
        if kind is StepKind.ROWNORM:
            made = [classes.row_factors_by_class(c, b, work.config) for c, b in zip(plan.classes, batches)]
        else:
            made = classes.spectral_directions(plan.classes, batches, kind, work.config)
        for cls, batch, d in zip(plan.classes, batches, made):
            n = len(cls.params)
            if kind is StepKind.ROWNORM and cls.tiled is not None:  # W <- W - step U factor: no direction written
                ws += cls.params
                us += batch.view(n, *cls.shape).unbind(0)
                fs += cls.factor_view(d if keep is None else d * keep).unbind(0)
                continue
            dtype = cls.params[0].dtype
            d = d if d.dtype == dtype else d.to(dtype)  # cast only where the weight is narrower (bf16)
            plain_ws += cls.params
            ds += (d if keep is None else d * keep).reshape(n, *cls.shape).unbind(0)
        if ws and isinstance(step_size, Tensor):  # a Tensor lr: a 0-d factor (value takes numbers only)
            torch._foreach_addcmul_(ws, us, torch._foreach_mul(fs, -step_size))
        elif ws:
            torch._foreach_addcmul_(ws, us, fs, value=-step_size)
        if plain_ws and isinstance(step_size, Tensor):  # a Tensor lr: a 0-d factor (alpha takes numbers only)
            torch._foreach_sub_(plain_ws, torch._foreach_mul(ds, step_size))
        elif plain_ws:
            torch._foreach_add_(plain_ws, ds, alpha=-step_size)

    def _muon_apply(self, work: _MuonWork, kinds: Sequence[StepKind], mask: Tensor | None, ctx: _StepContext) -> None:
        """Directions for each kind's jobs (one engine call per kind present), then the weight update.

        With a ``mask`` the decay factor is ``where(mask, 1 - lr wd, 1)`` (the same multiply) and the directions are
        multiplied by the mask (one list op: exact, ``D * 1 = D``; finite ``D * 0 = 0``, ``U`` being finite) before
        the usual update: a passed vote moves the weights bit for bit as the unmasked step, a failed one not at all.
        """
        if work.plan is not None:  # a schedule that decides per group: one kind
            self._class_apply(work, kinds[0], mask)
            self._count_kinds(work, kinds)
            return
        group, engine = work.group, self._get_engine()
        lr, wd = group_lr(group), group["weight_decay"]
        plain = isinstance(engine, LocalEngine)  # no DTensors: a weight is its own local data
        weights = list(work.params) if plain else [local_tensor(p) for p in work.params]
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
