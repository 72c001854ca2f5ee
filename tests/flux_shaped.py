"""A tiny model with the parameter names and shapes of torchtitan's Flux (torchtitan 0.3.0,
``torchtitan.models.flux``), for the torchtitan tests.

torchtitan's own Flux imports triton, datasets and transformers with its package (a CPU torch has no triton),
so the tests train this one: the same modules by the same names (double-stream blocks with image and text
streams, single-stream blocks with fused ``linear1``/``linear2``, modulations, QK RMSNorms, the final adaLN
layer), the same fused-matrix layouts, a plain forward without rotary embeddings. Where torchtitan's Flux does
import, tests/unit/test_torchtitan.py checks that both have the same parameter names and roles.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def timestep_features(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of timesteps ``t`` in [0, 1]: (N,) -> (N, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / half)  # (dim/2,)
    args = 1000.0 * t[:, None].float() * freqs[None]  # (N, dim/2)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, dim)


def heads_of(qkv: Tensor, heads: int, norm: QKNorm) -> tuple[Tensor, Tensor, Tensor]:
    """Fused ``qkv`` (N, L, 3h) -> q, k, v (N, H, L, D), queries and keys RMS-normalized per head."""
    n, length, _ = qkv.shape
    q, k, v = qkv.view(n, length, 3, heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (N, H, L, D)
    return norm.query_norm(q), norm.key_norm(k), v


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Self-attention over (N, H, L, D) -> (N, L, H D)."""
    out = nn.functional.scaled_dot_product_attention(q, k, v)  # (N, H, L, D)
    return out.transpose(1, 2).flatten(2)  # (N, L, h)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int) -> None:
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(nn.functional.silu(self.in_layer(x)))  # (N, h)


class Modulation(nn.Module):
    """``lin`` makes 3 (single) or 6 (double) chunks of width h from the conditioning vector."""

    def __init__(self, hidden: int, double: bool) -> None:
        super().__init__()
        self.chunks = 6 if double else 3
        self.lin = nn.Linear(hidden, self.chunks * hidden)

    def forward(self, vec: Tensor) -> tuple[Tensor, ...]:
        return self.lin(nn.functional.silu(vec))[:, None, :].chunk(self.chunks, dim=-1)  # chunks x (N, 1, h)


class QKNorm(nn.Module):
    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.query_norm = nn.RMSNorm(head_dim)
        self.key_norm = nn.RMSNorm(head_dim)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.norm = QKNorm(hidden // heads)
        self.proj = nn.Linear(hidden, hidden)


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights, attending jointly."""

    def __init__(self, hidden: int, heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.heads = heads
        for stream in ("img", "txt"):
            self.add_module(f"{stream}_mod", Modulation(hidden, double=True))
            self.add_module(f"{stream}_norm1", nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6))
            self.add_module(f"{stream}_attn", SelfAttention(hidden, heads))
            self.add_module(f"{stream}_norm2", nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6))
            self.add_module(
                f"{stream}_mlp",
                nn.Sequential(nn.Linear(hidden, mlp_hidden), nn.GELU("tanh"), nn.Linear(mlp_hidden, hidden)),
            )

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor) -> tuple[Tensor, Tensor]:
        mods, qkv = {}, []
        for stream, x in (("txt", txt), ("img", img)):
            mods[stream] = getattr(self, f"{stream}_mod")(vec)  # 6 x (N, 1, h)
            shift, scale = mods[stream][0], mods[stream][1]
            x_mod = (1 + scale) * getattr(self, f"{stream}_norm1")(x) + shift  # (N, L_s, h)
            stream_attn = getattr(self, f"{stream}_attn")
            qkv.append(heads_of(stream_attn.qkv(x_mod), self.heads, stream_attn.norm))  # 3 x (N, H, L_s, D)
        # One attention over the text tokens, then the image tokens.
        attn = attend(*(torch.cat(parts, dim=2) for parts in zip(*qkv)))  # (N, L_t + L_i, h)
        lt = txt.shape[1]
        out = []
        for stream, x, a in (("txt", txt, attn[:, :lt]), ("img", img, attn[:, lt:])):
            _, _, gate1, shift2, scale2, gate2 = mods[stream]
            x = x + gate1 * getattr(self, f"{stream}_attn").proj(a)  # (N, L_s, h)
            mlp_in = (1 + scale2) * getattr(self, f"{stream}_norm2")(x) + shift2
            out.append(x + gate2 * getattr(self, f"{stream}_mlp")(mlp_in))  # (N, L_s, h)
        return out[1], out[0]


class SingleStreamBlock(nn.Module):
    """Parallel attention and MLP: ``linear1`` makes q, k, v and the MLP's input, ``linear2`` reads both."""

    def __init__(self, hidden: int, heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.heads, self.hidden, self.mlp_hidden = heads, hidden, mlp_hidden
        self.linear1 = nn.Linear(hidden, 3 * hidden + mlp_hidden)
        self.linear2 = nn.Linear(hidden + mlp_hidden, hidden)
        self.norm = QKNorm(hidden // heads)
        self.pre_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.modulation = Modulation(hidden, double=False)

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale, gate = self.modulation(vec)  # 3 x (N, 1, h)
        qkv, mlp = self.linear1((1 + scale) * self.pre_norm(x) + shift).split(
            [3 * self.hidden, self.mlp_hidden], dim=-1
        )  # (N, L, 3h), (N, L, m)
        attn = attend(*heads_of(qkv, self.heads, self.norm))  # (N, L, h)
        return x + gate * self.linear2(torch.cat([attn, nn.functional.gelu(mlp, approximate="tanh")], -1))


class LastLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)  # 2 x (N, h)
        return self.linear((1 + scale[:, None]) * self.norm_final(x) + shift[:, None])  # (N, L, C)


class FluxShaped(nn.Module):
    """Flux's layout at a tiny width: ``in_channels`` latent channels per token, ``context_dim`` text
    features per token, a ``vec_dim`` pooled vector, ``depth`` double and ``depth_single`` single blocks."""

    def __init__(
        self,
        hidden: int = 32,
        heads: int = 2,
        mlp_ratio: float = 2.0,
        in_channels: int = 8,
        context_dim: int = 12,
        vec_dim: int = 6,
        time_dim: int = 16,
        depth: int = 2,
        depth_single: int = 2,
    ) -> None:
        super().__init__()
        mlp_hidden = int(hidden * mlp_ratio)
        self.time_dim = time_dim
        self.img_in = nn.Linear(in_channels, hidden)
        self.time_in = MLPEmbedder(time_dim, hidden)
        self.vector_in = MLPEmbedder(vec_dim, hidden)
        self.txt_in = nn.Linear(context_dim, hidden)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(hidden, heads, mlp_hidden) for _ in range(depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(hidden, heads, mlp_hidden) for _ in range(depth_single))
        self.final_layer = LastLayer(hidden, in_channels)
        # Flux zero-initializes its modulations; small random ones let every weight get a gradient at step 0.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "mod" in name:
                    p.mul_(0.5)

    def forward(self, img: Tensor, txt: Tensor, t: Tensor, y: Tensor) -> Tensor:
        img = self.img_in(img)  # (N, L_i, h)
        vec = self.time_in(timestep_features(t, self.time_dim)) + self.vector_in(y)  # (N, h)
        txt = self.txt_in(txt)  # (N, L_t, h)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec)
        x = torch.cat([txt, img], dim=1)  # (N, L_t + L_i, h)
        for block in self.single_blocks:
            x = block(x, vec)
        return self.final_layer(x[:, txt.shape[1] :], vec)  # (N, L_i, C)


def flux_batch(
    step: int,
    batch: int = 4,
    img_tokens: int = 6,
    txt_tokens: int = 3,
    in_channels: int = 8,
    context_dim: int = 12,
    vec_dim: int = 6,
) -> tuple[Tensor, ...]:
    """The seeded global batch of ``step``: latents, text features, timesteps, pooled vectors, targets."""
    g = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(batch, img_tokens, in_channels, generator=g),
        torch.randn(batch, txt_tokens, context_dim, generator=g),
        torch.rand(batch, generator=g),
        torch.randn(batch, vec_dim, generator=g),
        torch.randn(batch, img_tokens, in_channels, generator=g),
    )
