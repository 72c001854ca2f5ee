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
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from dimuon.optim import classes, fused
from dimuon.optim.adamw_group import AdamWGroup, AdamWPlan
from dimuon.optim.checkpoints import Checkpoints
from dimuon.optim.checkpoints import match_saved_by_name as match_saved_by_name  # re-exported
from dimuon.optim.classes import ClassStep, _MuonWork
from dimuon.optim.common import ALGORITHMS as ALGORITHMS  # re-exported, as the names below
from dimuon.optim.common import (
    Nonfinite,
    StepKind,
    local_tensor,
    matrix_shape,
)
from dimuon.optim.compiled import CompiledStepState
from dimuon.optim.distributed.engine import (
    DEFAULT_BUCKET_MB,
    DEFAULT_REFRESH,
    DirectionEngine,
    LocalEngine,
    Refresh,
    ReplicaRefresh,
)
from dimuon.optim.distributed.layout import is_dtensor
from dimuon.optim.gradients import warn_no_gradients
from dimuon.optim.linalg import (
    LrScale,
    NsAlgorithm,
    NsCoefficients,
)
from dimuon.optim.options import (
    _ENGINE_DEFAULTS,
    GROUP_ARGUMENTS,
    MATRIX_DEFAULTS,
    GroupOptions,
    _same_value,
    check_runtime_options,
    misspelling_hints,
)
from dimuon.optim.options import FlattenedParameterWarning as FlattenedParameterWarning  # re-exported
from dimuon.optim.options import ForeignGroupKeyWarning as ForeignGroupKeyWarning
from dimuon.optim.options import MuonOptions as MuonOptions
from dimuon.optim.options import misspelt_option as misspelt_option
from dimuon.optim.per_job import MASK_BATCH_NUMEL as MASK_BATCH_NUMEL  # re-exported
from dimuon.optim.per_job import PerJobStep
from dimuon.optim.per_job import masked_gradients as masked_gradients  # re-exported
from dimuon.optim.schedules import Schedule
from dimuon.optim.validation import check_params
from dimuon.optim.vote import NonfiniteVote, _GradientPlan, _Vote
from dimuon.optim.workspace import Workspace


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


class MuonFamily(
    GroupOptions,
    Checkpoints,
    NonfiniteVote,
    PerJobStep,
    ClassStep,
    AdamWGroup,
    CompiledStepState,
    torch.optim.Optimizer,
):
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
        given = dict(locals())
        defaults: dict[str, Any] = {
            "algorithm": "muon",
            **{key: given[key] for key in GROUP_ARGUMENTS},
            "adamw_betas": tuple(adamw_betas),
            **MATRIX_DEFAULTS,
            **self._schedule_defaults(),
        }
        self._refuse_unknown(schedule_options)
        defaults.update(schedule_options)
        self._validate_options(defaults, where="")
        check_runtime_options(given)
        self.nonfinite = nonfinite
        self.ns_compile = ns_compile
        self.adamw_fused = adamw_fused
        self.kernels = kernels
        self._tables = fused.Tables()  # the fused kernels' address tables, kept on the device between steps
        self.engine_options = {key: given[key] for key in _ENGINE_DEFAULTS}
        self._engine: DirectionEngine | None = engine
        self._engine_params: tuple[tuple[int, ...], tuple[type, ...]] | tuple[()] = ()  # what the engine was built for
        self._engine_given = engine is not None
        self._start_bookkeeping()
        super().__init__(params, defaults)
        self._constructing = False
        self._warn_flattened(stacklevel=4)
        self._warn_foreign_keys(stacklevel=4)
        self._prepare_engine()
        self._make_plans()

    def _refuse_unknown(self, schedule_options: dict[str, Any]) -> None:
        """A TypeError for arguments neither the core nor the schedule takes, naming the option each resembles."""
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

    def _start_bookkeeping(self) -> None:
        """What the optimizer keeps beside its state: warnings to give, counters, the vote's, the plans, buffers."""
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
        self._adamw_plans: dict[int, AdamWPlan] = {}  # per AdamW group, its parts by mesh, made after its first step
        # Per (group, count, shape, dtype, device): the CPU's Nesterov batch buffers, kept between steps.
        self._workspace: dict[tuple[Any, ...], Tensor] = {}
        # The CPU's Newton-Schulz temporaries and directions, lent within a step and kept between steps.
        self._map_buffers: Workspace | None = Workspace()
        self._schedule_scratch: dict[str, Any] = {}  # what the schedule keeps from one step to the next (not saved)

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
        if torch.compiler.is_compiling():  # run eagerly by dynamo, which then marks the state static (CUDA graphs)
            self._init_group()
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
        mask = None if read_now else vote.ok
        self._count_vote(vote.ok)
        stepped, works = [], []
        for gi, group, params in self._params_to_step(plan):
            stepped.append(group)
            if group["algorithm"] == "adamw":
                self._adamw_step(gi, group, params, mask)
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

    def _count_vote(self, ok: Tensor) -> None:
        """Keep the step's vote, and under ``"skip"`` count a failed one on the device (read when skipped_steps is
        read or the state saved)."""
        self._votes["last"] = ok
        if self.nonfinite == "skip":
            skipped = (~ok).to(torch.int64)
            pending = self._votes["pending_skips"]
            if pending is None:
                self._votes["pending_skips"] = skipped
            else:  # in place: a CUDA graph's output is overwritten by its next replay, so none is carried to it
                pending.add_(skipped)

    def _params_to_step(self, plan: _GradientPlan | None) -> list[tuple[int, dict[str, Any], list[Tensor]]]:
        """Per group with any, the parameters this step moves: those with a gradient, or under a sharded engine the
        Muon parameters every rank agreed on (``plan``)."""
        agreed: dict[int, list[Tensor]] = {}
        if plan is not None:
            for (gi, _, p), step_it in zip(plan.params, plan.agreed):
                if step_it:
                    agreed.setdefault(gi, []).append(p)
        out = []
        for gi, group in enumerate(self.param_groups):
            if plan is not None and group["algorithm"] == "muon":
                params = agreed.get(gi, [])
            else:
                params = [p for p in group["params"] if p.grad is not None]
            if params:
                out.append((gi, group, params))
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
