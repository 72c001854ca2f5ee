"""How a training run fails: the non-finite policy (one for every optimizer) and the error that stops a run.

Every step is checked for a finite loss and global gradient norm (one scalar each, already computed for the log
and for clipping; under FSDP2 the verdict is agreed by all ranks) before the optimizer applies the gradients. A
non-finite step is never applied, whatever the optimizer:

- ``--nonfinite raise`` (default): the run stops with :class:`RunFailed`, naming the step, what was not
  finite, the batch's non-finite input items where there are any, and the flags that get past it;
- ``--nonfinite skip``: the step is dropped (weights, optimizer state and EMA unchanged, the batch is not
  retried), counted, and logged as a ``nonfinite`` record; ``--skip-limit`` steps skipped in a row stop
  the run as diverged.

With the Muon family nothing waits for the device for this: the check is folded into the gradients the optimizer
votes on (:func:`dimuon.train.loop.fold_into_gradients`), the optimizer's vote (one 4-byte all-reduce) masks the
step and the EMA update on the device, and with ``skip`` the harness reads the votes of the window at the next
logging step (or checkpoint, or the run's end): the ``nonfinite`` record of a step skipped in between is written
then, with the step it happened at (``step``) and the step it was read at (``logged_at``), and ``--skip-limit`` is
checked then, so a diverged run stops up to ``--log-interval - 1`` steps after the limit was reached (every one
of them skipped too). With ``raise`` the optimizer reads its vote once per step and the run stops at that step.
Other optimizers (torch's AdamW, ``torch_muon``) have their check read on the host before they step, every step
(:func:`all_finite`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dimuon.train.distributed import DistEnv

__all__ = ["NonFiniteGuard", "RunFailed", "all_finite"]


class RunFailed(RuntimeError):
    """The run stopped before doing all it was asked to; ``hint`` says how to go on from its directory."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def all_finite(loss: torch.Tensor, grad_norm: torch.Tensor | float, env: DistEnv) -> bool:
    """Whether the step's loss and gradient norm are finite on every rank (one small all-reduce under FSDP)."""
    ok = torch.isfinite(loss.detach()).all() & torch.isfinite(torch.as_tensor(grad_norm, device=loss.device)).all()
    if env.distributed:
        flag = ok.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = flag.bool()
    return bool(ok)


def _value(t: torch.Tensor | float) -> float:
    return float(t.detach().float().mean()) if isinstance(t, torch.Tensor) else float(t)


@dataclass
class NonFiniteGuard:
    """Applies ``--nonfinite`` and ``--skip-limit`` and counts the skipped steps (``skipped`` is resumed)."""

    policy: str
    limit: int
    skipped: int = 0
    in_a_row: int = 0

    def passed(self) -> None:
        """A finite step was taken."""
        self.in_a_row = 0

    def event(
        self,
        done: int,
        steps: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | float,
        bad_items: list[str],
        batch_items: int,
    ) -> tuple[dict[str, Any], str]:
        """Account the non-finite step ``done`` (1-based); returns its ``nonfinite`` record and a message
        naming the step, what was not finite and the data (``bad_items``: the batch's non-finite inputs).

        Whether the run goes on is :meth:`stops`'s answer, asked after the record is logged.
        """
        loss_v, norm_v = _value(loss), _value(grad_norm)
        what = (
            ", ".join(
                f"{name} {v}" for name, v in (("loss", loss_v), ("gradient norm", norm_v)) if not math.isfinite(v)
            )
            or "a non-finite value"
        )
        if bad_items:
            shown = "; ".join(bad_items[:5]) + (f"; and {len(bad_items) - 5} more" if len(bad_items) > 5 else "")
            data = f"the batch holds non-finite input values: {shown}"
        else:
            data = f"the batch's {batch_items} input items are finite, so the model or the optimizer diverged"
        skip = self.policy == "skip"
        if skip:
            self.skipped += 1
            self.in_a_row += 1
        record = {
            "kind": "nonfinite",
            "step": done,
            "loss": loss_v,
            "grad_norm": norm_v,
            "action": "skipped" if skip else "stopped",
            "skipped_total": self.skipped,
            "items": bad_items,
        }
        line = f"step {done} of {steps}: {what}; {data}"
        if not skip:
            return record, (
                f"{line}. The step was not applied. Pass --nonfinite skip to skip such steps (they "
                "are counted in metrics.jsonl), fix the data, or lower --lr / --grad-clip"
            )
        if self.limit and self.in_a_row >= self.limit:
            return record, (
                f"{line}. That makes {self.in_a_row} skipped steps in a row (--skip-limit "
                f"{self.limit}): the run has diverged; lower --lr or --grad-clip"
            )
        return record, f"{line}: skipped (--nonfinite skip), {self.skipped} so far"

    def stops(self) -> bool:
        """Whether the step just accounted ends the run."""
        return self.policy != "skip" or bool(self.limit and self.in_a_row >= self.limit)
