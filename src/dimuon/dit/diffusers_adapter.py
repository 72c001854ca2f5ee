"""Use an unmodified diffusers ``DiTTransformer2DModel`` as a velocity model ``model(x, t, y)``.

Optional: needs ``pip install dimuon[diffusers]``. The adapter maps the flow time ``t`` in [0, 1] to
diffusers' timestep scale (``t * 1000``, the range of its sinusoidal embedding), keeps only the first
``in_channels`` output channels (the velocity; a learned-sigma model has twice as many outputs) and
owns label dropout: diffusers draws a separate drop mask in every block, so the adapter turns that
off and drops each sample's label once, with its own ``class_dropout_prob``, before the model sees it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor, nn

from dimuon.dit.model import dit_arch

__all__ = ["DiffusersDiT", "build_diffusers_dit", "diffusers_available"]


def diffusers_available() -> bool:
    """Whether the optional ``diffusers`` package can be imported."""
    return importlib.util.find_spec("diffusers") is not None


def _require_diffusers() -> Any:
    if not diffusers_available():
        raise ImportError(
            "the diffusers adapter needs the optional 'diffusers' package: pip install 'dimuon[diffusers]'"
        )
    import diffusers

    return diffusers


class DiffusersDiT(nn.Module):
    """Wrap a ``DiTTransformer2DModel`` so that ``forward(x, t, y)`` returns the velocity (N, C, H, W)."""

    def __init__(self, model: nn.Module, class_dropout_prob: float = 0.1, t_scale: float = 1000.0) -> None:
        super().__init__()
        self.model = model
        self.t_scale = t_scale
        self.class_dropout_prob = class_dropout_prob
        cfg = model.config
        self.in_channels = int(cfg.in_channels)
        self.input_size = int(cfg.sample_size)
        self.patch_size = int(cfg.patch_size)
        self.num_classes = int(cfg.num_embeds_ada_norm)
        # diffusers' label embedders hold the null row (index num_classes) and drop labels on their own
        # in training mode; the adapter drops labels itself, once per sample, so switch theirs off.
        from diffusers.models.embeddings import LabelEmbedding

        for module in model.modules():
            if isinstance(module, LabelEmbedding):
                if module.embedding_table.num_embeddings <= self.num_classes:
                    raise ValueError("the diffusers model has no null-label row: build it with label dropout > 0")
                module.dropout_prob = 0.0

    @property
    def null_label(self) -> int:
        """Index of the unconditional (dropped) class label."""
        return self.num_classes

    def forward(self, x: Tensor, t: Tensor, y: Tensor, drop_labels: Tensor | None = None) -> Tensor:
        """Velocity (N, C, H, W) for images (N, C, H, W), times (N,) or scalar in [0, 1], labels (N,)."""
        n = x.shape[0]
        t = t.expand(n) if t.ndim == 0 else t  # (N,)
        if drop_labels is None and self.training and self.class_dropout_prob > 0:
            drop_labels = torch.rand(n, device=y.device) < self.class_dropout_prob  # (N,)
        if drop_labels is not None:
            y = torch.where(drop_labels, torch.full_like(y, self.num_classes), y)  # (N,)
        x = x.to(self.model.pos_embed.proj.weight.dtype)  # (N, C, H, W), as DiT.forward: bf16 weights take fp32 images
        out = self.model(x, timestep=t * self.t_scale, class_labels=y, return_dict=False)[0]  # (N, C_out, H, W)
        return out[:, : self.in_channels]  # (N, C, H, W)

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float) -> Tensor:
        """Classifier-free guided velocity (N, C, H, W) with the null label, as ``DiT.forward_with_cfg``."""
        n = x.shape[0]
        t = t.expand(n) if t.ndim == 0 else t  # (N,)
        null = torch.full_like(y, self.num_classes)  # (N,)
        v = self.forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))  # (2N, C, H, W)
        v_cond, v_null = v.chunk(2, dim=0)  # 2 x (N, C, H, W)
        return v_null + cfg_scale * (v_cond - v_null)  # (N, C, H, W)


def build_diffusers_dit(
    name: str,
    *,
    input_size: int = 32,
    in_channels: int = 4,
    num_classes: int = 1000,
    class_dropout_prob: float = 0.1,
    learn_sigma: bool = False,
    **diffusers_kwargs: Any,
) -> DiffusersDiT:
    """A freshly initialised diffusers DiT with the hidden size, depth, heads and patch of a registry name.

    Extra keyword arguments go to ``DiTTransformer2DModel``. Weights follow diffusers' own init (not
    adaLN-Zero), so the initial output is not zero.
    """
    diffusers = _require_diffusers()
    arch = dit_arch(name)
    heads = arch["num_heads"]
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=heads,
        attention_head_dim=arch["hidden_size"] // heads,
        in_channels=in_channels,
        out_channels=2 * in_channels if learn_sigma else in_channels,
        num_layers=arch["depth"],
        sample_size=input_size,
        patch_size=arch["patch_size"],
        num_embeds_ada_norm=num_classes,
        **diffusers_kwargs,
    )
    return DiffusersDiT(model, class_dropout_prob=class_dropout_prob)
