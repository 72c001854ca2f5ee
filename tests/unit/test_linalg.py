"""Direction maps against exact answers: SVD polar factor, unit rows, batched == per-matrix."""

import pytest
import torch

from dimuon.optim import linalg


def _polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


SHAPES = [(16, 64), (64, 16), (32, 32), (24, 96), (8, 200)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_singular_values_in_band_and_aligned_with_polar(shape, coefficients, algorithm):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    y = linalg.newton_schulz(x, coefficients=coefficients, algorithm=algorithm, dtype=torch.float64)
    assert y.shape == x.shape
    sv = torch.linalg.svdvals(y)
    # Quintic NS5 is known to land singular values in roughly [0.68, 1.14] on Gaussian input;
    # Polar Express is tighter. Both keep the singular vectors of the polar factor.
    lo, hi = (0.6, 1.2) if coefficients == "quintic" else (0.8, 1.2)
    assert sv.min() > lo and sv.max() < hi
    cos = (y * _polar(x)).sum() / (y.norm() * _polar(x).norm())
    assert cos > 0.97


def test_many_steps_converge_to_polar_factor():
    torch.manual_seed(1)
    x = torch.randn(20, 50, dtype=torch.float64)
    y = linalg.newton_schulz(x, steps=12, coefficients="polar_express", dtype=torch.float64)
    # Polar Express repeats its last (convergent) row: the singular values approach 1.
    assert torch.allclose(torch.linalg.svdvals(y), torch.ones(20, dtype=torch.float64), atol=0.05)


@pytest.mark.parametrize("shape", [(32, 96), (16, 128), (96, 32), (48, 48)])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_gram_matches_standard_fp32(shape, coefficients):
    torch.manual_seed(2)
    x = torch.randn(3, *shape)
    std = linalg.newton_schulz(x, coefficients=coefficients, algorithm="standard", dtype=torch.float32)
    for restart in (0, 1, 2, 3):
        gram = linalg.newton_schulz(
            x, coefficients=coefficients, algorithm="gram", dtype=torch.float32, gram_restart_every=restart
        )
        rel = (gram - std).norm() / std.norm()
        assert rel < 1e-5, (restart, rel)


def test_gram_matches_standard_on_low_rank_input():
    # Gradients are often close to low rank: R has eigenvalues spanning many decades.
    torch.manual_seed(3)
    x = torch.randn(64, 4) @ torch.randn(4, 256) + 1e-3 * torch.randn(64, 256)
    std = linalg.newton_schulz(x, algorithm="standard", dtype=torch.float32)
    gram = linalg.newton_schulz(x, algorithm="gram", dtype=torch.float32)
    assert (gram - std).norm() / std.norm() < 1e-4


def test_batched_equals_per_matrix_and_input_untouched():
    torch.manual_seed(4)
    x = torch.randn(5, 12, 40)
    before = x.clone()
    batched = linalg.newton_schulz(x, dtype=torch.float32)
    single = torch.stack([linalg.newton_schulz(m, dtype=torch.float32) for m in x])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-6)
    assert torch.equal(x, before)


@pytest.mark.parametrize("shape", [(3, 12, 40), (3, 40, 12)], ids=["wide", "tall"])
@pytest.mark.parametrize("given", [torch.float32, torch.bfloat16], ids=["cast", "bf16_input"])
def test_bf16_iteration_normalizes_its_own_cast_in_place_and_never_writes_the_input(shape, given):
    """In bf16 the first iterate is the normalized input: written over the cast copy where the function made one
    (wide, from fp32), into a new tensor otherwise; the input is never written and the result is the same."""
    torch.manual_seed(5)
    x = torch.randn(*shape).to(given)
    before = x.clone()
    out = linalg.newton_schulz(x, dtype=torch.bfloat16)
    assert torch.equal(x, before)
    copy = x.to(torch.bfloat16).clone()  # a copy the function cannot own: the out-of-place normalization
    assert torch.equal(out, linalg.newton_schulz(copy, dtype=torch.bfloat16))


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("given", [torch.float32, torch.float16], ids=["cast", "fp16_input"])
def test_fp16_iteration_survives_a_norm_past_fp16_range(given, coefficients, algorithm):
    """Every entry fits in fp16 but the Frobenius norm (> 65504) does not: the fp16 iteration divides by the fp32
    norm and matches fp32 Newton-Schulz (it used to divide by inf and return zeros)."""
    x = (torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(3)) * 600).to(given)
    assert x.float().norm(dim=(-2, -1)).min() > 65504 and x.abs().max() < 65504
    wide = linalg.newton_schulz(x.float(), coefficients=coefficients, algorithm=algorithm, dtype=torch.float32)
    half = linalg.newton_schulz(x, coefficients=coefficients, algorithm=algorithm, dtype=torch.float16)
    assert torch.isfinite(half).all()
    assert ((half.float() - wide).norm() / wide.norm()).item() < 0.02


def test_zero_matrix_stays_zero_and_finite():
    y = linalg.newton_schulz(torch.zeros(8, 16), dtype=torch.float32)
    assert torch.equal(y, torch.zeros(8, 16))
    r = linalg.row_normalize(torch.zeros(4, 6))
    assert torch.equal(r, torch.zeros(4, 6))


@pytest.mark.parametrize("shape", [(6, 20), (20, 6), (9, 9)])
def test_rownorm_gives_unit_oriented_rows(shape):
    torch.manual_seed(5)
    x = torch.randn(*shape)
    r = linalg.row_normalize(x)
    dim = -1 if shape[0] <= shape[1] else -2
    torch.testing.assert_close(r.norm(dim=dim), torch.ones(min(shape)))
    # Same direction per oriented row: positive multiples of the input.
    ratio = r / x
    spread = ratio.std(dim=dim) / ratio.mean(dim=dim)
    assert (ratio > 0).all() and spread.abs().max() < 1e-5


def test_rownorm_rms_equals_spectral_rms_for_wide():
    # docs/algorithms.md, RowNorm: unit oriented rows have the RMS of an orthogonal-rows matrix.
    x = torch.randn(16, 64, dtype=torch.float64)
    assert torch.isclose(linalg.row_normalize(x).pow(2).mean().sqrt(), _polar(x).pow(2).mean().sqrt())


def test_lr_scales():
    assert linalg.lr_scale_factor("original", 64, 16) == pytest.approx(2.0)
    assert linalg.lr_scale_factor("original", 16, 64) == 1.0
    assert linalg.lr_scale_factor("match_rms_adamw", 16, 64) == pytest.approx(0.2 * 8)
    assert linalg.lr_scale_factor("none", 3, 5) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"coefficients": "cubic"}, "ns_coefficients must be one of"),
        ({"algorithm": "svd"}, "ns_algorithm must be one of"),
        ({"steps": 0}, "ns_steps must be >= 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linalg.newton_schulz(torch.randn(4, 8), **kwargs)
    with pytest.raises(ValueError, match="lr_scale must be one of"):
        linalg.lr_scale_factor("adam", 2, 2)


def test_default_dtype_is_fp32_on_cpu():
    assert linalg.default_ns_dtype(torch.device("cpu")) == torch.float32
    assert linalg.newton_schulz(torch.randn(4, 8, dtype=torch.float64)).dtype == torch.float32


@pytest.mark.parametrize("shape", [(70, 9), (3, 70, 9), (9, 70), (3, 9, 70)])
@pytest.mark.parametrize("dim", [-1, -2])
def test_square_sums_in_row_chunks_match_one_reduction(shape, dim, monkeypatch):
    """The CPU's chunked squares (chunks of 64 elements here, uneven at the end) sum what one reduction sums."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    whole = x.square().sum(dim=dim, keepdim=True)
    monkeypatch.setattr(linalg, "_CPU_SQUARE_CHUNK", 64)
    chunked = linalg.square_sums(x, dim)
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (2, 6, 9), (2, 9, 6), (5, 5)])
def test_row_factors_times_the_matrix_is_row_normalize(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    f = linalg.row_factors(x, scale=0.3)
    assert f.dtype == torch.float32
    assert f.shape[-1] == 1 if shape[-2] <= shape[-1] else f.shape[-2] == 1  # row factors, or column factors
    torch.testing.assert_close(x * f, linalg.row_normalize(x, scale=0.3))
    oriented = (x.float() * f).norm(dim=-1 if shape[-2] <= shape[-1] else -2)
    torch.testing.assert_close(oriented, torch.full_like(oriented, 0.3))
