"""Per-head orthogonalization of attention projections: the split options that make each head its own matrix.

An attention layer's query, key and value projections compute every head from its own ``head_dim`` rows, and its
output projection reads every head through its own ``head_dim`` columns. Orthogonalizing per head
(docs/algorithms.md, "Fused, per-head and stacked matrices") gives every head its own update instead of one for
the whole projection: the rows of a q/k/v projection split by head (``split_sizes``), the columns of the output
projection split by head (``col_split_sizes``). Off by default; the helpers here only build the options, in the
two forms :func:`dimuon.optim.param_groups` takes:

- ``split_sizes``: parameter name -> row chunk count (its ``split_sizes=`` argument);
- ``rules``: parameter name -> group options ``{"algorithm": "muon", "col_split_sizes": H}`` (its ``rules=``).

They recognise dimuon's DiT (and the timm attention that facebookresearch's DiT uses: ``qkv`` and ``proj``
under a module with ``num_heads``), diffusers' ``Attention`` (``to_q``/``to_k``/``to_v``, fused ``to_qkv``/
``to_kv``, the added ``add_{q,k,v}_proj`` of joint attention, ``to_out.0`` and ``to_add_out``, with ``heads``) and
``nn.MultiheadAttention``. Like the rest of :mod:`dimuon.optim` this imports nothing else of dimuon.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["HeadSplits", "dit_per_head_splits", "per_head_splits"]

# diffusers' Attention: projections whose rows hold heads (q, k, v and their fused and joint-attention forms),
# and output projections whose columns read them.
_DIFFUSERS_ROWS = ("to_q", "to_k", "to_v", "to_qkv", "to_kv", "add_q_proj", "add_k_proj", "add_v_proj")
_DIFFUSERS_COLS = ("to_out.0", "to_add_out")


@dataclass(frozen=True)
class HeadSplits:
    """Per-head splits of a model's attention projections, as :func:`dimuon.optim.param_groups` takes them.

    ``split_sizes`` maps parameter names (glob patterns) to their row chunk count (one chunk per head of each
    of q, k and v); ``rules`` maps output projections to ``{"algorithm": "muon", "col_split_sizes": H}``.
    Use them as ``param_groups(model, rules={**my_rules, **heads.rules}, split_sizes=heads.with_split_sizes(
    DIT_FUSED_SPLITS))``: param_groups takes the first pattern that matches, so a rule of yours that matches an
    output projection comes first and replaces its per-head split.
    """

    split_sizes: dict[str, int] = field(default_factory=dict)
    rules: dict[str, dict[str, Any]] = field(default_factory=dict)

    def with_split_sizes(
        self, split_sizes: Mapping[str, int | Sequence[int]] | None = None
    ) -> dict[str, int | Sequence[int]]:
        """The per-head row splits first, then ``split_sizes`` (e.g. ``DIT_FUSED_SPLITS``, whose 3-way qkv split
        the per-head one refines): one mapping for ``param_groups(split_sizes=...)``."""
        return {**self.split_sizes, **{k: v for k, v in (split_sizes or {}).items() if k not in self.split_sizes}}

    def __bool__(self) -> bool:
        return bool(self.split_sizes or self.rules)


def dit_per_head_splits(num_heads: int) -> HeadSplits:
    """Per-head splits of dimuon's DiT by name pattern, for ``num_heads`` heads (``dit_arch(name)["num_heads"]``
    of a registry model): ``*attn.qkv.weight`` in ``3 * num_heads`` row chunks, ``*attn.proj.weight`` in
    ``num_heads`` column chunks. :func:`per_head_splits` reads the same from a built model."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
    rules = {"*attn.proj.weight": {"algorithm": "muon", "col_split_sizes": num_heads}} if num_heads > 1 else {}
    return HeadSplits({"*attn.qkv.weight": 3 * num_heads}, rules)


def per_head_splits(model: nn.Module) -> HeadSplits:
    """Per-head splits of every attention layer of ``model`` it recognises, by exact parameter name.

    dimuon's DiT (and timm's attention): ``qkv`` rows in ``3 * num_heads`` chunks, ``proj`` columns in
    ``num_heads``. diffusers' ``Attention``: with ``head_dim = to_q.out_features / heads``, every q/k/v
    projection's rows in ``rows / head_dim`` chunks (key/value heads may be fewer), ``to_out.0`` and
    ``to_add_out`` columns in ``cols / head_dim``. ``nn.MultiheadAttention``: ``in_proj_weight`` rows in
    ``3 * num_heads`` (or each of ``q/k/v_proj_weight`` in ``num_heads``), ``out_proj`` columns in ``num_heads``.
    A split into one chunk (the output projection of a single head) and sizes a head count does not divide
    are left out. Names are those of
    ``model.named_parameters()``, so build the groups from the same (wrapped or not) model.
    """
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)  # a shared weight by its first name, as named_parameters() and param_groups say
    rows: dict[str, int] = {}
    cols: dict[str, int] = {}

    def add(table: dict[str, int], weight: Any, chunks: int, dim: int) -> None:
        name = names.get(id(weight))
        if name is not None and chunks > 1 and weight.ndim == 2 and weight.shape[dim] % chunks == 0:
            table.setdefault(name, chunks)

    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            heads = module.num_heads
            if module.in_proj_weight is not None:
                add(rows, module.in_proj_weight, 3 * heads, 0)
            for weight in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight):
                if weight is not None:
                    add(rows, weight, heads, 0)
            add(cols, module.out_proj.weight, heads, 1)
        elif _is_int(getattr(module, "heads", None)) and isinstance(_child(module, "to_q"), nn.Module):
            head_dim = _child(module, "to_q").weight.shape[0] // module.heads
            if head_dim < 1:
                continue
            for child in filter(None, (_child(module, n) for n in _DIFFUSERS_ROWS)):
                add(rows, child.weight, child.weight.shape[0] // head_dim, 0)
            for child in filter(None, (_child(module, n) for n in _DIFFUSERS_COLS)):
                add(cols, child.weight, child.weight.shape[1] // head_dim, 1)
        elif _is_int(getattr(module, "num_heads", None)) and all(
            isinstance(_child(module, n), nn.Module) for n in ("qkv", "proj")
        ):
            heads = module.num_heads
            add(rows, module.qkv.weight, 3 * heads, 0)
            add(cols, module.proj.weight, heads, 1)
    return HeadSplits(
        {_escape(n): k for n, k in rows.items()},
        {_escape(n): {"algorithm": "muon", "col_split_sizes": k} for n, k in cols.items()},
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _child(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` (``to_out.0``) holding a ``weight``, or None."""
    for part in path.split("."):
        module = module._modules.get(part) if module is not None else None
    return module if module is not None and getattr(module, "weight", None) is not None else None


def _escape(name: str) -> str:
    """A parameter name as a glob pattern that matches only itself."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)
