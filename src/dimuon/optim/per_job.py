"""The per-job step: each Muon parameter handed to the engine as a :class:`MatrixJob`, the path of sharded engines,
where a piece of a matrix is what a rank holds.

:class:`PerJobStep` is the part of :class:`~dimuon.optim.core.MuonFamily` that runs it: the momentum update, the
matrix jobs, one engine call per step kind and the weight update (fused where the kernels are). In one process the
class path (:mod:`dimuon.optim.classes`) runs the same rule by class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dimuon.optim import devices, fused
from dimuon.optim.classes import MASK_BATCH_NUMEL, _MuonWork, matrix_job
from dimuon.optim.common import StepKind, group_lr, local_tensor
from dimuon.optim.distributed.engine import (
    LocalEngine,
    MapConfig,
    RowDirection,
    RowScaled,
    shape_classes,
)
from dimuon.optim.schedules import Schedule, StepContext


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


class PerJobStep:
    """The per-job path's share of the optimizer: momenta, jobs, the engine's directions, the weight update."""

    state: Any
    schedule: Schedule
    kernels: str
    ns_compile: bool

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
        for p, u in zip(params, updates):
            i = index[id(p)]
            keys.append(self._param_name(group, i, gi))
            jobs.append(matrix_job(p, group, names[i] if names else f"params[{i}]", u))
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

    def _muon_apply(self, work: _MuonWork, kinds: Sequence[StepKind], mask: Tensor | None, ctx: StepContext) -> None:
        """Directions for each kind's jobs (one engine call per kind present), then the weight update.

        With a ``mask`` the decay factor is ``where(mask, 1 - lr wd, 1)`` (the same multiply) and the directions are
        multiplied by the mask (one list op: exact, ``D * 1 = D``; finite ``D * 0 = 0``, ``U`` being finite) before
        the usual update: a passed vote moves the weights bit for bit as the unmasked step, a failed one not at all.
        """
        if work.plan is not None and work.plan.fixed:  # a schedule that decides per group: one kind
            self._class_apply(work, kinds[0], mask)
            self._count_kinds(work, kinds)
            return
        if work.plan is not None:  # per matrix, on the class path: each kind's share of every class as one batch
            made = {kind: (part, self._class_apply(part, kind, mask)) for part, kind in self._by_kind(work, kinds)}
            self._count_kinds(work, kinds)
            self.schedule.after_step(work, kinds, made, mask, ctx)
            return
        group, engine = work.group, self._get_engine()
        lr, wd = group_lr(group), group["weight_decay"]
        plain = isinstance(engine, LocalEngine)  # no DTensors: a weight is its own local data
        weights = list(work.params) if plain else [local_tensor(p) for p in work.params]
        # Per kind present: one engine call, then one list update of the weights it moves (every matrix of a kind
        # shares the step size lr * mult, as the engine's directions carry their shape scale).
        chosen_by_kind = {kind: [i for i, k in enumerate(kinds) if k is kind] for kind in StepKind}
        chosen_by_kind = {kind: chosen for kind, chosen in chosen_by_kind.items() if chosen}
        directions, row_scaled = self._job_directions(work, weights, chosen_by_kind)
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

    def _job_directions(
        self, work: _MuonWork, weights: Sequence[Tensor], chosen_by_kind: dict[StepKind, list[int]]
    ) -> tuple[list[RowDirection | None], dict[int, RowScaled]]:
        """The engine's direction of every job, one call per kind; and the RowNorm directions left as
        ``U * factor`` (folded into the update, never written), by job."""
        engine = self._get_engine()
        directions: list[RowDirection | None] = [None] * len(work.jobs)
        row_scaled: dict[int, RowScaled] = {}
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
        return directions, row_scaled

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
