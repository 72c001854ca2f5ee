"""The state a compiled step reads, made and placed before the step is traced.

torch.compile treats an optimizer's ``_init_group`` as torch's own optimizers use it: dynamo runs it eagerly, outside
the graph, then marks every tensor of ``optimizer.state`` a static address. CUDA graphs (``mode="reduce-overhead"``)
replay in place only over static inputs: a state tensor the step mutates that is not marked makes inductor skip CUDA
graphs for the whole step ("mutated inputs"), and a counter left on the CPU skips them too ("cpu device"). What the
step carries from one step to the next outside ``state`` (the device count of skipped steps) is made here too, and
marked: a tensor a graph returned is overwritten by the graph's next replay, so none may be handed to it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dimuon.optim.common import local_tensor


class CompiledStepState:
    """The optimizer's ``_init_group``, which ``step`` calls under torch.compile only."""

    param_groups: list[dict[str, Any]]
    nonfinite: str
    _votes: dict[str, Tensor | None]

    def _param_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _init_group(self) -> None:
        """Every parameter's state made, the AdamW counters on their parameters' devices (where the capturable form a
        graph runs keeps them: :meth:`~dimuon.optim.adamw_group.AdamWGroup._adamw_part` moves them inside the graph
        where this did not run), and under ``nonfinite="skip"`` the skip counter made on the vote's device."""
        params = [(p, group) for group in self.param_groups for p in group["params"]]
        for p, group in params:
            state = self._param_state(p, group)
            step = state.get("step") if group["algorithm"] == "adamw" else None
            device = local_tensor(p).device
            if isinstance(step, Tensor) and step.device != device:
                state["step"] = step.to(device)
        if self.nonfinite == "skip" and params:
            if self._votes["pending_skips"] is None:
                device = local_tensor(params[0][0]).device  # the vote's (dimuon.optim.vote)
                self._votes["pending_skips"] = torch.zeros((), dtype=torch.int64, device=device)
            torch._dynamo.mark_static_address(self._votes["pending_skips"])
