"""``--optim.*`` flags derived from the optimizers' signatures: one source for the CLI, config.json and build()."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import tyro

from dimuon.optim import PeriodicRowMuon
from dimuon.train.config import ConfigError, TrainConfig, config_from_dict, config_to_dict
from dimuon.train.optim_options import (
    OPTION_SPECS,
    OptimOptions,
    derive_option_specs,
    documented_args,
    optimizer_kwargs,
    options_dataclass,
)
from dimuon.train.plan import resolve

# The flags dimuon train has always taken (the non-finite policy is the harness's own --nonfinite).
FLAGS = (
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "nesterov",
    "lr_scale",
    "ns_coefficients",
    "ns_steps",
    "ns_dtype",
    "ns_algorithm",
    "refresh",
    "bucket_mb",
    "comm_dtype",
    "k",
    "gamma",
    "period",
    "blocks",
    "block_lr_ratio",
    "threshold",
    "k_min",
    "k_max",
)


def test_every_known_flag_is_derived_and_non_cli_arguments_are_not() -> None:
    names = {f.name for f in dataclasses.fields(OptimOptions)}
    assert set(FLAGS) <= names
    assert not names & {"lr", "nonfinite", "params", "process_group", "engine", "schedule_options", "kwargs"}
    assert all(f.default is None for f in dataclasses.fields(OptimOptions))
    assert OPTION_SPECS["betas"].keywords == {
        "adamw": "betas",
        "muon": "adamw_betas",
        "periodic_row_muon": "adamw_betas",
        "muon_bp": "adamw_betas",
        "adaptive_row_muon": "adamw_betas",
        "torch_muon": "adamw_betas",
    }
    assert OPTION_SPECS["k"].keywords == {"periodic_row_muon": "k"}
    assert OPTION_SPECS["ns_dtype"].is_dtype and OPTION_SPECS["betas"].type == tuple[float, float]


def test_help_comes_from_the_optimizers_declared_texts() -> None:
    assert OPTION_SPECS["momentum"].help.startswith("EMA momentum coefficient beta in [0, 1)")
    assert "(default" not in OPTION_SPECS["eps"].help  # torch's defaults are not dimuon's
    assert OPTION_SPECS["weight_decay"].help.endswith("(every optimizer)")
    assert OPTION_SPECS["k"].help.startswith("a spectral (Newton-Schulz) step every k steps")  # the schedule's text
    assert OPTION_SPECS["amsgrad"].help.startswith("use the AMSGrad variant")  # declared for torch's AdamW
    assert documented_args(PeriodicRowMuon)["gamma"] == PeriodicRowMuon.schedule.options["gamma"].doc

    class Documented:
        """Something.

        Args:
            alpha (float, optional): a docstring is not read.
        """

    assert documented_args(Documented) == {}
    assert all(spec.help.split(" (")[0] for spec in OPTION_SPECS.values())  # every flag has a text of its own


class _WithNewOptions(PeriodicRowMuon):
    """A Muon-family optimizer that grew two options.

    Args:
        ns_compile: compile the Newton-Schulz iteration.
    """

    def __init__(
        self, params: Any, lr: float = 1e-3, ns_compile: bool = False, adamw_fused: bool | None = None, **kwargs: Any
    ) -> None:
        super().__init__(params, lr=lr, **kwargs)
        self.ns_compile, self.adamw_fused = ns_compile, adamw_fused


def test_an_option_added_to_an_optimizer_becomes_a_flag_with_no_other_edit() -> None:
    specs = derive_option_specs({"adamw": torch.optim.AdamW, "grown": _WithNewOptions})
    assert specs["ns_compile"].keywords == {"grown": "ns_compile"} and specs["ns_compile"].type is bool
    assert specs["ns_compile"].help.startswith("run Newton-Schulz through torch.compile")  # the core's declared text
    assert specs["fused"].keywords == {"adamw": "fused", "grown": "adamw_fused"}  # AdamW's option, one flag
    assert specs["k"].keywords == {"grown": "k"}  # inherited through **kwargs
    options = tyro.cli(options_dataclass(specs), args=["--ns-compile", "True", "--fused", "False", "--k", "4"])
    assert (options.ns_compile, options.fused, options.k, options.gamma) == (True, False, 4, None)


def test_one_flag_cannot_take_two_types() -> None:
    class Odd(torch.optim.SGD):
        def __init__(self, params: Any, lr: float = 0.1, betas: int = 3) -> None:
            super().__init__(params, lr=lr)

    with pytest.raises(TypeError, match="'betas'"):
        derive_option_specs({"adamw": torch.optim.AdamW, "odd": Odd})


def test_build_receives_each_optimizer_s_own_keywords() -> None:
    options = OptimOptions(betas=(0.9, 0.99), eps=1e-6, ns_dtype="bfloat16", k=4)
    assert optimizer_kwargs("periodic_row_muon", options, 0.01) == {
        "lr": 0.01,
        "adamw_betas": (0.9, 0.99),
        "adamw_eps": 1e-6,
        "ns_dtype": torch.bfloat16,
        "k": 4,
    }
    assert optimizer_kwargs("adamw", OptimOptions(betas=(0.9, 0.99)), 0.1) == {"lr": 0.1, "betas": (0.9, 0.99)}
    with pytest.raises(ConfigError, match="--optimizer adamw rejects its options"):
        resolve(TrainConfig(optimizer="adamw", optim=OptimOptions(k=3)))  # k is passed on, and refused by name
    resolve(TrainConfig(optimizer="adamw", optim=OptimOptions(fused=False, weight_decay=0.1)))


def test_a_config_saved_with_fewer_optim_keys_still_loads() -> None:
    saved = config_to_dict(TrainConfig(optim=OptimOptions(k=4, betas=(0.5, 0.6))))
    saved["optim"] = {"k": 4, "betas": [0.5, 0.6], "ns_dtype": None}  # an older config.json
    cfg = config_from_dict(saved)
    assert cfg.optim.k == 4 and cfg.optim.betas == (0.5, 0.6) and cfg.optim.fused is None


def test_a_config_saved_with_the_optimizer_s_nonfinite_option_keeps_its_policy() -> None:
    saved = config_to_dict(TrainConfig())
    del saved["nonfinite"]
    saved["optim"] = {"nonfinite": "skip"}  # a config.json of when the policy was an --optim.* flag
    assert config_from_dict(saved).nonfinite == "skip"


def test_blocks_takes_row_blocks_or_a_row_and_column_pair() -> None:
    from dimuon.train.run import parse_config

    assert OPTION_SPECS["blocks"].type == tuple[int, ...]
    for values, expect in ((["4"], (4,)), (["2", "2"], (2, 2))):
        cfg = parse_config(["--optimizer", "muon_bp", "--optim.blocks", *values])
        assert optimizer_kwargs(cfg.optimizer, cfg.optim, cfg.lr)["blocks"] == expect
        resolve(cfg)  # MuonBP accepts both
    with pytest.raises(ConfigError, match=r"blocks must be an int or a pair \(row_blocks, col_blocks\)"):
        resolve(parse_config(["--optimizer", "muon_bp", "--optim.blocks", "1", "2", "3"]))
