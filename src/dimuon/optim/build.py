"""``build(name, params, **opts)``: the one way the harness (or a user script) makes an optimizer."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import torch
from torch import nn

from dimuon.optim.core import MuonFamily, misspelling_hints
from dimuon.optim.grouping import param_groups
from dimuon.optim.muon import AdaptiveRowMuon, Muon, MuonBP, PeriodicRowMuon
from dimuon.optim.torch_muon import TorchMuonAdamW

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "muon": Muon,
    "periodic_row_muon": PeriodicRowMuon,
    "muon_bp": MuonBP,
    "adaptive_row_muon": AdaptiveRowMuon,
    "torch_muon": TorchMuonAdamW,
}

# Each optimizer's name in tables and plots.
LABELS: dict[str, str] = {
    "adamw": "AdamW",
    "muon": "Muon",
    "periodic_row_muon": "PeriodicRowMuon",
    "muon_bp": "MuonBP",
    "adaptive_row_muon": "AdaptiveRowMuon",
    "torch_muon": "torch.optim.Muon",
}
# The optimizers that run in one process only, and why (the layout limit every command states).
ONE_PROCESS_ONLY: dict[str, str] = {"torch_muon": "refuses sharded (DTensor) parameters"}

# AdamW defaults that match the AdamW group of the Muon-family optimizers (docs/algorithms.md, "AdamW group").
_ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def option_parameters(cls: type) -> dict[str, tuple[inspect.Parameter, Any]]:
    """Every keyword option of an optimizer class with its type hint: its ``__init__``'s named parameters, then
    those of each parent ``__init__`` it forwards ``**kwargs`` to (up to ``torch.optim.Optimizer``; a subclass's
    own declaration wins). For the Muon family: the schedule's options, then :class:`MuonFamily`'s."""
    found: dict[str, tuple[inspect.Parameter, Any]] = {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for klass in cls.__mro__:
        if klass in (torch.optim.Optimizer, object):
            break
        init = vars(klass).get("__init__")
        if init is None:
            continue
        hints = typing.get_type_hints(init)
        forwards = False
        for p in inspect.signature(init).parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                forwards = True
            elif p.kind in named and p.name not in ("self", "params"):
                found.setdefault(p.name, (p, hints.get(p.name, Any)))
        if not forwards:
            break
    return found


def _accepted_options(cls: type) -> set[str]:
    """The keyword options of ``cls`` (:func:`option_parameters`)."""
    return set(option_parameters(cls))


def build(name: str, params: nn.Module | Any, **opts: Any) -> torch.optim.Optimizer:
    """Optimizer ``name`` (``adamw``, ``muon``, ``periodic_row_muon``, ``muon_bp``, ``adaptive_row_muon``,
    ``torch_muon``) over ``params``.

    ``params`` may be a model (grouped with :func:`param_groups` for the Muon family and for
    ``torch_muon``, PyTorch's Muon + AdamW; all of its trainable parameters for AdamW), or anything a
    ``torch.optim`` optimizer accepts. Unknown
    option names raise a ``TypeError`` that lists the accepted ones.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {name!r}")
    cls = OPTIMIZERS[name]
    accepted = _accepted_options(cls)
    unknown = set(opts) - accepted
    if unknown:
        raise TypeError(
            f"optimizer {name!r} got unknown option(s) {sorted(unknown)}"
            + misspelling_hints(unknown, accepted)
            + f"; accepted: {sorted(accepted)}"
        )
    if isinstance(params, nn.Module):
        if issubclass(cls, (MuonFamily, TorchMuonAdamW)):
            params = param_groups(params)
        else:
            params = [p for p in params.parameters() if p.requires_grad]
    if cls is torch.optim.AdamW:
        opts = {**_ADAMW_DEFAULTS, **opts}
    return cls(params, **opts)
