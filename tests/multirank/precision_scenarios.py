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
    with torch.no_grad():  # a final layer that is not zero yet: the output depends on the time
        for p in model.final_layer.parameters():
            p.normal_(0, 0.05)
    par = Parallelism().resolve(world)
    apply_parallelism(model, par, build_mesh(par, "cpu"), param_dtype=param_dtype)
    seen = {}
    fc1 = model.blocks[0].mlp.fc1

    def note_dtype(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("compute", str(module.weight.dtype))

    def note_time(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("time", str(args[0].dtype))

    fc1.register_forward_pre_hook(note_dtype)
    model.t_embedder.register_forward_pre_hook(note_time)
    x = torch.randn(2, 1, 8, 8)  # fp32 images, as the harness feeds them
    out = model(x, torch.tensor([0.9955, 0.9975]), torch.zeros(2, dtype=torch.long))
    F.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32)).backward()
    # Two times 1/500 apart near 1 (one bf16 value): the model must tell them apart.
    with torch.no_grad():
        twin = model(x[:1].repeat(2, 1, 1, 1), torch.tensor([0.9955, 0.9975]), torch.zeros(2, dtype=torch.long))
    return {
        **seen,
        "stored": str(fc1.weight.dtype),
        "grad": str(fc1.weight.grad.dtype),
        "times_apart": bool(not torch.equal(twin[0], twin[1])),
    }
