"""The AdamW group: torch's AdamW for the parameters of ``"algorithm": "adamw"`` groups (biases, norms,
embeddings), fused where torch has the kernel, masked by the non-finite vote under ``nonfinite="skip"``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as adamw_functional
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from dimuon.optim.common import group_lr, local_tensor
from dimuon.optim.distributed.layout import is_dtensor


class AdamWGroup:
    """The AdamW groups' share of the optimizer: one torch AdamW call per group and device mesh."""

    adamw_fused: bool | None
    state: Any

    @staticmethod
    def _fused_supported(params: Sequence[Tensor]) -> bool:
        """Whether torch has a fused AdamW kernel for every one of ``params`` (device type and dtype), and they are
        contiguous: torch 2.13's fused kernel returns wrong updates for a non-contiguous parameter (and for a
        gradient or moments laid out unlike the parameter, which :meth:`_adamw_kernel` makes contiguous)."""
        devices = _get_fused_kernels_supported_devices()
        return all(
            local_tensor(p).device.type in devices and p.is_floating_point() and local_tensor(p).is_contiguous()
            for p in params
        )

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor], mask: Tensor | None) -> None:
        """torch's AdamW over the group, one kernel call per device mesh: a list kernel takes plain tensors or
        DTensors of one mesh, and tensor parallelism mixes them (layers in the plan, others outside it)."""
        by_mesh: dict[int, list[Tensor]] = {}
        for p in params:
            by_mesh.setdefault(id(p.device_mesh) if is_dtensor(p) else 0, []).append(p)
        for part in by_mesh.values():
            self._adamw_kernel(group, part, mask)

    def _adamw_kernel(self, group: dict[str, Any], params: list[Tensor], mask: Tensor | None) -> None:
        """torch's AdamW on ``params``; under a ``mask`` (the vote) torch's fused kernel is told ``found_inf`` where
        the vote failed (it then leaves parameters and moments untouched and torch takes the step counters back),
        and elsewhere :meth:`_masked_adamw` runs."""
        fused = self.adamw_fused if self.adamw_fused is not None else self._fused_supported(params)
        fused = fused and not torch.compiler.is_compiling()  # torch's fused kernel is not traced: a graph fuses itself
        if mask is not None and not fused:
            self._masked_adamw(group, params, mask)
            return
        # Under torch.compile the unfused kernel needs its capturable form (tensor step sizes).
        capturable = not fused and torch.compiler.is_compiling()
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            state = self._param_state(p, group)
            # Where torch keeps the counter: on the parameter's device for the fused and capturable
            # kernels, on the CPU otherwise (a checkpoint may bring it from either).
            device = local_tensor(p).device if fused or capturable else torch.device("cpu")
            if state["step"].device != device:
                state["step"] = state["step"].to(device)
            grad = p.grad
            if fused:
                # torch's fused kernel pairs elements by memory offset: parameter, gradient and moments must share
                # one layout (contiguous parameters only take this path). A gradient autograd.grad made strided is
                # copied for the step; moments a checkpoint brought in another layout are made contiguous once.
                if not local_tensor(grad).is_contiguous():
                    grad = grad.contiguous()
                for key in ("exp_avg", "exp_avg_sq"):
                    if not local_tensor(state[key]).is_contiguous():
                        state[key] = state[key].contiguous()
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        lr = group_lr(group)
        if isinstance(lr, Tensor) and not (fused or capturable):
            lr = lr.item()  # the foreach kernel takes a number (a device sync if lr lives on an accelerator)
        beta1, beta2 = group["adamw_betas"]
        adamw_functional(
            params,
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

    def _masked_adamw(self, group: dict[str, Any], params: list[Tensor], mask: Tensor) -> None:
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
        for p in params:
            state = self._param_state(p, group)
            param, grad = local_tensor(p), local_tensor(p.grad)
            if state["step"].device != param.device:
                state["step"] = state["step"].to(param.device)
            step, exp_avg, exp_avg_sq = state["step"], local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
            ok = mask.to(param.device)
            okf = ok.to(torch.float32)
            g = torch.where(ok, grad, 0)
            step.add_(okf)
            t = step.clamp_min(1)  # a skipped first step: finite corrections, multiplied by 0
            if wd != 0:
                param.mul_(torch.where(ok, 1.0 - lr * wd, 1.0))
            exp_avg.lerp_(torch.where(ok, grad, exp_avg), 1.0 - beta1)  # lerp(m, m, w) = m
            exp_avg_sq.mul_(torch.where(ok, beta2, 1.0)).addcmul_(g, g, value=1.0 - beta2)
            denom = (exp_avg_sq.sqrt() / (1.0 - beta2**t).sqrt()).add_(eps)
            param.sub_(torch.where(ok, exp_avg / denom, 0.0) * (lr / (1.0 - beta1**t)))
