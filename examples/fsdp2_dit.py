"""Train a DiT sharded with FSDP2 under torchrun with PeriodicRowMuon, and checkpoint model and optimizer with DCP.

Run (``pip install 'dimuon[harness]'``: ``dimuon.dit`` imports ``dimuon.io``, which needs numpy)::

    torchrun --nproc-per-node 8 examples/fsdp2_dit.py --steps 20   # GPUs: NCCL, one GPU per process
    torchrun --nproc-per-node 2 examples/fsdp2_dit.py --steps 20   # no CUDA: CPU processes, gloo
    torchrun --nproc-per-node 2 examples/fsdp2_dit.py --steps 20 --resume  # 20 more from --checkpoint

The code between the ``fsdp2`` markers is what the README shows; the batches, the flags and the exit are
around it. Every process draws the same seeded global batch and trains on its slice, and label dropout is
off (it would draw from each process's own random numbers), so a run resumed from a checkpoint, on any
number of processes, sees the batches the uninterrupted run saw (tests/multirank/test_fsdp2_example.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dimuon.dit import build_dit
from dimuon.dit.flow import flow_loss
from dimuon.optim import PeriodicRowMuon, param_groups

GLOBAL_BATCH, CLASSES, SIZE = 16, 10, 16
# One colour per class (4 latent channels): the model learns to carry noise to its label's colour.
CLASS_COLORS = torch.randn(CLASSES, 4, 1, 1, generator=torch.Generator().manual_seed(1234))


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This process's slice of global batch ``step``: images, labels, flow times and noise, seeded by ``step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise ValueError(f"the global batch of {GLOBAL_BATCH} needs a number of processes that divides it, not {world}")
    gen = torch.Generator().manual_seed(step)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)
    x1 = CLASS_COLORS[y] + 0.1 * torch.randn(GLOBAL_BATCH, 4, SIZE, SIZE, generator=gen)
    t, x0 = torch.rand(GLOBAL_BATCH, generator=gen), torch.randn(x1.shape, generator=gen)
    each = GLOBAL_BATCH // world
    return tuple(v[rank * each : (rank + 1) * each].to(device) for v in (x1, y, t, x0))


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--checkpoint", default="fsdp2_dit-checkpoint", help="DCP directory to save to (and --resume from)")
parser.add_argument("--resume", action="store_true", help="load --checkpoint before training")
args = parser.parse_args()
if args.steps < 1:
    parser.error(f"--steps must be at least 1, got {args.steps}")

device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)  # NCCL and FSDP2 use the current GPU
torch.manual_seed(0)  # the same initial weights on every rank
losses = []

# [fsdp2-begin]
dist.init_process_group()  # torchrun's environment: NCCL for CUDA tensors, gloo for CPU ones
mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # HSDP: a 2-D mesh (replicas, shards)
model = build_dit("DiT-XS/2", input_size=16, num_classes=10, class_dropout_prob=0.0).to(device)  # your DiT
for block in model.blocks:  # FSDP2 block by block, then the root
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = PeriodicRowMuon(param_groups(model), lr=0.01, k=3)  # after fully_shard: it reads the DTensor placements

state = {"step": 0}
if args.resume:  # each rank reads its own shards, whatever the number of ranks that saved them
    state["model"], state["optim"] = get_state_dict(model, opt)
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
for step in range(state["step"], state["step"] + args.steps):
    x1, y, t, x0 = batch(step, device)
    loss = flow_loss(model, x1, y, t=t, x0=x0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.detach())
model_sd, optim_sd = get_state_dict(model, opt)
dcp.save({"model": model_sd, "optim": optim_sd, "step": step + 1}, checkpoint_id=args.checkpoint)
# [fsdp2-end]

mean = torch.stack(losses)
dist.all_reduce(mean)  # the global batch's loss: the mean over the ranks' equal slices
mean /= dist.get_world_size()
if dist.get_rank() == 0:
    weight = model.blocks[0].attn.qkv.weight
    print(f"blocks.0.attn.qkv.weight is sharded {tuple(weight.placements)} over {dist.get_world_size()} process(es)")
    print(f"loss at step {step + 2 - args.steps}: {mean[0]:.4f}; at step {step + 1}: {mean[-1]:.4f}")
    print(f"checkpoint: {args.checkpoint}")
sys.stdout.flush()
if device.type == "cuda":
    dist.destroy_process_group()
# torch's gloo backend can abort at interpreter exit once a DeviceMesh exists: leave at once, after flushing.
os._exit(0)
