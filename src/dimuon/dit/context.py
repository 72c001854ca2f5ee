"""Context parallelism for the DiT: the ranks of a context-parallel group split every sample's token sequence.

Each rank keeps one contiguous chunk of the tokens (after the patch and position embeddings). Everything per token
(adaLN modulation, MLP, the final layer) runs on the chunk; attention gathers the keys and values of all chunks
(one all-gather per block, with autograd) and attends from the local queries to every token, so no kernel of
its own is needed: any SDPA kernel computes it, and its collectives (all-gather, reduce-scatter) are ones gloo and
NCCL both have. The final layer's output chunks are gathered back into whole images.

Gradients: an all-gather's backward sums every rank's gradient of the gathered tensor onto the rank that sent
the chunk. Every rank of the group computes the same loss from the same gathered output, so each rank's
gradients are ``cp`` times its chunk's share, and the mean over ``dp_shard x cp`` that FSDP takes of them is the
one-process gradient of the data-parallel batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["chunk_of", "gather_chunks", "group_rank_and_size"]


def group_rank_and_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)


def chunk_of(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (its length must divide by the group's size)."""
    rank, size = group_rank_and_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"{x.shape[dim]} tokens do not split evenly over {size} context-parallel ranks")
    return x.chunk(size, dim=dim)[rank]


class _GatherRows(torch.autograd.Function):
    """All-gather along dimension 0; the backward reduce-scatters (sums) the gradient back to each chunk's owner."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name of torch < 2.13
        gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_chunks(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Every rank's chunk of ``group``, concatenated along ``dim`` in rank order; differentiable: the backward sums
    the gradients of a chunk over the ranks onto its owner (one reduce-scatter)."""
    rows = x.movedim(dim, 0)  # (T_local, ...): the gathered dimension first, where a collective concatenates
    return _GatherRows.apply(rows, group).movedim(0, dim)  # (..., T_all, ...)
