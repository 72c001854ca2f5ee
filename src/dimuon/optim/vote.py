"""The non-finite vote: whether every gradient of a step is finite, agreed by every rank in one 4-byte all-reduce,
and (under a sharded engine) which Muon parameters every rank steps.

:class:`NonfiniteVote` is the part of :class:`~dimuon.optim.core.MuonFamily` that votes: nonfinite="skip"
masks the step by the vote on the device (no host read), "raise" reads it once and raises before anything moves.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dimuon.optim import devices
from dimuon.optim.common import _some_names, local_tensor, local_tensors
from dimuon.optim.distributed.engine import DirectionEngine, LocalEngine


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


class NonfiniteVote:
    """The vote's share of the optimizer: its verdicts, the agreed set of stepped parameters, its error messages."""

    param_groups: list[dict[str, Any]]
    nonfinite: str
    _grad_sets: dict[str, Any]
    _vote_codes: dict[tuple[bool, torch.device], tuple[Tensor, Tensor]]

    def _local_grads_finite(self) -> tuple[Tensor, _Verdicts]:
        """0-d bool on the parameters' device: every local gradient entry is finite (one pass per gradient: the
        extremes, or on an accelerator the largest magnitudes, are finite exactly when every entry is, NaN
        propagates); and the verdict per local gradient, for the error message (:meth:`_vote_values`)."""
        params = [(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        device = local_tensor(params[0][2]).device if params else torch.device("cpu")
        if isinstance(self._get_engine(), LocalEngine):  # plain tensors: a gradient is its own local data
            found = [(gi, i, p.grad) for gi, i, p in params if p.grad is not None]
        else:
            # the local pieces (a DTensor's own data, as to_local() gives it under no_grad): no call per gradient
            held = [(gi, i, p.grad) for gi, i, p in params if p.grad is not None]
            found = [(gi, i, g) for (gi, i, _), g in zip(held, local_tensors([g for _, _, g in held]))]
        grads: dict[torch.device, list[tuple[int, int, Tensor]]] = {}
        for gi, i, g in found:
            if g.numel() > 0:  # an empty local shard has nothing to check
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
        # lists made into tuples: a generator would resume (a Python call) once per parameter
        universe = tuple([id(p) for _, _, p in params])
        held = tuple([p.grad is not None for _, _, p in params])
        known = self._grad_sets.get("agreed")
        if known is not None and known[0] == universe:
            agreed = known[1]
        else:  # new parameters (the first step, a group added, parameters replaced): all that require a gradient
            agreed = tuple([p.requires_grad for _, _, p in params])
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
