"""Every tensor the harness makes lives where its data lives: a run under the meta-device trap (one
process here; 2 gloo ranks in tests/multirank/test_harness_devices.py; a GPU with ``-m cuda``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests import device_trap as dt

from dimuon.dit import build_dit, validation_loss
from dimuon.dit import flow as flow_module

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


def assert_same(a: dict, b: dict, device: str) -> None:
    """Equal on the CPU; on a GPU, whose backward kernels may sum in another order from run to run, close
    (a score on the k-NN border may move by a sample)."""
    if device == "cpu":
        assert a == b
        return
    assert a.keys() == b.keys()
    for key in a:
        tolerance = {"abs": 2 / 12} if key in ("precision", "recall", "density", "coverage") else {"rel": 1e-2}
        assert a[key] == pytest.approx(b[key], **tolerance), key


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_run_under_the_trap_computes_what_it_computes_without(device: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")  # the feature classifier trains once
    trapped = dt.run_harness(0, 1, device, str(tmp_path / "trapped"), cache, True)
    plain = dt.run_harness(0, 1, device, str(tmp_path / "plain"), cache, False)
    assert_same(trapped["summary"], plain["summary"], device)
    assert_same(trapped["eval"], plain["eval"], device)
    for name, p in trapped["resumed"].items():
        if device == "cpu":  # the restored trainer steps exactly as the one that wrote the checkpoint
            assert torch.equal(p, plain["resumed"][name]) and torch.equal(p, trapped["straight"][name]), name
        else:
            torch.testing.assert_close(p, plain["resumed"][name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(p, trapped["straight"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_trap_catches_a_tensor_made_without_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation noise drawn without naming the CPU (as it once was) fails under the trap, not silently."""

    def unplaced_noise(start: int, stop: int, shape, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(stop - start, *shape, generator=g)

    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    images, labels = torch.zeros(4, 1, 8, 8), torch.arange(4)
    with dt.trap(True):
        validation_loss(model, images, labels)  # the harness's own noise names its device
    monkeypatch.setattr(flow_module, "_fixed_noise", unplaced_noise)
    with dt.trap(True), pytest.raises((RuntimeError, NotImplementedError)):
        validation_loss(model, images, labels)
