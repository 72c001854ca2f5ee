"""The AdamW group: torch's AdamW for the parameters of ``"algorithm": "adamw"`` groups (biases, norms,
embeddings), fused where torch has the kernel, masked by the non-finite vote under ``nonfinite="skip"``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as adamw_functional
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from dimuon.optim.common import group_lr, local_tensor, local_tensors
from dimuon.optim.distributed.layout import is_dtensor

_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class AdamWPart:
    """One device mesh's share of an AdamW group as its kernel takes it, made once: the parameters, their state
    dicts and tensors (counters where the kernel keeps them, moments contiguous where it is fused)."""

    params: list[Tensor]
    states: list[dict[str, Any]]
    tensors: tuple[list[Tensor], list[Tensor], list[Tensor]]  # exp_avg, exp_avg_sq, step, as in _KEYS
    fused: bool
    dtensor: bool

    def current(self) -> bool:
        """Whether every state tensor is still the one planned (a load or a caller may have replaced one)."""
        return all(
            all(map(is_, kept, map(dict.get, self.states, repeat(key)))) for key, kept in zip(_KEYS, self.tensors)
        )


@dataclass
class AdamWPlan:
    """An AdamW group's parts by device mesh, valid for the parameters (ids), options and state it was made from."""

    key: tuple[Any, ...]
    state: Any
    parts: list[AdamWPart]


class AdamWGroup:
    """The AdamW groups' share of the optimizer: one torch AdamW call per group and device mesh, planned once."""

    adamw_fused: bool | None
    state: Any
    _adamw_plans: dict[int, AdamWPlan]

    @staticmethod
    def _fused_supported(params: Sequence[Tensor]) -> bool:
        """Whether torch has a fused AdamW kernel for every one of ``params`` (device type and dtype), and they are
        contiguous: torch 2.13's fused kernel returns wrong updates for a non-contiguous parameter (and for a
        gradient or moments laid out unlike the parameter, which :meth:`_adamw_part` makes contiguous)."""
        devices = _get_fused_kernels_supported_devices()
        return all(
            local_tensor(p).device.type in devices and p.is_floating_point() and local_tensor(p).is_contiguous()
            for p in params
        )

    def _adamw_step(self, gi: int, group: dict[str, Any], params: list[Tensor], mask: Tensor | None) -> None:
        """torch's AdamW over the group, one kernel call per device mesh: a list kernel takes plain tensors or
        DTensors of one mesh, and tensor parallelism mixes them (layers in the plan, others outside it)."""
        for part in self._adamw_parts(gi, group, params, mask is not None):
            if mask is not None and not part.fused:
                self._masked_adamw(group, part, mask)
            else:
                self._adamw_kernel(group, part, mask)

    def _adamw_parts(self, gi: int, group: dict[str, Any], params: list[Tensor], masked: bool) -> list[AdamWPart]:
        """Group ``gi``'s plan, made again where its parameters, ``adamw_fused``, the masking or a state tensor
        changed; kept only after the first step (which may remake the state), and made each step under a graph."""
        key = (tuple(map(id, params)), self.adamw_fused, masked)
        plan = None if torch.compiler.is_compiling() else self._adamw_plans.get(gi)
        if plan is None or plan.key != key or plan.state is not self.state or not all(p.current() for p in plan.parts):
            by_mesh: dict[int, list[Tensor]] = {}
            for p in params:
                by_mesh.setdefault(id(p.device_mesh) if is_dtensor(p) else 0, []).append(p)
            plan = AdamWPlan(key, self.state, [self._adamw_part(group, part, masked) for part in by_mesh.values()])
            if group["step"] > 0 and not torch.compiler.is_compiling():
                self._adamw_plans[gi] = plan
        return plan.parts

    def _adamw_part(self, group: dict[str, Any], params: list[Tensor], masked: bool) -> AdamWPart:
        """The state of ``params`` (one mesh) made ready for their kernel: counters moved, moments made contiguous."""
        fused = self.adamw_fused if self.adamw_fused is not None else self._fused_supported(params)
        fused = fused and not torch.compiler.is_compiling()  # torch's fused kernel is not traced: a graph fuses itself
        on_device = fused or masked or torch.compiler.is_compiling()  # the capturable form under a graph
        states = []
        for p in params:
            state = self._param_state(p, group)
            # Where torch keeps the counter: on the parameter's device for the fused and capturable kernels (and
            # the masked loop), on the CPU otherwise (a checkpoint may bring it from either).
            device = local_tensor(p).device if on_device else torch.device("cpu")
            if state["step"].device != device:
                state["step"] = state["step"].to(device)
            if fused:
                # torch's fused kernel pairs elements by memory offset: parameter, gradient and moments must share
                # one layout (contiguous parameters only take this path); moments a checkpoint brought in another
                # layout are made contiguous once.
                for key in ("exp_avg", "exp_avg_sq"):
                    if not local_tensor(state[key]).is_contiguous():
                        state[key] = state[key].contiguous()
            states.append(state)
        tensors = ([st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], [st["step"] for st in states])
        return AdamWPart(params, states, tensors, fused, is_dtensor(params[0]))

    def _adamw_kernel(self, group: dict[str, Any], part: AdamWPart, mask: Tensor | None) -> None:
        """torch's AdamW on one part; under a ``mask`` (the vote) torch's fused kernel is told ``found_inf`` where
        the vote failed (it then leaves parameters and moments untouched and torch takes the step counters back)."""
        fused = part.fused
        # Under torch.compile the unfused kernel needs its capturable form (tensor step sizes).
        capturable = not fused and torch.compiler.is_compiling()
        grads = [p.grad for p in part.params]
        # The fused kernel wants the gradient laid out as the parameter: one autograd.grad made strided is copied.
        if fused and part.dtensor:
            grads = [g if local.is_contiguous() else g.contiguous() for g, local in zip(grads, local_tensors(grads))]
        elif fused and not all(map(Tensor.is_contiguous, grads)):
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        lr = group_lr(group)
        if isinstance(lr, Tensor) and not (fused or capturable):
            lr = lr.item()  # the foreach kernel takes a number (a device sync if lr lives on an accelerator)
        beta1, beta2 = group["adamw_betas"]
        exp_avgs, exp_avg_sqs, steps = part.tensors
        adamw_functional(
            part.params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not fused,  # torch picks the per-tensor loop on CPU otherwise
            fused=fused,
            capturable=capturable,
            amsgrad=False,
            found_inf=None if mask is None else (~mask).to(torch.float32),
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )

    def _masked_adamw(self, group: dict[str, Any], part: AdamWPart, mask: Tensor) -> None:
        """AdamW (decoupled weight decay) where torch's fused kernel is not used (``adamw_fused=False``, a
        non-contiguous parameter, a device without it), masked by the vote without a host read.

        torch's other kernels cannot be masked: the foreach one keeps its step counters on the CPU and computes the
        bias corrections on the host, and neither takes ``found_inf``. So this is the single-tensor loop with the
        counters on the parameter's device (as torch's capturable form keeps them) and masked factors, the cheapest
        correct masking found: the first moment lerped towards ``where(mask, G, m)`` (``lerp(m, m, w) = m``), the second
        scaled by ``where(mask, beta2, 1)`` and added ``G'^2`` with ``G' = where(mask, G, 0)`` (``0 * NaN`` would
        leak), the decay by ``where(mask, 1 - lr wd, 1)``, the step ``where(mask, m / denom, 0) lr / (1 - beta1^t)``
        (selected, not multiplied by the mask: with ``adamw_eps=0`` a skipped first step's ``m / denom`` is
        ``0 / 0``): a failed vote leaves the parameter, both moments and the counter bitwise unchanged. It rounds
        as torch's unfused kernels do, to within an ulp (not bit for bit), on every step: a run's kernel does not
        change with its votes."""
        beta1, beta2 = group["adamw_betas"]
        lr, wd, eps = group_lr(group), group["weight_decay"], group["adamw_eps"]
        oks: dict[torch.device, tuple[Tensor, Tensor]] = {}
        for p, state in zip(part.params, part.states):
            param, grad = (local_tensor(p), local_tensor(p.grad)) if part.dtensor else (p, p.grad)
            step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
            if part.dtensor:
                exp_avg, exp_avg_sq = local_tensor(exp_avg), local_tensor(exp_avg_sq)
            if param.device not in oks:
                ok = mask.to(param.device)
                oks[param.device] = (ok, ok.to(torch.float32))
            ok, okf = oks[param.device]
            g = torch.where(ok, grad, 0)
            step.add_(okf)
            t = step.clamp_min(1)  # a skipped first step: finite corrections, multiplied by 0
            if wd != 0:
                param.mul_(torch.where(ok, 1.0 - lr * wd, 1.0))
            exp_avg.lerp_(torch.where(ok, grad, exp_avg), 1.0 - beta1)  # lerp(m, m, w) = m
            exp_avg_sq.mul_(torch.where(ok, beta2, 1.0)).addcmul_(g, g, value=1.0 - beta2)
            denom = (exp_avg_sq.sqrt() / (1.0 - beta2**t).sqrt()).add_(eps)
            param.sub_(torch.where(ok, exp_avg / denom, 0.0) * (lr / (1.0 - beta1**t)))
