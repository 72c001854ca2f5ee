"""The transformer classes the installed diffusers ships, and a tiny configuration of each: every size of a class's
defaults shrunk (one layer, two heads of 24 channels, narrow widths), so that its parameter names and roles can be
grouped, inspected and stepped on a CPU in milliseconds without building the full model.

Used by ``dimuon groups --tiny`` and by the grouping tests over the whole zoo. Nothing is downloaded.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch import nn

HEADS, HEAD_DIM = 2, 24
WIDTH = HEADS * HEAD_DIM  # 48: unlike any latent channel count x patch area, so roles stay apart by shape
# Values the shrinker cannot guess: a class's required arguments left None by its defaults, or sizes that must
# agree with each other.
FILLS: dict[str, Any] = {
    "in_channels": 4,
    "patch_size": 2,
    "caption_channels": WIDTH,
    "cross_attention_dim": WIDTH,
    "text_embed_dim_t5": WIDTH,
    "num_kv_heads": HEADS,
    "llama_layers": [0],
    "axes_dim": [8, 8],
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "DreamLiteTransformer2DModel": {"in_channels": 4, "norm_num_groups": 2},
    "TransformerTemporalModel": {"in_channels": 4, "norm_num_groups": 2},
    "Transformer2DModel": {
        "in_channels": 4,
        "sample_size": 8,
        "patch_size": 2,
        "norm_type": "ada_norm_zero",
        "num_embeds_ada_norm": 10,
    },
    "PRXTransformer2DModel": {"axes_dim": [12, 12]},
    "EasyAnimateTransformer3DModel": {"out_channels": 4},
    "WanAnimateTransformer3DModel": {"motion_encoder_size": 16},  # a key of its fixed table of channel widths
    "HiDreamImageTransformer2DModel": {"caption_channels": [WIDTH, WIDTH], "axes_dims_rope": (8, 8, 8)},
    "OmniGenTransformer2DModel": {
        "rope_scaling": {"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [1.0] * (HEAD_DIM // 2)}
    },
}
_SIZE_WORDS = (
    "hidden",
    "inner_dim",
    "d_model",
    "embed_dim",
    "cross_attention_dim",
    "joint_attention_dim",
    "text_dim",
    "caption_channels",
    "pooled_projection",
    "text_embed",
    "context_dim",
    "encoder_hid",
    "model_dim",
)
_NOT_SIZES = ("vocab", "freq", "max", "pos", "seq", "sample", "num")


def shrink(name: str, value: Any) -> Any:
    """A small stand-in for the default ``value`` of the constructor argument ``name`` (the value itself where
    it is no size)."""
    n = name.lower()
    if value is None:
        return FILLS.get(n)
    if isinstance(value, bool) or not isinstance(value, (int, tuple, list)):
        return value
    if isinstance(value, int):
        if "layers" in n or n in ("depth", "num_blocks") or n.endswith(("_blocks", "depth")):
            return min(value, 1)
        if "head_dim" in n:
            return HEAD_DIM
        if "heads" in n:
            return HEADS
        if n in ("sample_size", "height", "width"):
            return 8
        if n in ("num_frames", "sample_frames"):
            return min(value, 2)
        if any(k in n for k in ("ffn", "intermediate", "mlp_dim", "ff_inner")):
            return 2 * WIDTH
        if any(k in n for k in _SIZE_WORDS) or n in ("dim", "hidden_size"):
            return min(value, WIDTH)
        if n.endswith(("_dim", "_channels", "_size")) and value > 256 and not any(k in n for k in _NOT_SIZES):
            return WIDTH
        return value
    if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if n == "vace_layers":
            return type(value)([0])
        if "rope" in n or "axes" in n:  # rotary axes share the head's channels, each an even count
            dims = [HEAD_DIM // len(value) // 2 * 2] * len(value)
            dims[0] += HEAD_DIM - sum(dims)
            return type(value)(dims)
        if "layers" in n or "blocks" in n:
            return type(value)(min(v, 1) for v in value)
    return value


def tiny_config(cls: type) -> dict[str, Any]:
    """Every defaulted constructor argument of ``cls``, shrunk (see :func:`shrink`), with the class's overrides."""
    config = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.default is not inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            config[p.name] = shrink(p.name, p.default)
    return {**config, **OVERRIDES.get(cls.__name__, {})}


def transformer_classes() -> list[type]:
    """Every model class of ``diffusers.models.transformers``, by name (ImportError without diffusers)."""
    import diffusers.models.transformers as transformers
    from diffusers import ModelMixin

    found = {
        c for n in dir(transformers) if inspect.isclass(c := getattr(transformers, n)) and issubclass(c, ModelMixin)
    }
    return sorted(found, key=lambda c: c.__name__)


def transformer_class(name: str) -> type:
    """The diffusers model class called ``name``; ValueError listing the available ones otherwise."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        known = [c.__name__ for c in transformer_classes()]
        raise ValueError(f"diffusers {diffusers.__version__} has no model class {name!r}; its transformers: {known}")
    return cls


def build_tiny(cls: type, **config: Any) -> nn.Module:
    """``cls`` at its tiny configuration, updated with ``config`` (diffusers' construction warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**{**tiny_config(cls), **config})
