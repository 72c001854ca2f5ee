"""Collectives in seconds: where each mesh dimension lies (NVLink inside a node, the NIC across nodes) and the
cost of one call from its logical bytes (what reaches a rank under the textbook algorithm, as the census counts).

Rules, each a line of the docs (docs/plan.md, "The model"):

- ranks fill nodes in order, the last mesh dimension fastest (torchtitan's ``dp_replicate x dp_shard x tp``), so
  a group whose members are ``stride`` ranks apart has ``min(size, gpus_per_node // stride)`` members per node;
- a group inside one node moves its bytes over NVLink; a group across nodes is bounded by each GPU's own NIC (one
  per GPU: every member sends and receives through its own, in parallel rings);
- a collective costs its latency (:func:`latency_seconds`, NCCL's model: a base, then a hop per ring step at
  NVLink's or the network's hop latency; a tree for a small all-reduce) and its logical bytes over the link's bus
  bandwidth;
- an all-to-all sends each peer its share: the shares for peers in the node go over NVLink, the rest over the NIC,
  both at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dimuon.plan.hardware import Efficiency, GpuProfile

__all__ = ["GroupSpan", "collective_seconds", "group_span", "latency_seconds", "mesh_spans"]

RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


@dataclass(frozen=True)
class GroupSpan:
    """How a process group of ``size`` ranks lies on the nodes: ``per_node`` members in each node it touches."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def group_span(size: int, stride: int, gpus_per_node: int) -> GroupSpan:
    """A group of ``size`` ranks ``stride`` apart on nodes of ``gpus_per_node`` GPUs."""
    if size < 1 or stride < 1 or gpus_per_node < 1:
        raise ValueError(f"size, stride and gpus_per_node must be >= 1, got {size}, {stride}, {gpus_per_node}")
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return GroupSpan(size, per_node)


def mesh_spans(dims: tuple[tuple[str, int], ...], gpus_per_node: int) -> dict[str, GroupSpan]:
    """Every mesh dimension's span, the world's, and the flattened ``a+b`` groups of adjacent dimensions (the
    engine's group over ``dp_shard`` and ``tp`` together), for a mesh laid out row-major on the ranks."""
    names = [n for n, _ in dims]
    sizes = [s for _, s in dims]
    world = math.prod(sizes) if sizes else 1
    spans = {"world": group_span(world, 1, gpus_per_node)}
    for i, (name, size) in enumerate(dims):
        spans[name] = group_span(size, math.prod(sizes[i + 1 :]), gpus_per_node)
        for j in range(i + 1, len(dims)):
            spans["+".join(names[i : j + 1])] = group_span(
                math.prod(sizes[i : j + 1]), math.prod(sizes[j + 1 :]), gpus_per_node
            )
    return spans


def latency_seconds(kind: str, span: GroupSpan, eff: Efficiency) -> float:
    """The fixed part of one call, after NCCL's own latency model (``src/graph/tuning.cc``): a base latency, then
    one hop per ring step, the steps between nodes at the network's hop and the others at NVLink's; an all-reduce
    takes the cheaper of a ring (twice the steps) and a tree (up and down: the node's members, then log2 nodes);
    an all-to-all one hop per peer."""
    base = (eff.latency_network_us if span.crosses_nodes else eff.latency_nvlink_us) * 1e-6
    nvl, net = eff.hop_nvlink_us * 1e-6, eff.hop_network_us * 1e-6
    steps, inter = span.size - 1, span.nodes - 1
    ring = (steps - inter) * nvl + inter * net
    if kind == "all_reduce":
        tree = 2 * ((span.per_node - 1) * nvl + math.ceil(math.log2(span.nodes)) * net)
        return base + min(2 * ring, tree)
    if kind == "all_to_all":
        return base + (span.per_node - 1) * nvl + (span.size - span.per_node) * net
    return base + ring


def collective_seconds(kind: str, logical_bytes: float, span: GroupSpan, gpu: GpuProfile, eff: Efficiency) -> float:
    """One call of ``kind`` moving ``logical_bytes`` to a rank (the census's count) over a group lying as ``span``."""
    if span.size <= 1:
        return 0.0
    if kind not in (*RING_KINDS, "all_to_all"):
        raise ValueError(f"no cost rule for collective kind {kind!r}")
    nvlink = gpu.nvlink_gbs * 1e9 * eff.nvlink
    nic = gpu.nic_gbs * 1e9 * eff.network
    latency = latency_seconds(kind, span, eff)
    if kind in RING_KINDS:
        return latency + logical_bytes / (nic if span.crosses_nodes else nvlink)
    off_node = (span.size - span.per_node) / (span.size - 1)
    return latency + max(logical_bytes * (1 - off_node) / nvlink, logical_bytes * off_node / nic)
