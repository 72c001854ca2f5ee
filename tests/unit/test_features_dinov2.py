"""DINOv2 ViT/14: the official key layout, a from-the-state-dict reference forward, and checkpoint loading."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dimuon.metrics import build_extractor
from dimuon.metrics.features import DINOV2_CONFIGS, DinoV2Features, DinoV2ViT, ViTConfig


def random_state(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict replaced by N(0, 0.02^2), norms and layer scales near one."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=gen) * 0.02
        is_scale = key.endswith(("norm1.weight", "norm2.weight", "norm.weight", "gamma"))
        state[key] = 1.0 + noise if is_scale else noise
    return state


def official_keys(depth: int, swiglu: bool) -> set[str]:
    """Key set of the official `dinov2_vit*14_pretrain.pth` files."""
    keys = {"cls_token", "pos_embed", "mask_token", "patch_embed.proj.weight", "patch_embed.proj.bias"}
    keys |= {"norm.weight", "norm.bias"}
    mlp = ("mlp.w12", "mlp.w3") if swiglu else ("mlp.fc1", "mlp.fc2")
    for i in range(depth):
        for layer in ("norm1", "attn.qkv", "attn.proj", "norm2", *mlp):
            keys |= {f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"}
        keys |= {f"blocks.{i}.ls1.gamma", f"blocks.{i}.ls2.gamma"}
    return keys


@pytest.mark.parametrize(
    ("arch", "millions"),
    # Published backbone sizes: ViT-S/14 21M, ViT-B/14 86M, ViT-L/14 300M, ViT-g/14 1,100M parameters.
    [("vits14", (21, 23)), ("vitb14", (85, 88)), ("vitl14", (302, 306)), ("vitg14", (1130, 1140))],
)
def test_key_layout_and_sizes_of_every_config(arch: str, millions: tuple[int, int]) -> None:
    cfg = DINOV2_CONFIGS[arch]
    with torch.device("meta"):  # shapes only, no memory
        model = DinoV2ViT(cfg)
    state = model.state_dict()
    assert set(state) == official_keys(cfg.depth, cfg.swiglu)
    d = cfg.embed_dim
    assert state["pos_embed"].shape == (1, 1 + 37 * 37, d)  # 518 / 14 = 37 patches a side, plus CLS
    assert state["patch_embed.proj.weight"].shape == (d, 3, 14, 14)
    assert state["blocks.0.attn.qkv.weight"].shape == (3 * d, d)
    if cfg.swiglu:  # ViT-g: hidden (int(4d * 2/3) + 7) // 8 * 8 = 4096
        assert state["blocks.0.mlp.w12.weight"].shape == (2 * 4096, d)
        assert state["blocks.0.mlp.w3.weight"].shape == (d, 4096)
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    assert millions[0] <= n_params <= millions[1]


def reference_cls(state: dict[str, torch.Tensor], cfg: ViTConfig, x: torch.Tensor) -> torch.Tensor:
    """Plain-op forward read off the state dict: explicit softmax attention, GELU MLP, layer scale."""
    p, d, h = cfg.patch_size, cfg.embed_dim, cfg.num_heads
    tokens = F.conv2d(x, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=p)
    gh, gw = tokens.shape[-2:]
    tokens = tokens.flatten(2).transpose(1, 2)
    side = math.isqrt(state["pos_embed"].shape[1] - 1)
    grid = state["pos_embed"][:, 1:].reshape(1, side, side, d).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((gh + 0.1) / side, (gw + 0.1) / side), mode="bicubic")
    pos = torch.cat([state["pos_embed"][:, :1], grid.flatten(2).transpose(1, 2)], dim=1)
    t = torch.cat([state["cls_token"].expand(x.shape[0], -1, -1), tokens], dim=1) + pos
    for i in range(cfg.depth):
        s = {k.removeprefix(f"blocks.{i}."): v for k, v in state.items() if k.startswith(f"blocks.{i}.")}
        y = F.layer_norm(t, (d,), s["norm1.weight"], s["norm1.bias"], eps=1e-6)
        q, k, v = F.linear(y, s["attn.qkv.weight"], s["attn.qkv.bias"]).chunk(3, dim=-1)
        q, k, v = (z.reshape(*z.shape[:2], h, d // h).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(t.shape)
        t = t + s["ls1.gamma"] * F.linear(y, s["attn.proj.weight"], s["attn.proj.bias"])
        y = F.layer_norm(t, (d,), s["norm2.weight"], s["norm2.bias"], eps=1e-6)
        if cfg.swiglu:
            a, b = F.linear(y, s["mlp.w12.weight"], s["mlp.w12.bias"]).chunk(2, dim=-1)
            y = F.linear(F.silu(a) * b, s["mlp.w3.weight"], s["mlp.w3.bias"])
        else:
            y = F.linear(
                F.gelu(F.linear(y, s["mlp.fc1.weight"], s["mlp.fc1.bias"])),
                s["mlp.fc2.weight"],
                s["mlp.fc2.bias"],
            )
        t = t + s["ls2.gamma"] * y
    return F.layer_norm(t, (d,), state["norm.weight"], state["norm.bias"], eps=1e-6)[:, 0]


@pytest.mark.parametrize("swiglu", [False, True])
def test_forward_matches_the_plain_op_reference(swiglu: bool) -> None:
    cfg = ViTConfig(embed_dim=48, depth=2, num_heads=4, swiglu=swiglu, pretrain_size=98)  # 7x7 pretrain grid
    model = DinoV2ViT(cfg)
    state = random_state(model, seed=1)
    model.load_state_dict(state)
    x = torch.randn(2, 3, 56, 42)  # a 4x3 grid: the position table is resized
    torch.testing.assert_close(model(x), reference_cls(state, cfg, x), rtol=1e-4, atol=1e-5)


def test_position_table_is_used_as_is_at_the_pretrain_size_and_resized_with_the_official_zoom() -> None:
    cfg = ViTConfig(embed_dim=8, depth=1, num_heads=2)
    model = DinoV2ViT(cfg)
    assert model.position_embedding(37, 37) is model.pos_embed
    table = model.position_embedding(16, 16)[0, 1:]  # (256, 8)
    grid = model.pos_embed[:, 1:].detach().reshape(1, 37, 37, 8).permute(0, 3, 1, 2)
    # The official encoder zooms by (16 + 0.1) / 37 rather than resizing to 16x16; the sampling positions
    # differ, so the tables do too (by far more than round-off), and features follow the official ones.
    zoomed = F.interpolate(grid, scale_factor=(16.1 / 37, 16.1 / 37), mode="bicubic")
    resized = F.interpolate(grid, size=(16, 16), mode="bicubic")
    torch.testing.assert_close(table, zoomed.flatten(2).transpose(1, 2)[0].detach())
    assert (table - resized.flatten(2).transpose(1, 2)[0]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def vits_file(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A randomly initialised ViT-S/14 in the official layout, saved as a plain state dict (~88 MB)."""
    with torch.device("meta"):
        shapes = DinoV2ViT(DINOV2_CONFIGS["vits14"])
    state = random_state(shapes, seed=0)
    path = tmp_path_factory.mktemp("dinov2") / "dinov2_vits14_pretrain.pth"
    torch.save(state, path)
    return path, state


def test_extractor_loads_the_file_and_preprocesses_like_fd_dinov2(vits_file) -> None:
    path, state = vits_file
    ex = build_extractor("dinov2", weights=path, arch="vits14")
    assert ex.name == "dinov2-vits14" and ex.feature_dim == 384
    gray = torch.rand(2, 1, 28, 28) * 2 - 1
    feats = ex(gray)
    assert feats.shape == (2, 384) and torch.isfinite(feats).all()
    # Same as: grayscale to RGB, [0, 1], antialiased bicubic to 224, ImageNet normalisation, CLS token.
    x = ((gray.expand(-1, 3, -1, -1) + 1) / 2).clamp(0, 1)
    x = F.interpolate(x, size=(224, 224), mode="bicubic", antialias=True).clamp(0, 1)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    x = (x - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    torch.testing.assert_close(feats, reference_cls(state, DINOV2_CONFIGS["vits14"], x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ex(gray[:1].expand(-1, 3, -1, -1)), feats[:1])  # grayscale == replicated RGB


def test_mismatched_checkpoints_list_their_keys(vits_file, tmp_path) -> None:
    path, state = vits_file
    broken = dict(state)
    del broken["blocks.3.ls1.gamma"]
    broken["register_tokens"] = torch.zeros(1, 4, 384)
    bad = tmp_path / "bad.pth"
    torch.save(broken, bad)
    with pytest.raises(ValueError) as err:
        DinoV2Features(bad, arch="vits14")
    msg = str(err.value)
    assert "missing keys (1): blocks.3.ls1.gamma" in msg
    assert "unexpected keys (1): register_tokens" in msg
    # The right file for another size: every mismatch reported, and the size the file does have.
    with pytest.raises(ValueError, match=re.compile(r"shape mismatches .*looks like arch='vits14'", re.S)):
        DinoV2Features(path, arch="vitb14")


def test_missing_file_says_what_to_supply(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dinov2_vitl14_pretrain\.pth"):
        build_extractor("dinov2", weights=tmp_path / "nope.pth")
    with pytest.raises(ValueError, match="arch must be one of"):
        DinoV2Features(tmp_path / "nope.pth", arch="vith14")


def test_a_partial_or_wrapped_file_fails_with_one_line_naming_it(vits_file, tmp_path) -> None:
    path, state = vits_file
    partial = tmp_path / "partial.pth"
    partial.write_bytes(path.read_bytes()[: 1 << 20])  # the first MiB of a download
    with pytest.raises(ValueError, match=r"partial\.pth cannot be read as a torch checkpoint .*a partial download"):
        DinoV2Features(partial, arch="vits14")
    teacher = tmp_path / "teacher.pth"
    torch.save({"teacher": {f"backbone.{k}": v for k, v in list(state.items())[:3]}, "iteration": 7}, teacher)
    with pytest.raises(ValueError, match=r"not a flat state dict of tensors \(2 other entries: iteration, teacher\)"):
        DinoV2Features(teacher, arch="vits14")
    with pytest.raises(ValueError, match=r"the weights may be in \['teacher'\]"):
        DinoV2Features(teacher, arch="vits14")
