"""The single-process step by shape class: a group's matrices planned once, then one batch per class each step.

A Muon group's parameters of one shape, dtype and device are one :class:`ShapeClass`: their Nesterov momenta lie in
one ``(B, rows, cols)`` buffer, every map takes the whole class as one batch, and the weights move in one list op
per step kind. What is static about a matrix (its view as a matrix, its split and stacked ranges, the regions each
step kind maps, where its momentum lives) is worked out when the plan is made (:func:`make_plan`), so a step's
Python grows with classes and step kinds, not with matrices. The values are those of
:class:`~dimuon.optim.distributed.engine.LocalEngine` on the same jobs, op for op (the golden-steps test holds
them). A schedule that decides per matrix (the adaptive one) takes each kind's matrices of a class as one batch
(:meth:`ClassStep._by_kind`). Sharded engines plan classes of local pieces
(:mod:`dimuon.optim.distributed.piece_classes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from dimuon.optim import devices, fused
from dimuon.optim.common import StepKind, group_lr, local_tensors
from dimuon.optim.distributed import engine as engine_module  # its newton_schulz, as the op census patches it
from dimuon.optim.distributed.engine import (
    LocalEngine,
    MapConfig,
    MatrixJob,
    Region,
    block_grid,
    col_split_sizes_to_ranges,
    map_regions,
    split_sizes_to_ranges,
    stacked_ranges,
)
from dimuon.optim.linalg import lr_scale_factor, row_factors
from dimuon.optim.schedules import Schedule

# Below this many elements a gradient's masking is launch-bound on an accelerator (a launch costs more than the
# four extra passes of stacking it with its momentum): such gradients of one shape are masked in one ``where``.
MASK_BATCH_NUMEL = 1 << 20


@dataclass
class ShapeClass:
    """The stepped matrices of one group alike in parameter shape and dtype and device: one batch at every step."""

    params: list[Tensor]
    shape: tuple[int, ...]  # the parameter's shape
    rows: int  # of its matrix (a stacked parameter's ``(count*rows, cols)`` view)
    cols: int
    lead: int  # leading dimensions of ``shape`` that make the matrix's rows (2 when stacked)
    dtype: torch.dtype  # the momentum's
    device: torch.device
    regions: dict[StepKind, list[Region]]  # what each step kind maps: the logical matrices, or their blocks
    tiled: str | None  # "rows" or "cols" where RowNorm's factors tile the matrix (the direction never written)
    alone: bool  # its gradients are masked one by one (the CPU, or large ones), else stacked

    def factor_view(self, f: Tensor) -> Tensor:
        """A ``(B, rows, 1)`` or ``(B, 1, cols)`` RowNorm factor shaped to broadcast against the parameters."""
        ones = (1,) * (len(self.shape) - self.lead)
        if self.tiled == "rows":
            return f.view(len(self.params), *self.shape[: self.lead], *ones)
        return f.view(len(self.params), *((1,) * self.lead), *self.shape[self.lead :])


@dataclass
class GroupPlan:
    """A Muon group's matrices as the step takes them: valid while the group holds ``ids`` with ``options``."""

    ids: tuple[int, ...]
    options: tuple[Any, ...]
    classes: list[ShapeClass]
    params: list[Tensor]  # class after class
    bufs: list[Tensor]  # their momentum buffers, in the same order
    jobs: list[MatrixJob]  # per parameter in the same order, made once (each step sets their updates)
    keys: list[str]  # per parameter in the same order, its name in refresh_stats()
    fixed: bool  # the schedule decides per group (one kind), else per matrix (each kind's share of a class mapped)
    slots: dict[int, Tensor] = field(default_factory=dict)  # the CPU's Nesterov batches, kept between steps
    launchable: bool = False  # the fused kernels can take its parameters and momenta (dtypes, layout, one device)
    sharded: bool = False  # DTensor parameters: classes of local pieces (dimuon.optim.distributed.piece_classes)
    memo: dict = field(default_factory=dict)  # what the sharded engine keeps of these jobs between steps


@dataclass
class _MuonWork:
    """One Muon group's step between the momentum update and the weight update."""

    group: dict[str, Any]
    params: list[Tensor]
    jobs: list[MatrixJob]
    config: MapConfig
    keys: list[str]  # each parameter's name in refresh_stats()
    plan: GroupPlan | None = None  # where the step takes the class path: the plan and its U batches
    batches: list[Tensor] | None = None


def plan_options(group: dict[str, Any]) -> tuple[Any, ...]:
    """The group options the plan is made from: a plan is remade where one changes."""
    return (
        group["split_sizes"],
        group["col_split_sizes"],
        group["stacked"],
        group.get("blocks", 1),
        group["lr_scale"],
    )


def _tiling(regions: Sequence[Region], rows: int, cols: int) -> str | None:
    """How RowNorm's per-region factors tile the matrix (LocalEngine's compose_row_direction, decided once)."""
    factor = [(r1 - r0, 1) if r1 - r0 <= c1 - c0 else (1, c1 - c0) for r0, r1, c0, c1 in regions]
    by_rows = all(f == (r1 - r0, 1) and (c0, c1) == (0, cols) for (r0, r1, c0, c1), f in zip(regions, factor))
    by_cols = all(f == (1, c1 - c0) and (r0, r1) == (0, rows) for (r0, r1, c0, c1), f in zip(regions, factor))
    edges = [(r0, r1) if by_rows else (c0, c1) for r0, r1, c0, c1 in regions]
    tiles = all(a[1] == b[0] for a, b in pairwise(edges)) and edges[0][0] == 0
    tiles = tiles and edges[-1][1] == (rows if by_rows else cols)
    if not (by_rows or by_cols) or not tiles:
        return None
    return "rows" if by_rows else "cols"


def matrix_job(p: Tensor, group: dict[str, Any], name: str, update: Tensor | None = None) -> MatrixJob:
    """The engine's job of parameter ``p`` (without ``update``: the static part a plan keeps)."""
    stacked = group["stacked"]
    if stacked:  # (count, rows, cols...) stacked matrices: their (count*rows, cols) view
        count, rows, cols = p.shape[0], p.shape[1], math.prod(p.shape[2:])
    else:  # one (shape[0], rest) matrix, as a conv weight is flattened
        count, rows, cols = 1, p.shape[0], math.prod(p.shape[1:])
    splits = split_sizes_to_ranges(rows, group["split_sizes"], name)
    return MatrixJob(
        name=name,
        # A stacked parameter's matrices lie one under the other: the (count*rows, cols) view.
        update=None if update is None else update.reshape(-1, cols) if stacked else update,  # type: ignore[arg-type]
        rows=count * rows,
        cols=cols,
        splits=stacked_ranges(count, rows, splits) if stacked else splits,
        blocks=block_grid(group.get("blocks", 1)),
        meta={"param": p},
        col_splits=col_split_sizes_to_ranges(cols, group["col_split_sizes"], name),
        matrix_rows=rows if stacked else None,
    )


def make_plan(
    group: dict[str, Any], bufs: Sequence[Tensor], names: Sequence[str], keys: Sequence[str], fixed: bool
) -> GroupPlan:
    """The plan of a Muon group whose parameters (plain tensors) have the momentum buffers ``bufs``; ``fixed``:
    its schedule decides one kind for the whole group."""
    params = list(group["params"])
    jobs = [matrix_job(p, group, name) for p, name in zip(params, names)]
    members: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, b) in enumerate(zip(params, bufs)):
        members.setdefault((tuple(p.shape), p.dtype, b.dtype, b.device), []).append(i)
    classes, order = [], []
    for (shape, _, dtype, device), idx in members.items():
        job = jobs[idx[0]]
        regions = {kind: map_regions(job, kind) for kind in StepKind}
        row_regions = job.regions()
        numel = math.prod(shape)
        classes.append(
            ShapeClass(
                params=[params[i] for i in idx],
                shape=shape,
                rows=job.rows,
                cols=job.cols,
                lead=2 if group["stacked"] else 1,
                dtype=dtype,
                device=device,
                regions={**regions, StepKind.ROWNORM: row_regions},
                tiled=_tiling(row_regions, job.rows, job.cols),
                alone=devices.cpu_path(device) or numel > MASK_BATCH_NUMEL,
            )
        )
        order += idx
    return ordered_plan(group, classes, order, params, bufs, jobs, keys, fixed)


def ordered_plan(
    group: dict[str, Any],
    classes: list[Any],
    order: Sequence[int],
    params: Sequence[Tensor],
    bufs: Sequence[Tensor],
    jobs: Sequence[MatrixJob],
    keys: Sequence[str],
    fixed: bool,
    sharded: bool = False,
) -> GroupPlan:
    """The plan of ``group``'s ``classes``: its parameters, momenta, jobs and names put in class ``order``."""
    return GroupPlan(
        ids=tuple(map(id, group["params"])),
        options=plan_options(group),
        classes=classes,
        params=[params[i] for i in order],
        bufs=[bufs[i] for i in order],
        jobs=[jobs[i] for i in order],
        keys=[keys[i] for i in order],
        fixed=fixed,
        sharded=sharded,
    )


def masked_gradients(plan: GroupPlan, mask: Tensor, grads: Sequence[Tensor]) -> list[Tensor]:
    """``where(mask, G, M)`` per gradient (class order), one ``where`` per class where its gradients are small on
    an accelerator: :func:`dimuon.optim.per_job.masked_gradients`, classes known in advance."""
    out: list[Tensor] = []
    start = 0
    for cls in plan.classes:
        stop = start + len(cls.params)
        gs, ms = grads[start:stop], plan.bufs[start:stop]
        if cls.alone or len(gs) == 1:
            out += [torch.where(mask, g, m) for g, m in zip(gs, ms)]
        else:
            out += torch.where(mask, torch.stack(gs), torch.stack(ms)).unbind(0)
        start = stop
    return out


def nesterov_batches(plan: GroupPlan, grads: Sequence[Tensor], beta: float, nesterov: bool) -> list[Tensor]:
    """Per class, its ``(B, rows, cols)`` batch of ``U``: ``lerp(G, M, beta)`` written into one buffer per class
    (kept between steps on the CPU), or with Nesterov off the momenta stacked (``U = M``)."""
    if not nesterov:
        return stacked_momenta(plan)
    batches = u_batches(plan)
    outs: list[Tensor] = []
    gs: list[Tensor] = []
    ms: list[Tensor] = []
    start = 0
    for batch, cls in zip(batches, plan.classes):
        stop = start + len(cls.params)
        ms += [b.view(cls.rows, cls.cols) for b in plan.bufs[start:stop]]
        outs += batch.unbind(0)
        gs += [g.reshape(cls.rows, cls.cols) for g in grads[start:stop]]
        start = stop
    one_device = len({cls.device for cls in plan.classes}) == 1
    if devices.cpu_path(plan.classes[0].device) or not one_device:  # one pass per matrix: U <- lerp(G, M, beta)
        for g, m, u in zip(gs, ms, outs):
            torch.lerp(g, m, beta, out=u)
    else:  # two list ops for the whole group: U <- G, then U <- lerp(U, M, beta), the same lerp bit for bit
        torch._foreach_copy_(outs, gs)
        torch._foreach_lerp_(outs, ms, beta)
    return batches


def u_batches(plan: GroupPlan) -> list[Tensor]:
    """Per class, the ``(B, rows, cols)`` buffer its Nesterov momenta are written into (kept between steps on the
    CPU, where a fresh one would be paged in again; an accelerator's allocator caches it)."""
    batches = []
    for ci, cls in enumerate(plan.classes):
        cpu = devices.cpu_path(cls.device)
        batch = plan.slots.get(ci) if cpu else None
        if batch is None:
            batch = torch.empty((len(cls.params), cls.rows, cls.cols), dtype=cls.dtype, device=cls.device)
            if cpu:
                plan.slots[ci] = batch
        batches.append(batch)
    return batches


def stacked_momenta(plan: GroupPlan) -> list[Tensor]:
    """Per class, its momenta stacked as a ``(B, rows, cols)`` batch: ``U = M`` with Nesterov off."""
    out, start = [], 0
    for cls in plan.classes:
        stop = start + len(cls.params)
        out.append(torch.stack([b.view(cls.rows, cls.cols) for b in plan.bufs[start:stop]]))
        start = stop
    return out


def plan_weights(plan: GroupPlan) -> list[Tensor]:
    """The tensors the step writes, class after class: the parameters, or a sharded plan's local pieces (read at
    every step: a wrapper may give a parameter new local data)."""
    if plan.sharded:
        return local_tensors(plan.params)
    return plan.params


def directions_by_class(made: Tensor | list[Tensor]) -> list[Tensor]:
    """One class's directions, per matrix: the rows of its batch, or the list a refresh made."""
    return list(made) if isinstance(made, list) else list(made.unbind(0))


def weight_directions(made: Tensor | list[Tensor], cls: ShapeClass, keep: Tensor | None) -> list[Tensor]:
    """One class's directions per matrix, shaped and typed as its weights (cast only where the weight is narrower,
    bf16), times the vote's ``keep`` where the step is masked."""
    dtype = cls.params[0].dtype
    if isinstance(made, list):  # a refresh's directions, per matrix
        rows = [d.reshape(cls.shape) for d in made]
        rows = rows if not rows or rows[0].dtype == dtype else [d.to(dtype) for d in rows]
        return rows if keep is None or not rows else list(torch._foreach_mul(rows, keep))
    made = made if made.dtype == dtype else made.to(dtype)
    return list((made if keep is None else made * keep).reshape(len(cls.params), *cls.shape).unbind(0))


def grads_launchable(plan: GroupPlan, grads: Sequence[Tensor]) -> bool:
    """Whether the fused kernels take these gradients too (the parameters and momenta are checked with the plan),
    without a Python call per gradient."""
    return (
        plan.launchable
        and all(map(Tensor.is_contiguous, grads))
        and {g.dtype for g in grads} <= set(fused._DTYPES)
        and {g.device for g in grads} == {plan.classes[0].device}
    )


def _map(batch: Tensor, kind: StepKind, config: MapConfig, rows: int, cols: int) -> Tensor:
    """The scaled direction of a ``(B, rows, cols)`` batch at a spectral or block step (``apply_map_batched``'s
    arithmetic on one shape)."""
    return engine_module.orthogonalize_batch(batch, config, lr_scale_factor(config.lr_scale, rows, cols))


def spectral_directions(
    classes: Sequence[ShapeClass], batches: Sequence[Tensor], kind: StepKind, config: MapConfig
) -> list[Tensor]:
    """Per class, the ``(B, rows, cols)`` directions of a spectral or block step: every region of one shape and
    dtype in the group orthogonalized in one batch, each class's regions then assembled."""
    buckets: dict[tuple[Any, ...], list[tuple[int, Region]]] = {}
    for ci, cls in enumerate(classes):
        for r0, r1, c0, c1 in cls.regions[kind]:
            buckets.setdefault((r1 - r0, c1 - c0, cls.dtype), []).append((ci, (r0, r1, c0, c1)))
    parts: list[list[tuple[Region, Tensor]]] = [[] for _ in classes]
    for (rows, cols, _), members in buckets.items():
        pieces = [batches[ci][:, r0:r1, c0:c1] for ci, (r0, r1, c0, c1) in members]
        contiguous_rows = members[0][1][2:] == (0, classes[members[0][0]].cols)
        if len(pieces) == 1 and contiguous_rows:
            batch = pieces[0]  # rows of one buffer, evenly spaced: a view, as the engine takes it
        else:
            batch = torch.cat([p.contiguous() for p in pieces]) if len(pieces) > 1 else pieces[0].contiguous()
        result = _map(batch, kind, config, rows, cols)
        for (ci, region), part in zip(members, result.split([len(classes[ci].params) for ci, _ in members])):
            parts[ci].append((region, part))
    out = []
    for cls, regions in zip(classes, parts):
        if not regions:  # a sharded class holding none of its matrices' rows: an empty direction
            wide = torch.promote_types(cls.dtype, torch.float32)
            out.append(torch.zeros((len(cls.params), cls.rows, cls.cols), dtype=wide, device=cls.device))
            continue
        if len(regions) == 1 and regions[0][0] == (0, cls.rows, 0, cls.cols):
            out.append(regions[0][1])
            continue
        whole = torch.empty((len(cls.params), cls.rows, cls.cols), dtype=regions[0][1].dtype, device=cls.device)
        torch._foreach_copy_([whole[:, r0:r1, c0:c1] for (r0, r1, c0, c1), _ in regions], [d for _, d in regions])
        out.append(whole)
    return out


def row_factors_by_class(cls: ShapeClass, batch: Tensor, config: MapConfig) -> Tensor:
    """A tiled class's RowNorm factors, ``(B, rows, 1)`` or ``(B, 1, cols)`` (the shape scale folded in), or an
    untiled class's direction written region by region."""
    regions = cls.regions[StepKind.ROWNORM]
    factors = [
        row_factors(batch[:, r0:r1, c0:c1], scale=lr_scale_factor(config.lr_scale, r1 - r0, c1 - c0))
        for r0, r1, c0, c1 in regions
    ]
    if cls.tiled is not None:
        return factors[0] if len(factors) == 1 else torch.cat(factors, dim=1 if cls.tiled == "rows" else 2)
    out = torch.zeros(batch.shape, dtype=factors[0].dtype, device=batch.device)
    for (r0, r1, c0, c1), f in zip(regions, factors):
        if torch.compiler.is_compiling():  # a graph takes no strided out=: the product, then a copy (same values)
            out[:, r0:r1, c0:c1] = batch[:, r0:r1, c0:c1] * f
        else:
            torch.mul(batch[:, r0:r1, c0:c1], f, out=out[:, r0:r1, c0:c1])
    return out


class ClassStep:
    """The class path's share of the optimizer: its plans, made with the groups, and the step they take."""

    param_groups: list[dict[str, Any]]
    state: Any
    schedule: Schedule
    kernels: str
    _engine: Any
    _plans: dict[int, GroupPlan | None]
    _adamw_plans: dict[int, Any]

    def _make_plans(self) -> None:
        """Every Muon group's plan by shape class, where the step can take the class path: a single process (the
        local engine), contiguous plain parameters (a schedule that decides per matrix reads the jobs' updates,
        views of the class batches)."""
        self._plans = {}
        self._adamw_plans = {}  # the AdamW groups' plans, made again at their next step
        for gi, group in enumerate(self.param_groups):
            if group["algorithm"] == "muon" and group["params"]:
                self._plans[gi] = self._make_plan(gi, group)

    def _make_plan(self, gi: int, group: dict[str, Any]) -> GroupPlan | None:
        """Group ``gi``'s plan: by shape class in one process, by class of local pieces under an engine that plans
        them (the sharded one's ``class_plan``); None where the step takes the per-job path."""
        params = group["params"]
        schedule = type(self.schedule)
        fixed = schedule.decide is Schedule.decide and schedule.after_step is Schedule.after_step
        local = type(self._engine) is LocalEngine
        if not local and not hasattr(self._engine, "class_plan"):
            return None
        states = [self.state.get(p, {}) for p in params]
        if any("momentum_buffer" not in st or not p.is_contiguous() for p, st in zip(params, states)):
            return None  # parameters on the meta device, or not laid out as their matrices
        names = group.get("param_names")
        made = make_plan if local else self._engine.class_plan
        plan = made(
            group,
            [st["momentum_buffer"] for st in states],
            [names[i] if names else f"params[{i}]" for i in range(len(params))],
            [self._param_name(group, i, gi) for i in range(len(params))],
            fixed,
        )
        if plan is not None:
            plan.launchable = fused.launchable(*plan_weights(plan), *plan.bufs)
        return plan

    def _group_plan(self, gi: int, group: dict[str, Any], params: list[Tensor]) -> GroupPlan | None:
        """Group ``gi``'s plan where this step takes the class path (every parameter has a gradient, the state is
        made), else None; made here only after the first step (which may remake the momenta), and where parameters
        were replaced or matrix options changed since."""
        if group["step"] == 0 or len(params) != len(group["params"]):
            return None
        plan = self._plans[gi] if gi in self._plans else self._make_plan(gi, group)  # made after the first step
        if plan is not None and (plan.ids != tuple(map(id, params)) or plan.options != plan_options(group)):
            plan = self._make_plan(gi, group)
        self._plans[gi] = plan
        return plan

    def _class_work(self, group: dict[str, Any], plan: GroupPlan, mask: Tensor | None) -> _MuonWork:
        """:meth:`_muon_work` by shape class: the momenta in one list op, ``U`` in one batch per class."""
        beta = group["momentum"]
        grads = [p.grad for p in plan.params]
        if plan.sharded:  # each gradient's local piece (the momenta in the plan are local already)
            grads = local_tensors(grads)
            if True in [g is None for g in grads]:  # stepped by the ranks' agreement without a gradient here: the
                # ranks disagree on it, so the vote failed everywhere and the step is masked; zeros stand in
                grads = [torch.zeros_like(b) if g is None else g for g, b in zip(grads, plan.bufs)]
        if fused.fuses(self.kernels, plan.classes[0].device) and grads_launchable(plan, grads):
            # One launch: M <- lerp(M, G, 1 - beta) and U <- lerp(G, M, beta), G masked by the vote in the kernel.
            slots = u_batches(plan) if group["nesterov"] else None
            outs = [u for b in slots for u in b.unbind(0)] if slots is not None else None
            fused.momentum_(self._tables, grads, plan.bufs, outs, beta, mask)
            batches = slots if slots is not None else stacked_momenta(plan)  # U, or U = M as updated
        else:
            if mask is None:
                grads = [g.to(b.dtype) for g, b in zip(grads, plan.bufs)]
            else:
                grads = masked_gradients(plan, mask, grads)
            # M <- beta*M + (1-beta)*G  (EMA form)
            torch._foreach_lerp_(plan.bufs, grads, 1.0 - beta)
            batches = nesterov_batches(plan, grads, beta, group["nesterov"])
        config = self._map_config(group, plan.classes[0].device)
        if not plan.fixed:  # a schedule that decides per matrix reads each job's U (its staleness, its state)
            us = [u for batch in batches for u in batch.unbind(0)]
            for job, u in zip(plan.jobs, us):
                job.update = u
        return _MuonWork(group, plan.params, plan.jobs, config, plan.keys, plan, batches)

    def _by_kind(self, work: _MuonWork, kinds: Sequence[StepKind]) -> list[tuple[_MuonWork, StepKind]]:
        """A group whose matrices take different kinds (a schedule deciding per matrix), split by kind: per kind
        present, the work of its matrices, each class's share as one batch (the class batch itself, or its rows
        picked in one op), in the order the per-job path maps them."""
        plan, batches = work.plan, work.batches
        assert plan is not None and batches is not None
        out = []
        for kind in [k for k in StepKind if k in kinds]:
            subs, picked, jobs, start = [], [], [], 0
            for cls, batch in zip(plan.classes, batches):
                stop = start + len(cls.params)
                idx = [i for i, k in enumerate(kinds[start:stop]) if k is kind]
                if len(idx) == len(cls.params):
                    subs.append(cls)
                    picked.append(batch)
                elif idx:  # a sharded stacked class's per-member placements with its members
                    placed = {"placed": tuple([cls.placed[i] for i in idx])} if getattr(cls, "placed", ()) else {}
                    subs.append(replace(cls, params=[cls.params[i] for i in idx], **placed))
                    picked.append(batch[idx])
                jobs += [plan.jobs[start + i] for i in idx]
                start = stop
            params = [p for cls in subs for p in cls.params]
            part = replace(plan, classes=subs, params=params, jobs=jobs)
            out.append((_MuonWork(work.group, params, jobs, work.config, [], part, picked), kind))
        return out

    def _class_directions(self, work: _MuonWork, kind: StepKind) -> list[Any]:
        """Per class, its directions at this step kind: a ``(B, rows, cols)`` batch (RowNorm's factors where they
        tile), or for a sharded plan's refresh the list the engine's refresh made."""
        plan, batches, config = work.plan, work.batches, work.config
        assert plan is not None and batches is not None
        if kind is StepKind.ROWNORM and plan.sharded:
            return self._engine.class_row_factors(plan.classes, batches)
        if kind is StepKind.ROWNORM:
            return [row_factors_by_class(c, b, config) for c, b in zip(plan.classes, batches)]
        if plan.sharded and kind is StepKind.SPECTRAL:
            return self._engine.class_refresh(plan, batches, config)
        return spectral_directions(plan.classes, batches, kind, config)

    def _class_apply(self, work: _MuonWork, kind: StepKind, mask: Tensor | None) -> list[Any]:
        """:meth:`_muon_apply` by shape class: directions per class, then the decay and one list update. Returns
        the directions (RowNorm's factors where they tile), per class."""
        group, plan, batches = work.group, work.plan, work.batches
        assert plan is not None and batches is not None
        lr, wd = group_lr(group), group["weight_decay"]
        made = self._class_directions(work, kind)
        if self._fused_class_apply(work, kind, made, mask):
            return made
        weights = plan_weights(plan)
        if wd != 0:
            decay = 1.0 - lr * wd  # decoupled, with the unscaled lr
            if mask is not None:
                decay = torch.where(mask, torch.as_tensor(decay, dtype=torch.float64, device=mask.device), 1.0)
            torch._foreach_mul_(weights, decay)
        step_size = lr * self.schedule.multiplier(kind, group)
        keep = mask.to(torch.float32) if mask is not None else None
        ws, us, fs, plain_ws, ds, start = [], [], [], [], [], 0
        for cls, batch, d in zip(plan.classes, batches, made):
            n = len(cls.params)
            mine, start = weights[start : start + n], start + n
            if kind is StepKind.ROWNORM and cls.tiled is not None:  # W <- W - step U factor: no direction written
                ws += mine
                us += batch.view(n, *cls.shape).unbind(0)
                fs += cls.factor_view(d if keep is None else d * keep).unbind(0)
                continue
            plain_ws += mine
            ds += weight_directions(d, cls, keep)
        if ws and isinstance(step_size, Tensor):  # a Tensor lr: a 0-d factor (value takes numbers only)
            torch._foreach_addcmul_(ws, us, torch._foreach_mul(fs, -step_size))
        elif ws:
            torch._foreach_addcmul_(ws, us, fs, value=-step_size)
        if plain_ws and isinstance(step_size, Tensor):  # a Tensor lr: a 0-d factor (alpha takes numbers only)
            torch._foreach_sub_(plain_ws, torch._foreach_mul(ds, step_size))
        elif plain_ws:
            torch._foreach_add_(plain_ws, ds, alpha=-step_size)
        return made

    def _fused_class_apply(self, work: _MuonWork, kind: StepKind, made: Sequence[Any], mask: Tensor | None) -> bool:
        """``W <- (1 - lr wd) W - step D f`` for the whole group in the fused kernel (one launch per dtype pair), where
        it takes the step; False where the eager list ops must (per_job.py's _fused_apply, by class)."""
        group, plan, batches = work.group, work.plan, work.batches
        assert plan is not None and batches is not None
        lr, wd = group_lr(group), group["weight_decay"]
        device = plan.classes[0].device
        if not (plan.launchable and fused.fuses(self.kernels, device)) or (isinstance(lr, Tensor) and wd != 0):
            return False  # a Tensor lr's decay would be a device number too: the eager form takes it
        rows = [kind is StepKind.ROWNORM and cls.tiled is not None for cls in plan.classes]
        dtypes = [d[0].dtype if isinstance(d, list) else d.dtype for d in made]
        wanted = [torch.float32 if tiled else dtype for tiled, dtype in zip(rows, dtypes)]
        if any(dtype != want or want not in fused._DTYPES for dtype, want in zip(dtypes, wanted)):
            return False
        if isinstance(lr, Tensor) and lr.device.type == "cpu" and device.type != "cpu":
            lr = float(lr)  # a host number: no device read
        ds, fs = [], []
        for cls, batch, d, tiled in zip(plan.classes, batches, made, rows):
            ds += batch.unbind(0) if tiled else directions_by_class(d)  # U with its factor, or the direction
            fs += d.unbind(0) if tiled else [None] * len(cls.params)
        step = lr * self.schedule.multiplier(kind, group)
        fused.update_(self._tables, plan_weights(plan), ds, fs, step, 1.0 - float(lr) * wd if wd else 1.0, mask)
        return True
