"""Role-based parameter grouping: hidden matrices to Muon, everything else to AdamW.

docs/algorithms.md, "Which parameters get Muon": Muon updates the weights of hidden linear maps and hidden
convolutions (attention, MLP, adaLN modulation, the second linear of a timestep MLP); AdamW takes every
parameter that is not the weight of a linear or convolution module (biases, norm gains, embedding tables,
learned modulation tables such as ``scale_shift_table``, positional and padding embeddings, learned tokens
registered as bare parameters), the patch/latent embeddings, the first linear of every sinusoidal-input MLP
(timestep, guidance) and the output projections. The decision is made by module role (module type, then
name rules), not by ``ndim == 2`` alone, and user rules win.
Mixture-of-experts weights stacked as ``(experts, m, n)`` go to Muon with ``stacked=True`` (one matrix per expert).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dimuon.optim.common import ALGORITHMS

Rule = tuple[str, "str | Mapping[str, Any]"]

# Names (glob patterns) of weights that are inputs or outputs of the network, not hidden layers: dimuon's DiT,
# facebookresearch-style DiTs and the transformer classes diffusers ships (docs/algorithms.md lists them).
INPUT_OUTPUT_PATTERNS: tuple[str, ...] = (
    # patch / latent embeddings
    "x_embedder.*",  # DiT (a conv), Flux (a linear)
    "x_embedders.*",
    "pos_embed.*",  # diffusers' PatchEmbed
    "patch_embed*",  # patch_embed, patch_embedding (Wan's Conv3d), patch_embedder
    "*_patch_embedding.*",
    "patch_short.*",
    "patch_mid.*",
    "patch_long.*",
    "img_in.*",
    "proj.*",  # at the top of the model (EasyAnimate's patch embedding)
    "proj_in.*",  # at the top of the model: the latents' input projection
    "proj_in_conv.*",
    "audio_proj_in.*",
    "input_proj.*",
    "image_projector.*",
    "preprocess_conv.*",
    # label embedding tables
    "y_embedder.*",
    "*class_embedder.*",
    # the first linear of dimuon's timestep MLP (diffusers' are found by their module, see SINUSOIDAL_INPUTS)
    "t_embedder.mlp.0.*",
    "*timestep_embedder.linear_1.*",
    # output projections to pixels / latents
    "final_layer.linear.*",
    "final_linear.*",
    "proj_out*",  # diffusers' final modulation and output projections
    "audio_proj_out.*",
    "postprocess_conv.*",
    "lm_head.*",
)

# The final layer's conditioning map (shift and scale from the conditioning vector, as every block's adaLN
# modulation): a hidden linear map for Muon, whatever the model names it (checked before INPUT_OUTPUT_PATTERNS, whose
# ``proj_out*`` would take diffusers' DiT's ``proj_out_1`` for an output projection).
FINAL_MODULATION_PATTERNS: tuple[str, ...] = ("final_layer.adaLN_modulation.*", "proj_out_1.*", "norm_out.linear.*")

# The first layer of an MLP that reads sinusoidal features (a timestep's, a guidance scale's): a linear named
# one of FIRST_LAYER_NAMES directly under a module whose own name holds one of SINUSOIDAL_WORDS or is one of
# SINUSOIDAL_MODULES (``time_embedder.linear_1``, ``guidance_embedder.linear_1``, ``time_embedding.0``, ...).
FIRST_LAYER_NAMES: tuple[str, ...] = ("linear_1", "0", "in_layer", "in_proj", "fc1")
SINUSOIDAL_WORDS: tuple[str, ...] = ("time", "guidance")
SINUSOIDAL_MODULES: tuple[str, ...] = ("t_embedder", "delta_embedder")  # whole names: text_embedder is not one
# Output projections named like a hidden layer, recognised by the class of the module that holds them.
OUTPUT_CHILDREN: dict[str, str] = {"LuminaLayerNormContinuous": "linear_2"}

# Modules whose ``weight`` is a linear map (conv weights are flattened to (out, in * kernel)).
MATRIX_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)

# Fused matrices of dimuon's DiT that can be orthogonalized chunk by chunk.
DIT_FUSED_SPLITS: dict[str, int] = {
    "*attn.qkv.weight": 3,
    "blocks.*.adaLN_modulation.1.weight": 6,
    "final_layer.adaLN_modulation.1.weight": 2,
}


def is_matrix_weight(name: str, module: nn.Module) -> bool:
    """Whether parameter ``name`` of ``module`` is the weight of a linear map or convolution (or the fused input
    projection of ``nn.MultiheadAttention``), rather than a table, an embedding or a bare parameter."""
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.MultiheadAttention):
        return leaf in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
    return isinstance(module, MATRIX_MODULES) and leaf == "weight"


# A name part that marks mixture-of-experts weights stacked along a leading expert dimension, ``(experts, m, n)``:
# torchtitan's GroupedExperts (``moe.experts.w1``, ``moe.routed_experts.inner_experts.w1_EFD``), transformers' MoE
# blocks (``mlp.experts.gate_up_proj``).
EXPERTS_WORD = "experts"
EXPERTS_ROLE = "stacked experts (E, m, n): each expert's matrix on its own (stacked=True)"


def is_stacked_experts(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Whether ``name`` is a bare 3-D parameter of a mixture of experts (one matrix per expert, not a conv weight):
    Muon orthogonalizes each expert's matrix on its own (``stacked=True``), not the ``(E, m*n)`` flattening."""
    if param.ndim != 3 or is_matrix_weight(name, module):
        return False
    return any(EXPERTS_WORD in part.lower() for part in name.split("."))


def reads_sinusoidal_features(name: str) -> bool:
    """Whether weight ``name`` is the first layer of a timestep or guidance MLP (it reads sinusoidal features)."""
    parts = name.split(".")
    if len(parts) < 3:
        return False
    parent, layer = parts[-3], parts[-2]
    lowered = parent.lower()
    return layer in FIRST_LAYER_NAMES and (any(w in lowered for w in SINUSOIDAL_WORDS) or lowered in SINUSOIDAL_MODULES)


def default_role(name: str, param: nn.Parameter, module: nn.Module, parent: nn.Module | None = None) -> tuple[str, str]:
    """The default algorithm of one parameter and why, decided by its role in the model (``parent``: the module
    that holds ``module``, for output projections recognised by their holder)."""
    if param.ndim < 2:
        return "adamw", "a bias, gain or scalar (fewer than 2 dimensions)"
    if is_stacked_experts(name, param, module):
        return "muon", EXPERTS_ROLE
    if not is_matrix_weight(name, module):
        return "adamw", f"not the weight of a linear map or convolution ({type(module).__name__}.{name.split('.')[-1]})"
    modulation = next((pat for pat in FINAL_MODULATION_PATTERNS if fnmatch.fnmatchcase(name, pat)), None)
    if modulation is not None:
        return (
            "muon",
            f"the final layer's conditioning map, a hidden linear map as every adaLN (name matches {modulation!r})",
        )
    pattern = next((pat for pat in INPUT_OUTPUT_PATTERNS if fnmatch.fnmatchcase(name, pat)), None)
    if pattern is not None:
        return "adamw", f"an input or output layer (name matches {pattern!r})"
    if reads_sinusoidal_features(name):
        return "adamw", "the first layer of a timestep/guidance MLP (reads sinusoidal features)"
    child = name.split(".")[-2] if name.count(".") else ""
    if parent is not None and OUTPUT_CHILDREN.get(type(parent).__name__) == child:
        return "adamw", f"the output projection of {type(parent).__name__}"
    kind = "convolution" if param.ndim > 2 else "linear map"
    return "muon", f"a hidden {kind}" + (" (updated as a (shape[0], rest) matrix)" if param.ndim > 2 else "")


def default_algorithm(name: str, param: nn.Parameter, module: nn.Module, parent: nn.Module | None = None) -> str:
    """The default algorithm of one parameter, decided by its role in the model (see :func:`default_role`)."""
    return default_role(name, param, module, parent)[0]


def _normalize_rule(pattern: str, value: str | Mapping[str, Any]) -> dict[str, Any]:
    options = {"algorithm": value} if isinstance(value, str) else dict(value)
    algo = options.get("algorithm")
    if algo is not None and algo not in ALGORITHMS:
        raise ValueError(f"rule {pattern!r}: algorithm must be one of {ALGORITHMS}, got {algo!r}")
    return options


def _matches(names: Sequence[str], pattern: str) -> bool:
    """Whether any of a parameter's names (as given, as the network names it) matches a glob ``pattern``."""
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)


def _match_split(names: Sequence[str], split_sizes: Mapping[str, int | Sequence[int]] | None) -> Any:
    for pattern, sizes in (split_sizes or {}).items():
        if _matches(names, pattern):
            return tuple(sizes) if not isinstance(sizes, int) else sizes
    return None


# Name parts that wrappers insert between a module and its own modules (torch.compile, activation checkpointing).
WRAPPER_PARTS: tuple[str, ...] = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def wrapper_prefix(model: nn.Module) -> str:
    """The name prefix of the network a wrapper holds: descends while a module has no parameters of its own and
    one child holds them all (``DiffusersDiT.model``, ``torch.compile``'s ``_orig_mod``, DDP's ``module``)."""
    prefix, module = "", model
    while not any(True for _ in module.parameters(recurse=False)):
        holders = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(holders) != 1:
            break
        name, module = holders[0]
        prefix += name + "."
    return prefix


def role_name(name: str, prefix: str = "") -> str:
    """A parameter's name as the network itself names it: ``prefix`` (:func:`wrapper_prefix`) and the wrappers'
    name parts (:data:`WRAPPER_PARTS`) removed, so the role patterns hold on a wrapped model too."""
    name = name[len(prefix) :] if prefix and name.startswith(prefix) else name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def _tied_role(
    p: nn.Parameter, places: Sequence[tuple[str, nn.Module, nn.Module | None]], prefix: str
) -> tuple[str, str]:
    """The default role of a parameter held in ``places`` (its name, module and parent in each): AdamW where the
    role in any place is AdamW (an embedding table tied to an output projection is a table, whichever module was
    registered first), else the first place's."""
    roles = [(alias, default_role(role_name(alias, prefix), p, module, parent)) for alias, module, parent in places]
    alias, (algorithm, role) = next((r for r in roles if r[1][0] == "adamw"), roles[0])
    if alias != places[0][0]:
        role += f", as {alias} (tied)"
    return algorithm, role


def param_groups(
    model: nn.Module,
    rules: Sequence[Rule] | Mapping[str, str | Mapping[str, Any]] | None = None,
    split_sizes: Mapping[str, int | Sequence[int]] | None = None,
    reasons: dict[str, str] | None = None,
    per_head: bool = False,
    roles: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups for a Muon-family optimizer, with parameter names.

    ``rules`` maps glob patterns on parameter names to ``"muon"``, ``"adamw"`` or a dict of group
    options (e.g. ``{"algorithm": "adamw", "lr": 3e-4}``); the first matching rule wins over the
    role-based default. ``split_sizes`` maps patterns to a chunk count or row counts of fused
    matrices to orthogonalize chunk by chunk (see :data:`DIT_FUSED_SPLITS`). Frozen parameters
    (``requires_grad=False``) are left out. ``reasons``, when given, is filled with why each parameter went
    where it did (``dimuon groups`` prints them). ``per_head=True`` orthogonalizes attention projections per head
    (:func:`dimuon.optim.heads.per_head_splits`: q/k/v rows and output-projection columns by head) wherever they
    land in a Muon group, under user rules too: its row splits refine ``split_sizes`` (a fused qkv in 3H chunks
    rather than 3), and a rule's own ``split_sizes`` and ``col_split_sizes`` win over them.

    Names are matched as given and as the network itself names them (:func:`role_name`: a wrapper's prefix,
    ``torch.compile``'s and activation checkpointing's name parts removed), so a wrapped model is grouped as the
    bare one. A parameter held in several places (a weight tied between modules, a module used twice) is listed
    under its first name (``named_parameters``'), and grouped alike whichever module was registered first: rules and
    patterns match any of its names, and its default role is AdamW where its role in any place is (an embedding
    table tied to an output projection stays a table). ``roles`` maps patterns to the algorithm of a role the
    defaults do not know (a model family's input layers): it replaces the default algorithm, and a rule that sets
    options but no algorithm keeps it. A rule that matches no parameter is named in a warning (a misspelt pattern
    would otherwise change nothing, silently).
    """
    rule_list = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
    normalized = [(pat, _normalize_rule(pat, val)) for pat, val in rule_list]
    split_sizes, head_cols = _head_splits(model, per_head, split_sizes)
    prefix = wrapper_prefix(model)
    owners = _places(model)
    groups: dict[tuple, dict[str, Any]] = {}
    seen: set[int] = set()
    matched: set[str] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        places = owners[id(p)]
        # Rules and patterns see every name of the parameter (as given and as the network names it).
        names = tuple(dict.fromkeys(n for alias, _, _ in places for n in (alias, role_name(alias, prefix))))
        options, why = _first_rule(names, normalized, matched)
        experts = _stacked_experts(p, places, prefix)
        algorithm, role = _role(p, places, prefix, names, roles, experts)
        if reasons is not None:  # a rule that sets options but no algorithm leaves the role's algorithm
            reasons[name] = role if not why else why if "algorithm" in options else f"{role}; options by {why}"
        options.setdefault("algorithm", algorithm)
        if options["algorithm"] == "muon":  # a rule's own stacked and splits win
            if experts:
                options.setdefault("stacked", True)
            _set_splits(options, _match_split(names, split_sizes), head_cols.get(name))
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        group = groups.setdefault(key, {"params": [], **options})
        group["params"].append((name, p))
    _warn_unmatched([pat for pat, _ in normalized if pat not in matched])
    return list(groups.values())


def _head_splits(
    model: nn.Module, per_head: bool, split_sizes: Mapping[str, int | Sequence[int]] | None
) -> tuple[Mapping[str, int | Sequence[int]] | None, dict[str, Any]]:
    """``split_sizes`` refined by the per-head rows (3H chunks of a fused qkv rather than 3), and the per-head
    column splits by parameter name, where ``per_head``."""
    if not per_head:
        return split_sizes, {}
    from dimuon.optim.heads import per_head_splits

    heads = per_head_splits(model)
    return heads.with_split_sizes(split_sizes), {name: opts["col_split_sizes"] for name, opts in heads.rules.items()}


def _stacked_experts(p: nn.Parameter, places: Sequence[Any], prefix: str) -> bool:
    """Whether ``p`` is a stacked experts tensor by any of its names (a wrapper prefix may be the experts module)."""
    return any(
        is_stacked_experts(n, p, module) for alias, module, _ in places for n in (alias, role_name(alias, prefix))
    )


def _role(
    p: nn.Parameter,
    places: Sequence[Any],
    prefix: str,
    names: Sequence[str],
    roles: Mapping[str, str] | None,
    experts: bool = False,
) -> tuple[str, str]:
    """The default algorithm of a parameter and why: by the first of ``roles`` matching one of its names, else as
    stacked experts, else by its role in the network (tied ones as their most table-like place)."""
    role_pattern = next((pat for pat in roles or {} if _matches(names, pat)), None)
    if role_pattern is not None:
        return roles[role_pattern], f"its role (pattern {role_pattern!r})"  # type: ignore[index]
    return ("muon", EXPERTS_ROLE) if experts else _tied_role(p, places, prefix)


def _set_splits(options: dict[str, Any], split: Any, head_cols: Any) -> None:
    """A Muon parameter's row and column splits where its rule set none."""
    if split is not None:
        options.setdefault("split_sizes", split)
    if head_cols is not None:
        options.setdefault("col_split_sizes", head_cols)


def _warn_unmatched(unmatched: list[str]) -> None:
    """Name the rules that matched no parameter: a misspelt pattern would otherwise change nothing, silently."""
    if unmatched:
        warnings.warn(
            f"param_groups: rule(s) {unmatched} matched no trainable parameter, so they change nothing; patterns "
            "are fnmatch globs on parameter names, e.g. 'blocks.*.attn.qkv.weight'",
            UserWarning,
            stacklevel=3,
        )


def _places(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, nn.Module | None]]]:
    """Every place that holds each parameter (a weight tied between modules, or a module used twice, has several),
    in registration order: (its name there, the module holding it, that module's parent)."""
    owners: dict[int, list[tuple[str, nn.Module, nn.Module | None]]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for mod_name, module in modules.items():
        parent = modules.get(mod_name.rpartition(".")[0]) if mod_name else None
        for p_name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append((f"{mod_name}.{p_name}" if mod_name else p_name, module, parent))
    return owners


def _first_rule(
    names: Sequence[str], normalized: Sequence[tuple[str, dict[str, Any]]], matched: set[str]
) -> tuple[dict[str, Any], str]:
    """The options of the first rule matching any of ``names`` and why (``matched`` gains its pattern), or none."""
    for pattern, opts in normalized:
        if _matches(names, pattern):
            matched.add(pattern)
            return dict(opts), f"user rule {pattern!r}"
    return {}, ""


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
