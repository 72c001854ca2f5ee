"""Exponential moving average of model weights that also works on FSDP2-sharded (DTensor) parameters.

The EMA is a dict of tensors keyed like ``model.state_dict()`` (floating parameters and persistent
buffers). For a sharded model each entry is a DTensor with the parameter's mesh and placements, and
the update touches only the local shards, so it needs no communication.

Loading EMA weights into a model for sampling, three ways:

- ``ema.copy_to(model)``: overwrite the model's weights in place (same sharding as at construction);
- ``with ema.swapped_into(model): ...``: use the EMA weights inside the block, then restore;
- ``model.load_state_dict(ema.weights())``: the weights dict has the model's own keys, so a fresh
  unsharded model of the same config accepts it (for DTensors, gather with ``full_tensor()`` first, or
  load through ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["EMA"]


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view sharing its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    """EMA of a module's floating-point parameters: ``e <- e + (1 - decay) * (p - e)`` at every ``update``.

    Persistent buffers (e.g. norm statistics) are copied, not averaged. With ``warmup`` the decay used at update ``k``
    (0-based) is ``min(decay, (1 + k) / (10 + k))``, so an early EMA is not dominated by the random init.
    The EMA is stored in ``dtype`` (default: each parameter's own dtype).
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        *,
        warmup: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.num_updates = 0
        with torch.no_grad():
            self.params: dict[str, Tensor] = {
                name: p.detach().clone().to(dtype or p.dtype)
                for name, p in model.named_parameters()
                if p.is_floating_point()
            }
            self.buffers: dict[str, Tensor] = {name: b.detach().clone() for name, b in _persistent_buffers(model)}

    def current_decay(self) -> float:
        """Decay that the next ``update`` will use."""
        if not self.warmup:
            return self.decay
        k = self.num_updates
        return min(self.decay, (1 + k) / (10 + k))

    @torch.no_grad()
    def update(self, model: nn.Module, mask: Tensor | None = None) -> None:
        """Move the EMA toward the model's current weights (call after each optimizer step).

        ``mask`` (a 0-d bool on the device, e.g. the optimizer's non-finite vote): where it is false the EMA and its
        buffers stay bitwise as they were, without a host read (each weight is taken as ``where(mask, p, e)``: one
        pass per parameter); ``num_updates``, a host number, counts the update either way."""
        weight = 1.0 - self.current_decay()
        named = dict(model.named_parameters())
        ema_same, model_same, ema_cast, model_cast = [], [], [], []
        for name, e in self.params.items():
            e_loc, p_loc = _local(e), _local(named[name].detach())
            if mask is not None:
                p_loc = torch.where(mask, p_loc.to(e_loc.dtype), e_loc)  # lerp(e, e, w) = e
            if e_loc.dtype == p_loc.dtype:
                ema_same.append(e_loc)
                model_same.append(p_loc)
            else:
                ema_cast.append(e_loc)
                model_cast.append(p_loc)
        if ema_same:
            torch._foreach_lerp_(ema_same, model_same, weight)
        for e_loc, p_loc in zip(ema_cast, model_cast, strict=True):
            e_loc.lerp_(p_loc.to(e_loc.dtype), weight)
        buffers = dict(_persistent_buffers(model))
        for name, b in self.buffers.items():
            new = _local(buffers[name])
            _local(b).copy_(new if mask is None else torch.where(mask, new, _local(b)))
        self.num_updates += 1

    def weights(self) -> dict[str, Tensor]:
        """EMA weights keyed like the model's ``state_dict`` (floating parameters and persistent buffers)."""
        return {**self.params, **self.buffers}

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's parameters and persistent buffers with the EMA (local shards only)."""
        targets = dict(model.named_parameters())
        targets.update(_persistent_buffers(model))
        for name, e in self.weights().items():
            _local(targets[name]).copy_(_local(e))

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Use the EMA weights in ``model`` inside the block; the training weights come back afterwards."""
        with torch.no_grad():
            backup = {name: _local(t).clone() for name, t in _tracked_state(model)}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, t in _tracked_state(model):
                    _local(t).copy_(backup[name])

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: decay settings, update count and the weights (DTensors stay sharded)."""
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "num_updates": self.num_updates,
            "weights": self.weights(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output; the weights are copied into the existing tensors."""
        weights = state["weights"]
        expected = set(self.params) | set(self.buffers)
        if set(weights) != expected:
            missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
            raise KeyError(f"EMA state does not match the model: missing {missing}, unexpected {extra}")
        for name, e in self.weights().items():
            source = weights[name]
            if hasattr(e, "placements") and hasattr(source, "placements") and source.placements != e.placements:
                source = source.redistribute(e.device_mesh, e.placements)  # e.g. saved gathered along tp
            _local(e).copy_(_local(source))
        self.decay = float(state["decay"])
        self.warmup = bool(state["warmup"])
        self.num_updates = int(state["num_updates"])


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Named buffers that appear in ``state_dict`` (non-persistent ones are derived, not learned)."""
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def _tracked_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The tensors an EMA tracks: floating parameters and all persistent buffers."""
    for name, p in model.named_parameters():
        if p.is_floating_point():
            yield name, p
    yield from _persistent_buffers(model)
