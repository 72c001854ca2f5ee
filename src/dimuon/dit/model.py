"""Diffusion transformer (DiT) with adaLN-Zero blocks, and a registry of sizes.

The model maps a noisy image ``x`` (N, C, H, W), a flow time ``t`` in [0, 1] of shape (N,) and class
labels ``y`` (N,) to a velocity with the same layout as ``x``. Module names are part of the API: the
optimizer's parameter grouping routes parameters by these names (see "Which parameters get Muon" in
``docs/algorithms.md``).

Time scale: the timestep embedder multiplies ``t`` by ``t_scale`` (1000) before the sinusoidal features,
so the frequencies cover [0, 1] as densely as they cover DiT's integer steps 0..999.

Label ``num_classes`` is the null label: the embedding table has ``num_classes + 1`` rows, training
replaces labels by it with probability ``class_dropout_prob``, and classifier-free guidance uses it
for the unconditional branch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from dimuon.dit.context import chunk_of, gather_chunks, group_rank_and_size

__all__ = [
    "DIT_MODELS",
    "DIT_PATCHES",
    "DIT_SIZES",
    "DiT",
    "DiTBlock",
    "FinalLayer",
    "LabelEmbedder",
    "PatchEmbed",
    "TimestepEmbedder",
    "build_dit",
    "dit_arch",
    "patchify",
    "sincos_pos_embed_2d",
    "unpatchify",
]


# --------------------------------------------------------------------------------------------------
# Shape helpers
# --------------------------------------------------------------------------------------------------


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """Per-sample affine modulation of token features: ``x * (1 + scale) + shift``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)  # (N, T, D)


def patchify(x: Tensor, patch_size: int) -> Tensor:
    """Cut images into non-overlapping patches: (N, C, H, W) -> (N, T, p*p*C), patch-row-major tokens.

    Within a token the features are ordered (p_row, p_col, C), the layout ``unpatchify`` inverts.
    """
    n, c, h, w = x.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by patch size {p}")
    x = x.reshape(n, c, h // p, p, w // p, p)  # (N, C, h, p, w, p)
    x = x.permute(0, 2, 4, 3, 5, 1)  # (N, h, w, p, p, C)
    return x.reshape(n, (h // p) * (w // p), p * p * c)  # (N, T, p*p*C)


def unpatchify(x: Tensor, patch_size: int, channels: int, height: int, width: int) -> Tensor:
    """Inverse of ``patchify``: (N, T, p*p*C) -> (N, C, H, W) for an image of ``height`` x ``width``."""
    n = x.shape[0]
    p = patch_size
    h, w = height // p, width // p
    x = x.reshape(n, h, w, p, p, channels)  # (N, h, w, p, p, C)
    x = x.permute(0, 5, 1, 3, 2, 4)  # (N, C, h, p, w, p)
    return x.reshape(n, channels, h * p, w * p)  # (N, C, H, W)


def sincos_pos_embed_2d(dim: int, grid_size: int) -> Tensor:
    """Fixed 2-D sine-cosine position embedding, (grid_size**2, dim), tokens in patch-row-major order.

    The first half of the features encodes the row index, the second half the column index; each half
    is ``[sin(pos * w_k), cos(pos * w_k)]`` with ``w_k = 10000 ** (-k / (dim/4))``.
    """
    if dim % 4:
        raise ValueError(f"hidden size {dim} must be divisible by 4 for the 2-D sin-cos embedding")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)  # (D/4,)
    pos = torch.arange(grid_size, dtype=torch.float64)  # (G,)
    angles = pos[:, None] * omega[None, :]  # (G, D/4)
    axis = torch.cat([angles.sin(), angles.cos()], dim=1)  # (G, D/2)
    rows = axis[:, None, :].expand(grid_size, grid_size, dim // 2)  # (G, G, D/2), varies with row
    cols = axis[None, :, :].expand(grid_size, grid_size, dim // 2)  # (G, G, D/2), varies with column
    emb = torch.cat([rows, cols], dim=-1)  # (G, G, D)
    return emb.reshape(grid_size * grid_size, dim).float()  # (T, D)


# --------------------------------------------------------------------------------------------------
# Embedders: patches, time, class labels
# --------------------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Linear patch embedding as a strided convolution: (N, C, H, W) -> (N, T, D)."""

    def __init__(self, in_channels: int, hidden_size: int, patch_size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)  # (N, D, h, w)
        return x.flatten(2).transpose(1, 2)  # (N, T, D)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of ``t * t_scale`` followed by a two-layer SiLU MLP: (N,) -> (N, D)."""

    def __init__(
        self,
        hidden_size: int,
        frequency_size: int = 256,
        t_scale: float = 1000.0,
        max_period: float = 10000.0,
    ) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.t_scale = t_scale
        self.max_period = max_period
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    def sinusoidal(self, t: Tensor) -> Tensor:
        """Features ``[cos(s*w_k), sin(s*w_k)]`` of ``s = t * t_scale``, ``w_k = max_period**(-k/half)``."""
        half = self.frequency_size // 2
        k = torch.arange(half, dtype=torch.float32, device=t.device)  # (F/2,)
        freqs = torch.exp(-math.log(self.max_period) * k / half)  # (F/2,)
        args = (t.float() * self.t_scale)[:, None] * freqs[None, :]  # (N, F/2)
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, 2*(F/2))
        if self.frequency_size % 2:
            emb = F.pad(emb, (0, 1))  # (N, F)
        return emb  # (N, F)

    def forward(self, t: Tensor) -> Tensor:
        freq = self.sinusoidal(t)  # (N, F)
        freq = freq.to(self.mlp[0].weight.dtype)  # (N, F)
        return self.mlp(freq)  # (N, D)


class LabelEmbedder(nn.Module):
    """Class embedding with an extra null row (index ``num_classes``) for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def drop_labels(self, labels: Tensor, drop: Tensor | None = None) -> Tensor:
        """Replace labels by the null label where ``drop`` is true (random with ``dropout_prob`` if None)."""
        if drop is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob  # (N,)
        return torch.where(drop, torch.full_like(labels, self.num_classes), labels)  # (N,)

    def forward(self, labels: Tensor, train: bool, drop: Tensor | None = None) -> Tensor:
        if (train and self.dropout_prob > 0) or drop is not None:
            labels = self.drop_labels(labels, drop)  # (N,)
        return self.embedding_table(labels)  # (N, D)


# --------------------------------------------------------------------------------------------------
# Transformer blocks
# --------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention over tokens with a fused qkv projection and PyTorch's SDPA kernel.

    The fused qkv output holds ``[q; k; v]``, each in head order. Under head-wise tensor parallelism
    (``dimuon.dit.parallel``) each rank's qkv computes its own heads' q, k and v, so the forward reads the
    number of heads from the qkv output: ``H`` in one process, ``H / tp`` on a tensor-parallel rank. Under
    context parallelism (``cp_group``, training mode) the queries are this rank's tokens and the keys and values
    are gathered from every rank of the group (``dimuon.dit.context``).
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.cp_group: ProcessGroup | None = None  # set by DiT.context_parallel

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape  # T: this rank's tokens under context parallelism
        qkv = self.qkv(x)  # (N, T, 3*h*dh), h = H (or this rank's heads under TP), dh = D/H
        h = qkv.shape[-1] // (3 * self.head_dim)
        qkv = qkv.reshape(n, t, 3, h, self.head_dim)  # (N, T, 3, h, dh)
        q = qkv[:, :, 0].transpose(1, 2)  # (N, h, T, dh)
        kv = qkv[:, :, 1:]  # (N, T, 2, h, dh)
        if self.cp_group is not None and self.training:
            kv = gather_chunks(kv, self.cp_group, dim=1)  # (N, S, 2, h, dh), S: the tokens of every cp rank
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (N, h, S, dh)
        x = F.scaled_dot_product_attention(q, k, v)  # (N, h, T, dh)
        x = x.transpose(1, 2).reshape(n, t, h * self.head_dim)  # (N, T, h*dh)
        return self.proj(x)  # (N, T, D)


class Mlp(nn.Module):
    """Token-wise feed-forward network: Linear, tanh-approximated GELU, Linear."""

    def __init__(self, hidden_size: int, mlp_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, mlp_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(mlp_hidden, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc1(x)  # (N, T, M)
        x = self.act(x)  # (N, T, M)
        return self.fc2(x)  # (N, T, D)


class DiTBlock(nn.Module):
    """Transformer block whose norms are modulated by the conditioning, with zero-initialised gates."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        mod = self.adaLN_modulation(c)  # (N, 6D)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mod.chunk(6, dim=1)  # 6 x (N, D)
        h = modulate(self.norm1(x), shift_a, scale_a)  # (N, T, D)
        x = x + gate_a.unsqueeze(1) * self.attn(h)  # (N, T, D)
        h = modulate(self.norm2(x), shift_m, scale_m)  # (N, T, D)
        return x + gate_m.unsqueeze(1) * self.mlp(h)  # (N, T, D)


class FinalLayer(nn.Module):
    """Modulated norm and a linear map from tokens to patch pixels."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)  # 2 x (N, D)
        x = modulate(self.norm_final(x), shift, scale)  # (N, T, D)
        return self.linear(x)  # (N, T, p*p*C_out)


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class DiT(nn.Module):
    """Class-conditional diffusion transformer; ``forward(x, t, y)`` returns (N, C_out, H, W).

    The first ``in_channels`` output channels are the velocity; with ``learn_sigma`` the model has
    ``2 * in_channels`` outputs (DiT's layout) and the rectified-flow code ignores the extra ones.
    After :meth:`context_parallel`, training-mode forwards split the tokens over a process group.
    """

    def __init__(
        self,
        input_size: int = 32,
        in_channels: int = 4,
        patch_size: int = 2,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        num_classes: int = 1000,
        class_dropout_prob: float = 0.1,
        learn_sigma: bool = False,
    ) -> None:
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input size {input_size} is not divisible by patch size {patch_size}")
        if not 0.0 <= class_dropout_prob <= 1.0:
            raise ValueError(f"class_dropout_prob must be in [0, 1], got {class_dropout_prob}")
        self.config: dict[str, Any] = dict(
            input_size=input_size,
            in_channels=in_channels,
            patch_size=patch_size,
            hidden_size=hidden_size,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            num_classes=num_classes,
            class_dropout_prob=class_dropout_prob,
            learn_sigma=learn_sigma,
        )
        self.input_size = input_size
        self.in_channels = in_channels
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.grid_size = input_size // patch_size

        self.x_embedder = PatchEmbed(in_channels, hidden_size, patch_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # Fixed, derived from the config: a non-persistent buffer keeps it out of checkpoints and optimizers.
        pos = sincos_pos_embed_2d(hidden_size, self.grid_size).unsqueeze(0)  # (1, T, D)
        self.register_buffer("pos_embed", pos, persistent=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.cp_group: ProcessGroup | None = None
        self.initialize_weights()

    def context_parallel(self, group: ProcessGroup | None) -> None:
        """Split the token sequence of training-mode forwards over ``group`` (None: whole sequences again).

        Every rank of the group must get the same inputs (and ``drop_labels``, or the same random state for the
        label dropout); each keeps a contiguous chunk of the tokens after the embeddings, attention gathers keys and
        values, and the output is gathered whole (``dimuon.dit.context``).
        Eval-mode forwards (validation, sampling) run the whole sequence on every rank and take any inputs.
        """
        if group is not None:
            size = group_rank_and_size(group)[1]
            tokens = self.grid_size**2
            if tokens % size:
                raise ValueError(f"{tokens} tokens per image do not split over {size} context-parallel ranks")
        self.cp_group = group
        for block in self.blocks:
            block.attn.cp_group = group

    @property
    def null_label(self) -> int:
        """Index of the unconditional (dropped) class label."""
        return self.num_classes

    def initialize_weights(self) -> None:
        """DiT's init: Xavier linears, N(0, 0.02) embeddings, zero adaLN and output, so f(x, t, y) == 0."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        # The patch embedding is a linear map on flattened patches: initialise it as one.
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: every residual branch starts closed, so each block starts as the identity.
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[1].weight)
            nn.init.zeros_(block.adaLN_modulation[1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(self, x: Tensor, t: Tensor, y: Tensor, drop_labels: Tensor | None = None) -> Tensor:
        """Predict (N, C_out, H, W) from images (N, C, H, W), times (N,) or scalar in [0, 1], labels (N,).

        Labels are dropped at random only in training mode; ``drop_labels`` (N,) bool forces the choice.
        """
        n, _, h, w = x.shape  # (N, C, H, W)
        if h != self.input_size or w != self.input_size:
            raise ValueError(f"expected {self.input_size}x{self.input_size} inputs, got {h}x{w}")
        t = t.expand(n) if t.ndim == 0 else t  # (N,), kept in its own dtype: the embedder computes in fp32
        x = self.x_embedder(
            x.to(self.x_embedder.proj.weight.dtype)
        )  # (N, T, D), in the parameters' dtype (bf16 under FSDP2's)
        x = x + self.pos_embed.to(x.dtype)  # (N, T, D)
        cp = self.cp_group if self.training else None
        if cp is not None:
            x = chunk_of(x, cp, dim=1)  # (N, T/cp, D): this rank's contiguous tokens
        t_emb = self.t_embedder(t)  # (N, D)
        y_emb = self.y_embedder(y, self.training, drop_labels)  # (N, D)
        c = t_emb + y_emb  # (N, D)
        for block in self.blocks:
            x = block(x, c)  # (N, T, D), T/cp tokens under context parallelism
        x = self.final_layer(x, c)  # (N, T, p*p*C_out), T/cp tokens under context parallelism
        if cp is not None:
            x = gather_chunks(x, cp, dim=1)  # (N, T, p*p*C_out): the chunks of every rank, in order
        return unpatchify(x, self.patch_size, self.out_channels, h, w)  # (N, C_out, H, W)

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float) -> Tensor:
        """Classifier-free guided velocity (N, C, H, W): ``v_null + cfg_scale * (v_y - v_null)``.

        Runs the conditional and the null-label branch as one doubled batch.
        """
        n, c = x.shape[0], self.in_channels
        t = t.expand(n) if t.ndim == 0 else t  # (N,)
        null = torch.full_like(y, self.null_label)  # (N,)
        out = self.forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))  # (2N, C_out, H, W)
        v_cond, v_null = out[:, :c].chunk(2, dim=0)  # 2 x (N, C, H, W)
        return v_null + cfg_scale * (v_cond - v_null)  # (N, C, H, W)


# --------------------------------------------------------------------------------------------------
# Size registry: hidden/depth/heads of S, B, L, XL as in the DiT paper; XS and T are small additions.
# --------------------------------------------------------------------------------------------------

DIT_SIZES: dict[str, tuple[int, int, int]] = {
    # name: (hidden_size, depth, num_heads)
    "T": (64, 2, 2),  # unit tests
    "XS": (128, 6, 4),  # CPU demos: 28x28 MNIST with patch 4 trains in minutes on 2 cores
    "S": (384, 12, 6),
    "B": (768, 12, 12),
    "L": (1024, 24, 16),
    "XL": (1152, 28, 16),
}
DIT_PATCHES: dict[str, tuple[int, ...]] = {
    "T": (2, 4),
    "XS": (2, 4),
    "S": (2, 4, 8),
    "B": (2, 4, 8),
    "L": (2, 4, 8),
    "XL": (2, 4, 8),
}


def _make_constructor(hidden_size: int, depth: int, num_heads: int, patch_size: int) -> Callable[..., DiT]:
    def constructor(**kwargs: Any) -> DiT:
        return DiT(hidden_size=hidden_size, depth=depth, num_heads=num_heads, patch_size=patch_size, **kwargs)

    return constructor


DIT_MODELS: dict[str, Callable[..., DiT]] = {
    f"DiT-{size}/{p}": _make_constructor(*DIT_SIZES[size], patch_size=p)
    for size in DIT_SIZES
    for p in DIT_PATCHES[size]
}


def dit_arch(name: str) -> dict[str, int]:
    """Hidden size, depth, heads and patch of a registry name such as ``"DiT-S/2"``."""
    if name not in DIT_MODELS:
        raise ValueError(f"unknown DiT model {name!r}; choose one of: {', '.join(DIT_MODELS)}")
    size, patch = name.removeprefix("DiT-").split("/")
    hidden, depth, heads = DIT_SIZES[size]
    return dict(hidden_size=hidden, depth=depth, num_heads=heads, patch_size=int(patch))


def build_dit(name: str, **kwargs: Any) -> DiT:
    """Build a registry model, e.g. ``build_dit("DiT-XS/4", input_size=28, in_channels=1, num_classes=10)``."""
    return DiT(**dit_arch(name), **kwargs)
