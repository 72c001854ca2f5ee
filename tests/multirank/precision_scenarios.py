"""Rank-side program of the mixed-precision test: dimuon's DiT under FSDP2 with ``param_dtype=bf16``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dimuon.dit import build_dit
from dimuon.dit.parallel import Parallelism, apply_parallelism, build_mesh


def dtypes_in_a_step(rank: int, world: int, param_dtype: torch.dtype | None) -> dict[str, str]:
    """The dtype a block's weight computes in, the dtype its shard is stored in, and its gradient's."""
    torch.manual_seed(0)
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=4)
    par = Parallelism().resolve(world)
    apply_parallelism(model, par, build_mesh(par, "cpu"), param_dtype=param_dtype)
    seen = {}
    fc1 = model.blocks[0].mlp.fc1

    def note_dtype(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("compute", str(module.weight.dtype))

    fc1.register_forward_pre_hook(note_dtype)
    x = torch.randn(2, 1, 8, 8)
    out = model(x.to(param_dtype or torch.float32), torch.rand(2), torch.zeros(2, dtype=torch.long))
    F.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32)).backward()
    return {**seen, "stored": str(fc1.weight.dtype), "grad": str(fc1.weight.grad.dtype)}
