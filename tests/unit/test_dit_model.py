"""DiT model: registry, module names, shapes, adaLN-Zero init, patch layout, CFG, diffusers adapter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dimuon.dit.model import (
    DIT_MODELS,
    DiT,
    build_dit,
    dit_arch,
    patchify,
    sincos_pos_embed_2d,
    unpatchify,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _perturb(model: nn.Module, seed: int = 0, std: float = 0.05) -> nn.Module:
    """Give every parameter random values so that the zero-initialised paths carry signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def _inputs(n: int, c: int, size: int, num_classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, size, size, generator=g)
    t = torch.rand(n, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return x, t, y


def test_registry_has_the_required_sizes_with_paper_dimensions():
    for name in [
        "DiT-T/2",
        "DiT-XS/2",
        "DiT-XS/4",
        "DiT-S/2",
        "DiT-S/4",
        "DiT-B/2",
        "DiT-B/4",
        "DiT-L/2",
        "DiT-XL/2",
    ]:
        assert name in DIT_MODELS
    assert dit_arch("DiT-S/2") == dict(hidden_size=384, depth=12, num_heads=6, patch_size=2)
    assert dit_arch("DiT-B/4") == dict(hidden_size=768, depth=12, num_heads=12, patch_size=4)
    assert dit_arch("DiT-L/2") == dict(hidden_size=1024, depth=24, num_heads=16, patch_size=2)
    assert dit_arch("DiT-XL/2") == dict(hidden_size=1152, depth=28, num_heads=16, patch_size=2)


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown DiT model 'DiT-Q/2'.*DiT-S/2"):
        build_dit("DiT-Q/2")


@pytest.mark.parametrize(
    ("name", "size", "channels", "learn_sigma"),
    [
        ("DiT-T/2", 8, 1, False),
        ("DiT-T/4", 16, 3, True),
        ("DiT-XS/4", 28, 1, False),
        ("DiT-XS/2", 8, 4, False),
    ],
)
def test_output_shape(name, size, channels, learn_sigma):
    model = build_dit(name, input_size=size, in_channels=channels, num_classes=10, learn_sigma=learn_sigma)
    x, t, y = _inputs(3, channels, size)
    out = model(x, t, y)
    assert out.shape == (3, 2 * channels if learn_sigma else channels, size, size)


def test_module_names_and_shapes_for_parameter_routing():
    d, classes = 64, 10
    model = build_dit("DiT-T/2", input_size=8, in_channels=3, num_classes=classes)
    modules = dict(model.named_modules())
    assert isinstance(modules["x_embedder.proj"], nn.Conv2d)
    assert isinstance(modules["t_embedder.mlp.0"], nn.Linear)
    assert isinstance(modules["t_embedder.mlp.2"], nn.Linear)
    assert modules["y_embedder.embedding_table"].weight.shape == (classes + 1, d)
    for i in range(2):
        assert isinstance(modules[f"blocks.{i}.norm1"], nn.LayerNorm)
        assert isinstance(modules[f"blocks.{i}.norm2"], nn.LayerNorm)
        assert modules[f"blocks.{i}.attn.qkv"].weight.shape == (3 * d, d)
        assert modules[f"blocks.{i}.attn.proj"].weight.shape == (d, d)
        assert modules[f"blocks.{i}.mlp.fc1"].weight.shape == (4 * d, d)
        assert modules[f"blocks.{i}.mlp.fc2"].weight.shape == (d, 4 * d)
        assert modules[f"blocks.{i}.adaLN_modulation.1"].weight.shape == (6 * d, d)
    assert isinstance(modules["final_layer.norm_final"], nn.LayerNorm)
    assert modules["final_layer.linear"].weight.shape == (2 * 2 * 3, d)
    assert modules["final_layer.adaLN_modulation.1"].weight.shape == (2 * d, d)
    # The position embedding is fixed: not a parameter, not in the state dict.
    assert "pos_embed" not in dict(model.named_parameters())
    assert "pos_embed" not in model.state_dict()


def test_zero_init_gives_exactly_zero_output_and_zero_modulation():
    model = build_dit("DiT-T/2", input_size=8, in_channels=2, num_classes=10, learn_sigma=True)
    for name, p in model.named_parameters():
        if "adaLN_modulation" in name or name.startswith("final_layer.linear"):
            assert torch.count_nonzero(p) == 0, name
    x, t, y = _inputs(4, 2, 8)
    out = model(x, t, y)
    assert torch.equal(out, torch.zeros_like(out))
    # The other weights are not zero: the network is not degenerate, only its gates are closed.
    assert model.blocks[0].attn.qkv.weight.abs().sum() > 0
    assert model.x_embedder.proj.weight.abs().sum() > 0


def test_bfloat16_model_runs_in_bfloat16():
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10).to(torch.bfloat16)
    x, t, y = _inputs(2, 1, 8)
    assert model(x.to(torch.bfloat16), t, y).dtype == torch.bfloat16


def test_output_depends_on_time_and_label_once_trained_away_from_init():
    model = _perturb(build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)).eval()
    x, t, y = _inputs(4, 1, 8)
    base = model(x, t, y)
    assert not torch.allclose(base, model(x, 1 - t, y))
    assert not torch.allclose(base, model(x, t, (y + 1) % 10))
    # A scalar time is broadcast over the batch.
    assert torch.allclose(model(x, torch.tensor(0.3), y), model(x, torch.full((4,), 0.3), y))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    c=st.integers(1, 4),
    p=st.sampled_from([1, 2, 4]),
    gh=st.integers(1, 4),
    gw=st.integers(1, 4),
)
def test_patchify_unpatchify_round_trip(n, c, p, gh, gw):
    x = torch.randn(n, c, gh * p, gw * p)
    tokens = patchify(x, p)
    assert tokens.shape == (n, gh * gw, p * p * c)
    assert torch.equal(unpatchify(tokens, p, c, gh * p, gw * p), x)


def test_patchify_layout_matches_the_conv_patch_embedding():
    # The conv embedding applied to an image equals a linear map on patchify's tokens, so the token
    # order (and thus the position embedding) and the (p, p, C) feature order agree with the model.
    model = build_dit("DiT-T/4", input_size=16, in_channels=3, num_classes=10)
    conv = model.x_embedder.proj
    x = torch.randn(2, 3, 16, 16)
    w = conv.weight.permute(0, 2, 3, 1).reshape(conv.out_channels, -1)  # (D, p*p*C)
    expected = patchify(x, 4) @ w.T + conv.bias
    assert torch.allclose(model.x_embedder(x), expected, atol=1e-5)


def test_patchify_rejects_indivisible_sizes():
    with pytest.raises(ValueError, match="not divisible by patch size 4"):
        patchify(torch.randn(1, 1, 10, 8), 4)
    with pytest.raises(ValueError, match="input size 28 is not divisible by patch size 8"):
        DiT(input_size=28, patch_size=8, hidden_size=64, depth=1, num_heads=2)


def test_sincos_position_embedding_rows_and_columns():
    emb = sincos_pos_embed_2d(16, 3).reshape(3, 3, 16)
    # First half encodes the row, second half the column.
    assert torch.equal(emb[0, 0, :8], emb[0, 2, :8])
    assert torch.equal(emb[0, 1, 8:], emb[2, 1, 8:])
    assert not torch.equal(emb[0, 0, :8], emb[1, 0, :8])
    assert torch.allclose(emb[0, 0], torch.cat([torch.zeros(4), torch.ones(4), torch.zeros(4), torch.ones(4)]))
    assert len({tuple(r.tolist()) for r in emb.reshape(9, 16)}) == 9


def test_wrong_input_size_is_a_clear_error():
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    with pytest.raises(ValueError, match="expected 8x8 inputs, got 16x16"):
        model(torch.randn(1, 1, 16, 16), torch.rand(1), torch.zeros(1, dtype=torch.long))


def test_label_dropout_uses_the_null_row():
    model = _perturb(build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10, class_dropout_prob=1.0))
    x, t, y = _inputs(3, 1, 8)
    null = torch.full_like(y, model.null_label)
    model.train()
    dropped = model(x, t, y)
    model.eval()
    assert torch.allclose(dropped, model(x, t, null))
    assert not torch.allclose(dropped, model(x, t, y))  # eval mode keeps the labels
    forced = model(x, t, y, drop_labels=torch.tensor([True, False, True]))
    assert torch.allclose(forced[1], model(x, t, y)[1], atol=1e-6)
    assert torch.allclose(forced[0], dropped[0], atol=1e-6)


def test_forward_with_cfg():
    model = _perturb(build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10, learn_sigma=True)).eval()
    x, t, y = _inputs(3, 1, 8)
    cond = model(x, t, y)[:, :1]
    uncond = model(x, t, torch.full_like(y, 10))[:, :1]
    assert torch.allclose(model.forward_with_cfg(x, t, y, 1.0), cond, atol=1e-5)
    assert torch.allclose(model.forward_with_cfg(x, t, y, 0.0), uncond, atol=1e-5)
    assert torch.allclose(model.forward_with_cfg(x, t, y, 4.0), uncond + 4.0 * (cond - uncond), atol=1e-4)


def test_config_rebuilds_the_same_architecture():
    model = build_dit("DiT-T/4", input_size=16, in_channels=3, num_classes=7)
    clone = DiT(**model.config)
    clone.load_state_dict(model.state_dict())
    x, t, y = _inputs(2, 3, 16, num_classes=7)
    _perturb(model)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(model.eval()(x, t, y), clone.eval()(x, t, y))


# --------------------------------------------------------------------------------------------------
# diffusers adapter (optional dependency)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def diffusers_dit():
    pytest.importorskip(
        "diffusers", reason="the diffusers adapter needs the optional extra: pip install 'dimuon[diffusers]'"
    )
    from dimuon.dit.diffusers_adapter import build_diffusers_dit

    torch.manual_seed(0)
    return build_diffusers_dit("DiT-T/2", input_size=8, in_channels=2, num_classes=10, learn_sigma=True)


def test_diffusers_adapter_returns_velocity_channels_at_scaled_timesteps(diffusers_dit):
    model = diffusers_dit.eval()
    x, t, y = _inputs(3, 2, 8)
    v = model(x, t, y)
    assert v.shape == (3, 2, 8, 8)
    raw = model.model(x, timestep=t * 1000, class_labels=y, return_dict=False)[0]
    assert raw.shape == (3, 4, 8, 8)
    assert torch.equal(v, raw[:, :2])
    assert not torch.allclose(v, model(x, t * 0.5, y))


def test_diffusers_adapter_label_dropout_and_cfg(diffusers_dit):
    model = diffusers_dit
    x, t, y = _inputs(3, 2, 8)
    null = torch.full_like(y, model.null_label)
    model.eval()
    uncond, cond = model(x, t, null), model(x, t, y)
    model.class_dropout_prob = 1.0
    model.train()
    try:
        assert torch.allclose(model(x, t, y), uncond, atol=1e-6)
    finally:
        model.class_dropout_prob = 0.1
        model.eval()
    assert torch.allclose(model.forward_with_cfg(x, t, y, 3.0), uncond + 3.0 * (cond - uncond), atol=1e-4)


def test_diffusers_adapter_trains_with_the_flow_loss(diffusers_dit):
    from dimuon.dit.flow import flow_loss

    model = diffusers_dit.train()
    x, _, y = _inputs(4, 2, 8)
    loss = flow_loss(model, x, y, generator=torch.Generator().manual_seed(0))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert loss.item() > 0 and len(grads) > 0
    model.zero_grad(set_to_none=True)


def test_diffusers_adapter_with_bf16_weights_takes_fp32_images_as_dit_does():
    pytest.importorskip(
        "diffusers", reason="the diffusers adapter needs the optional extra: pip install 'dimuon[diffusers]'"
    )
    from dimuon.dit.diffusers_adapter import build_diffusers_dit
    from dimuon.dit.flow import validation_loss
    from dimuon.dit.sampler import sample

    torch.manual_seed(0)
    model = build_diffusers_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=3).to(torch.bfloat16).eval()
    x, t, y = _inputs(2, 1, 8, num_classes=3)
    assert model(x, t, y).dtype == torch.bfloat16  # fp32 images in, computed in the weights' dtype
    out = sample(model, y, (1, 8, 8), steps=2, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 1, 8, 8) and torch.isfinite(out).all()
    assert validation_loss(model, x.clamp(-1, 1), y, t_grid=(0.5,)).mean > 0
