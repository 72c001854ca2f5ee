"""The Muon-family update against references: fp32 reference, torch.optim.Muon, schedule identities."""

import copy

import pytest
import torch
from torch import nn

from dimuon.optim import FlattenedParameterWarning, Muon, MuonBP, PeriodicRowMuon, StepKind
from dimuon.optim.reference import ReferenceMuon

SHAPES = [(24, 40), (40, 24), (32, 32), (10, 70), (7, 3)]


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g, dtype=dtype)) for s in SHAPES]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in SHAPES]


def _run(opt, params, steps, dtype=torch.float32):
    for t in range(steps):
        for p, g in zip(params, _grads(t, dtype)):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def _max_rel(a, b):
    return max(((x.double() - y.double()).norm() / y.double().norm()).item() for x, y in zip(a, b))


def test_muon_original_matches_fp32_reference_of_torch_muon():
    ours = _params()
    ref = _params()
    opts = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    out = _run(Muon(ours, lr_scale="original", ns_dtype=torch.float32, **opts), ours, 10)
    expect = _run(ReferenceMuon(ref, lr_scale="original", **opts), ref, 10)
    assert _max_rel(out, expect) <= 1e-5


def test_reference_is_torch_muon_in_fp32():
    # Holds the oracle itself to torch.optim.Muon: run torch's update with its NS forced to fp32.
    import torch.optim._muon as tm

    ref = _params()
    theirs = _params()
    expect = _run(ReferenceMuon(ref, lr=0.02, weight_decay=0.1, lr_scale="original"), ref, 10)
    original = tm._zeropower_via_newtonschulz

    def fp32_ns(grad, coeffs, steps, eps):
        x = grad.float()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        a, b, c = coeffs
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    tm._zeropower_via_newtonschulz = fp32_ns
    try:
        got = _run(torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original"), theirs, 10)
    finally:
        tm._zeropower_via_newtonschulz = original
    assert _max_rel(got, expect) <= 1e-5


def test_matches_torch_muon_in_bf16():
    ours = _params()
    theirs = _params()
    opts = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    out = _run(Muon(ours, lr_scale="original", ns_dtype=torch.bfloat16, **opts), ours, 3)
    got = _run(torch.optim.Muon(theirs, adjust_lr_fn="original", **opts), theirs, 3)
    # Both orthogonalize in bf16 (8 mantissa bits); the updates agree to bf16 rounding.
    for a, b, p0 in zip(out, got, _params()):
        step_ours, step_theirs = a - p0, b - p0
        rel = (step_ours - step_theirs).norm() / step_theirs.norm()
        assert rel < 3e-2


@pytest.mark.parametrize("lr_scale", ["match_rms_adamw", "original", "none"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_periodic_k1_equals_muon(lr_scale, nesterov):
    a, b = _params(), _params()
    opts = dict(lr=0.01, lr_scale=lr_scale, nesterov=nesterov, weight_decay=0.05)
    out_a = _run(PeriodicRowMuon(a, k=1, gamma=0.3, **opts), a, 6)
    out_b = _run(Muon(b, **opts), b, 6)
    for x, y in zip(out_a, out_b):
        assert torch.equal(x, y)


def test_muonbp_one_block_equals_muon():
    a, b = _params(), _params()
    out_a = _run(MuonBP(a, lr=0.01, period=3, blocks=1, block_lr_ratio=1.0), a, 7)
    out_b = _run(Muon(b, lr=0.01), b, 7)
    for x, y in zip(out_a, out_b):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("cls", "schedule", "kw"),
    [
        (PeriodicRowMuon, "periodic_row_muon", dict(k=3, gamma=0.15)),
        (PeriodicRowMuon, "periodic_row_muon", dict(k=2, gamma=1.0)),
        (MuonBP, "muon_bp", dict(period=3, blocks=3, block_lr_ratio=0.7)),
        (MuonBP, "muon_bp", dict(period=5, blocks=4, block_lr_ratio=1.0)),
    ],
)
@pytest.mark.parametrize("lr_scale", ["match_rms_adamw", "original"])
def test_schedules_match_reference(cls, schedule, kw, lr_scale):
    ours, ref = _params(), _params()
    out = _run(cls(ours, lr=0.01, weight_decay=0.1, lr_scale=lr_scale, ns_dtype=torch.float32, **kw), ours, 8)
    expect = _run(ReferenceMuon(ref, lr=0.01, weight_decay=0.1, lr_scale=lr_scale, schedule=schedule, **kw), ref, 8)
    assert _max_rel(out, expect) <= 1e-5


def test_step_kind_sequences():
    p = [nn.Parameter(torch.randn(4, 6))]
    prm = PeriodicRowMuon(p, k=3)
    bp = MuonBP([nn.Parameter(torch.randn(4, 6))], period=4, blocks=2)
    kinds_prm, kinds_bp = [], []
    for opt, kinds in ((prm, kinds_prm), (bp, kinds_bp)):
        for _ in range(7):
            kinds.append(opt.step_kinds()[0])
            for q in opt.param_groups[0]["params"]:
                q.grad = torch.randn_like(q)
            opt.step()
    S, R, B = StepKind.SPECTRAL, StepKind.ROWNORM, StepKind.BLOCK
    assert kinds_prm == [S, R, R, S, R, R, S]
    assert kinds_bp == [S, B, B, B, S, B, B]


def test_rownorm_step_moves_each_oriented_row_by_gamma_lr_scale():
    w = nn.Parameter(torch.zeros(8, 32))
    opt = PeriodicRowMuon([w], lr=0.1, k=10, gamma=0.5, momentum=0.0, nesterov=False, lr_scale="none")
    w.grad = torch.randn(8, 32)
    opt.step()  # spectral (t = 0)
    before = w.detach().clone()
    w.grad = torch.randn(8, 32)
    opt.step()  # RowNorm (t = 1)
    moved = (w.detach() - before).norm(dim=1)
    torch.testing.assert_close(moved, torch.full((8,), 0.05))


def test_split_sizes_orthogonalize_chunks_apart():
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(24, 8))  # a fused (3 x 8, 8) matrix
    opt = Muon(
        [{"params": [w], "split_sizes": 3}],
        lr=1.0,
        momentum=0.0,
        nesterov=False,
        lr_scale="none",
        ns_coefficients="polar_express",
        ns_steps=10,
    )
    g = torch.randn(24, 8)
    w.grad = g
    opt.step()
    for chunk in torch.chunk(-w.detach(), 3):
        sv = torch.linalg.svdvals(chunk)
        assert sv.min() > 0.9 and sv.max() < 1.1  # each chunk is (nearly) orthogonal on its own
    # Without the split the whole 24 x 8 matrix is orthogonalized: its chunks are far from it.
    whole = nn.Parameter(torch.zeros(24, 8))
    whole.grad = g
    Muon(
        [whole], lr=1.0, momentum=0.0, nesterov=False, lr_scale="none", ns_coefficients="polar_express", ns_steps=10
    ).step()
    assert min(torch.linalg.svdvals(c).min() for c in torch.chunk(-whole.detach(), 3)) < 0.8


def test_bf16_params_keep_fp32_momentum_without_aliasing():
    w = nn.Parameter(torch.randn(16, 24, dtype=torch.bfloat16))
    opt = Muon([w], lr=0.01)
    g = torch.randn(16, 24, dtype=torch.bfloat16)
    w.grad = g.clone()
    opt.step()
    buf = opt.state[w]["momentum_buffer"]
    assert buf.dtype == torch.float32
    assert buf.data_ptr() != w.grad.data_ptr()
    assert torch.equal(w.grad, g)  # the gradient is never written
    torch.testing.assert_close(buf, 0.05 * g.float())


def test_conv_weight_is_flattened():
    conv = nn.Conv2d(4, 8, 3)
    ref = copy.deepcopy(conv)
    with pytest.warns(FlattenedParameterWarning, match=r"\(8, 4, 3, 3\)"):
        opt = Muon([conv.weight], lr=0.1, lr_scale="none", momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    g = torch.randn_like(conv.weight)
    conv.weight.grad = g
    opt.step()
    from dimuon.optim.reference import reference_orthogonalize

    expect = ref.weight.detach() - 0.1 * reference_orthogonalize(g.reshape(8, -1)).view_as(g)
    torch.testing.assert_close(conv.weight.detach(), expect, rtol=1e-5, atol=1e-6)
