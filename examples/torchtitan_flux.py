"""Train torchtitan's Flux with dimuon's PeriodicRowMuon: a torchtitan ``config_registry`` module.

torchtitan (0.3.0) takes a run's whole config from a function named on its command line; these functions
return torchtitan's own Flux configs (``torchtitan.models.flux.config_registry``) with the optimizer replaced by
dimuon's container: PeriodicRowMuon for Flux's hidden matrices, its AdamW group for the input layers, the
output projection, biases and norm gains. Everything else (data, encoders, FSDP2/HSDP over the blocks,
activation checkpointing, LR warmup and decay, DCP checkpoints, validation) is torchtitan's.

Run (``pip install 'dimuon[torchtitan]'`` beside torchtitan's Flux requirements, and the encoders, autoencoder
and data torchtitan's Flux README names), from this directory's parent::

    PYTHONPATH=examples torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module torchtitan_flux --config flux_dev_periodic_row_muon
    PYTHONPATH=examples torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module torchtitan_flux --config flux_debug_periodic_row_muon --training.steps 20

torchtitan's flags override the config as usual (``--optimizer.dimuon-kwargs.lr 2e-4``,
``--optimizer.dimuon-kwargs.k 4``, ``--optimizer.no-split-fused``, ``--training.steps``,
``--parallelism.data-parallel-replicate-degree 2`` for HSDP). ``flux_dev_muon_by_patterns`` groups by
torchtitan's own regex ``param_groups`` instead (torch's AdamW for the inputs and output, dimuon's Muon for the
rest).

These configs set ``parallelism.spmd_backend = "partial_dtensor"``: under torchtitan 0.3.0's default,
``"spmd_types"``, torch 2.13's ``fully_shard`` refuses Flux's parameters before any optimizer exists ("When
dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh"); ``"partial_dtensor"`` shards
them with FSDP2 as DTensors, which dimuon's optimizers read their layout from (docs/torchtitan.md).

The learning rates start from the AdamW ones of torchtitan's configs: with dimuon's default
``lr_scale="match_rms_adamw"`` a Muon-family update has AdamW's RMS, so the same lr is the place to start
tuning from; the weight decay is that of torchtitan's ``default_adamw``.
"""

from __future__ import annotations

from typing import Any

from dimuon.integrations.torchtitan import DimuonOptimizersContainer, default_dimuon

# Flux's input layers and output projection (torchtitan's parameter names), for the pattern grouping.
FLUX_INPUTS_AND_OUTPUT = r"^(img_in|txt_in|time_in\.in_layer|vector_in\.in_layer|final_layer\.linear)\."


def periodic_row_muon(
    lr: float = 1e-4, k: int = 3, gamma: float = 0.15, weight_decay: float = 0.1
) -> DimuonOptimizersContainer.Config:
    """PeriodicRowMuon by dimuon's grouping of Flux (its AdamW group at the same lr and weight decay)."""
    return default_dimuon("PeriodicRowMuon", lr=lr, k=k, gamma=gamma, weight_decay=weight_decay)


def muon_by_patterns(lr: float = 1e-4, weight_decay: float = 0.1) -> DimuonOptimizersContainer.Config:
    """torchtitan's pattern grouping: torch's AdamW for the inputs, output, biases and norms, Muon for the rest
    (the qkv matrices orthogonalized as q, k and v)."""
    from torchtitan.components.optimizer import ParamGroupConfig

    adamw = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    muon = {"lr": lr, "weight_decay": weight_decay}
    return DimuonOptimizersContainer.Config(
        grouping="patterns",
        param_groups=[
            ParamGroupConfig(pattern=FLUX_INPUTS_AND_OUTPUT, optimizer_name="AdamW", optimizer_kwargs=adamw),
            ParamGroupConfig(pattern=r"(\.bias|norm\.weight)$", optimizer_name="AdamW", optimizer_kwargs=adamw),
            ParamGroupConfig(
                pattern=r"qkv\.weight$", optimizer_name="Muon", optimizer_kwargs={**muon, "split_sizes": 3}
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name="Muon", optimizer_kwargs=muon),
        ],
    )


def with_torch_2_13_sharding(config: Any) -> Any:
    """FSDP2 over DTensors (torchtitan's ``partial_dtensor`` backend): what torch 2.13's ``fully_shard`` takes."""
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def flux_debug_periodic_row_muon() -> Any:
    """torchtitan's ``flux_debugmodel`` (2 + 2 blocks, width 1536) with PeriodicRowMuon at its lr."""
    from torchtitan.models.flux.config_registry import flux_debugmodel

    config = flux_debugmodel()
    config.optimizer = periodic_row_muon(lr=8e-4)
    return with_torch_2_13_sharding(config)


def flux_dev_periodic_row_muon() -> Any:
    """torchtitan's ``flux_dev`` (FLUX.1-dev, 12B) with PeriodicRowMuon at its lr."""
    from torchtitan.models.flux.config_registry import flux_dev

    config = flux_dev()
    config.optimizer = periodic_row_muon(lr=1e-4)
    return with_torch_2_13_sharding(config)


def flux_dev_muon_by_patterns() -> Any:
    """torchtitan's ``flux_dev`` with Muon by torchtitan's own parameter-group patterns."""
    from torchtitan.models.flux.config_registry import flux_dev

    config = flux_dev()
    config.optimizer = muon_by_patterns(lr=1e-4)
    return with_torch_2_13_sharding(config)
