"""The harness's device-specific paths: the sampler, a training run's state, and its RNG across a checkpoint.

Each test runs on the CPU here and on a GPU with ``-m cuda`` (bf16 autocast, CUDA generators, the CUDA
RNG state in checkpoints, fused AdamW counters on the device, moving a checkpoint between devices).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import device_trap as dt

from dimuon.dit import build_dit, sample
from dimuon.train.checkpoint import load_training_state
from dimuon.train.config import EvalOptions
from dimuon.train.distributed import setup
from dimuon.train.loop import Trainer
from dimuon.train.plan import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)
DEVICES = ["cpu", CUDA]


@pytest.fixture
def exact_fp32():
    """No TF32 in CUDA matmuls and convolutions while the test runs (results comparable with the CPU's)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def random_dit(seed: int = 0) -> torch.nn.Module:
    """DiT-T/2 on 8x8 single-channel images with every weight random (the zero init would sample pure noise)."""
    torch.manual_seed(seed)
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_guided_heun_sampling_on_the_device_matches_the_cpu(device: str, exact_fp32: None) -> None:
    model = random_dit()
    labels = torch.arange(6) % 10
    noise = torch.randn(6, 1, 8, 8, generator=torch.Generator(device="cpu").manual_seed(1))
    expected = sample(model, labels, (1, 8, 8), steps=3, method="heun", cfg_scale=2.5, noise=noise)
    model = model.to(device)
    got = sample(model, labels.to(device), (1, 8, 8), steps=3, method="heun", cfg_scale=2.5, noise=noise.to(device))
    assert got.device.type == device and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-3, atol=1e-4)  # other attention kernels on a GPU
    # Seeded noise drawn by a generator on the device: the same seed, the same images.
    draws = [
        sample(
            model,
            labels.to(device),
            (1, 8, 8),
            steps=2,
            cfg_scale=2.5,
            generator=torch.Generator(device=device).manual_seed(7),
        )
        for _ in range(2)
    ]
    assert draws[0].device.type == device and torch.equal(draws[0], draws[1])


def trained(tmp_path: Path, device: str, **overrides: Any) -> Trainer:
    """A 2-step run on ``device`` (bf16 autocast, no evaluation) with its checkpoint written at the end."""
    cfg = dt.tiny_config(tmp_path / f"run-{device}", tmp_path / "cache", device, eval=EvalOptions(), **overrides)
    trainer = Trainer(resolve(cfg), setup(device))
    trainer.fit()
    return trainer


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_keeps_its_state_on_the_device(device: str, tmp_path: Path) -> None:
    trainer = trained(tmp_path, device)
    expected = torch.device(device).type
    assert {p.device.type for p in trainer.model.parameters()} == {expected}
    assert {t.device.type for t in trainer.ema.weights().values()} == {expected}
    for state in trainer.opt.state.values():  # fused AdamW keeps even its step counters on the device
        assert {v.device.type for v in state.values() if isinstance(v, torch.Tensor)} == {expected}
    assert math.isfinite(trainer.summary["train_loss"]) and math.isfinite(trainer.summary["val_loss"])


def rng_draws(device: str) -> list[torch.Tensor]:
    """One draw from each global generator a run uses: the CPU's, and the GPU's on a GPU."""
    draws = [torch.rand(4)]
    if device == "cuda":
        draws.append(torch.rand(4, device="cuda").cpu())
    return draws


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_restores_the_global_rng_of_every_device_it_used(device: str, tmp_path: Path) -> None:
    trainer = trained(tmp_path, device)
    state = torch.load(Path(trainer.summary["checkpoint"]) / "state.pt", weights_only=True)
    assert len(state["rng"]) == 1 and len(state["rng"][0]) == (2 if device == "cuda" else 1)  # one rank
    after_save = rng_draws(device)  # nothing drew from the generators since the save
    torch.manual_seed(1234)  # scrambles the CPU generator and every GPU's
    load_training_state(
        trainer.summary["checkpoint"], model=trainer.model, optimizer=trainer.opt, ema=trainer.ema, env=trainer.env
    )
    for a, b in zip(rng_draws(device), after_save, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_moves_between_the_cpu_and_the_device(device: str, tmp_path: Path) -> None:
    """Written on one device, restored on the other: the same weights, EMA and optimizer state, now living
    on the reader's device, and the reader trains on."""
    for written, read in sorted({(device, "cpu"), ("cpu", device)}):
        root = tmp_path / f"{written}-to-{read}"
        writer = trained(root, written)
        reader = Trainer(
            resolve(dt.tiny_config(root / "reader", tmp_path / "cache", read, eval=EvalOptions())), setup(read)
        )
        load_training_state(
            writer.summary["checkpoint"], model=reader.model, optimizer=reader.opt, ema=reader.ema, env=reader.env
        )
        pairs = [
            *zip(writer.model.parameters(), reader.model.parameters(), strict=True),
            *zip(writer.ema.weights().values(), reader.ema.weights().values(), strict=True),
        ]
        for p, q in zip(writer.opt.state.values(), reader.opt.state.values(), strict=True):
            pairs += [(p[k], q[k]) for k in p]
        for a, b in pairs:
            assert b.device.type == torch.device(read).type
            assert torch.equal(a.detach().cpu(), b.detach().cpu())
        reader.train_step(dt.STEPS)
        assert all(p.device.type == torch.device(read).type for p in reader.model.parameters())
