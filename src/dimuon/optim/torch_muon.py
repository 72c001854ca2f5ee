"""``TorchMuonAdamW``: PyTorch's own ``torch.optim.Muon`` on the hidden matrices and ``torch.optim.AdamW`` on the rest.

The baseline as PyTorch ships it, behind the same parameter groups and the same ``build`` call as dimuon's
optimizers, so the harness and the benchmarks can train with it side by side. One process only: on
sharded (DTensor) parameters ``torch.optim.Muon`` computes the right update, but through DTensor's generic
operator rules, which gather and re-shard inside every Newton-Schulz product (about 3.5x the bytes of
dimuon's ``refresh="gather"`` on FSDP2, measured by ``dimuon bench comm``); the peer rows of the
benchmarks run it that way on purpose, the harness uses dimuon's sharded Muon instead.

The two inner optimizers hold the very group dicts this optimizer lists in ``param_groups``, so a
training loop or LR scheduler that sets ``group["lr"]`` drives both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dimuon.optim.core import match_saved_by_name
from dimuon.optim.validation import check_params

__all__ = ["TorchMuonAdamW"]


class TorchMuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` (groups with ``algorithm="muon"``) and ``torch.optim.AdamW`` (the other groups) in one.

    ``params`` are groups as :func:`dimuon.optim.param_groups` makes them. Defaults follow dimuon's
    Muon: no weight decay, momentum 0.95 with Nesterov, 5 quintic Newton-Schulz steps, and
    ``adjust_lr_fn="match_rms_adamw"`` so that one lr fits both groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ) -> None:
        check_params(params, type(self).__name__)
        groups = list(params)
        if not groups or not all(isinstance(g, dict) and "algorithm" in g for g in groups):
            raise ValueError(
                "TorchMuonAdamW takes parameter groups with an 'algorithm' key: pass dimuon.optim.param_groups(model) "
                "or a model to dimuon.optim.build('torch_muon', model)"
            )
        unknown = sorted({g["algorithm"] for g in groups} - {"muon", "adamw"})
        if unknown:
            raise ValueError(f"group algorithm must be 'muon' or 'adamw', got {unknown}")
        # "momentum" among the defaults: OneCycleLR and CyclicLR cycle it (torch's Muon's) as for dimuon's Muon.
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        for group in self.param_groups:
            for p in _tensors(group):
                if hasattr(p, "device_mesh"):
                    raise NotImplementedError(
                        "torch_muon runs in one process only: on sharded (DTensor) parameters torch.optim.Muon "
                        "gathers and re-shards inside every Newton-Schulz product (several times the bytes of a "
                        "sharded refresh); use 'muon' (dimuon's sharded Newton-Schulz) instead"
                    )
        self._inner_options = {
            "muon": dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn),
            "adamw": dict(betas=adamw_betas, eps=adamw_eps),
        }
        self._muon: torch.optim.Muon | None = None
        self._adamw: torch.optim.AdamW | None = None
        for group in self.param_groups:
            self._adopt(group)

    def _adopt(self, group: dict[str, Any]) -> None:
        """Hand ``group`` (the very dict) to the inner optimizer of its algorithm, so lr changes reach it."""
        kind = group["algorithm"]
        if kind == "muon":
            names = group.get("param_names") or [f"params[{i}]" for i in range(len(group["params"]))]
            for name, p in zip(names, group["params"]):
                if p.ndim != 2:
                    raise ValueError(
                        f"torch.optim.Muon takes 2-D parameters only, and {name!r} with shape {tuple(p.shape)} is in a "
                        "'muon' group: use dimuon's 'muon' (it updates conv weights as (out, rest) matrices), or a "
                        "rule that puts it in an 'adamw' group"
                    )
        inner = self._muon if kind == "muon" else self._adamw
        if inner is not None:
            inner.add_param_group(group)
            return
        cls = torch.optim.Muon if kind == "muon" else torch.optim.AdamW
        inner = cls(
            [group], lr=self.defaults["lr"], weight_decay=self.defaults["weight_decay"], **self._inner_options[kind]
        )
        if kind == "muon":
            self._muon = inner
        else:
            self._adamw = inner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group with an ``algorithm`` key ("muon" or "adamw"), stepped by that inner optimizer from now on."""
        if param_group.get("algorithm") not in ("muon", "adamw"):
            raise ValueError(f"group algorithm must be 'muon' or 'adamw', got {param_group.get('algorithm')!r}")
        super().add_param_group(param_group)
        if hasattr(self, "_inner_options"):  # after construction (the constructor adopts its groups itself)
            self._adopt(self.param_groups[-1])

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self._muon, self._adamw) if opt is not None]

    def __getstate__(self) -> dict[str, Any]:
        """torch's state plus the inner optimizers (pickled together, so they keep sharing the group dicts)."""
        return {
            **super().__getstate__(),
            "_muon": self._muon,
            "_adamw": self._adamw,
            "_inner_options": self._inner_options,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)  # torch's __setstate__ adds it; the groups take no such option

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step on the matrices and one AdamW step on the rest; the closure is evaluated once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner():
            # The inner steps without torch's step hooks: hooks (global ones too) fire once, for this optimizer.
            type(opt).step.__wrapped__(opt)
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizers' state dicts (one process: save with ``torch.save``); state_dict hooks run."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state: dict[str, Any] = {
            "muon": None if self._muon is None else self._muon.state_dict(),
            "adamw": None if self._adamw is None else self._adamw.state_dict(),
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore from :meth:`state_dict`, then share the reloaded group dicts again; load hooks run. State goes
        to parameters by name where both sides carry ``param_names``
        (:func:`dimuon.optim.core.match_saved_by_name`), else by position."""
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        for key, opt in (("muon", self._muon), ("adamw", self._adamw)):
            if (opt is None) != (state_dict.get(key) is None):
                raise ValueError(
                    f"state_dict does not match this optimizer: its {key!r} part is "
                    f"{'missing' if opt is not None else 'present'}, but this optimizer has "
                    f"{'' if opt is not None else 'no '}{key} groups"
                )
            if opt is not None:
                part = state_dict[key]
                if isinstance(part, dict) and "param_groups" in part:  # state matched by name, as dimuon's optimizers
                    part = match_saved_by_name(opt.param_groups, part)
                opt.load_state_dict(part)
        reloaded = iter(
            [*(self._muon.param_groups if self._muon else []), *(self._adamw.param_groups if self._adamw else [])]
        )
        by_algorithm: dict[str, list[dict[str, Any]]] = {"muon": [], "adamw": []}
        for group in reloaded:
            by_algorithm[group["algorithm"]].append(group)
        self.param_groups = [by_algorithm[g["algorithm"]].pop(0) for g in self.param_groups]
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _tensors(group: dict[str, Any]) -> list[torch.Tensor]:
    return [p[1] if isinstance(p, tuple) else p for p in group["params"]]
