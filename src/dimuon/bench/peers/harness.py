"""What the benchmarks need to time a peer beside dimuon: the same gradients every step, a first step that
may fail without ending the run, and a plain word on bf16 Newton-Schulz on this CPU."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from dimuon.bench.peers.registry import PeerStatus, Setting, build_peer, probe

# CPU features (``bench.report.cpu_flags``) that give bf16 matrix products their own hardware.
BF16_UNITS = ("amx_bf16", "avx512_bf16")


class GradientSnapshot:
    """The gradients of ``params`` as they are now, put back before every timed step.

    Some peers write into ``p.grad`` (muon-fsdp2 leaves its update there, dtensor-muon adds the
    Nesterov term in place) or drop it; every optimizer of a run must step on the same gradients.
    """

    def __init__(self, params: Iterable[Tensor]) -> None:
        self._saved = [(p, p.grad.detach().clone()) for p in params if p.grad is not None]

    def restore(self) -> None:
        """Copy the saved values back into ``p.grad`` (a fresh copy where it was dropped or replaced)."""
        for p, saved in self._saved:
            if _same_layout(p.grad, saved):
                p.grad.detach().copy_(saved)
            else:
                p.grad = saved.clone()


def _same_layout(grad: Tensor | None, saved: Tensor) -> bool:
    """Whether ``saved`` can be copied into ``grad`` in place (same kind, shape, dtype and placements)."""
    return (
        grad is not None
        and type(grad) is type(saved)
        and grad.shape == saved.shape
        and grad.dtype == saved.dtype
        and getattr(grad, "placements", None) == getattr(saved, "placements", None)
    )


def first_step(opt: Any, snapshot: GradientSnapshot) -> str | None:
    """One untimed step on the saved gradients; the error in one line if it raises, None if it ran."""
    snapshot.restore()
    try:
        opt.step()
    except Exception as err:  # the row says why, the other optimizers still run
        text = str(err).strip().splitlines()
        return f"its step fails: {type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
    finally:
        snapshot.restore()
    return None


def start_peer(
    key: str,
    muon: list[Tensor],
    rest: list[Tensor],
    lr: float,
    snapshot: GradientSnapshot,
    device: torch.device | str = "cpu",
    setting: Setting = "local",
) -> tuple[Any, PeerStatus, str | None]:
    """Probe peer ``key``, build it and take its first step: (the optimizer or None, its status, why it did
    not run or None). The error is returned apart so that ranks can agree on it before marking the status."""
    status = probe(key, device, setting)
    if not status.runnable:
        return None, status, None
    try:
        opt = build_peer(key, muon, rest, lr)
    except Exception as err:  # a constructor that refuses the setting is a row too
        return None, status, f"its constructor fails: {type(err).__name__}: {err}"
    error = first_step(opt, snapshot)
    return (None if error else opt), status, error


def bf16_note(cpu_flags: Sequence[str], device_type: str = "cpu") -> str:
    """What bf16 Newton-Schulz means for the speed on this machine (for the rows that hard-code it)."""
    if device_type != "cpu":
        return "bf16 NS"
    units = [f for f in BF16_UNITS if f in cpu_flags]
    if units:
        return f"bf16 NS: this CPU has bf16 units ({', '.join(units)}), fast here; 7-100x slower on CPUs without"
    return "bf16 NS on a CPU without bf16 units: slow here (fp32 would be faster)"
