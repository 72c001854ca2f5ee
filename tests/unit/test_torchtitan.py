"""dimuon.integrations.torchtitan in one process: the Flux roles, torchtitan's container built from its config
(dimuon's grouping and torchtitan's patterns), the config's checks, tyro overrides, and the example's configs.
The FSDP2 runs and checkpoints are in tests/multirank/test_torchtitan.py."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch

pytest.importorskip("torchtitan.components.optimizer", reason="needs torchtitan (see README: torchtitan)")

from tests.example_modules import import_example
from tests.flux_shaped import FluxShaped, flux_batch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.components.optimizer import ParamGroupConfig

from dimuon.integrations.torchtitan import (
    DimuonOptimizersContainer,
    default_dimuon,
    torchtitan_param_groups,
)
from dimuon.optim import ForeignGroupKeyWarning, MuonBP, PeriodicRowMuon, param_groups


def roles(groups: list[dict]) -> dict[str, tuple[str, object]]:
    """Parameter name -> (algorithm, split sizes)."""
    return {name: (g["algorithm"], g.get("split_sizes")) for g in groups for name in g["param_names"]}


def step(model: FluxShaped, optimizers, steps: int = 1) -> list[float]:
    losses = []
    for t in range(steps):
        img, txt, ts, y, target = flux_batch(t)
        loss = (model(img, txt, ts, y) - target).pow(2).mean()
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
    return losses


def test_flux_roles_hidden_matrices_to_muon_inputs_and_output_to_adamw() -> None:
    got = roles(torchtitan_param_groups(FluxShaped()))
    assert got["time_in.out_layer.weight"] == got["vector_in.out_layer.weight"] == ("muon", None)
    assert got["double_blocks.1.txt_attn.proj.weight"] == got["double_blocks.0.img_mlp.2.weight"] == ("muon", None)
    assert got["single_blocks.0.linear2.weight"] == ("muon", None)  # attention and MLP outputs fused by columns
    assert got["double_blocks.0.img_attn.qkv.weight"] == ("muon", 3)
    assert got["double_blocks.1.txt_mod.lin.weight"] == ("muon", 6)
    assert got["single_blocks.1.modulation.lin.weight"] == ("muon", 3)
    assert got["single_blocks.1.linear1.weight"] == ("muon", (32, 32, 32, 64))  # q, k, v, the MLP's input
    assert got["final_layer.adaLN_modulation.1.weight"] == ("muon", 2)
    for name in (
        "img_in.weight",
        "txt_in.weight",
        "time_in.in_layer.weight",
        "vector_in.in_layer.weight",
        "final_layer.linear.weight",
    ):
        assert got[name] == ("adamw", None), name
    model = FluxShaped()
    assert all(got[n][0] == "adamw" for n, p in model.named_parameters() if p.ndim < 2)
    assert set(got) == {n for n, _ in model.named_parameters()}


def test_activation_checkpointed_blocks_group_alike_under_canonical_names() -> None:
    model = FluxShaped()
    for blocks in (model.double_blocks, model.single_blocks):  # as torchtitan's apply_ac wraps them
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert roles(torchtitan_param_groups(model)) == roles(torchtitan_param_groups(FluxShaped()))


def test_a_rule_setting_only_options_keeps_a_flux_input_layer_on_adamw() -> None:
    by_name = {
        name: g for g in torchtitan_param_groups(FluxShaped(), {"txt_in.*": {"lr": 1e-5}}) for name in g["param_names"]
    }
    assert by_name["txt_in.weight"]["algorithm"] == "adamw" and by_name["txt_in.weight"]["lr"] == 1e-5


def test_rules_come_first_and_adamw_kwargs_fill_the_adamw_groups() -> None:
    groups = torchtitan_param_groups(
        FluxShaped(),
        {"*img_mlp.0.weight": {"algorithm": "adamw", "lr": 1e-4}},
        adamw_kwargs={"lr": 3e-3, "weight_decay": 0.1},
    )
    by_name = {name: g for g in groups for name in g["param_names"]}
    assert by_name["double_blocks.0.img_mlp.0.weight"]["lr"] == 1e-4  # the rule's own lr wins
    assert by_name["double_blocks.0.img_mlp.0.weight"]["weight_decay"] == 0.1
    assert by_name["img_in.weight"]["lr"] == 3e-3
    assert "lr" not in by_name["double_blocks.0.img_mlp.2.weight"]  # Muon groups take the optimizer's lr
    model = FluxShaped()
    plain = roles(torchtitan_param_groups(model, flux_roles=False, split_fused=False))  # dimuon's own roles alone
    assert plain == {name: (g["algorithm"], None) for g in param_groups(model) for name, _ in g["params"]}


@pytest.mark.parametrize(("implementation", "adamw_fused"), [("fused", None), ("foreach", False), ("for-loop", False)])
def test_container_builds_dimuon_from_its_config(implementation: str, adamw_fused: bool | None) -> None:
    model = FluxShaped()
    config = default_dimuon("PeriodicRowMuon", lr=0.01, k=2, weight_decay=0.05)
    config.implementation = implementation
    config.optimizer_factory_kwargs_by_name = {"PeriodicRowMuon": {"nonfinite": "skip"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignGroupKeyWarning)  # fused/foreach are understood, not ignored
        optimizers = config.build(model_parts=[model])
    (opt,) = optimizers.optimizers
    assert isinstance(opt, PeriodicRowMuon) and opt.adamw_fused is adamw_fused and opt.nonfinite == "skip"
    assert not any("fused" in g or "foreach" in g for g in opt.param_groups)
    assert {g["k"] for g in opt.param_groups} == {2} and opt.param_groups[0]["lr"] == 0.01
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = step(model, optimizers, 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert {g["step"] for g in opt.param_groups} == {3}


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("Muon", {}),
        ("PeriodicRowMuon", {"k": 2}),
        ("MuonBP", {"period": 2}),
        ("AdaptiveRowMuon", {"threshold": 0.3, "k_min": 1, "k_max": 3}),
    ],
)
def test_every_optimizer_continues_exactly_from_the_containers_flat_state_dict(name: str, options: dict) -> None:
    def fresh():
        torch.manual_seed(0)
        model = FluxShaped()
        return model, default_dimuon(name, lr=0.01, weight_decay=0.05, **options).build(model_parts=[model])

    model, optimizers = fresh()
    step(model, optimizers, 2)
    saved = copy.deepcopy((model.state_dict(), optimizers.state_dict()))  # what DCP stores, FQN-keyed
    assert all(key.startswith(("state.", "param_groups.")) for key in saved[1])
    step(model, optimizers, 2)
    resumed_model, resumed = fresh()
    resumed_model.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    assert {g["step"] for g in resumed.optimizers[0].param_groups} == {2}
    step(resumed_model, resumed, 2)
    for (n, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), n


def test_patterns_name_dimuon_and_torch_optimizers() -> None:
    model = FluxShaped()
    config = DimuonOptimizersContainer.Config(
        grouping="patterns",
        param_groups=[
            ParamGroupConfig(
                pattern=r"(^(img_in|txt_in|final_layer\.linear)\.|\.bias$|norm\.weight$|in_layer)",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-3},
            ),
            ParamGroupConfig(pattern=r"qkv", optimizer_name="MuonBP", optimizer_kwargs={"lr": 0.01, "split_sizes": 3}),
            ParamGroupConfig(pattern=r".*", optimizer_name="MuonBP", optimizer_kwargs={"lr": 0.01, "period": 2}),
        ],
    )
    optimizers = config.build(model_parts=[model])
    adamw, muon = optimizers.optimizers
    assert type(adamw) is torch.optim.AdamW and isinstance(muon, MuonBP)
    assert [g.get("split_sizes") for g in muon.param_groups] == [3, None]
    assert muon.param_groups[1]["period"] == 2 and muon.param_groups[0]["period"] == 5  # the default
    step(model, optimizers, 2)
    assert {g["step"] for g in muon.param_groups} == {2}


def test_config_refuses_what_it_would_ignore() -> None:
    pattern = [ParamGroupConfig(pattern=".*", optimizer_name="Muon", optimizer_kwargs={"lr": 1e-3})]
    with pytest.raises(ValueError, match="set grouping='patterns'"):
        DimuonOptimizersContainer.Config(param_groups=pattern)
    with pytest.raises(ValueError, match="is empty"):
        DimuonOptimizersContainer.Config(grouping="patterns")
    with pytest.raises(ValueError, match="dimuon_kwargs: options of grouping='dimuon'"):
        DimuonOptimizersContainer.Config(grouping="patterns", param_groups=pattern, dimuon_kwargs={"lr": 1.0})
    with pytest.raises(ValueError, match=r"MuonBP has no option\(s\) \['k'\]"):
        default_dimuon("MuonBP", k=3)
    with pytest.raises(ValueError, match="'betas' is torch AdamW's name, dimuon's AdamW groups take 'adamw_betas'"):
        default_dimuon(adamw_kwargs={"betas": (0.9, 0.99)})
    with pytest.raises(ValueError, match="dimuon_optimizer must be one of"):
        DimuonOptimizersContainer.Config(dimuon_optimizer="muon")
    with pytest.raises(ValueError, match="'eps' is torch AdamW's name"):
        DimuonOptimizersContainer.Config(
            grouping="patterns",
            param_groups=[
                ParamGroupConfig(pattern=".*", optimizer_name="Muon", optimizer_kwargs={"lr": 1e-3, "eps": 1e-6}),
            ],
        ).build(model_parts=[FluxShaped()])
    with pytest.raises(NotImplementedError, match="dimuon adds Muon, PeriodicRowMuon, MuonBP, AdaptiveRowMuon"):
        DimuonOptimizersContainer.Config(
            grouping="patterns",
            param_groups=[
                ParamGroupConfig(pattern=".*", optimizer_name="Lion", optimizer_kwargs={"lr": 1e-3}),
            ],
        ).build(model_parts=[FluxShaped()])


def test_command_line_overrides_reach_the_config() -> None:
    tyro = pytest.importorskip("tyro")
    default = default_dimuon("PeriodicRowMuon", lr=1e-3, k=3)
    config = tyro.cli(
        DimuonOptimizersContainer.Config, default=default, args=["--dimuon-kwargs.k", "4", "--no-split-fused"]
    )
    assert config.dimuon_kwargs == {"lr": 1e-3, "k": 4} and config.split_fused is False
    with pytest.raises(SystemExit):  # the config's own check, through tyro
        tyro.cli(DimuonOptimizersContainer.Config, default=default, args=["--dimuon-optimizer", "MuonBP"])


def _example():
    return import_example("torchtitan_flux")


def test_example_configs_build_over_a_tiny_flux() -> None:
    example = _example()
    for config in (example.periodic_row_muon(lr=0.01), example.muon_by_patterns(lr=0.01)):
        model = FluxShaped()
        optimizers = config.build(model_parts=[model])
        assert all(torch.isfinite(torch.tensor(step(model, optimizers, 2))))


flux_importable = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("datasets") is not None


@pytest.mark.skipif(not flux_importable, reason="torchtitan.models.flux imports triton, datasets and transformers")
def test_torchtitans_flux_has_the_replicas_names_and_roles() -> None:
    from torchtitan.models.flux import flux_configs

    with torch.device("meta"):
        flux = flux_configs["flux-debug"]().build()  # 2 double and 2 single blocks, width 1536
    ours = roles(torchtitan_param_groups(FluxShaped(depth=2, depth_single=2)))
    theirs = roles(torchtitan_param_groups(flux))
    assert set(theirs) == set(ours)
    for name, (algorithm, split) in theirs.items():
        assert algorithm == ours[name][0] and (split is None) == (ours[name][1] is None), name
    assert theirs["single_blocks.0.linear1.weight"][1] == (1536, 1536, 1536, 6144)
    config = _example().flux_debug_periodic_row_muon()
    assert isinstance(config.optimizer, DimuonOptimizersContainer.Config)
    assert config.parallelism.spmd_backend == "partial_dtensor"
    (opt,) = config.optimizer.build(model_parts=[flux]).optimizers
    assert isinstance(opt, PeriodicRowMuon)
