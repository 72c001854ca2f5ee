"""Train an unmodified diffusers ``DiTTransformer2DModel`` with PeriodicRowMuon under Hugging Face accelerate's
FSDP2 plugin.

accelerate builds its FSDP2 model in ``accelerator.prepare`` and then points the optimizer's parameter
groups at the sharded parameters: the optimizer was made over the plain ones. dimuon's optimizers derive
each parameter's layout at the step from the parameters they hold then, so nothing else is needed.

Run (``pip install 'dimuon[accelerate]'``)::

    accelerate launch --num_processes 2 examples/accelerate_fsdp2_dit.py --steps 20        # GPUs
    torchrun --nproc-per-node 2 examples/accelerate_fsdp2_dit.py --steps 20 --fsdp-on-cpu  # CPU processes, gloo

accelerate (1.15) turns its FSDP plugin on only for accelerator processes; ``--fsdp-on-cpu`` sets the
distributed type it would pick there, so its FSDP2 preparation runs on CPU processes as well.

Every process draws the same seeded global batch and trains on its slice; FSDP averages the gradients,
so the run follows one process training on the whole batch (tests/multirank/test_accelerate_example.py
holds it to that within 1e-5).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch


def train(
    steps: int = 6, batch_size: int = 8, lr: float = 0.01, seed: int = 0, fsdp_on_cpu: bool = False
) -> dict[str, Any]:
    """Train ``steps`` steps; return the losses and the full (gathered) weights on every process.

    accelerate turns its FSDP plugin on for accelerators only; ``fsdp_on_cpu`` sets the distributed type it
    picks there, so that its FSDP2 preparation runs on CPU processes too (the multi-rank test uses it).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from dimuon.dit.diffusers_adapter import build_diffusers_dit
    from dimuon.dit.flow import flow_loss
    from dimuon.optim import PeriodicRowMuon, param_groups

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    plugin = (
        FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["BasicTransformerBlock"],
            # diffusers' DiT reads block 0's label/time embedder again after the last block: keep blocks gathered
            # until backward, or that read would meet resharded parameters.
            reshard_after_forward=False,
        )
        if distributed
        else None
    )
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=plugin)
    if distributed and fsdp_on_cpu and accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    torch.manual_seed(seed)
    model = build_diffusers_dit("DiT-T/2", input_size=8, in_channels=4, num_classes=10)
    groups = param_groups(model)  # hidden matrices to Muon, the rest (embeddings, biases, norms) to AdamW
    muon = sorted(name for g in groups if g["algorithm"] == "muon" for name, _ in g["params"])
    optimizer = PeriodicRowMuon(groups, lr=lr, k=3, ns_dtype=torch.float32)
    model, optimizer = accelerator.prepare(model, optimizer)

    rank, world = accelerator.process_index, accelerator.num_processes
    keep = torch.zeros(batch_size // world, dtype=torch.bool, device=accelerator.device)  # no label dropout
    losses = []
    for step in range(steps):
        # The global batch (data, times, noise), the same on every process; each trains on its slice.
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        x1, x0 = torch.randn(2, batch_size, 4, 8, 8, generator=gen)
        y, t = torch.randint(0, 10, (batch_size,), generator=gen), torch.rand(batch_size, generator=gen)
        mine = slice(rank * batch_size // world, (rank + 1) * batch_size // world)
        x1, x0, y, t = (v[mine].to(accelerator.device) for v in (x1, x0, y, t))
        loss = flow_loss(lambda x, tt, yy: model(x, tt, yy, drop_labels=keep), x1, y, t=t, x0=x0)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for name, p in model.named_parameters()
    }
    placements = sorted({str(getattr(p, "placements", "plain")) for p in model.parameters()})
    return {"losses": losses, "weights": weights, "placements": placements, "muon": muon}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--fsdp-on-cpu",
        action="store_true",
        help="use accelerate's FSDP2 preparation on CPU processes too (it does on accelerators only)",
    )
    args = parser.parse_args()
    result = train(args.steps, args.batch_size, args.lr, fsdp_on_cpu=args.fsdp_on_cpu)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"layouts {result['placements']}; loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    os._exit(0)  # leave without torch's gloo teardown, which aborts at interpreter exit once a mesh exists


if __name__ == "__main__":
    main()
