"""Checkpoint compatibility: ``state_dict`` and ``load_state_dict`` as torch's, plus what dimuon adds to them
(state matched by parameter name, a load refused with what differs, matrix state kept in its saved dtypes, old
pickles and state dicts that lack newer options, the skipped-step counters folded in before a save).

:class:`Checkpoints` is the part of :class:`~dimuon.optim.core.MuonFamily` that saves and loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from dimuon.optim import fused
from dimuon.optim.common import _some_names, matrix_shape
from dimuon.optim.distributed.engine import split_sizes_to_ranges
from dimuon.optim.distributed.layout import is_dtensor
from dimuon.optim.names import network_names
from dimuon.optim.options import (
    _ENGINE_DEFAULTS,
    _MATRIX_GROUP_OPTIONS,
    _RUNTIME_DEFAULTS,
    GROUP_DEFAULTS,
    MATRIX_DEFAULTS,
    _same_value,
)
from dimuon.optim.workspace import Workspace


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


class Checkpoints:
    """The optimizer's save and load: torch's, with the checks and conversions above."""

    param_groups: list[dict[str, Any]]
    state: Any
    _votes: dict[str, Tensor | None]
    _schedule_owners: dict[str, str]  # MuonFamily's: each schedule option -> the first optimizer taking it

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
        pending = self._votes["pending_skips"]
        if pending is not None:
            count = int(pending)
            pending.zero_()  # kept: a compiled step counts into the tensor it was traced with
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
            "_plans": {},
            "_adamw_plans": {},
            "_tables": fused.Tables(),
            "_map_buffers": Workspace(),
            "_schedule_scratch": {},
        }
        for key, value in runtime.items():
            if not hasattr(self, key):
                setattr(self, key, value)
        # Pickles of earlier versions lack the newer options: the table's defaults.
        for key, value in _ENGINE_DEFAULTS.items():
            self.engine_options.setdefault(key, value)
        for key, value in {**GROUP_DEFAULTS, **MATRIX_DEFAULTS}.items():
            self.defaults.setdefault(key, value)
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
            pending = self._votes["pending_skips"]
            if pending is not None:  # the loaded counts replace this run's (a refused load keeps them)
                pending.zero_()
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
            self._make_plans()  # the loaded momenta are new tensors, laid out as their parameters now

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
            stray = sorted(k for k in set(saved) - mine if k in self._schedule_owners)
            missing = sorted(mine - set(saved) - set(self.schedule.late_options))
            if stray or missing:
                owners = ", ".join(sorted({self._schedule_owners[k] for k in stray}))
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
