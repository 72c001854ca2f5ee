"""The core's option table is the one declaration of its options: the constructor's signature, ``MuonOptions``, the
defaults a group, the optimizer and its engine hold, and the option texts are held to it (names, order, defaults)."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch
from torch import nn

from dimuon.optim import Muon
from dimuon.optim.core import MuonFamily, MuonOptions
from dimuon.optim.docs import CORE_OPTIONS
from dimuon.optim.options import _ENGINE_DEFAULTS, _RUNTIME_DEFAULTS, CORE_TABLE, GROUP_ARGUMENTS, MATRIX_DEFAULTS

ARGUMENTS = [o for o in CORE_TABLE if o.where != "matrix"]


def test_signature_follows_the_table() -> None:
    """MuonFamily.__init__ takes the table's constructor options, in its order, with its defaults."""
    parameters = [p for p in inspect.signature(MuonFamily.__init__).parameters.values() if p.name != "self"]
    assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD  # the schedule's options
    assert [p.name for p in parameters[:-1]] == [o.name for o in ARGUMENTS]
    for p, option in zip(parameters, ARGUMENTS):
        if option.name != "params":
            assert p.default == option.default, option.name


def test_muon_options_follow_the_table() -> None:
    """MuonOptions types the options after ``params`` and ``lr``, in the table's order, as the signature does."""
    typed = typing.get_type_hints(MuonOptions)
    assert list(typed) == [o.name for o in ARGUMENTS if o.name not in ("params", "lr")]
    family = typing.get_type_hints(MuonFamily.__init__)
    assert all(typed[name] == family[name] for name in typed)


def test_defaults_and_texts_come_from_the_table() -> None:
    assert tuple(o.name for o in CORE_TABLE if o.where == "group") == GROUP_ARGUMENTS
    assert list(MATRIX_DEFAULTS) == ["split_sizes", "col_split_sizes", "stacked"]
    assert set(_RUNTIME_DEFAULTS) | set(_ENGINE_DEFAULTS) == {
        o.name for o in CORE_TABLE if o.where in ("runtime", "engine")
    }
    assert list(CORE_OPTIONS) == [o.name for o in ARGUMENTS]
    opt = Muon([nn.Parameter(torch.randn(3, 4))])
    assert opt.engine_options == _ENGINE_DEFAULTS
    assert {key: getattr(opt, key) for key in _RUNTIME_DEFAULTS} == _RUNTIME_DEFAULTS
    for option in CORE_TABLE:
        if option.where in ("group", "matrix"):
            assert opt.defaults[option.name] == option.default, option.name


@pytest.mark.parametrize("option", [o for o in CORE_TABLE if o.check is not None], ids=lambda o: o.name)
def test_every_check_takes_its_default_and_names_its_option(option) -> None:
    option.check(option.name, "", option.default)
    with pytest.raises((TypeError, ValueError), match=option.name):
        option.check(option.name, "", object())


def test_an_old_pickle_takes_the_tables_defaults_for_newer_options() -> None:
    """A pickle of an earlier version, without some options in its defaults, groups, runtime or engine options,
    unpickles with the table's defaults for them."""
    opt = Muon([nn.Parameter(torch.randn(3, 4))], lr=0.01)
    state = opt.__getstate__()
    state["defaults"] = {k: v for k, v in state["defaults"].items() if k not in ("ns_algorithm", "col_split_sizes")}
    state["param_groups"] = [{k: v for k, v in g.items() if k != "ns_algorithm"} for g in state["param_groups"]]
    state["engine_options"] = {k: v for k, v in state["engine_options"].items() if k != "replica_refresh"}
    del state["kernels"]
    old = Muon.__new__(Muon)
    old.__setstate__(state)
    assert old.defaults["ns_algorithm"] == "standard" and old.defaults["col_split_sizes"] is None
    assert old.param_groups[0]["ns_algorithm"] == "standard" and old.param_groups[0]["lr"] == 0.01
    assert old.engine_options["replica_refresh"] == "repeat" and old.kernels == "auto"
