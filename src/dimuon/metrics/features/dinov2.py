"""DINOv2 ViT/14 image encoder whose state dict follows the official checkpoint layout, and its CLS features.

The official `dinov2_vit{s,b,l,g}14_pretrain.pth` files are plain state dicts (`cls_token`, `pos_embed` for a
518x518 input i.e. 37x37 patches, `mask_token`, `patch_embed.proj.*`, `blocks.{i}.{norm1,attn.qkv,attn.proj,
ls1,norm2,mlp,ls2}.*`, `norm.*`); ViT-g uses a SwiGLU MLP (`mlp.w12`, `mlp.w3`). FD-DINOv2 reads the final
normed CLS token of ViT-L/14 at 224x224 (bicubic resize, ImageNet mean/std).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.features.preprocess import check_images, resize_bicubic, to_rgb, to_unit_range

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INPUT_SIZE = 224
WEIGHTS_HINT = (
    "the official DINOv2 backbone checkpoint (e.g. dinov2_vitl14_pretrain.pth, ~1.2 GB, published by "
    "facebookresearch/dinov2 at https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth); "
    "download it on a machine with internet access and pass its path as `weights`"
)


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a DINOv2 ViT: width, depth, heads, MLP kind; patch 14 and a 518x518 position grid."""

    embed_dim: int
    depth: int
    num_heads: int
    swiglu: bool = False
    mlp_ratio: float = 4.0
    patch_size: int = 14
    pretrain_size: int = 518


CONFIGS: dict[str, ViTConfig] = {
    "vits14": ViTConfig(embed_dim=384, depth=12, num_heads=6),
    "vitb14": ViTConfig(embed_dim=768, depth=12, num_heads=12),
    "vitl14": ViTConfig(embed_dim=1024, depth=24, num_heads=16),
    "vitg14": ViTConfig(embed_dim=1536, depth=40, num_heads=24, swiglu=True),
}


class Attention(nn.Module):
    """Multi-head self-attention with a fused `qkv` projection laid out as `[q; k; v]` by heads."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, d // self.num_heads)  # (B, T, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, Dh)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))  # (B, T, D)


class Mlp(nn.Module):
    """Two-layer GELU MLP (`fc1`, `fc2`)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """SwiGLU MLP of ViT-g: `w12` gives gate and value halves, `w3` projects back; width 2/3 of 4d, rounded to 8."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


class LayerScale(nn.Module):
    """Per-channel residual-branch scale `gamma`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block with layer-scaled residual branches."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        d, hidden = cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio)
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.attn = Attention(d, cfg.num_heads)
        self.ls1 = LayerScale(d)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.mlp = SwiGLU(d, hidden) if cfg.swiglu else Mlp(d, hidden)
        self.ls2 = LayerScale(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))  # (B, T, D)
        return x + self.ls2(self.mlp(self.norm2(x)))  # (B, T, D)


class PatchEmbed(nn.Module):
    """Non-overlapping patch projection `proj` (a strided conv)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.embed_dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, h*w, D)


class DinoV2ViT(nn.Module):
    """DINOv2 backbone; `forward` returns the final-norm CLS token `(B, D)` of normalised RGB input."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, grid = cfg.embed_dim, cfg.pretrain_size // cfg.patch_size
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid * grid, d))
        self.mask_token = nn.Parameter(torch.zeros(1, d))  # used in pretraining only; kept for the layout
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(d, eps=1e-6)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)

    def position_embedding(self, h: int, w: int) -> torch.Tensor:
        """Position table `(1, 1 + h*w, D)` for an `h x w` patch grid: the pretrained grid, bicubically resized.

        As the official encoder, the zoom factor is `(n + 0.1) / n_pretrain`, so that float round-off in the
        factor cannot lose an output row; this fixes where the bicubic kernel samples the pretrained grid.
        """
        n = self.pos_embed.shape[1] - 1
        side = math.isqrt(n)
        if h == w == side:
            return self.pos_embed
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:].float()
        d = patch_pos.shape[-1]
        grid = patch_pos.reshape(1, side, side, d).permute(0, 3, 1, 2)  # (1, D, side, side)
        grid = F.interpolate(grid, scale_factor=((h + 0.1) / side, (w + 0.1) / side), mode="bicubic")
        if grid.shape[-2:] != (h, w):
            raise RuntimeError(f"position grid resized to {tuple(grid.shape[-2:])}, expected {(h, w)}")
        patch_pos = grid.permute(0, 2, 3, 1).reshape(1, h * w, d).to(self.pos_embed.dtype)  # (1, h*w, D)
        return torch.cat([cls_pos, patch_pos], dim=1)  # (1, 1 + h*w, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, height, width = x.shape
        p = self.cfg.patch_size
        tokens = self.patch_embed(x)  # (B, h*w, D)
        tokens = torch.cat([self.cls_token.expand(b, -1, -1), tokens], dim=1)  # (B, 1 + h*w, D)
        tokens = tokens + self.position_embedding(height // p, width // p)  # (B, 1 + h*w, D)
        for block in self.blocks:
            tokens = block(tokens)  # (B, 1 + h*w, D)
        return self.norm(tokens)[:, 0]  # (B, D)


def _guess_arch(state: dict[str, torch.Tensor]) -> str | None:
    """Which of CONFIGS a state dict's `cls_token` width and block count point to, if any."""
    cls = state.get("cls_token")
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for arch, cfg in CONFIGS.items():
        if cls is not None and cls.shape[-1] == cfg.embed_dim and depth == cfg.depth:
            return arch
    return None


def _format_keys(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_dinov2_state(model: DinoV2ViT, state: dict[str, torch.Tensor], arch: str = "") -> None:
    """Strictly load an official-layout state dict, raising a ValueError that lists every mismatch."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = sorted(
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or wrong_shape:
        lines = [f"DINOv2 checkpoint does not match the {arch or 'requested'} layout:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {_format_keys(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {_format_keys(unexpected)}")
        if wrong_shape:
            lines.append(f"  shape mismatches ({len(wrong_shape)}): {_format_keys(wrong_shape)}")
        guess = _guess_arch(state)
        if guess is not None and guess != arch:
            lines.append(f"  the file looks like arch={guess!r}")
        raise ValueError("\n".join(lines))
    # `assign` adopts the file's tensors, so a model built on the meta device needs no second copy.
    model.load_state_dict(state, strict=True, assign=True)


def dinov2_space(arch: str) -> str:
    """The feature space of a DINOv2 encoder of ``arch`` (its weights file adds a digest to the series' key)."""
    return f"dinov2-{arch}"


class DinoV2Features(FeatureExtractor):
    """FD-DINOv2 features: CLS token of a DINOv2 ViT/14 at 224x224 (bicubic, ImageNet mean/std)."""

    def __init__(self, weights: str | Path, arch: str = "vitl14") -> None:
        if arch not in CONFIGS:
            raise ValueError(f"arch must be one of {sorted(CONFIGS)}, got {arch!r}")
        cfg = CONFIGS[arch]
        super().__init__(name=dinov2_space(arch), feature_dim=cfg.embed_dim)
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"DINOv2 weights not found at {str(path)!r}; supply {WEIGHTS_HINT}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated download, another format: one line, not torch's traceback
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise ValueError(
                f"{path} cannot be read as a torch checkpoint ({reason}); a partial download? supply {WEIGHTS_HINT}"
            ) from exc
        if not isinstance(state, dict):
            raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
        others = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
        if others:
            nested = [k for k in others if isinstance(state[k], dict)]
            where = f"; the weights may be in {nested}: save that entry's state dict" if nested else ""
            raise ValueError(
                f"{path} is not a flat state dict of tensors ({len(others)} other entries: "
                f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}){where}; supply {WEIGHTS_HINT}"
            )
        # Half-precision copies of the checkpoint load too; the encoder runs in float32.
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        with torch.device("meta"):
            vit = DinoV2ViT(cfg)
        load_dinov2_state(vit, state, arch)
        self.vit = vit.eval().requires_grad_(False)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_rgb(to_unit_range(check_images(images).to(self.device)))  # (B, 3, H, W) in [0, 1]
        x = resize_bicubic(x, INPUT_SIZE)  # (B, 3, 224, 224)
        x = (x - self.mean) / self.std
        return self.vit(x)  # (B, D)
