"""dimuon's optimizers as torchtitan's optimizers: :class:`DimuonOptimizersContainer` (torchtitan 0.3.0).

torchtitan builds the optimizers of a run from ``Trainer.Config.optimizer``, an ``OptimizersContainer.Config``,
with ``config.optimizer.build(model_parts=...)`` once the model is parallelized; it steps them with its LR
schedulers and checkpoints them with DCP through the container's flat, FQN-keyed ``state_dict`` and
``load_state_dict``. Its extension point is a container subclass with its own ``Config`` (as torchtitan's
TorchFT container is), named in a ``config_registry`` function::

    from dimuon.integrations.torchtitan import default_dimuon
    from torchtitan.models.flux.config_registry import flux_dev

    def flux_dev_prm():
        config = flux_dev()
        config.optimizer = default_dimuon("PeriodicRowMuon", lr=1e-4, k=3, weight_decay=0.1)
        config.parallelism.spmd_backend = "partial_dtensor"  # FSDP2 over DTensors, as torch 2.13 shards
        return config

    # torchrun --nproc-per-node 8 -m torchtitan.train --module my_configs --config flux_dev_prm

The parameters are grouped one of two ways:

- ``grouping="dimuon"`` (default), by role (:func:`torchtitan_param_groups`): the hidden matrices of
  torchtitan's Flux get ``dimuon_optimizer``'s Muon-family update; its input layers (``img_in``, ``txt_in``,
  ``time_in.in_layer``, ``vector_in.in_layer``), the output projection, biases and norm gains get that
  optimizer's AdamW group; Flux's fused matrices are orthogonalized chunk by chunk. One dimuon optimizer per
  model part.
- ``grouping="patterns"``, by torchtitan's own ``param_groups`` (``ParamGroupConfig``: a regex on the
  parameter names, first match wins, an ``optimizer_name`` and its ``optimizer_kwargs``), in which
  ``optimizer_name`` may also be ``"Muon"``, ``"PeriodicRowMuon"``, ``"MuonBP"`` or ``"AdaptiveRowMuon"``.
  torchtitan builds one optimizer per name; ``"AdamW"`` is torch's.

The container's ``implementation`` puts ``fused`` and ``foreach`` keys in every group; for a dimuon optimizer
they choose its AdamW groups' kernel: ``"fused"`` (torchtitan's default) leaves ``adamw_fused=None`` (fused
wherever torch has the kernel for the parameters), any group with ``fused`` false sets ``adamw_fused=False``
(foreach). Options of a whole dimuon optimizer (``nonfinite``, ``refresh``, ``bucket_mb``, ...) go in
``dimuon_kwargs`` or, keyed by the optimizer's name, in torchtitan's ``optimizer_factory_kwargs_by_name``.

Layering: an integration. It imports ``dimuon.optim`` and torchtitan (this module only: importing it without
torchtitan raises an ImportError naming the extra), nothing else of dimuon.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from dimuon.optim import AdaptiveRowMuon, Muon, MuonBP, MuonFamily, PeriodicRowMuon, param_groups
from dimuon.optim.build import option_parameters

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as error:  # pragma: no cover - exercised where torchtitan is absent
    raise ImportError(
        "dimuon.integrations.torchtitan needs torchtitan 0.3.0: pip install 'dimuon[torchtitan]'"
    ) from error

__all__ = [
    "DIMUON_OPTIMIZERS",
    "FLUX_FUSED_SPLITS",
    "FLUX_INPUT_RULES",
    "DimuonOptimizersContainer",
    "build_dimuon_optimizer",
    "default_dimuon",
    "flux_split_sizes",
    "torchtitan_param_groups",
]

DimuonName = Literal["Muon", "PeriodicRowMuon", "MuonBP", "AdaptiveRowMuon"]
# The names a torchtitan config gives dimuon's optimizers (torchtitan names its own by class: "AdamW").
DIMUON_OPTIMIZERS: dict[str, type[MuonFamily]] = {
    "Muon": Muon,
    "PeriodicRowMuon": PeriodicRowMuon,
    "MuonBP": MuonBP,
    "AdaptiveRowMuon": AdaptiveRowMuon,
}
assert set(DIMUON_OPTIMIZERS) == set(get_args(DimuonName))
Grouping = Literal["dimuon", "patterns"]

# torchtitan's Flux: the layers that read the network's inputs, and its output projection, take AdamW (rules of
# dimuon.optim.param_groups; the timestep and vector MLPs' second linears are hidden matrices).
FLUX_INPUT_RULES: dict[str, str] = {
    "img_in.*": "adamw",  # patchified latents -> width
    "txt_in.*": "adamw",  # T5 features -> width
    "time_in.in_layer.*": "adamw",  # reads sinusoidal timestep features
    "vector_in.in_layer.*": "adamw",  # reads CLIP's pooled vector
    "final_layer.linear.*": "adamw",  # width -> latent patches (dimuon's default too)
}
# Flux's fused matrices, by the chunks their forward splits them into (glob patterns; ``*`` also spans the
# activation-checkpoint wrapper's name part). Each single block's linear1 is added by flux_split_sizes.
FLUX_FUSED_SPLITS: dict[str, int] = {
    "double_blocks.*_mod.lin.weight": 6,  # img_mod, txt_mod: shift, scale, gate of attention and of the MLP
    "double_blocks.*_attn.qkv.weight": 3,
    "single_blocks.*.modulation.lin.weight": 3,  # shift, scale, gate
    "final_layer.adaLN_modulation.1.weight": 2,  # shift, scale
}
_SINGLE_LINEAR1 = "single_blocks.*.linear1.weight"  # rows: q, k, v (hidden each), then the MLP's input
# torch AdamW's group keys and what dimuon's AdamW groups call them (a dimuon optimizer would ignore them).
_TORCH_ADAMW_KEYS = {"betas": "adamw_betas", "eps": "adamw_eps"}


def flux_split_sizes(model: nn.Module) -> dict[str, int | tuple[int, ...]]:
    """:data:`FLUX_FUSED_SPLITS` plus each single block's ``linear1`` split into q, k, v and the MLP's input
    rows, ``(h, h, h, rows - 3h)`` for its ``(rows, h)`` weight (global shape; sharded parameters alike)."""
    splits: dict[str, int | tuple[int, ...]] = dict(FLUX_FUSED_SPLITS)
    for name, p in model.named_parameters():
        if p.ndim == 2 and fnmatch.fnmatchcase(name, _SINGLE_LINEAR1) and p.shape[0] > 3 * p.shape[1]:
            rows, h = p.shape
            splits[name] = (h, h, h, rows - 3 * h)
    return splits


def torchtitan_param_groups(
    model: nn.Module,
    rules: Mapping[str, str | Mapping[str, Any]] | None = None,
    *,
    flux_roles: bool = True,
    split_fused: bool = True,
    adamw_kwargs: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """dimuon's parameter groups of one torchtitan model part, with torchtitan's canonical parameter names.

    The groups of :func:`dimuon.optim.param_groups` under ``rules``, with ``flux_roles`` the roles of
    :data:`FLUX_INPUT_RULES` (the algorithm of those layers where a rule sets none); with ``split_fused``, Flux's
    fused matrices split by :func:`flux_split_sizes`.
    ``adamw_kwargs`` are options of the AdamW groups (``{"lr": 3e-4, "weight_decay": 0.1}``) where a rule does
    not set them. Each group lists its ``params`` and their ``param_names``, the FQNs torchtitan keys the
    optimizer's checkpoint by (the activation-checkpoint wrapper's name part removed).
    """
    groups = param_groups(
        model,
        rules=dict(rules or {}),
        split_sizes=flux_split_sizes(model) if split_fused else None,
        roles=FLUX_INPUT_RULES if flux_roles else None,  # a rule setting only options keeps the role's AdamW
    )
    result = []
    for group in groups:
        named = group.pop("params")
        out = {"params": [p for _, p in named], "param_names": [canonical_fqn(n) for n, _ in named], **group}
        if out["algorithm"] == "adamw":
            for key, value in (adamw_kwargs or {}).items():
                out.setdefault(key, value)
        result.append(out)
    return result


def build_dimuon_optimizer(
    cls: type[MuonFamily], defaults: Mapping[str, Any], groups: Sequence[dict[str, Any]], **options: Any
) -> MuonFamily:
    """A dimuon optimizer over torchtitan-made parameter groups (the factory the container resolves a dimuon
    name to): ``fused``/``foreach`` become ``adamw_fused``; ``options`` (torchtitan's
    ``optimizer_factory_kwargs_by_name``) win over ``defaults`` (the config's ``dimuon_kwargs``)."""
    own, fused = [], set()
    for i, group in enumerate(groups):
        group = dict(group)
        fused.add(group.pop("fused", None))
        group.pop("foreach", None)
        _refuse_torch_adamw_keys(group, f"{cls.__name__} parameter group {i}")
        own.append(group)
    options = {**defaults, **options}
    if False in fused:
        options.setdefault("adamw_fused", False)
    return cls(own, **options)


def _refuse_torch_adamw_keys(options: Mapping[str, Any], where: str) -> None:
    named = {key: ours for key, ours in _TORCH_ADAMW_KEYS.items() if key in options}
    if named:
        raise ValueError(
            f"{where}: "
            + ", ".join(
                f"{key!r} is torch AdamW's name, dimuon's AdamW groups take {ours!r}" for key, ours in named.items()
            )
        )


def _accepted_options(cls: type) -> set[str]:
    return set(option_parameters(cls)) - {"engine"}


class DimuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with dimuon's optimizers: by dimuon's grouping, or by torchtitan's
    ``param_groups`` patterns naming them (see the module's docstring). Stepping, ``zero_grad``, LR schedulers,
    hooks and the flat, FQN-keyed checkpoints are torchtitan's own; dimuon's state exists from construction, so
    torchtitan's ``init_optim_state`` never has to take a step for it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        grouping: Grouping = "dimuon"
        """``"dimuon"``: dimuon's roles group every model part (``param_groups`` stays empty); ``"patterns"``:
        torchtitan's ``param_groups``, whose ``optimizer_name`` may also name a dimuon optimizer."""

        dimuon_optimizer: DimuonName = "PeriodicRowMuon"
        """The dimuon optimizer of ``grouping="dimuon"``."""

        dimuon_kwargs: dict[str, Any] = field(default_factory=dict)
        """Its constructor's options (``lr``, ``weight_decay``, ``k``, ``nonfinite``, ...; dimuon's defaults
        otherwise); ``grouping="dimuon"`` only."""

        adamw_kwargs: dict[str, Any] = field(default_factory=dict)
        """Options of its AdamW groups only (``{"lr": 3e-4, "weight_decay": 0.1}``; the betas and eps are
        ``adamw_betas``/``adamw_eps`` of ``dimuon_kwargs``); ``grouping="dimuon"`` only."""

        rules: dict[str, Any] = field(default_factory=dict)
        """Rules of ``dimuon.optim.param_groups`` (glob pattern -> ``"muon"``, ``"adamw"`` or group options),
        before the Flux roles; ``grouping="dimuon"`` only."""

        flux_roles: bool = True
        """Give torchtitan's Flux input layers and output projection to the AdamW group."""

        split_fused: bool = True
        """Orthogonalize Flux's fused matrices (qkv, modulations, single blocks' linear1) chunk by chunk."""

        def __post_init__(self) -> None:
            if self.grouping not in get_args(Grouping):
                raise ValueError(f"grouping must be one of {get_args(Grouping)}, got {self.grouping!r}")
            if self.dimuon_optimizer not in DIMUON_OPTIMIZERS:
                raise ValueError(
                    f"dimuon_optimizer must be one of {tuple(DIMUON_OPTIMIZERS)}, got {self.dimuon_optimizer!r}"
                )
            if self.grouping == "patterns":
                if not self.param_groups:
                    raise ValueError(
                        "grouping='patterns' groups by param_groups (torchtitan's ParamGroupConfig "
                        "list), which is empty"
                    )
                given = [name for name in ("dimuon_kwargs", "adamw_kwargs", "rules") if getattr(self, name)]
                if given:
                    raise ValueError(
                        f"{', '.join(given)}: options of grouping='dimuon'; with "
                        "grouping='patterns' each ParamGroupConfig carries its optimizer_kwargs"
                    )
                return
            if self.param_groups:
                raise ValueError(
                    "param_groups is torchtitan's pattern grouping: set grouping='patterns' to use "
                    "it, or leave it empty for dimuon's grouping"
                )
            cls = DIMUON_OPTIMIZERS[self.dimuon_optimizer]
            unknown = set(self.dimuon_kwargs) - _accepted_options(cls)
            if unknown:
                raise ValueError(
                    f"dimuon_kwargs: {cls.__name__} has no option(s) {sorted(unknown)}; its options: "
                    f"{sorted(_accepted_options(cls))}"
                )
            _refuse_torch_adamw_keys(self.adamw_kwargs, "adamw_kwargs")

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self._dimuon_config = config  # read by the two hooks below while torchtitan's __init__ builds
        super().__init__(config, model_parts=model_parts)

    def _build_param_groups(
        self, model: nn.Module, param_group_configs: list[Any], impl_kwargs: dict[str, Any]
    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]:
        """torchtitan's pattern groups, or dimuon's groups of ``model`` for one optimizer (with the labels
        torchtitan logs them by)."""
        config = self._dimuon_config
        if config.grouping == "patterns":
            return OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        groups = torchtitan_param_groups(
            model,
            config.rules,
            flux_roles=config.flux_roles,
            split_fused=config.split_fused,
            adamw_kwargs=config.adamw_kwargs,
        )
        groups = [{**group, **impl_kwargs} for group in groups]  # as torchtitan's own groups carry them
        labels = [
            f"dimuon roles: {g['algorithm']}" + (f", split {g['split_sizes']}" if "split_sizes" in g else "")
            for g in groups
        ]
        return {config.dimuon_optimizer: groups}, {config.dimuon_optimizer: labels}

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:
        if name not in DIMUON_OPTIMIZERS:
            try:
                return OptimizersContainer._resolve_optimizer_factory(name)
            except NotImplementedError as error:
                raise NotImplementedError(f"{error} (dimuon adds {', '.join(DIMUON_OPTIMIZERS)})") from error
        config = self._dimuon_config
        defaults = config.dimuon_kwargs if config.grouping == "dimuon" else {}
        return functools.partial(build_dimuon_optimizer, DIMUON_OPTIMIZERS[name], defaults)


def default_dimuon(
    optimizer: DimuonName = "PeriodicRowMuon", adamw_kwargs: Mapping[str, Any] | None = None, **dimuon_kwargs: Any
) -> DimuonOptimizersContainer.Config:
    """The container's config for dimuon's grouping of torchtitan's Flux (as torchtitan's ``default_adamw``
    is AdamW's): ``default_dimuon("PeriodicRowMuon", lr=1e-4, k=3, weight_decay=0.1)``."""
    return DimuonOptimizersContainer.Config(
        dimuon_optimizer=optimizer, dimuon_kwargs=dict(dimuon_kwargs), adamw_kwargs=dict(adamw_kwargs or {})
    )
