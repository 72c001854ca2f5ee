"""The adaptive schedule: each matrix takes a spectral step when the direction of its last one has gone stale.

:class:`AdaptiveRowSchedule` owns everything the adaptive refresh needs (docs/algorithms.md, "Adaptive refresh"):
its options, the per-matrix state (the bf16 reference direction ``O_s``, two row sums taken with it, and the
matrix's age), the decision (staleness signals where the bounds leave the choice open: one engine reduction, one
agreement over the world and one host read for all groups together) and the update of its state after the step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dimuon.optim.common import local_tensor, local_tensors, matrix_shape
from dimuon.optim.distributed.engine import (
    MatrixJob,
    RowRange,
    as_batch,
    col_split_sizes_to_ranges,
    shape_classes,
)
from dimuon.optim.distributed.layout import is_dtensor
from dimuon.optim.schedules import (
    GAMMA_DOC,
    NEVER_REFRESHED,
    Option,
    Schedule,
    StepContext,
    StepKind,
    Work,
    _non_negative,
    _positive,
    _positive_int,
)
from dimuon.optim.staleness import (
    REFERENCE_DTYPE,
    ROW_SUMS,
    partial_sums_batch,
    reference_row_sums_many,
    row_sums_batch,
    staleness_batch,
    staleness_from_sums,
    staleness_partial_sums_many,
)


def row_sums_width(p: Tensor, group: Mapping[str, Any]) -> int:
    """Columns of a parameter's ``refresh_row_sums``: per row of ``p`` (per stacked matrix), two sums for every
    row of its matrix (one for an unstacked parameter) and every column range."""
    _, rows, cols = matrix_shape(p, group["stacked"])
    col_ranges = col_split_sizes_to_ranges(cols, group["col_split_sizes"], "") or ((0, cols),)
    return ROW_SUMS * len(col_ranges) * (rows if group["stacked"] else 1)


def _row_sums_view(state: Mapping[str, Any], job: MatrixJob) -> Tensor:
    """The local ``refresh_row_sums`` of a job's parameter, one row per row of the job's (local) matrix."""
    return local_tensor(state["refresh_row_sums"]).view(job.update.shape[0], ROW_SUMS * len(job.col_ranges()))


def zeros_by_rows(p: Tensor, cols: int, stacked: bool = False) -> Tensor:
    """fp32 zeros of shape ``(p.shape[0], cols)``, laid out over the ranks by rows as ``p`` is (a DTensor with
    ``p``'s mesh and placements for a DTensor ``p``), so a checkpoint reshards it with the parameter. With
    ``stacked``, ``cols`` come alike per row of each stacked matrix (``p``'s dimension 1), split as those rows are."""
    local = local_tensor(p)
    width = cols // p.shape[1] * local.shape[1] if stacked and p.shape[1] else cols
    zeros = torch.zeros(local.shape[0], width, dtype=torch.float32, device=local.device)
    if not is_dtensor(p):
        return zeros
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        zeros, p.device_mesh, p.placements, run_check=False, shape=(p.shape[0], cols), stride=(cols, 1)
    )


def _lag(name: str, value: Any) -> None:
    if isinstance(value, bool) or value not in (0, 1):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")


# The optimizer's scratch key of the signals measured for the next step: (matrix keys, host values, copy event).
_NEXT = "adaptive_next_signals"
# signal_lag=1: the matrices refreshed at the previous step, whose saved signal is none without a read.
_CLEARED = "adaptive_cleared_signals"
NO_SIGNAL = -math.inf  # refresh_signal of a matrix without one (a staleness 1 - cos/cos_s is finite or +inf)


def _k_bounds(group: Mapping[str, Any], where: str) -> None:
    if group["k_max"] < group["k_min"]:
        raise ValueError(f"k_max{where} must be >= k_min ({group['k_min']}), got {group['k_max']}")


@dataclass(frozen=True)
class AdaptiveRowSchedule(Schedule):
    """Per matrix: spectral when its staleness (``dimuon.optim.staleness``) is above ``threshold``, RowNorm
    (scaled by ``gamma``) otherwise, with ``k_min <= interval <= k_max`` between its spectral steps.

    ``age`` is ``t - s``: the steps from the matrix's last spectral step ``s`` to the coming step ``t``
    (:data:`~dimuon.optim.schedules.NEVER_REFRESHED` before its first). The signal is only needed where the bounds
    leave the choice open (``k_min <= age < k_max``); see :meth:`needs_signal`.
    """

    name: str = "adaptive_row_muon"
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.ROWNORM)
    options: ClassVar[Mapping[str, Option]] = {
        "threshold": Option(
            0.35,
            _non_negative,
            "staleness above which a matrix takes a spectral step (0 = at every step the bounds allow).",
        ),
        "k_min": Option(
            1, _positive_int, "fewest steps from one spectral step of a matrix to its next (1 allows consecutive ones)."
        ),
        "k_max": Option(
            8, _positive_int, "most steps from one spectral step of a matrix to its next (the refresh is forced then)."
        ),
        "gamma": Option(0.15, _positive, GAMMA_DOC),
        "signal_lag": Option(
            0,
            _lag,
            "0: decide from this step's staleness (one host read, which waits for the device, per step where a "
            "choice is open); 1: from the previous step's, copied to the host while the step runs, so the decision "
            "waits for nothing (a matrix refreshed one step ago has no signal yet and takes RowNorm).",
        ),
    }
    reads_signals: ClassVar[bool] = True
    whole_rows: ClassVar[str | None] = "keeps per-row sums for its staleness signal"
    state_dtypes: ClassVar[tuple[str, ...]] = ("refresh_direction", "refresh_row_sums", "refresh_signal")
    late_options: ClassVar[tuple[str, ...]] = ("signal_lag",)

    def check(self, group: Mapping[str, Any], where: str) -> None:
        super().check(group, where)
        _k_bounds(group, where)

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind | None:
        return None  # decided per matrix at the step (refresh_stats() says what was decided)

    def multiplier(self, kind: StepKind, group: Mapping[str, Any]) -> float:
        return float(group["gamma"]) if kind is StepKind.ROWNORM else 1.0

    # ----------------------------------------------------------------- state
    def init_state(self, p: Tensor, group: Mapping[str, Any], state: dict[str, Any]) -> None:
        """The staleness signal's reference: the direction of the matrix's last spectral step, two sums per row
        taken then (shaped and sharded by rows like the parameter), and the steps since."""
        ref = state.get("refresh_direction")
        if ref is None or (group["step"] == 0 and ref.device != p.device):
            state["refresh_direction"] = torch.zeros_like(
                p, dtype=REFERENCE_DTYPE, memory_format=torch.contiguous_format
            )
            state["refresh_row_sums"] = zeros_by_rows(p, row_sums_width(p, group), group["stacked"])
        state.setdefault("refresh_age", NEVER_REFRESHED)
        if "refresh_signal" not in state:  # -inf: none measured since the last refresh (a staleness is > -inf); from
            # construction on, so that a checkpoint loaded in place (DCP) into a new optimizer's state has the entry
            state["refresh_signal"] = torch.full((), NO_SIGNAL, dtype=torch.float32, device=local_tensor(p).device)

    def state_shape(self, name: str, p: Tensor, group: Mapping[str, Any]) -> tuple[int, ...] | None:
        return (p.shape[0], row_sums_width(p, group)) if name == "refresh_row_sums" else None

    # ----------------------------------------------------------------- decision
    def needs_signal(self, age: int, group: Mapping[str, Any]) -> bool:
        return age != NEVER_REFRESHED and int(group["k_min"]) <= age < int(group["k_max"])

    def decide_one(self, age: int, signal: float | None, group: Mapping[str, Any]) -> StepKind:
        """The kind of one matrix's coming step; ``signal`` is read only where :meth:`needs_signal` holds."""
        if age == NEVER_REFRESHED or age >= int(group["k_max"]):
            return StepKind.SPECTRAL
        if age < int(group["k_min"]):
            return StepKind.ROWNORM
        if signal is None:  # signal_lag=1 before a signal was measured since the last refresh
            return StepKind.ROWNORM
        return StepKind.SPECTRAL if signal > float(group["threshold"]) else StepKind.ROWNORM

    def decide(self, works: Sequence[Work], ctx: StepContext) -> list[list[StepKind]]:
        """Per matrix, from its age and (where the bounds leave the choice open) its staleness signal: one engine
        reduction of the signal sums, one agreement over the world and one host read for all groups together, so
        every rank decides alike. Groups with ``signal_lag=1`` take the signals measured at the previous step
        (already on the host) and measure the next step's after deciding, without waiting for them."""
        state = ctx.state
        ages = [[state[p]["refresh_age"] for p in w.params] for w in works]
        lagged = [int(w.group["signal_lag"]) == 1 for w in works]
        open_ = [(wi, ji) for wi, w in enumerate(works) for ji in self._open(ages[wi], w.group)]
        now = [(wi, ji) for wi, ji in open_ if not lagged[wi]]
        signals: dict[tuple[int, int], float] = {}
        if now:
            signals = dict(zip(now, ctx.read(self._stalest(works, now, ctx))))  # the host reads them once
        if any(lagged):
            # "raise": the vote is read before the lagged signals are taken or measured (a failed step changes none)
            if not now:
                ctx.settle()
            signals.update(self._previous_signals(works, [(wi, ji) for wi, ji in open_ if lagged[wi]], ctx))
        kinds = [self._kinds(wi, ages[wi], signals, w.group) for wi, w in enumerate(works)]
        if any(lagged):  # the next step's signals: the matrices taking RowNorm now whose choice is open then
            following = [
                (wi, ji)
                for wi, w in enumerate(works)
                if lagged[wi]
                for ji in self._open([a + 1 for a in ages[wi]], w.group)
                if kinds[wi][ji] is StepKind.ROWNORM
            ]
            self._measure_for_next(works, following, ctx)
        return kinds

    def _open(self, ages: Sequence[int], group: Mapping[str, Any]) -> list[int]:
        """The matrices (by index) whose choice the bounds leave open at these ages (:meth:`needs_signal` of each,
        in one pass)."""
        k_min, k_max = int(group["k_min"]), int(group["k_max"])
        return [i for i, age in enumerate(ages) if age != NEVER_REFRESHED and k_min <= age < k_max]

    def _kinds(
        self, wi: int, ages: Sequence[int], signals: Mapping[tuple[int, int], float], group: Mapping[str, Any]
    ) -> list[StepKind]:
        """:meth:`decide_one` of every matrix of work ``wi``, in one pass."""
        k_min, k_max, threshold = int(group["k_min"]), int(group["k_max"]), float(group["threshold"])
        kinds = []
        for ji, age in enumerate(ages):
            if age == NEVER_REFRESHED or age >= k_max:
                kinds.append(StepKind.SPECTRAL)
            elif age < k_min:
                kinds.append(StepKind.ROWNORM)
            else:  # no signal: signal_lag=1 before one was measured since the last refresh
                signal = signals.get((wi, ji))
                kinds.append(StepKind.SPECTRAL if signal is not None and signal > threshold else StepKind.ROWNORM)
        return kinds

    def _stalest(self, works: Sequence[Work], items: Sequence[tuple[int, int]], ctx: StepContext) -> Tensor:
        """Each item's staleness (a fused parameter's stalest logical matrix), the same on every rank: one engine
        reduction of the signal sums, then their maximum over the world (replicas hold the same sums up to the last
        bits, from a non-deterministic reduction, and a choice they made apart would issue different collectives)."""
        plans = [getattr(w, "plan", None) for w in works]
        if None not in plans and not plans[0].sharded:  # type: ignore[union-attr]  # one process, by class
            return self._stalest_by_class(works, items, ctx)
        by_pieces = None not in plans  # a mesh, every group by class of local pieces
        stalest = (_stalest_by_pieces if by_pieces else _stalest_by_job)(works, items, ctx)
        agree = getattr(ctx.engine, "agree_max", None)
        return agree(stalest) if agree is not None else stalest

    def _stalest_by_class(self, works: Sequence[Work], items: Sequence[tuple[int, int]], ctx: StepContext) -> Tensor:
        """:meth:`_stalest` on the class path (one process): each class's items as one batch of its ``U``."""
        out = []
        for job, u, states in _by_class(works, items, ctx.state):
            refs = torch.stack([st["refresh_direction"] for st in states]).view(u.shape)
            sums = torch.stack([st["refresh_row_sums"] for st in states])
            out.append(staleness_batch(u, refs, sums, job.logical_ranges(), _col_ranges(job, u)))
        return torch.cat(out)

    def _measure_for_next(self, works: Sequence[Work], items: Sequence[tuple[int, int]], ctx: StepContext) -> None:
        """Measure ``items``' staleness now for the next step's decision: kept in the state (a checkpoint carries
        it) and copied to the host without waiting (pinned memory and an event on CUDA)."""
        ctx.scratch.pop(_NEXT, None)
        if not items:
            return
        stalest = self._stalest(works, items, ctx)
        params = [works[wi].params[ji] for wi, ji in items]
        for p, value in zip(params, stalest.unbind(0)):
            ctx.state[p]["refresh_signal"] = value
        event = None
        if stalest.is_cuda:
            host = torch.empty(stalest.shape, dtype=stalest.dtype, pin_memory=True)
            host.copy_(stalest, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = stalest  # the CPU's values: reading them later waits for nothing
        ctx.scratch[_NEXT] = ([id(p) for p in params], host, event)

    def _previous_signals(
        self, works: Sequence[Work], items: Sequence[tuple[int, int]], ctx: StepContext
    ) -> dict[tuple[int, int], float]:
        """``items``' newest signals: from the host copy made at the previous step (its copy long finished), else
        from the state, which holds the same values (one read: after a checkpoint's load, or for a matrix that had
        no gradient at the previous step and kept its older signal), so a resumed run decides as the live one. An
        item measured before its last refresh, or never, has none (-inf in the state; known on the host without a
        read for the matrices refreshed at the previous step)."""
        params = {(wi, ji): works[wi].params[ji] for wi, ji in items}
        found: dict[tuple[int, int], float] = {}
        cleared = ctx.scratch.pop(_CLEARED, set())
        pending = ctx.scratch.pop(_NEXT, None)
        if pending is not None:
            keys, host, event = pending
            if event is not None:
                event.synchronize()
            values = dict(zip(keys, host.tolist()))
            found = {item: values[id(p)] for item, p in params.items() if id(p) in values}
        saved = [
            (item, ctx.state[p]["refresh_signal"])
            for item, p in params.items()
            if item not in found and id(p) not in cleared and "refresh_signal" in ctx.state[p]
        ]
        if saved:
            values = torch.stack([local_tensor(v).reshape(()) for _, v in saved]).tolist()
            found.update({item: value for (item, _), value in zip(saved, values) if value != NO_SIGNAL})
        return found

    # ----------------------------------------------------------------- after the step
    def after_step(
        self,
        work: Work,
        kinds: Sequence[StepKind],
        directions: Sequence[Any],
        mask: Tensor | None,
        ctx: StepContext,
    ) -> None:
        """A refreshed matrix keeps its new direction (bf16) and row sums as the staleness signal's reference, and
        its age restarts; the others age by one step.

        Under a ``mask`` (``nonfinite="skip"``) the reference and its row sums are written as ``where(mask, new,
        old)``: a skipped step leaves them bitwise as they were. The ages are host numbers and advance as the step
        slot's decisions say (the host cannot know the vote): a matrix whose refresh was skipped restarts its
        age with its older reference kept, so its next refresh may come up to ``k_max`` slots later (sooner where
        its staleness, measured against that older reference, passes the threshold from ``k_min`` on)."""
        refreshed = [i for i, kind in enumerate(kinds) if kind is StepKind.SPECTRAL]
        if getattr(work, "plan", None) is not None:
            self._refresh_by_class(directions, mask, ctx)  # type: ignore[arg-type]
        else:
            self._refresh_by_job(work, refreshed, directions, mask, ctx)
        for p, kind in zip(work.params, kinds):
            state = ctx.state[p]
            state["refresh_age"] = 1 if kind is StepKind.SPECTRAL else state["refresh_age"] + 1
        if refreshed and int(work.group["signal_lag"]) == 1:  # a signal measured against the older reference: none
            signals = [ctx.state[work.params[i]].get("refresh_signal") for i in refreshed]
            signals = [s for s in signals if isinstance(s, Tensor)]
            if signals:
                torch._foreach_clamp_max_(signals, NO_SIGNAL)  # -inf, in one launch
            ctx.scratch.setdefault(_CLEARED, set()).update([id(work.params[i]) for i in refreshed])

    def _refresh_by_job(
        self, work: Work, refreshed: Sequence[int], directions: Sequence[Any], mask: Tensor | None, ctx: StepContext
    ) -> None:
        """The refreshed matrices' new references and row sums, job by job (their local pieces)."""
        refs = [
            local_tensor(ctx.state[work.params[i]]["refresh_direction"]).view(work.jobs[i].update.shape)
            for i in refreshed
        ]
        sums = [_row_sums_view(ctx.state[work.params[i]], work.jobs[i]) for i in refreshed]
        updates = [work.jobs[i].update for i in refreshed]
        col_splits = [work.jobs[i].col_splits for i in refreshed]
        if refreshed:  # the new reference (its own rounding), then its row sums: a few list ops per shape
            copy_by_shape_([directions[i] for i in refreshed], refs, mask)
            copy_by_shape_(reference_row_sums_many(updates, refs, col_splits), sums, mask)

    def _refresh_by_class(
        self, made: Mapping[StepKind, tuple[Any, list[Tensor]]], mask: Tensor | None, ctx: StepContext
    ) -> None:
        """The refreshed matrices' new references and row sums on the class path: per class one cast, one row-sum
        batch, and under a mask one ``where`` each, then one list copy each."""
        if StepKind.SPECTRAL not in made:
            return
        part, directions = made[StepKind.SPECTRAL]
        start = 0
        for cls, u, d in zip(part.plan.classes, part.batches, directions):
            job, start = part.jobs[start], start + len(cls.params)
            states = [ctx.state[p] for p in cls.params]
            refs = local_tensors([st["refresh_direction"] for st in states])  # a mesh's local pieces
            sums = local_tensors([st["refresh_row_sums"] for st in states])
            new = (torch.stack(d) if isinstance(d, list) else d).to(REFERENCE_DTYPE)  # a mesh's refresh: a list
            if mask is not None:
                new = torch.where(mask, new, torch.stack(refs).view(new.shape))
            rows = row_sums_batch(u, new, _col_ranges(job, u)).view(len(sums), *sums[0].shape)
            if mask is not None:
                rows = torch.where(mask, rows, torch.stack(sums))
            torch._foreach_copy_(refs, new.view(len(refs), *cls.shape).unbind(0))
            torch._foreach_copy_(sums, rows.unbind(0))


def copy_by_shape_(sources: Sequence[Tensor], targets: Sequence[Tensor], mask: Tensor | None = None) -> None:
    """``targets[i] <- sources[i]`` (cast to the target's dtype), or ``where(mask, sources[i], targets[i])`` under a
    0-d ``mask`` (a failed vote leaves the targets bitwise as they were): per shape and dtypes one cast, one
    ``where`` over the shape's batch and one list copy, not an op per tensor."""
    for idx in shape_classes(targets, sources):
        dsts = [targets[i] for i in idx]
        new = as_batch([sources[i].reshape(dsts[0].shape) for i in idx]).to(dsts[0].dtype)  # (B, *shape)
        if mask is not None:
            new = torch.where(mask, new, torch.stack(dsts))
        torch._foreach_copy_(dsts, list(new.unbind(0)))


def _segment_max(values: Tensor, lengths: Sequence[int]) -> Tensor:
    """The maximum of each run of ``lengths`` consecutive ``values`` (a fused parameter's stalest logical matrix):
    no op where every run is one value, one where all are equally long, one per run otherwise."""
    if all(n == 1 for n in lengths):
        return values
    if len(set(lengths)) == 1:
        return values.view(len(lengths), lengths[0]).amax(dim=1)
    return torch.stack([v.max() for v in values.split(list(lengths))])


def _by_class(
    works: Sequence[Work], items: Sequence[tuple[int, int]], state: Mapping[Tensor, Any]
) -> list[tuple[MatrixJob, Tensor, list[dict[str, Any]]]]:
    """Per class of the works' plans holding any of ``items`` (in their order): its first job, the items' ``U``
    as one batch (the class batch, or its rows picked in one op) and their states."""
    by_work: dict[int, list[int]] = {}
    for wi, ji in items:
        by_work.setdefault(wi, []).append(ji)
    out = []
    for wi, chosen in by_work.items():
        plan, batches = works[wi].plan, works[wi].batches  # type: ignore[attr-defined]
        start = 0
        for cls, batch in zip(plan.classes, batches):
            stop = start + len(cls.params)
            idx = [j - start for j in chosen if start <= j < stop]
            if idx:
                u = batch if len(idx) == len(cls.params) else batch[idx]
                job = getattr(cls, "signal_job", None) or plan.jobs[start]  # stacked: the parameter's job
                out.append((job, u, [state[cls.params[i]] for i in idx]))
            start = stop
    return out


def _stalest_by_job(works: Sequence[Work], items: Sequence[tuple[int, int]], ctx: StepContext) -> Tensor:
    """Each item's staleness before the world's agreement on the per-job path: each job's partial sums over the
    rows held here, added over its shard group by the engine."""
    state = ctx.state

    def partial(jobs: Sequence[MatrixJob], local_ranges: Sequence[Sequence[RowRange | None]]) -> list[Tensor]:
        states = [state[job.meta["param"]] for job in jobs]
        return staleness_partial_sums_many(
            [job.update for job in jobs],
            [local_tensor(st["refresh_direction"]).view(job.update.shape) for st, job in zip(states, jobs)],
            [_row_sums_view(st, job) for st, job in zip(states, jobs)],
            local_ranges,
            [job.col_splits for job in jobs],
        )

    sums = ctx.engine.matrix_sums([works[wi].jobs[ji] for wi, ji in items], partial)
    return _segment_max(staleness_from_sums(torch.cat(sums)), [len(s) for s in sums])


def _stalest_by_pieces(works: Sequence[Work], items: Sequence[tuple[int, int]], ctx: StepContext) -> Tensor:
    """Each item's staleness before the world's agreement on a mesh's class path: per class of local pieces the
    partial sums over the rows held here, one batch (the per-job path's sums, per class), added over each shard
    group by the engine (one flat all-reduce per process group)."""
    picked = _by_class(works, items, ctx.state)

    def partial(jobs: Sequence[MatrixJob], local_ranges: Sequence[Sequence[RowRange | None]]) -> list[Tensor]:
        out = []
        for (job, u, states), ranges in zip(picked, local_ranges):
            refs = torch.stack(local_tensors([st["refresh_direction"] for st in states])).view(u.shape)
            sums = torch.stack(local_tensors([st["refresh_row_sums"] for st in states]))
            out.append(partial_sums_batch(u, refs, sums, ranges, _col_ranges(job, u)))
        return out

    sums = ctx.engine.matrix_sums([job for job, _, _ in picked], partial)  # a class's first job stands for it
    # every class's signals in one pass over their sums end to end, then each matrix's stalest logical matrix
    values = staleness_from_sums(torch.cat([s.reshape(-1, s.shape[-1]) for s in sums]))
    widths = [s.shape[1] for s in sums]
    if len(set(widths)) == 1:
        return values.view(-1, widths[0]).amax(dim=1)
    parts = values.split([s.shape[0] * s.shape[1] for s in sums])
    return torch.cat([v.view(-1, width).amax(dim=1) for v, width in zip(parts, widths)])


def _col_ranges(job: MatrixJob, u: Tensor) -> tuple[RowRange, ...]:
    """The column ranges of a batch of the job's local pieces: its column splits (whole columns here), else the
    local row whole (a mesh may split the columns)."""
    return job.col_splits or ((0, u.shape[-1]),)
