"""Rank-side programs of the DiT's context-parallel tests: the token split on its own (gradients averaged over the
context-parallel ranks as FSDP averages them), and under FSDP2 over the ``cp`` ranks with an optimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dimuon.optim import build, param_groups

from . import mesh_scenarios as ms


def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training-mode output for the fixed inputs and the gradients of its mean square."""
    out = model(*ms._dit_inputs())
    out.square().mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def split_tokens(rank: int, world: int) -> dict:
    """The DiT with its tokens split over all ranks (no FSDP): training-mode output, gradients averaged over the
    ranks (what FSDP's reduce-scatter over ``cp`` does), and an eval-mode output that runs whole sequences."""
    model = ms.dit_model()
    model.context_parallel(dist.group.WORLD)
    out, grads = loss_and_grads(model)
    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    with torch.no_grad():
        evaluated = model.eval()(*ms._dit_inputs())
    return {"out": out, "grads": grads, "eval_out": evaluated}


def under_fsdp(rank: int, world: int, tp: int = 1) -> dict:
    """The DiT laid out by ``apply_parallelism`` with ``cp = world / tp``: the first output and the parameters after
    three PeriodicRowMuon steps."""
    from dimuon.dit.parallel import Parallelism, apply_parallelism, build_mesh, tp_process_group

    par = Parallelism(dp_shard=1, tp=tp, cp=world // tp).resolve(world)
    mesh = build_mesh(par, "cpu")
    model = apply_parallelism(ms.dit_model(), par, mesh)
    opt = build(
        "periodic_row_muon",
        param_groups(model),
        lr=ms.LR,
        k=2,
        ns_dtype=torch.float32,
        process_group=tp_process_group(par, mesh),
    )
    first = ms.dit_train(model, opt)
    return {"out": first, "params": ms.full_params(model)}


def context_parallel(rank: int, world: int) -> dict:
    """One spawn for both programs (a gloo spawn costs seconds)."""
    result = {"split": split_tokens(rank, world), "fsdp": under_fsdp(rank, world)}
    dist.barrier()
    return result
