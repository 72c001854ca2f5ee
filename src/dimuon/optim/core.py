"""One optimizer core for Muon, Periodic Row-wise Muon and MuonBP.

The core owns everything the three share (ALGORITHMS.md sections 1, 4, 5): EMA momentum with
optional Nesterov, decoupled weight decay, the shape-dependent lr scale, the auxiliary AdamW for
``"algorithm": "adamw"`` groups, the per-group step counter and ``state_dict``. What differs is
the :class:`~dimuon.optim.schedules.Schedule` (which direction map at step ``t``), and where the
maps run is the engine's business (single process or sharded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as adamw_functional

from dimuon.optim import linalg
from dimuon.optim.distributed.engine import (
    REFRESH_STRATEGIES,
    DirectionEngine,
    LocalEngine,
    MapConfig,
    MatrixJob,
    split_sizes_to_ranges,
)
from dimuon.optim.schedules import Schedule, StepKind

ALGORITHMS = ("muon", "adamw")
NONFINITE_POLICIES = ("raise", "skip")

# Keys a parameter group may carry besides "params" (torch adds "param_names"; LR schedulers add
# "initial_lr"). Anything else is a typo that would otherwise be silently ignored.
_EXTRA_GROUP_KEYS = {"params", "param_names", "initial_lr", "name", "step"}


def _is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def local_tensor(t: Tensor) -> Tensor:
    """The process-local data of a (possibly DTensor) tensor."""
    return t.to_local() if _is_dtensor(t) else t


def _check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False, integer: bool = False) -> None:
    """Raise a ValueError/TypeError naming ``name`` unless ``value`` lies in the stated range."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an int" if integer else "a number"
        raise TypeError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        interval = f"{lo or '(-inf'}, {hi or 'inf)'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


class MuonFamily(torch.optim.Optimizer):
    """Muon-family optimizer: one core, a schedule picks the direction map per step.

    Groups with ``"algorithm": "muon"`` (the default) get the matrix update; groups with
    ``"algorithm": "adamw"`` get AdamW with ``adamw_betas``/``adamw_eps``. Use the subclasses
    :class:`~dimuon.optim.Muon`, :class:`~dimuon.optim.PeriodicRowMuon` and
    :class:`~dimuon.optim.MuonBP`.
    """

    schedule: Schedule = Schedule()

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        lr_scale: str = "match_rms_adamw",
        ns_coefficients: str = "quintic",
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        ns_algorithm: str = "standard",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        nonfinite: str = "raise",
        refresh: str = "gather",
        bucket_mb: float = 16.0,
        comm_dtype: torch.dtype | None = None,
        process_group: Any = None,
        engine: DirectionEngine | None = None,
        **schedule_options: Any,
    ) -> None:
        defaults: dict[str, Any] = dict(
            algorithm="muon",
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            lr_scale=lr_scale,
            ns_coefficients=ns_coefficients,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            ns_algorithm=ns_algorithm,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            split_sizes=None,
            **self._schedule_defaults(),
        )
        unknown = set(schedule_options) - set(self._schedule_defaults())
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected argument(s) {sorted(unknown)}; "
                f"its schedule options are {sorted(self._schedule_defaults())}"
            )
        defaults.update(schedule_options)
        self._validate_options(defaults, where="")
        _check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        _check_choice("refresh", refresh, REFRESH_STRATEGIES)
        _check_number("bucket_mb", bucket_mb, low=0.0, low_open=True)
        if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
            raise TypeError(f"comm_dtype must be None or a floating torch.dtype, got {comm_dtype!r}")
        self.nonfinite = nonfinite
        self.engine_options = {"refresh": refresh, "bucket_mb": bucket_mb, "comm_dtype": comm_dtype,
                               "process_group": process_group}
        self._engine: DirectionEngine | None = engine
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- configuration
    @classmethod
    def _schedule_defaults(cls) -> dict[str, Any]:
        """Schedule hyperparameters this optimizer accepts, with their defaults."""
        return {}

    def _validate_options(self, g: dict[str, Any], where: str) -> None:
        """One clear error per bad hyperparameter, naming it (``where`` names the group)."""
        _check_choice(f"algorithm{where}", g["algorithm"], ALGORITHMS)
        _check_number(f"lr{where}", g["lr"], low=0.0)
        _check_number(f"weight_decay{where}", g["weight_decay"], low=0.0)
        _check_number(f"momentum{where}", g["momentum"], low=0.0, high=1.0, high_open=True)
        if not isinstance(g["nesterov"], bool):
            raise TypeError(f"nesterov{where} must be a bool, got {g['nesterov']!r}")
        _check_choice(f"lr_scale{where}", g["lr_scale"], linalg.LR_SCALES)
        _check_choice(f"ns_coefficients{where}", g["ns_coefficients"], linalg.COEFFICIENT_SETS)
        _check_choice(f"ns_algorithm{where}", g["ns_algorithm"], linalg.NS_ALGORITHMS)
        _check_number(f"ns_steps{where}", g["ns_steps"], low=1, high=100, integer=True)
        if g["ns_dtype"] is not None and not (
            isinstance(g["ns_dtype"], torch.dtype) and g["ns_dtype"].is_floating_point
        ):
            raise TypeError(f"ns_dtype{where} must be None or a floating torch.dtype, got {g['ns_dtype']!r}")
        betas = g["adamw_betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"adamw_betas{where} must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            _check_number(f"adamw_betas[{i}]{where}", b, low=0.0, high=1.0, high_open=True)
        _check_number(f"adamw_eps{where}", g["adamw_eps"], low=0.0)
        for key in self._schedule_defaults():
            self._validate_schedule_option(key, g[key], where)

    def _validate_schedule_option(self, key: str, value: Any, where: str) -> None:
        """Subclasses check their schedule options here."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        unknown = set(param_group) - set(self.defaults) - _EXTRA_GROUP_KEYS
        if unknown:
            raise ValueError(
                f"unknown parameter-group option(s) {sorted(unknown)}; allowed: "
                f"{sorted(set(self.defaults) | {'params', 'param_names'})}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f" (parameter group {len(self.param_groups) - 1})"
        self._validate_options(group, where)
        group.setdefault("step", 0)
        names = group.get("param_names")
        if group["algorithm"] == "muon":
            for i, p in enumerate(group["params"]):
                pname = names[i] if names else f"params[{i}] of group {len(self.param_groups) - 1}"
                if p.ndim < 2:
                    raise ValueError(
                        f"parameter {pname!r} with shape {tuple(p.shape)} is in a 'muon' group, but Muon "
                        "updates matrices (ndim >= 2; conv weights are flattened to (out, in*k*k)); "
                        "put it in an 'adamw' group (dimuon.optim.param_groups does this)"
                    )
                split_sizes_to_ranges(p.shape[0], group["split_sizes"], pname)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        engine_defaults = {"refresh": "gather", "bucket_mb": 16.0, "comm_dtype": None, "process_group": None}
        for key, value in (("nonfinite", "raise"), ("_engine", None), ("engine_options", engine_defaults)):
            if not hasattr(self, key):
                setattr(self, key, value)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            group.setdefault("step", 0)

    # ----------------------------------------------------------------- execution
    def _get_engine(self, params: Sequence[Tensor]) -> DirectionEngine:
        """Local engine for plain tensors; sharded engine for DTensors or when a process group is given."""
        if self._engine is None:
            if self.engine_options["process_group"] is not None or any(_is_dtensor(p) for p in params):
                from dimuon.optim.distributed.sharded import ShardedEngine

                self._engine = ShardedEngine(**self.engine_options)
            else:
                self._engine = LocalEngine()
        return self._engine

    def _grads_are_finite(self) -> bool:
        """One fused reduction over every gradient; sharded gradients agree across ranks."""
        grads = [local_tensor(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return True
        # One pass per gradient: the extremes are finite exactly when every entry is (NaN propagates).
        extremes = [torch.stack(torch.aminmax(g)) for g in grads if g.numel() > 0]
        flag = torch.isfinite(torch.cat(extremes).float()).all() if extremes else torch.tensor(True)
        return self._get_engine([]).all_true(flag)

    def _first_nonfinite(self) -> str:
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all()):
                    return names[i] if names else f"params[{i}] of group {gi} with shape {tuple(p.shape)}"
        return "a parameter on another rank"

    def _check_sparse(self) -> None:
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    pname = names[i] if names else f"params[{i}] of group {gi}"
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients (parameter {pname!r})")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step; returns the closure's loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_sparse()
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._get_engine(all_params)
        if not self._grads_are_finite():
            if self.nonfinite == "skip":
                self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
                return loss
            raise FloatingPointError(
                f"non-finite gradient in {self._first_nonfinite()}; the step was not taken and the "
                "momentum is unchanged (pass nonfinite='skip' to skip such steps instead)"
            )
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["algorithm"] == "adamw":
                self._adamw_step(group, params)
            else:
                self._muon_step(group, params)
            group["step"] += 1
        return loss

    def _muon_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        kind = self.schedule.kind(group["step"], group)
        names = group.get("param_names")
        index = {id(p): i for i, p in enumerate(group["params"])}
        grads, bufs, jobs = [], [], []
        for p in params:
            state = self.state[p]
            g = local_tensor(p.grad)
            if "momentum_buffer" not in state:
                # fp32 or the parameter dtype if wider; never aliases the gradient. Shaped (and for
                # DTensor parameters, sharded) like the parameter, so checkpoints can reshard it.
                dtype = torch.promote_types(p.dtype, torch.float32)
                state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            buf = local_tensor(state["momentum_buffer"])
            grads.append(g.to(buf.dtype))
            bufs.append(buf)
        # M <- beta*M + (1-beta)*G  (EMA form)
        torch._foreach_lerp_(bufs, grads, 1.0 - beta)
        updates = self._nesterov_updates(params, grads, bufs, beta, group["nesterov"])
        for p, u in zip(params, updates):
            rows = p.shape[0]
            cols = math.prod(p.shape[1:])
            i = index[id(p)]
            name = names[i] if names else f"params[{i}]"
            jobs.append(
                MatrixJob(
                    name=name,
                    update=u,
                    rows=rows,
                    cols=cols,
                    splits=split_sizes_to_ranges(rows, group["split_sizes"], name),
                    blocks=int(group.get("blocks", 1)),
                    meta={"param": p},
                )
            )
        config = MapConfig(
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            ns_algorithm=group["ns_algorithm"],
            ns_dtype=group["ns_dtype"],
            lr_scale=group["lr_scale"],
        )
        directions = self._get_engine(params).directions(jobs, kind, config)
        step_size = lr * self.schedule.multiplier(kind, group)
        for p, d in zip(params, directions):
            w = local_tensor(p)
            if wd != 0:
                w.mul_(1.0 - lr * wd)  # decoupled, with the unscaled lr
            w.add_(d.reshape(w.shape).to(w.dtype), alpha=-step_size)

    @staticmethod
    def _nesterov_updates(
        params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], beta: float, nesterov: bool
    ) -> list[Tensor]:
        """``U`` per parameter as a 2-D ``(local_rows, cols)`` matrix (read-only downstream).

        With Nesterov, ``U = (1-beta) G + beta M`` is written straight into one ``(B, r, c)``
        buffer per shape, the batch the engine would otherwise have to stack (a copy saved).
        """
        flat = [b.reshape(b.shape[0], math.prod(p.shape[1:])) for p, b in zip(params, bufs)]
        if not nesterov:
            return flat  # U = M
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, b in enumerate(flat):
            by_shape.setdefault(tuple(b.shape), []).append(i)
        out: list[Tensor] = [flat[0]] * len(flat)
        for shape, idx in by_shape.items():
            batch = torch.empty((len(idx), *shape), dtype=flat[idx[0]].dtype, device=flat[idx[0]].device)
            for j, i in enumerate(idx):
                torch.lerp(grads[i].reshape(shape), flat[i], beta, out=batch[j])
                out[i] = batch[j]
        return out

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["adamw_betas"]
        adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=True,  # torch picks the per-tensor loop on CPU otherwise
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )

    # ----------------------------------------------------------------- introspection
    def step_kinds(self) -> list[StepKind | None]:
        """The kind the *next* step takes in each group (``None`` for AdamW groups)."""
        return [
            self.schedule.kind(g["step"], g) if g["algorithm"] == "muon" else None for g in self.param_groups
        ]

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Logical bytes and calls per collective kind since the last reset (empty in one process)."""
        return self._engine.comm_stats() if self._engine is not None else {}

    def reset_comm_stats(self) -> None:
        if self._engine is not None:
            self._engine.reset_comm_stats()
