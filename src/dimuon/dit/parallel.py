"""Parallelism for dimuon's DiT: degrees in torchtitan's style, one device mesh, the tensor-parallel plan, FSDP2.

Degrees ``dp_replicate x dp_shard x cp x tp`` multiply to the world size and build one mesh with the
dimensions that are larger than 1, named ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``:

- ``dp_shard`` alone: FSDP2 (every block, then the root); ``dp_replicate x dp_shard``: HSDP (replicas of
  a sharded model, e.g. one replica per node); ``tp`` alone: tensor parallelism; ``dp_shard x tp``:
  FSDP over tensor parallelism; all three: HSDP over tensor parallelism, the 3-D mesh large DiTs train on
  (replicas across groups of nodes, FSDP inside a group, TP inside a node). ``dp_replicate`` without
  ``dp_shard`` (DDP) is refused at start-up: FSDP2 would shard over a lone data-parallel dimension.
- ``cp``: context parallelism. The ranks of a ``cp`` group train on the same samples, each on a contiguous chunk
  of their tokens (``dimuon.dit.context``; attention gathers keys and values over ``cp``); FSDP2 shards over
  ``dp_shard x cp`` flattened into one dimension (torchtitan's ``dp_shard_cp``), whose gradient mean is the
  one-process gradient. It combines with the other degrees.

The tensor-parallel plan (per block; docs/training.md, "Parallelism"):

- ``attn.qkv`` head-wise column-parallel: the weight as ``_StridedShard(0, split_factor=3)``, so tensor
  rank ``r`` holds the q, k and v rows of heads ``[r H/tp, (r+1) H/tp)``; its output is those heads'
  q, k, v, and attention runs on local heads. The bias stays replicated (FSDP2 over a strided bias would
  nest two ``_StridedShard`` on one dimension, which torch does not store as the placements say).
- ``attn.proj`` and ``mlp.fc2`` row-parallel (``Shard(1)``: each rank's heads / hidden units), their
  outputs all-reduced; ``mlp.fc1`` column-parallel (``Shard(0)``).
- ``adaLN_modulation`` stays replicated over ``tp``: it acts on one conditioning vector per sample, not on
  every token, so splitting it saves almost no compute, while every rank needs all ``6D`` outputs for
  the full-width modulation (an all-gather per block); FSDP still shards it over ``dp_shard``.
  Embeddings and the final layer stay replicated over ``tp`` for the same reason.

Parameter names and values are unchanged: a checkpoint saved under any layout is the same model.
Under FSDP, the qkv weight is sharded over ``dp_shard`` along its input dimension
(``shard_placement_fn``), which keeps it ``(Shard(1), _StridedShard(0, 3))``: two shardings of different
dimensions, a layout torch stores exactly as it says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "Parallelism",
    "apply_parallelism",
    "build_mesh",
    "checkpointable",
    "clip_grad_norm",
    "shard_block_lists",
    "tensor_parallel_dit",
    "tp_process_group",
]

FLAGS = {
    "dp_replicate": "--parallel.dp-replicate",
    "dp_shard": "--parallel.dp-shard",
    "cp": "--parallel.cp",
    "tp": "--parallel.tp",
}


@dataclass(frozen=True)
class Parallelism:
    """Parallel degrees; ``dp_shard = -1`` takes what the others leave of the world. ``cp`` (context parallel)
    splits every sample's tokens over its ranks, with FSDP over the flattened ``dp_shard x cp``."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1

    def resolve(self, world: int) -> Parallelism:
        """The degrees with ``dp_shard`` filled in, checked against ``world``; a ValueError names the flags."""
        for key in ("dp_replicate", "tp", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"{FLAGS[key]} must be >= 1, got {getattr(self, key)}")
        others = self.dp_replicate * self.tp * self.cp
        cp_words = (f" x {FLAGS['cp']} ({self.cp})", f" x {FLAGS['cp']}", f" x {self.cp}") if self.cp > 1 else ("",) * 3
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world % others:
                raise ValueError(
                    f"{FLAGS['dp_replicate']} ({self.dp_replicate}) x {FLAGS['tp']} ({self.tp}){cp_words[0]} "
                    f"must divide the world size {world}"
                )
            dp_shard = world // others
        elif dp_shard < 1:
            raise ValueError(f"{FLAGS['dp_shard']} must be >= 1 or -1 (the rest of the world), got {dp_shard}")
        resolved = Parallelism(self.dp_replicate, dp_shard, self.tp, self.cp)
        if dp_shard * others != world:
            raise ValueError(
                f"{FLAGS['dp_replicate']} x {FLAGS['dp_shard']} x {FLAGS['tp']}{cp_words[1]} = {self.dp_replicate} x "
                f"{dp_shard} x {self.tp}{cp_words[2]} = {dp_shard * others} must equal the world size {world}"
            )
        resolved.check_mesh()
        if resolved.dp_replicate > 1 and resolved.dp_shard * resolved.cp == 1:
            # One data-parallel mesh dimension is sharded by FSDP2 whatever its name: this would run plain FSDP
            # over the "replicas" and record HSDP. Replication without sharding (DDP) is not what the harness runs;
            # with cp > 1 FSDP shards over cp (dp_shard x cp flattened), which is HSDP.
            raise ValueError(
                f"{FLAGS['dp_replicate']} {self.dp_replicate} with {FLAGS['dp_shard']} 1 would shard over the "
                f"replicas (FSDP2 shards a lone data-parallel dimension): give {FLAGS['dp_shard']} >= 2 for HSDP, or "
                f"leave {FLAGS['dp_replicate']} at 1 for FSDP over all {world} ranks"
            )
        return resolved

    def check_mesh(self) -> None:
        """The mesh limit, the one place it is written: the optimizer's layouts take a mesh of any number of
        dimensions, judged by the placements (``dimuon.optim.distributed.layout``), so every combination of the
        degrees is taken; nothing is refused here today."""

    def check_model(self, hidden_size: int, num_heads: int, mlp_hidden: int) -> None:
        """Tensor parallelism splits heads and MLP units evenly: raise naming --parallel.tp if it cannot."""
        if self.tp == 1:
            return
        for what, n in (("attention heads", num_heads), ("MLP hidden units", mlp_hidden)):
            if n % self.tp:
                raise ValueError(f"{FLAGS['tp']} ({self.tp}) must divide the model's {n} {what}")

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh dimensions: those of degree > 1, in the order dp_replicate, dp_shard, cp, tp."""
        return tuple((k, getattr(self, k)) for k in ("dp_replicate", "dp_shard", "cp", "tp") if getattr(self, k) > 1)


def build_mesh(par: Parallelism, device_type: str) -> Any:
    """One device mesh with the dimensions of ``par`` larger than 1 (None for one process)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not par.dims:
        return None
    names, sizes = zip(*par.dims)
    return init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))


def _headwise_qkv_style() -> Any:
    """A ParallelStyle for the fused qkv: weight ``_StridedShard(0, 3)``, bias replicated, local output."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import _StridedShard

    class HeadwiseQKV(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def partition(name: str, mod: nn.Module, mesh: Any) -> None:
                weight = distribute_tensor(mod.weight.detach(), mesh, [_StridedShard(0, split_factor=3)])
                mod.register_parameter("weight", nn.Parameter(weight, requires_grad=mod.weight.requires_grad))
                bias = distribute_tensor(mod.bias.detach(), mesh, [Replicate()])
                mod.register_parameter("bias", nn.Parameter(bias, requires_grad=mod.bias.requires_grad))

            def inputs(mod: nn.Module, args: tuple, mesh: Any) -> tuple:
                (x,) = args
                return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False),)

            def outputs(mod: nn.Module, out: Any, mesh: Any) -> Any:
                return out.to_local()  # (N, T, 3 * local heads * head_dim): this rank's q, k, v

            return distribute_module(module, device_mesh, partition, inputs, outputs)

    return HeadwiseQKV()


def tensor_parallel_dit(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Apply the tensor-parallel plan of the module docstring to every transformer block of ``model``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        plan = {
            "attn.qkv": _headwise_qkv_style(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)
    return model


def _is_strided(placement: Any) -> bool:
    """A head-wise ``_StridedShard`` placement (torch's private class for a shard of a strided layout)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def _fsdp_placement(param: nn.Parameter) -> Any:
    """FSDP's placement for a parameter: the input dimension for a head-wise (strided) TP weight, else dim 0."""
    from torch.distributed.tensor import Shard

    placements = getattr(param, "placements", ())
    if any(_is_strided(p) for p in placements):
        return Shard(1)
    return None  # FSDP2's default, Shard(0)


def apply_parallelism(
    model: nn.Module, par: Parallelism, mesh: Any, reshard_root: bool = True, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Tensor parallelism over ``tp`` and the token split over ``cp`` (if any), then FSDP2 over the data-parallel
    dimensions (``cp`` among them): every block, then the root (which also reshards after forward, so gradient-free
    forwards leave parameters sharded).

    ``param_dtype`` (bf16 for ``--precision bf16``): FSDP2's ``MixedPrecisionPolicy`` all-gathers the parameters
    in that dtype and computes with them, and reduce-scatters the gradients in fp32 into the fp32 shards the
    optimizer steps: half the all-gather bytes of fp32, the optimizer's math unchanged."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if par.tp > 1:
        tensor_parallel_dit(model, mesh["tp"])
    if par.cp > 1:
        model.context_parallel(mesh["cp"].get_group())
    dp = tuple(name for name, _ in par.dims if name != "tp")
    if not dp:
        return model
    dp_mesh = _data_mesh(mesh, dp)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=_fsdp_placement, mp_policy=policy)
    # The root keeps its inputs as given: the flow time t stays fp32 into the timestep embedder (cast to bf16 it
    # would take steps of 1/256 near 1); DiT.forward casts the images to the patch embedding's dtype itself.
    root = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None, cast_forward_inputs=False
    )
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_root, mp_policy=root)
    return model


def _data_mesh(mesh: Any, dp: tuple[str, ...]) -> Any:
    """FSDP2's mesh over the data-parallel dimensions ``dp``; with ``cp``, data x context flattened into one shard
    dimension (torchtitan's ``dp_shard_cp``), after ``dp_replicate`` for HSDP."""
    if "cp" not in dp:
        return mesh[dp] if len(dp) > 1 or mesh.ndim > 1 else mesh
    from torch.distributed.device_mesh import DeviceMesh

    shard = tuple(name for name in dp if name != "dp_replicate")
    flat = mesh[shard]._flatten("_".join(shard)) if len(shard) > 1 else mesh[shard[0]]
    return DeviceMesh._concatenate([mesh["dp_replicate"], flat]) if "dp_replicate" in dp else flat


def shard_block_lists(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 on any model as torchtitan lays out a transformer: every child of each outermost ``nn.ModuleList``
    that holds parameters (a model's blocks: ``blocks``, ``transformer_blocks``, ``single_transformer_blocks``...),
    then the root, over every dimension of ``mesh`` (HSDP on a 2-D mesh)."""
    from torch.distributed.fsdp import fully_shard

    sharded: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(f"{s}.") for s in sharded):
            continue
        for i, child in enumerate(module):
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
                sharded.append(f"{name}.{i}" if name else str(i))
    fully_shard(model, mesh=mesh)
    return model


def tp_process_group(par: Parallelism, mesh: Any) -> torch.distributed.ProcessGroup | None:
    """Under tensor parallelism alone the parameters outside the plan are plain tensors, the same on every
    rank: the optimizer splits their Newton-Schulz work over this group (``process_group=``)."""
    if par.tp > 1 and len(par.dims) == 1:
        return mesh.get_group("tp")
    return None


def checkpointable(state: Any) -> Any:
    """``state`` (nested dicts of tensors) with every ``_StridedShard`` DTensor gathered along that mesh dimension
    (``Replicate()`` there), so ``torch.distributed.checkpoint`` can save and load it: DCP describes a rank's
    piece as one contiguous block, which a head-wise strided piece is not. Other entries are kept as they are.
    """
    if isinstance(state, dict):
        return {k: checkpointable(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(checkpointable(v) for v in state)
    placements = getattr(state, "placements", None)
    if placements and any(_is_strided(p) for p in placements):
        from torch.distributed.tensor import Replicate

        safe = [Replicate() if _is_strided(p) else p for p in placements]
        return state.redistribute(state.device_mesh, safe)
    return state


@torch.no_grad()
def clip_grad_norm(parameters: Any, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients spread over several meshes: tensor parallelism mixes
    plain tensors, 1-D and 2-D DTensors, which torch's list kernels refuse to combine. The norm is taken per
    mesh (a reduction over that mesh for DTensors), summed, and every gradient scaled in place (not when
    ``max_norm <= 0``); returns the total norm before clipping (a plain tensor, the same on every rank)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(id(g.device_mesh) if hasattr(g, "device_mesh") else 0, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.float().square())
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm <= 0:  # the norm alone
        return total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for group in by_mesh.values():
        local = [g.to_local() if hasattr(g, "to_local") else g for g in group]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total
