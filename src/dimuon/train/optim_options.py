"""The ``--optim.*`` flags of ``dimuon train``, derived from the optimizers' own ``__init__`` signatures.

An optimizer's keyword options are declared once, in its signature (with its type hint and its default; the
Muon family's shared ones in ``MuonFamily.__init__``, typed for its subclasses by ``MuonOptions``) and its text
once in :mod:`dimuon.optim.docs`; :data:`OptimOptions` is built from them when this module is imported,
so an option added to an optimizer appears as a flag, in ``config.json`` and in ``build()`` with no
edit here. The rules:

- The flags are the union of the options of every optimizer in ``dimuon.optim.OPTIMIZERS``, except
  ``lr`` (it is ``--lr``), ``nonfinite`` (the harness applies one policy to every optimizer: ``--nonfinite``)
  and arguments that cannot be typed on a command line (``process_group``, ``engine``: anything whose
  type is not a number, string, bool, dtype or a tuple of those).
- Every flag defaults to ``None``: keep the optimizer's own default. A flag the chosen optimizer does
  not take is passed on anyway, so ``build`` rejects it with the list of what it accepts.
- The Muon family drives its AdamW groups with ``adamw_*`` options (``adamw_betas``, ``adamw_eps``);
  where an optimizer has no option of that name without the prefix, the flag drops the prefix, so
  ``--optim.betas`` is AdamW's ``betas`` and the Muon family's ``adamw_betas``.
- ``torch.dtype`` options are spelled ``float32``, ``bfloat16`` or ``float16``.
- An option that takes a scalar or tuples of it (``blocks: int | tuple[int, int]``) takes one or more values
  (``--optim.blocks 4``, ``--optim.blocks 2 2``), passed on as a tuple.
- The help text is the first sentence of the option's declared text (:mod:`dimuon.optim.docs`, a schedule's
  ``Option.doc``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import tyro

from dimuon.optim import OPTIMIZERS, MuonFamily
from dimuon.optim.build import option_parameters
from dimuon.optim.docs import ADAMW_OPTIONS, CORE_OPTIONS, TORCH_MUON_OPTIONS
from dimuon.optim.torch_muon import TorchMuonAdamW

__all__ = [
    "DTYPES",
    "OPTION_SPECS",
    "OptimOptions",
    "OptionSpec",
    "accepted_parameters",
    "derive_option_specs",
    "documented_args",
    "optimizer_kwargs",
    "options_dataclass",
    "options_from_dict",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DtypeName = Literal["float32", "bfloat16", "float16"]
AUX_PREFIX = "adamw_"  # the Muon family's options of its AdamW groups
NOT_OPTIONS = ("self", "params", "lr", "nonfinite")  # the top-level --lr and --nonfinite
_SCALARS = (bool, int, float, str)


@dataclass
class OptionSpec:
    """One ``--optim.<name>`` flag: its command-line type, help, and each optimizer's keyword for it."""

    name: str
    type: Any
    keywords: dict[str, str] = field(default_factory=dict)  # optimizer -> its own keyword
    help: str = ""

    @property
    def is_dtype(self) -> bool:
        return self.type is DtypeName


# --------------------------------------------------------------------------------------------------
# Reading the optimizers
# --------------------------------------------------------------------------------------------------


def accepted_parameters(cls: type) -> dict[str, tuple[inspect.Parameter, Any]]:
    """Keyword options of an optimizer class with their type hints (:func:`dimuon.optim.build.option_parameters`),
    less ``lr`` and ``nonfinite`` (their own flags)."""
    return {name: found for name, found in option_parameters(cls).items() if name not in NOT_OPTIONS}


def documented_args(cls: type) -> dict[str, str]:
    """``name -> description`` of an optimizer's options, from the declared texts (:mod:`dimuon.optim.docs` and its
    schedule's ``Option.doc``); no docstring is read."""
    if isinstance(cls, type) and issubclass(cls, MuonFamily):
        return {**CORE_OPTIONS, **{key: option.doc for key, option in cls.schedule.options.items()}}
    if cls is torch.optim.AdamW:
        return dict(ADAMW_OPTIONS)
    if cls is TorchMuonAdamW:
        return dict(TORCH_MUON_OPTIONS)
    return {}


_DEFAULT_REMARK = re.compile(r"\s*\(default(?::[^()]*(?:\([^()]*\)[^()]*)*)?\)")


def _first_sentence(text: str) -> str:
    """The first sentence of a description, without ``(default ...)`` remarks or reST markup."""
    text = re.sub(r"`([^`]*)`_", r"\1", _DEFAULT_REMARK.sub("", text)).replace("``", "")
    text = re.sub(r"\s+", " ", text).strip()
    return re.split(r"(?<=\.)\s+(?=[A-Z])", text, maxsplit=1)[0].rstrip(" .")


def cli_type(hint: Any) -> Any:
    """The command-line type of a type hint, or None if it cannot be typed on a command line.

    ``None`` and ``torch.Tensor`` drop out of unions (every flag may be left unset, and a tensor
    hyperparameter is given as a number); ``torch.dtype`` becomes a dtype name.
    """
    if hint is torch.dtype:
        return DtypeName
    if hint in _SCALARS:
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return hint
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a not in (type(None), torch.Tensor)]
        if len(kept) == 1:
            return cli_type(kept[0])
        # A scalar or tuples of it (MuonBP's ``blocks: int | tuple[int, int]``): one flag taking one or more values.
        typed = [cli_type(a) for a in kept]
        scalars = [t for t in typed if t in _SCALARS]
        tuples_of = {a for t in typed if typing.get_origin(t) is tuple for a in typing.get_args(t) if a is not Ellipsis}
        if (
            len(scalars) == 1
            and len(typed) == len(scalars) + sum(typing.get_origin(t) is tuple for t in typed)
            and tuples_of <= set(scalars)
        ):
            return tuple[scalars[0], ...]
        return None
    if origin is tuple and args:
        inner = [cli_type(a) for a in args if a is not Ellipsis]
        if any(t not in _SCALARS for t in inner):
            return None
        return tuple[tuple(inner)] if Ellipsis not in args else tuple[inner[0], ...]
    return None


def derive_option_specs(optimizers: Mapping[str, type]) -> dict[str, OptionSpec]:
    """The ``--optim.*`` flags of a registry of optimizers (name -> class), in registry order."""
    specs: dict[str, OptionSpec] = {}
    for opt_name, cls in optimizers.items():
        params = accepted_parameters(cls)
        docs = documented_args(cls)
        for keyword, (_, hint) in params.items():
            typ = cli_type(hint)
            if typ is None:
                continue
            bare = keyword.removeprefix(AUX_PREFIX)
            flag = bare if keyword.startswith(AUX_PREFIX) and bare not in params else keyword
            spec = specs.setdefault(flag, OptionSpec(flag, typ))
            if spec.type != typ:
                raise TypeError(
                    f"optimizer option {flag!r} has type {spec.type} in {sorted(spec.keywords)} but {typ} in "
                    f"{opt_name} ({keyword}): one flag cannot serve both"
                )
            spec.keywords[opt_name] = keyword
            if not spec.help and keyword in docs:
                spec.help = _first_sentence(docs[keyword])
    for spec in specs.values():
        spec.help = f"{spec.help + ' ' if spec.help else ''}({_takers(spec, list(optimizers))})"
    return specs


def _takers(spec: OptionSpec, order: list[str]) -> str:
    """Which optimizers take a flag, and under which keyword where it differs from the flag."""
    if list(spec.keywords) == order and all(k == spec.name for k in spec.keywords.values()):
        return "every optimizer"
    by_keyword: dict[str, list[str]] = {}
    for opt_name, keyword in spec.keywords.items():
        by_keyword.setdefault(keyword, []).append(opt_name)
    return "; ".join(
        ", ".join(names) + ("" if keyword == spec.name else f" as {keyword}") for keyword, names in by_keyword.items()
    )


# --------------------------------------------------------------------------------------------------
# The dataclass and the keyword arguments of build()
# --------------------------------------------------------------------------------------------------


def options_dataclass(specs: Mapping[str, OptionSpec], name: str = "OptimOptions") -> type:
    """A dataclass with one ``T | None = None`` field per flag, its help attached for tyro."""
    fields = [
        (spec.name, Annotated[spec.type | None, tyro.conf.arg(help=spec.help)], dataclasses.field(default=None))
        for spec in specs.values()
    ]
    cls = dataclasses.make_dataclass(name, fields)
    cls.__module__ = __name__
    cls.__doc__ = (
        "Optimizer options; None keeps the optimizer's own default.\n\n"
        "An option the chosen optimizer does not take (e.g. --optim.k with muon) is an error."
    )
    return cls


OPTION_SPECS: dict[str, OptionSpec] = derive_option_specs(OPTIMIZERS)
OptimOptions = options_dataclass(OPTION_SPECS)


def optimizer_kwargs(optimizer: str, options: Any, lr: float) -> dict[str, Any]:
    """Keyword options of ``dimuon.optim.build(optimizer, ...)``: ``lr`` and every set flag, in the optimizer's
    own spelling (dtype names become ``torch.dtype``)."""
    kwargs: dict[str, Any] = {"lr": lr}
    for spec in OPTION_SPECS.values():
        value = getattr(options, spec.name)
        if value is None:
            continue
        kwargs[spec.keywords.get(optimizer, spec.name)] = DTYPES[value] if spec.is_dtype else value
    return kwargs


def options_from_dict(data: Mapping[str, Any]) -> Any:
    """:data:`OptimOptions` from its ``config.json`` form (lists back to tuples); unknown keys raise ``KeyError``."""
    unknown = sorted(set(data) - set(OPTION_SPECS))
    if unknown:
        raise KeyError(unknown)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return OptimOptions(**values)
