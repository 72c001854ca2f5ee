"""The one warning of a step that finds no gradient at all: its parameters are most likely not the model's."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

# The optimizers warned already (once each: a loop of silent no-op steps would otherwise warn every step).
_WARNED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class NoGradientWarning(UserWarning):
    """A step found no gradient on any of the optimizer's parameters, so it changed nothing: most often the
    parameters were replaced after the optimizer was built (``fully_shard``, ``model.to(device)``, a wrapper)."""


def warn_no_gradients(opt: torch.optim.Optimizer, param_groups: Sequence[dict[str, Any]]) -> None:
    """Warn once per optimizer that its step found no gradient (called only for such a step: free otherwise)."""
    count = sum(len(group["params"]) for group in param_groups)
    if not count or opt in _WARNED or torch.compiler.is_compiling():
        return
    _WARNED.add(opt)
    warnings.warn(
        f"{type(opt).__name__}.step() found no gradient on any of its {count} parameters and changed nothing; "
        "most likely they are not the model's any more: fully_shard, model.to(device) or another wrapper replaced "
        "them after the optimizer was built (build the optimizer after them), or step ran before backward",
        NoGradientWarning,
        stacklevel=5,
    )
