"""Buffers for one optimizer step's large temporaries, kept from step to step on the CPU.

On the CPU a fresh large allocation is paged in again at every step: glibc hands the freed memory back to the
system, and the next step's allocation of the same size takes one page fault per 4 KiB (a bf16 Newton-Schulz step of
DiT-S/2 with 2 blocks took about 6,200 of them, against 600 for ``torch.optim.Muon``'s per-matrix iteration).
Accelerators' caching allocators keep freed blocks already, so only the CPU form of the step uses a
:class:`Workspace` (:func:`dimuon.optim.devices.cpu_path`). A buffer is lent by shape, dtype and device and comes
back when its borrower is done with it (:meth:`Workspace.give_back`) or when the step ends (:meth:`Workspace.release`):
a buffer is never lent twice at once, so what a step computes is what it computes without one. Buffers are bytes,
lent as any shape and dtype that fits, so one Newton-Schulz batch's temporaries serve the next shape's too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


class Workspace:
    """Byte buffers per device, each lent whole as a contiguous tensor of the shape and dtype asked for and reused
    once given back (the smallest free one large enough, and at most twice the size asked for); none is ever freed,
    so once a step's sequence of requests has run, the same sequence takes no new memory."""

    def __init__(self) -> None:
        self._free: dict[torch.device, list[Tensor]] = {}  # uint8 buffers per device
        self._lent: dict[int, Tensor] = {}  # storage address -> the uint8 buffer lent out

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        """A contiguous tensor of that shape, dtype and device (its values undefined), lent until given back; an
        empty shape gets a fresh tensor (there is nothing to keep)."""
        shape = tuple(int(n) for n in shape)
        device = torch.device(device)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        free = self._free.setdefault(device, [])
        fits = [i for i, b in enumerate(free) if nbytes <= b.numel() <= 2 * nbytes]  # at most half of it idle
        buffer = (
            free.pop(min(fits, key=lambda i: free[i].numel()))
            if fits
            else torch.empty(nbytes, dtype=torch.uint8, device=device)
        )
        self._lent[buffer.untyped_storage().data_ptr()] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    def give_back(self, *tensors: Tensor) -> None:
        """The lent buffers behind ``tensors`` (each a tensor :meth:`empty` returned, or a view of one) free to lend
        again; a tensor that lies in no lent buffer is ignored."""
        for t in tensors:
            buffer = self._lent.pop(t.untyped_storage().data_ptr(), None) if t.numel() > 0 else None
            if buffer is not None:
                self._free.setdefault(buffer.device, []).append(buffer)

    def release(self) -> None:
        """Every lent buffer back (the step that borrowed them is over)."""
        for buffer in self._lent.values():
            self._free.setdefault(buffer.device, []).append(buffer)
        self._lent.clear()

    @property
    def lent(self) -> int:
        """Buffers lent and not given back."""
        return len(self._lent)

    @property
    def held_bytes(self) -> int:
        """Bytes of every buffer this workspace holds, lent or free."""
        return sum(b.numel() for b in self._lent.values()) + sum(b.numel() for f in self._free.values() for b in f)
