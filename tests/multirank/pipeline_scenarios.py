"""What each rank runs in tests/multirank/test_torchtitan_pipeline.py: two pipeline stages on two gloo ranks, each
rank holding one model part (the whole model with the other stage's layers deleted, as torchtitan splits it, so the
parameter names are the model's), stepped by torchtitan's optimizer container and checkpointed by its checkpoint
manager; the activations and their gradients cross between the stages by send and recv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STAGES = 2
DEPTH = 4  # blocks, DEPTH // STAGES per stage
WIDTH = 16
STEPS = 5
SAVE_AT = 2  # PeriodicRowMuon, k = 3: spectral at 0 and 3; the resume starts on a RowNorm step mid-period
LAYOUTS = ("fsdp", "plain")  # each stage sharded by FSDP2 over its own (one-rank) data-parallel mesh, or not at all


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))  # (N, D)


class Stack(nn.Module):
    """An input layer, DEPTH blocks and an output layer; a pipeline stage holds some of them (None: not here)."""

    def __init__(self) -> None:
        super().__init__()
        self.x_embedder: nn.Module | None = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleDict({str(i): Block(WIDTH) for i in range(DEPTH)})
        self.final_layer: nn.Module | None = nn.Linear(WIDTH, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.x_embedder is not None:
            h = self.x_embedder(h)  # (N, D)
        for block in self.blocks.values():
            h = block(h)
        return h if self.final_layer is None else self.final_layer(h)  # (N, 8) on the last stage


def model_part(stage: int) -> Stack:
    """Stage ``stage``'s part of the model every rank initializes alike (torchtitan's split: layers deleted)."""
    torch.manual_seed(0)
    model = Stack()
    per = DEPTH // STAGES
    for key in list(model.blocks):
        if not stage * per <= int(key) < (stage + 1) * per:
            del model.blocks[key]
    if stage != 0:
        model.x_embedder = None
    if stage != STAGES - 1:
        model.final_layer = None
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)


def build(parts: list[nn.Module]) -> tuple[Any, Any]:
    """The container over ``model_parts`` and its LR schedulers, from their configs as torchtitan's trainer builds
    them."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from dimuon.integrations.torchtitan import default_dimuon

    config = default_dimuon("PeriodicRowMuon", lr=0.02, k=3, weight_decay=0.05, adamw_kwargs={"lr": 3e-3})
    optimizers = config.build(model_parts=parts)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, min_lr_factor=0.1).build(
        optimizers=optimizers, training_steps=STEPS
    )
    return optimizers, schedulers


def one_process(start: int = 0, stop: int = STEPS) -> dict[str, Any]:
    """Both stages in one process, one container over both parts: what each rank's stage must follow."""
    parts = [model_part(s) for s in range(STAGES)]
    optimizers, schedulers = build(parts)
    losses = []
    for step in range(start, stop):
        x, y = batch(step)
        h = x
        for part in parts:
            h = part(h)
        loss = (h - y).pow(2).mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for part in parts for n, p in part.named_parameters()}
    return {"params": params, "losses": losses}


def _stage_step(part: nn.Module, rank: int, world: int, step: int) -> float | None:
    """One forward and backward through the pipeline on this data-parallel rank's slice of the batch: stage 0
    sends its output to the same slice's rank of stage 1 and receives its gradient."""
    dp = world // STAGES
    stage, index = divmod(rank, dp)
    x, y = (t.chunk(dp)[index] for t in batch(step))
    if stage == 0:
        h = part(x)
        dist.send(h.detach().contiguous(), rank + dp)
        grad = torch.empty_like(h)
        dist.recv(grad, rank + dp)
        h.backward(grad)
        return None
    h = torch.empty(x.shape[0], WIDTH)
    dist.recv(h, rank - dp)
    h.requires_grad_(True)
    loss = (part(h) - y).pow(2).mean()
    loss.backward()
    dist.send(h.grad.contiguous(), rank - dp)
    return loss.item()


def _stage(rank: int, world: int, layout: str) -> nn.Module:
    """This rank's model part, laid out: FSDP2 over this stage's data-parallel submesh (no pp dimension)."""
    dp = world // STAGES
    part = model_part(rank // dp)
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (STAGES, dp), mesh_dim_names=("pp", "dp_shard"))["dp_shard"]
        for block in part.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(part, mesh=mesh)
    return part


def _full(part: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in part.named_parameters()
    }


def _checkpointer(root: str, part: nn.Module, optimizers: Any, schedulers: Any) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0, last_save_model_only=False
    )
    return config.build(
        dataloader=None,
        model_parts=[part],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
        base_folder=root,
    )


def stages(rank: int, world: int, root: str, layouts: tuple[str, ...] = LAYOUTS) -> dict[str, Any]:
    """Each layout (``world // STAGES`` data-parallel ranks per stage): STEPS steps saved at SAVE_AT by torchtitan's
    checkpoint manager, then a fresh stage and container that load the checkpoint and continue; this rank's
    parameters and losses of both runs, and the groups its optimizer's collectives ran over."""
    result: dict[str, Any] = {}
    for layout in layouts:
        folder = str(Path(root) / layout)
        part = _stage(rank, world, layout)
        optimizers, schedulers = build([part])
        manager = _checkpointer(folder, part, optimizers, schedulers)
        losses = []
        for step in range(STEPS):
            losses.append(_stage_step(part, rank, world, step))
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            manager.save(step + 1)
        manager.close()
        comm = {  # mesh dimension -> collective kinds and their calls
            dim: {kind: stats["calls"] for kind, stats in kinds.items()}
            for opt in optimizers
            for dim, kinds in opt.comm_stats(by_mesh_dim=True).items()
        }
        straight = {
            "params": _full(part),
            "losses": losses,
            "comm": comm,
            "placements": sorted({str(getattr(p, "placements", None)) for p in part.parameters()}),
        }
        part = _stage(rank, world, layout)
        optimizers, schedulers = build([part])
        manager = _checkpointer(folder, part, optimizers, schedulers)
        assert manager.load(step=SAVE_AT), "no checkpoint found"
        phases = sorted({g["step"] for opt in optimizers for g in opt.param_groups})
        resumed = [
            _stage_step_and_step(part, optimizers, schedulers, rank, world, step) for step in range(SAVE_AT, STEPS)
        ]
        manager.close()
        result[layout] = {"straight": straight, "resumed": {"params": _full(part), "losses": resumed, "phases": phases}}
    return result


def _stage_step_and_step(
    part: nn.Module, optimizers: Any, schedulers: Any, rank: int, world: int, step: int
) -> float | None:
    loss = _stage_step(part, rank, world, step)
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return loss
