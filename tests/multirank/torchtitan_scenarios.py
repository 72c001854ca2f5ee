"""What each rank runs in tests/multirank/test_torchtitan.py: torchtitan's optimizer container (built from
its config, as torchtitan's trainer builds it), LR schedulers and checkpoint manager around dimuon's
optimizers, on a Flux-shaped model sharded with FSDP2 as torchtitan shards Flux."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.flux_shaped import FluxShaped, flux_batch

STEPS = 6
SAVE_AT = 4  # PeriodicRowMuon, k = 3: spectral at 0 and 3, RowNorm at 1, 2, 4, 5: the resume is mid-period
MODES = ("dimuon", "patterns")


def optimizer_config(mode: str) -> Any:
    """The container's config: dimuon's grouping, or torchtitan's patterns naming torch's AdamW and dimuon's
    PeriodicRowMuon (with torchtitan's foreach implementation)."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from dimuon.integrations.torchtitan import DimuonOptimizersContainer, default_dimuon

    if mode == "dimuon":
        return default_dimuon("PeriodicRowMuon", lr=0.02, k=3, weight_decay=0.05, adamw_kwargs={"lr": 3e-3})
    muon = {"lr": 0.02, "k": 3, "weight_decay": 0.05}
    return DimuonOptimizersContainer.Config(
        grouping="patterns",
        implementation="foreach",
        param_groups=[
            ParamGroupConfig(
                pattern=r"^(img_in|txt_in|time_in\.in_layer|vector_in\.in_layer|final_layer\.linear)\.",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
            ),
            ParamGroupConfig(
                pattern=r"(\.bias|norm\.weight)$",
                optimizer_name="PeriodicRowMuon",
                optimizer_kwargs={"lr": 3e-3, "algorithm": "adamw"},
            ),
            ParamGroupConfig(
                pattern=r"qkv\.weight$", optimizer_name="PeriodicRowMuon", optimizer_kwargs={**muon, "split_sizes": 3}
            ),
            ParamGroupConfig(pattern=r"\.weight$", optimizer_name="PeriodicRowMuon", optimizer_kwargs=muon),
        ],
    )


def shard_like_torchtitan(model: FluxShaped, mesh: Any) -> None:
    """FSDP2 as torchtitan's ``apply_fsdp`` for Flux: the input layers, every block, the final layer, the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in (
        model.img_in,
        model.time_in,
        model.vector_in,
        model.txt_in,
        *model.double_blocks,
        *model.single_blocks,
    ):
        fully_shard(layer, mesh=mesh)
    fully_shard(model.final_layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)


class TrainState:
    """The step, saved beside the model and optimizer as torchtitan's trainer saves its own (``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def build(mode: str, world: int | None, rank: int = 0) -> tuple[nn.Module, Any, Any]:
    """The model (sharded over ``world`` ranks, or whole for None), its optimizers and LR schedulers, built from
    their configs as torchtitan's trainer builds them."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    torch.manual_seed(0)
    model = FluxShaped()
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh

        shard_like_torchtitan(model, init_device_mesh("cpu", (world,)))
    optimizers = optimizer_config(mode).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, min_lr_factor=0.1).build(
        optimizers=optimizers, training_steps=STEPS
    )
    return model, optimizers, schedulers


def train(
    model: nn.Module,
    optimizers: Any,
    schedulers: Any,
    start: int,
    stop: int,
    rank: int,
    world: int,
    on_step: Any = None,
) -> list[float]:
    """Steps ``start .. stop - 1`` on each rank's slice of the global batch (FSDP2 averages the gradients)."""
    losses = []
    for step in range(start, stop):
        img, txt, t, y, target = (x.chunk(world)[rank] for x in flux_batch(step))
        loss = (model(img, txt, t, y) - target).pow(2).mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1)
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def checkpointer(root: str, mode: str, model: nn.Module, optimizers: Any, schedulers: Any, state: TrainState) -> Any:
    """torchtitan's checkpoint manager (DCP, synchronous), saving every SAVE_AT steps."""
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0, last_save_model_only=False
    )
    return config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=str(Path(root) / mode),
    )


def one_process(mode: str) -> dict[str, Any]:
    """The run on one process with the whole model and batch: what the sharded run must follow."""
    model, optimizers, schedulers = build(mode, None)
    losses = train(model, optimizers, schedulers, 0, STEPS, 0, 1)
    return {"params": full_params(model), "losses": losses}


def straight(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every mode uninterrupted for STEPS steps, saved at SAVE_AT by torchtitan's checkpoint manager (and, in
    dimuon's grouping, by torch's optimizer state-dict API into DCP as well)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    result: dict[str, Any] = {}
    for mode in MODES:
        model, optimizers, schedulers = build(mode, world, rank)
        state = TrainState()
        manager = checkpointer(root, mode, model, optimizers, schedulers, state)

        def save(step: int, model=model, optimizers=optimizers, manager=manager, state=state, mode=mode) -> None:
            state.step = step
            manager.save(step)
            if mode == "dimuon" and step == SAVE_AT:
                dcp.save(
                    {
                        "model": get_model_state_dict(model),
                        "optim": get_optimizer_state_dict(model, optimizers.optimizers),
                    },
                    checkpoint_id=str(Path(root) / "torch-state-dict"),
                )

        losses = train(model, optimizers, schedulers, 0, STEPS, rank, world, on_step=save)
        manager.close()
        result[mode] = {
            "params": full_params(model),
            "losses": losses,
            "placements": sorted({str(p.placements) for p in model.parameters()}),
        }
    return result


def resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Fresh models and optimizers that load the SAVE_AT checkpoints and continue to STEPS."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    result: dict[str, Any] = {}
    for mode in MODES:
        model, optimizers, schedulers = build(mode, world, rank)
        state = TrainState()
        manager = checkpointer(root, mode, model, optimizers, schedulers, state)
        assert manager.load(), "no checkpoint found"
        phases = [g["step"] for opt in optimizers for g in opt.param_groups if "algorithm" in g]
        losses = train(model, optimizers, schedulers, state.step, STEPS, rank, world)
        manager.close()
        result[mode] = {
            "params": full_params(model),
            "losses": losses,
            "step": state.step,
            "phases": phases,
            "lr": [g["lr"] for opt in optimizers for g in opt.param_groups],
        }
    # torch's state-dict API (what torchtitan's container used before its flat state dicts) on the same optimizers.
    model, optimizers, schedulers = build("dimuon", world, rank)
    states = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizers.optimizers)}
    dcp.load(states, checkpoint_id=str(Path(root) / "torch-state-dict"))
    set_model_state_dict(model, states["model"])
    set_optimizer_state_dict(model, optimizers.optimizers, states["optim"])
    for _ in range(SAVE_AT):  # the LR schedule is the trainer's to restore (torchtitan saves it as lr_scheduler)
        schedulers.step()
    losses = train(model, optimizers, schedulers, SAVE_AT, STEPS, rank, world)
    result["torch-state-dict"] = {"params": full_params(model), "losses": losses}
    return result
