"""Run directories of a tiny digits DiT with checkpoints, and ``dimuon eval`` on them with fast settings: shared
by the evaluation tests."""

from __future__ import annotations

from pathlib import Path

import torch

from dimuon.dit import build_dit
from dimuon.eval.run import main

FAST_FLAGS = [
    "--num-samples",
    "40",
    "--sample-steps",
    "3",
    "--cfg",
    "2.0",
    "--batch-size",
    "16",
    "--no-progress",
]


def tiny_dit(seed: int, scale: float = 0.05) -> torch.nn.Module:
    """DiT-T/2 on 8x8 digits with every weight perturbed, so its samples depend on labels, time and weights."""
    torch.manual_seed(seed)
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


def make_run(root: Path, steps=(10, 20, 30), seed: int = 0) -> Path:
    """A run directory with checkpoints of a tiny digits DiT whose weights drift from step to step."""
    from dimuon.dit import EMA
    from dimuon.train import checkpoint as ckpt
    from dimuon.train.distributed import DistEnv

    model = tiny_dit(seed)
    ema = EMA(model, decay=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = {
        "config": {"model": "DiT-T/2", "dataset": "digits", "seed": seed},
        "dataset": {"name": "digits", "kwargs": {}},
        "image_shape": [1, 8, 8],
        "num_classes": 10,
        "model": {"name": "DiT-T/2", "kwargs": model.config},
    }
    env = DistEnv(rank=0, world=1, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        ema.update(model)
        progress = {"active_time_s": 0.5 * step}
        ckpt.save_checkpoint(
            root, step, model=model, optimizer=optimizer, ema=ema, progress=progress, meta=meta, env=env
        )
    return root


def run_eval(run: Path, cache_dir: Path, *extra: str) -> int:
    return main(["--run", str(run), "--cache-dir", str(cache_dir), *FAST_FLAGS, *extra])
