"""Parameter names across wrappers: how a state_dict saved under one wrapping meets an optimizer built under another.

A model trained under DDP (``module.``), ``torch.compile`` (``_orig_mod``), FSDP1 or activation checkpointing names
its parameters with the wrappers' parts; resuming it bare, or wrapped otherwise, must still find each state.
"""

from __future__ import annotations

from collections.abc import Sequence

# The prefix DistributedDataParallel and DataParallel put before every name of the model they hold.
DATA_PARALLEL_PREFIX = "module."


def without_wrapper_parts(names: Sequence[str]) -> list[str]:
    """``names`` without the name parts wrappers insert (:data:`dimuon.optim.grouping.WRAPPER_PARTS`)."""
    from dimuon.optim.grouping import WRAPPER_PARTS  # grouping imports the core, which imports this module

    return [".".join(part for part in name.split(".") if part not in WRAPPER_PARTS) for name in names]


def _without_prefix(names: Sequence[str]) -> list[str] | None:
    """``names`` without DDP's ``module.`` where every one of them carries it; else None."""
    if not names or not all(name.startswith(DATA_PARALLEL_PREFIX) for name in names):
        return None
    return [name[len(DATA_PARALLEL_PREFIX) :] for name in names]


def _check_distinct(given: Sequence[str], network: Sequence[str], side: str) -> None:
    """Refuse names that only wrappers' parts told apart: their states could go to either parameter."""
    first: dict[str, str] = {}
    for name, bare in zip(given, network):
        if bare in first:
            raise ValueError(
                f"{side} parameter names {first[bare]!r} and {name!r} are both {bare!r} without wrappers' name parts, "
                "so state cannot be matched to them by name; name them apart, or load by position (drop "
                "param_names from the state_dict's groups)"
            )
        first[bare] = name


def network_names(mine: Sequence[str], theirs: Sequence[str]) -> tuple[list[str], list[str]]:
    """The optimizer's names ``mine`` and a state_dict's ``theirs`` as the network names them: wrappers' name parts
    removed from both, and DDP's ``module.`` from the side whose every name carries it where that makes the two
    sides the same names (one side only, so a model with a child called ``module`` still matches itself)."""
    ours, others = without_wrapper_parts(mine), without_wrapper_parts(theirs)
    if set(ours) != set(others):
        for a, b in ((_without_prefix(ours), others), (ours, _without_prefix(others))):
            if a is not None and b is not None and set(a) == set(b):
                ours, others = a, b
                break
    _check_distinct(mine, ours, "the optimizer's")
    _check_distinct(theirs, others, "the state_dict's")
    return ours, others
