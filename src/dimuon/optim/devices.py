"""Where the fastest form of a step differs by device: one switch, :func:`cpu_path`.

On an accelerator every op is a kernel launch and the allocator caches memory, so the step is a few list
(``torch._foreach_*``) and batched ops. On the CPU an op launches nothing, but every pass over memory and every
fresh large allocation (paged in again at each step) costs; there the step takes one pass per tensor where two list
ops would take two, chunks its squares, and keeps its Nesterov buffers and the maps' temporaries and directions
(:mod:`dimuon.optim.workspace`) from step to step. Both forms compute the
same values (tests hold them together); the op census sets the switch off to count what an accelerator dispatches.
"""

from __future__ import annotations

import torch


def cpu_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the CPU's form of the step."""
    return device.type == "cpu"
