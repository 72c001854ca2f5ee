"""Role-based parameter grouping: hidden matrices to Muon, everything else to AdamW.

docs/algorithms.md, "Which parameters get Muon": Muon updates the hidden 2-D weights (attention qkv and out-proj, MLP,
adaLN modulation, the timestep MLP's second linear); AdamW takes the patch/label embeddings, the
final output projection, biases, norm gains and any other 1-D/0-D tensor. The decision is made
by module role (module type plus name rules), not by ``ndim == 2`` alone, and user rules win.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dimuon.optim.core import ALGORITHMS

Rule = tuple[str, "str | Mapping[str, Any]"]

# Names (glob patterns) of weights that are inputs or outputs of the network, not hidden layers.
# Covers dimuon's DiT, facebookresearch-style DiTs and diffusers' DiTTransformer2DModel.
INPUT_OUTPUT_PATTERNS: tuple[str, ...] = (
    "x_embedder.*",  # patch embedding (DiT)
    "pos_embed.*",  # patch embedding (diffusers)
    "patch_embed.*",
    "y_embedder.*",  # label embedding table
    "*class_embedder.*",
    "t_embedder.mlp.0.*",  # first timestep-MLP linear reads sinusoidal features
    "*timestep_embedder.linear_1.*",
    "final_layer.linear.*",  # output projection to pixels/latents
    "proj_out*",  # diffusers' final modulation and output projections
    "lm_head.*",
)

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

# Fused matrices of dimuon's DiT that can be orthogonalized chunk by chunk.
DIT_FUSED_SPLITS: dict[str, int] = {
    "*attn.qkv.weight": 3,
    "blocks.*.adaLN_modulation.1.weight": 6,
    "final_layer.adaLN_modulation.1.weight": 2,
}


def default_algorithm(name: str, param: nn.Parameter, module: nn.Module) -> str:
    """The default algorithm of one parameter, decided by its role in the model."""
    if param.ndim < 2:
        return "adamw"  # biases, norm gains, scalars
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag, *_NORM_TYPES)):
        return "adamw"
    if any(fnmatch.fnmatchcase(name, pat) for pat in INPUT_OUTPUT_PATTERNS):
        return "adamw"
    return "muon"


def _normalize_rule(pattern: str, value: str | Mapping[str, Any]) -> dict[str, Any]:
    options = {"algorithm": value} if isinstance(value, str) else dict(value)
    algo = options.get("algorithm")
    if algo is not None and algo not in ALGORITHMS:
        raise ValueError(f"rule {pattern!r}: algorithm must be one of {ALGORITHMS}, got {algo!r}")
    return options


def _match_split(name: str, split_sizes: Mapping[str, int | Sequence[int]] | None) -> Any:
    for pattern, sizes in (split_sizes or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return tuple(sizes) if not isinstance(sizes, int) else sizes
    return None


def param_groups(
    model: nn.Module,
    rules: Sequence[Rule] | Mapping[str, str | Mapping[str, Any]] | None = None,
    split_sizes: Mapping[str, int | Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups for a Muon-family optimizer, with parameter names.

    ``rules`` maps glob patterns on parameter names to ``"muon"``, ``"adamw"`` or a dict of group
    options (e.g. ``{"algorithm": "adamw", "lr": 3e-4}``); the first matching rule wins over the
    role-based default. ``split_sizes`` maps patterns to a chunk count or row counts of fused
    matrices to orthogonalize chunk by chunk (see :data:`DIT_FUSED_SPLITS`). Frozen parameters
    (``requires_grad=False``) are left out.
    """
    rule_list = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
    normalized = [(pat, _normalize_rule(pat, val)) for pat, val in rule_list]
    owner = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (f"{mod_name}.{p_name}" if mod_name else p_name, module))
    groups: dict[tuple, dict[str, Any]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        _, module = owner[id(p)]
        options: dict[str, Any] = {}
        for pattern, opts in normalized:
            if fnmatch.fnmatchcase(name, pattern):
                options = dict(opts)
                break
        options.setdefault("algorithm", default_algorithm(name, p, module))
        if options["algorithm"] == "muon":
            split = _match_split(name, split_sizes)
            if split is not None:
                options["split_sizes"] = split
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        group = groups.setdefault(key, {"params": [], **options})
        group["params"].append((name, p))
    return list(groups.values())


def describe_groups(groups: Sequence[Mapping[str, Any]]) -> str:
    """A readable table of which parameter went where (for logs and debugging)."""
    lines = []
    for i, g in enumerate(groups):
        extras = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        lines.append(f"group {i}: {extras}")
        names = g.get("param_names")
        for i, item in enumerate(g["params"]):
            name, p = item if isinstance(item, tuple) else (names[i] if names else f"params[{i}]", item)
            lines.append(f"    {name:60s} {tuple(p.shape)}")
    return "\n".join(lines)
