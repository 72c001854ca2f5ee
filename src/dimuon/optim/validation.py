"""Checks of option values that raise one clear error naming the option and what it allows."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.nn import Module


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise a ValueError/TypeError naming ``name`` unless ``value`` lies in the stated range."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an int" if integer else "a number"
        raise TypeError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        interval = f"{lo or '(-inf'}, {hi or 'inf)'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _integral(value: Any) -> Any:
    """``value`` with integral floats as ints (also inside a tuple or list); anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, float) for v in value):
        return type(value)(_integral(v) for v in value)
    return value


# The core's integer-valued options: Newton-Schulz steps and the matrix splits (chunk counts or sizes).
INTEGER_OPTIONS: tuple[str, ...] = ("ns_steps", "split_sizes", "col_split_sizes")


def integer_options(schedule_defaults: Mapping[str, Any]) -> tuple[str, ...]:
    """The integer-valued options of an optimizer: the core's and its schedule's whose default is an int."""
    ints = (k for k, v in schedule_defaults.items() if isinstance(v, int) and not isinstance(v, bool))
    return (*INTEGER_OPTIONS, *ints)


def take_integral_floats(options: dict[str, Any], keys: Iterable[str]) -> None:
    """Integer options ``keys`` given as integral floats (``k=3.0`` read from a YAML or JSON config) as ints, in
    place, so the recorded option is the int; a float with a fraction stays for the check to refuse by name."""
    for key in keys:
        if key in options:
            options[key] = _integral(options[key])


def check_params(params: Any, optimizer: str) -> None:
    """Refuse a model passed where parameters go, pointing at its grouping (torch's own error, "'DiT' object is
    not iterable", names neither)."""
    if isinstance(params, Module):
        raise TypeError(
            f"{optimizer} takes parameters or parameter groups, not a model ({type(params).__name__}): pass "
            f"dimuon.optim.param_groups(model) (Muon for hidden matrices, AdamW for the rest), model.parameters(), or "
            f"the model to dimuon.optim.build(name, model)"
        )


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    """Raise a ValueError naming ``name`` and the allowed values unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def check_lr(value: Any, where: str) -> None:
    """A number >= 0, or a one-element floating Tensor holding one (as torch's optimizers accept)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor lr{where} must be 1-element, got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"Tensor lr{where} must be floating point, got {value.dtype}")
        value = value.item()
    check_number(f"lr{where}", value, low=0.0)


def check_split(name: str, value: Any) -> None:
    """``None``, a chunk count (an int >= 1) or chunk sizes (a non-empty sequence of ints >= 1)."""

    def is_int(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if value is None or (is_int(value) and value >= 1):
        return
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and value
        and all(is_int(v) and v >= 1 for v in value)
    ):
        return
    raise ValueError(
        f"{name} must be None, a chunk count (an int >= 1) or chunk sizes (a non-empty sequence of "
        f"ints >= 1), got {value!r}"
    )
