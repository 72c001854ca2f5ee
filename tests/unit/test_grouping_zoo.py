"""param_groups over every transformer class of the installed diffusers (tiny configurations, nothing downloaded):
each builds, groups, and takes 3 steps of every optimizer (the families named in STEPPED_ALWAYS in every run, the
rest under ``-m slow``); no table, embedding, patch embedding, sinusoidal-input
linear or output projection lands in a Muon group."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from dimuon.dit.diffusers_zoo import build_tiny, transformer_classes
from dimuon.optim import OPTIMIZERS, build, param_groups

CLASSES = transformer_classes()
STEPPED_PARAMS = 500_000  # larger tiny models (big fixed-size convs or vocabularies) are grouped, not stepped
# Stepped in every run: the families the issue tracker and users name most; the rest of the zoo steps under -m slow.
STEPPED_ALWAYS = {
    "DiTTransformer2DModel",
    "PixArtTransformer2DModel",
    "SD3Transformer2DModel",
    "FluxTransformer2DModel",
    "WanTransformer3DModel",
    "HunyuanDiT2DModel",
    "SanaTransformer2DModel",
}
LINEAR_OR_CONV = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# A hidden layer whose shape equals the latents' in this tiny configuration (the shape oracle cannot tell them).
SHAPE_TWINS = {
    "MiniMaxH3Transformer3DModel": {"norm_out.linear.weight"},  # the final modulation: 2 x width = 96 = 4 x 24
    "MochiTransformer3DModel": {"time_embed.caption_proj.weight", "norm_out.linear.weight"},
}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    out = {}
    for cls in CLASSES:
        try:
            out[cls.__name__] = build_tiny(cls)
        except Exception as exc:  # a class the tiny configuration cannot build: listed, not hidden
            out[cls.__name__] = exc
    return out


def muon_names(model: nn.Module) -> set[str]:
    return {n for g in param_groups(model) if g["algorithm"] == "muon" for n, _ in g["params"]}


def latent_shapes(model: nn.Module) -> tuple[set[int], set[int]]:
    """Widths that read or write the latents: channels x patch volume (and the channels alone, for convs)."""
    cfg = dict(getattr(model, "config", {}))
    c_in = cfg.get("in_channels") if isinstance(cfg.get("in_channels"), int) else 0
    c_out = cfg.get("out_channels") if isinstance(cfg.get("out_channels"), int) else c_in
    patch = cfg.get("patch_size") or 1
    area = math.prod(patch) if isinstance(patch, (tuple, list)) else patch * patch
    volume = area * (cfg.get("patch_size_t") or 1)
    return {c_in * area, c_in * volume} - {0}, {c_out * area, c_out * volume, 2 * c_out * volume} - {0}


def test_every_transformer_class_builds_tiny(models):
    failed = {name: repr(m) for name, m in models.items() if isinstance(m, Exception)}
    assert len(models) >= 60 and not failed, failed


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_muon_gets_hidden_linear_and_conv_weights_only(models, cls):
    model = models[cls.__name__]
    if isinstance(model, Exception):
        pytest.skip(f"does not build tiny: {model}")
    modules = dict(model.named_modules())
    muon = muon_names(model)
    assert muon, "no hidden matrix found"
    reads, writes = latent_shapes(model)
    twins = SHAPE_TWINS.get(cls.__name__, set())
    wrong = []
    for name in muon:
        owner_name, _, leaf = name.rpartition(".")
        module = modules[owner_name]
        parent = modules.get(owner_name.rpartition(".")[0])
        if not isinstance(module, LINEAR_OR_CONV) or leaf != "weight":
            wrong.append((name, f"a {type(module).__name__}.{leaf}: not a linear map"))
        elif (
            type(parent).__name__.endswith("TimestepEmbedding")
            and owner_name.endswith("linear_1")
            and (module.in_features == 256 or any(w in owner_name for w in ("time", "guidance")))
        ):
            wrong.append((name, "the first linear of a timestep MLP (reads sinusoidal features)"))
        elif owner_name.count(".") <= 1 and name not in twins:  # the model's own input and output layers
            fan_in = module.in_features if isinstance(module, nn.Linear) else module.in_channels
            fan_out = module.out_features if isinstance(module, nn.Linear) else module.out_channels
            if fan_in in reads or (not isinstance(module, nn.Linear) and fan_in == dict(model.config)["in_channels"]):
                wrong.append((name, f"reads the latents ({tuple(module.weight.shape)}): a patch embedding"))
            if fan_out in writes:
                wrong.append((name, f"writes the latents ({tuple(module.weight.shape)}): an output projection"))
    assert not wrong, wrong


@pytest.mark.parametrize(
    "cls",
    [c if c.__name__ in STEPPED_ALWAYS else pytest.param(c, marks=pytest.mark.slow) for c in CLASSES],
    ids=lambda c: c.__name__,
)
def test_three_steps_of_every_optimizer(models, cls):
    model = models[cls.__name__]
    if isinstance(model, Exception):
        pytest.skip(f"does not build tiny: {model}")
    if sum(p.numel() for p in model.parameters()) > STEPPED_PARAMS:
        pytest.skip(f"over {STEPPED_PARAMS} parameters at its tiny configuration: grouped above, not stepped")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    flattened = [n for g in param_groups(model) if g["algorithm"] == "muon" for n, p in g["params"] if p.ndim > 2]
    for name in OPTIMIZERS:
        model.load_state_dict(start, strict=False)
        if name == "torch_muon" and flattened:  # torch's Muon takes 2-D parameters only: it says so, by name
            with pytest.raises(ValueError, match=rf"takes 2-D parameters only, and '{flattened[0]}' with shape"):
                build(name, model, lr=1e-3)
            continue
        opt = build(name, model, lr=1e-3)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            opt.step()
            opt.zero_grad()
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, start[n])]
        assert not bad and moved, (name, bad)
    model.load_state_dict(start, strict=False)
