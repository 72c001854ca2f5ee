"""AdaptiveRowMuon: per-matrix refresh decisions, their bounds, identities, the reference, one core, the stats."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from dimuon.optim import AdaptiveRowMuon, Muon, PeriodicRowMuon, StepKind, build
from dimuon.optim.distributed.engine import LocalEngine
from dimuon.optim.reference import ReferenceMuon
from dimuon.optim.staleness import reference_row_sums, staleness_from_sums, staleness_partial_sums

S, R = StepKind.SPECTRAL, StepKind.ROWNORM
SHAPES = [(24, 40), (40, 24), (32, 32), (10, 70), (7, 3)]


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _run(opt, params, steps: int, seed: int = 1000) -> list[torch.Tensor]:
    for t in range(steps):
        g = torch.Generator().manual_seed(seed + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return [p.detach().clone() for p in params]


def _kinds_of_each_step(opt, params, grads_per_step) -> list[list[StepKind]]:
    """Feed the given gradients; each step's kind per parameter, read from the refresh statistics."""
    out = []
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.reset_refresh_stats()
        opt.step()
        stats = opt.refresh_stats()["matrices"]
        out.append([S if stats[f"params[{i}] of group 0"]["spectral"] else R for i in range(len(params))])
    return out


def _cos(a, b):
    return (a * b).sum() / (a.norm() * b.norm())


def test_staleness_of_partial_sums_adds_up_over_row_pieces():
    g = torch.Generator().manual_seed(0)
    u_s = torch.randn(10, 6, generator=g)
    o, u = (u_s + scale * torch.randn(10, 6, generator=g) for scale in (0.3, 1.0))  # aligned, then less so
    ranges = ((0, 4), (4, 10))
    rows = reference_row_sums(u_s, o)
    whole = staleness_partial_sums(u, o, rows, ranges)
    pieces = staleness_partial_sums(u[:7], o[:7], rows[:7], ((0, 4), (4, 7))) + staleness_partial_sums(
        u[7:], o[7:], rows[7:], (None, (0, 3))
    )
    torch.testing.assert_close(pieces, whole)
    expect = torch.stack([1 - _cos(u[a:b], o[a:b]) / _cos(u_s[a:b], o[a:b]) for a, b in ranges])
    torch.testing.assert_close(staleness_from_sums(whole), expect)
    assert staleness_from_sums(torch.zeros(1, 4)).item() == float("inf")  # no reference yet: stale


@pytest.mark.parametrize("shape", [(128, 512), (384, 128)])
def test_a_bf16_reference_gives_the_fp32_signal(shape):
    from dimuon.optim.linalg import newton_schulz

    g = torch.Generator().manual_seed(0)
    u_s = torch.randn(*shape, generator=g) * torch.rand(shape[1], generator=g)  # uneven column scales
    o_s = newton_schulz(u_s, dtype=torch.float32)
    for noise in (0.3, 1.0, 3.0):
        u = u_s + noise * u_s.std() * torch.randn(*shape, generator=g)
        fp32, bf16 = (
            staleness_from_sums(staleness_partial_sums(u, o, reference_row_sums(u_s, o), ((0, shape[0]),)))
            for o in (o_s, o_s.to(torch.bfloat16))
        )
        assert (fp32 - bf16).abs().item() <= 2e-5


def test_decisions_follow_the_rule_on_constructed_momenta():
    # momentum 0 without Nesterov: the momentum U is the gradient itself. Against the direction O_s computed
    # from A, the momentum A has staleness 0 and -A has staleness 2 (its cosine with O_s flipped sign).
    g = torch.Generator().manual_seed(0)
    a, b = nn.Parameter(torch.zeros(4, 6)), nn.Parameter(torch.zeros(6, 4))
    opt = AdaptiveRowMuon([a, b], lr=0.1, momentum=0.0, nesterov=False, threshold=0.3, k_min=2, k_max=4)
    grad_a, grad_b = torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g)
    steps = [
        (grad_a, grad_b),  # t0: never refreshed: spectral
        (-grad_a, -grad_b),  # t1: age 1 < k_min: RowNorm however stale
        (-grad_a, grad_b),  # t2: age 2: a has staleness 2 > 0.3 (spectral), b 0 (RowNorm)
        (-grad_a, grad_b),  # t3: a age 1 (RowNorm); b age 3, staleness 0 (RowNorm)
        (-grad_a, grad_b),  # t4: a age 2, staleness 0 (RowNorm); b age 4 = k_max: forced
        (-grad_a, grad_b),  # t5: a age 3, staleness 0 (RowNorm); b age 1 (RowNorm)
        (-grad_a, grad_b),  # t6: a age 4 = k_max: forced; b age 2, staleness 0 (RowNorm)
    ]
    kinds = _kinds_of_each_step(opt, [a, b], steps)
    assert kinds == [[S, S], [R, R], [S, R], [R, R], [R, S], [R, R], [S, R]]
    assert [opt.state[p]["refresh_age"] for p in (a, b)] == [1, 3]
    assert opt.step_kinds() == [None]  # decided per matrix at the step, not per group


def test_a_group_may_set_its_own_threshold():
    a, b = nn.Parameter(torch.zeros(4, 6)), nn.Parameter(torch.zeros(4, 6))
    opt = AdaptiveRowMuon(
        [{"params": [a]}, {"params": [b], "threshold": 0.3}],
        lr=0.1,
        momentum=0.0,
        nesterov=False,
        threshold=5.0,
        k_min=1,
        k_max=9,
    )
    grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    for g in (grad, -grad):  # staleness 2 at the second step
        a.grad, b.grad = g.clone(), g.clone()
        opt.reset_refresh_stats()
        opt.step()
    stats = opt.refresh_stats()["matrices"]
    assert stats["params[0] of group 0"]["spectral"] == 0 and stats["params[0] of group 1"]["spectral"] == 1


def test_a_fused_matrix_refreshes_when_any_of_its_parts_went_stale():
    w = nn.Parameter(torch.zeros(8, 4))
    opt = AdaptiveRowMuon(
        [{"params": [w], "split_sizes": 2}], lr=0.1, momentum=0.0, nesterov=False, threshold=0.3, k_min=1, k_max=9
    )
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    half_flipped = grad.clone()
    half_flipped[4:] *= -1  # the second chunk's staleness is 2, the first's 0
    kinds = _kinds_of_each_step(opt, [w], [(grad,), (grad,), (half_flipped,)])
    assert kinds == [[S], [R], [S]]


@pytest.mark.parametrize(("threshold", "k_min", "k_max"), [(0.0, 2, 5), (1e9, 1, 4), (0.2, 1, 3), (0.05, 2, 6)])
def test_intervals_stay_within_k_min_and_k_max(threshold, k_min, k_max):
    params = _params()
    opt = AdaptiveRowMuon(params, lr=0.01, threshold=threshold, k_min=k_min, k_max=k_max)
    spectral_at: list[list[int]] = [[] for _ in params]
    for t in range(24):
        g = torch.Generator().manual_seed(t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.reset_refresh_stats()
        opt.step()
        for i, stats in enumerate(opt.refresh_stats()["matrices"].values()):
            if stats["spectral"]:
                spectral_at[i].append(t)
    for times in spectral_at:
        assert times[0] == 0
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(k_min <= gap <= k_max for gap in gaps), gaps
        if threshold == 0.0:
            assert set(gaps) == {k_min}  # random gradients always go stale: refreshed as soon as allowed
        if threshold == 1e9:
            assert set(gaps) == {k_max}  # never that stale: refreshed only when forced


def test_equal_bounds_are_periodic_row_muon_and_zero_threshold_is_muon():
    a, b = _params(), _params()
    out_a = _run(AdaptiveRowMuon(a, lr=0.01, k_min=3, k_max=3, gamma=0.2, weight_decay=0.1), a, 9)
    out_b = _run(PeriodicRowMuon(b, lr=0.01, k=3, gamma=0.2, weight_decay=0.1), b, 9)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b))
    a, b = _params(), _params()
    out_a = _run(AdaptiveRowMuon(a, lr=0.01, threshold=0.0, k_min=1, k_max=4), a, 6)
    out_b = _run(Muon(b, lr=0.01), b, 6)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b))


@pytest.mark.parametrize(
    "kw",
    [
        dict(threshold=0.02, k_min=1, k_max=5),
        dict(threshold=0.1, k_min=1, k_max=4, gamma=0.5),
        dict(threshold=0.02, k_min=1, k_max=5, signal_lag=1),  # decided from the previous step's signal
        dict(threshold=0.05, k_min=2, k_max=6, signal_lag=1),
    ],
)
def test_matches_the_reference_update_and_decisions(kw):
    ours, ref = _params(), _params()
    opt = AdaptiveRowMuon(ours, lr=0.01, weight_decay=0.1, lr_scale="original", ns_dtype=torch.float32, **kw)
    oracle = ReferenceMuon(ref, lr=0.01, weight_decay=0.1, lr_scale="original", schedule="adaptive_row_muon", **kw)
    base = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(ours)]
    decisions = []
    for t in range(12):
        g = torch.Generator().manual_seed(2000 + t)
        grads = [b + 0.5 * torch.randn(p.shape, generator=g) for p, b in zip(ours, base)]  # momenta settle
        for p, q, grad in zip(ours, ref, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.reset_refresh_stats()
        opt.step()
        oracle.step()
        decisions.append([S if m["spectral"] else R for m in opt.refresh_stats()["matrices"].values()])
    assert decisions == oracle.decisions
    assert {k for step in decisions for k in step} == {S, R}  # both kinds were taken
    for x, y in zip(ours, ref):
        assert ((x - y).norm() / y.norm()).item() <= 1e-5


class RecordingEngine(LocalEngine):
    """The single-process engine, recording which jobs each call gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def directions(self, jobs, kind, config):
        self.calls.append((kind.value, [j.name for j in jobs]))
        return super().directions(jobs, kind, config)

    def row_directions(self, jobs, config):
        self.calls.append(("rownorm", [j.name for j in jobs]))
        return super().row_directions(jobs, config)

    def matrix_sums(self, jobs, partial_sums):
        self.calls.append(("sums", [j.name for j in jobs]))
        return super().matrix_sums(jobs, partial_sums)


def test_one_engine_call_per_kind_with_only_the_chosen_matrices():
    a, b, c = (nn.Parameter(torch.zeros(4, 6)) for _ in range(3))
    engine = RecordingEngine()
    opt = AdaptiveRowMuon(
        [("a", a), ("b", b), ("c", c)],
        lr=0.1,
        momentum=0.0,
        nesterov=False,
        threshold=0.3,
        k_min=1,
        k_max=3,
        engine=engine,
    )
    one = torch.ones(4, 6)
    for grads in [(one, one, one), (-one, one, one), (one, one, one)]:
        for p, g in zip((a, b, c), grads):
            p.grad = g.clone()
        opt.step()
    assert engine.calls == [
        ("spectral", ["a", "b", "c"]),  # t0: every matrix refreshes first; nothing to measure
        ("sums", ["a", "b", "c"]),
        ("spectral", ["a"]),
        ("rownorm", ["b", "c"]),  # t1: only a turned
        ("sums", ["a", "b", "c"]),
        ("spectral", ["a"]),
        ("rownorm", ["b", "c"]),  # t2: a turned back
    ]


def test_signals_of_every_group_take_one_reduction():
    a, b = nn.Parameter(torch.zeros(4, 6)), nn.Parameter(torch.zeros(6, 4))
    engine = RecordingEngine()
    opt = AdaptiveRowMuon(
        [{"params": [("a", a)]}, {"params": [("b", b)], "gamma": 0.3}], lr=0.1, k_min=1, engine=engine
    )
    for _ in range(3):
        a.grad, b.grad = torch.randn(4, 6), torch.randn(6, 4)
        opt.step()
    assert [c for c in engine.calls if c[0] == "sums"] == [("sums", ["a", "b"])] * 2


def test_refresh_stats_count_spectral_steps_per_matrix_and_overall():
    params = _params()
    opt = PeriodicRowMuon(params, lr=0.01, k=3)
    _run(opt, params, 7)
    stats = opt.refresh_stats()
    assert stats["spectral"] == 3 * len(params) and stats["steps"] == 7 * len(params)
    assert stats["spectral_fraction"] == pytest.approx(3 / 7)
    assert all(m == {"spectral": 3, "steps": 7, "fraction": 3 / 7} for m in stats["matrices"].values())
    opt.reset_refresh_stats()
    assert opt.refresh_stats() == {"spectral_fraction": 0.0, "spectral": 0, "steps": 0, "matrices": {}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_state_keeps_its_dtypes_through_a_state_dict_round_trip(dtype):
    params = [nn.Parameter(p.detach().to(dtype)) for p in _params()]
    opt = build("adaptive_row_muon", params, lr=0.01, k_min=1, threshold=0.2)
    _run(opt, params, 3)
    sd = opt.state_dict()
    fresh = AdaptiveRowMuon([nn.Parameter(p.detach().clone()) for p in params], lr=0.01, k_min=1, threshold=0.2)
    fresh.load_state_dict(sd)  # torch casts state to the parameters' dtype; it comes back as saved, exactly
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        assert opt.state[p]["refresh_direction"].dtype is torch.bfloat16
        assert opt.state[p]["refresh_row_sums"].shape == (p.shape[0], 2)
        for key in ("refresh_direction", "refresh_row_sums", "momentum_buffer"):
            assert fresh.state[q][key].dtype == opt.state[p][key].dtype, key
            assert torch.equal(fresh.state[q][key], opt.state[p][key]), key
        assert fresh.state[q]["refresh_age"] == opt.state[p]["refresh_age"]


def test_a_lagged_signal_reads_nothing_it_waits_for_and_resumes_exactly_from_a_state_dict():
    """signal_lag=1: the decision takes the values measured one step earlier (no read of this step's signal), and a
    state_dict taken mid-run carries them, so a fresh optimizer continues with the same decisions and weights."""
    kw = dict(threshold=0.02, k_min=1, k_max=5, signal_lag=1, lr=0.01, ns_dtype=torch.float32)
    ours = _params()
    opt = AdaptiveRowMuon(ours, **kw)
    base = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(ours)]

    def grads(t):
        g = torch.Generator().manual_seed(3000 + t)
        return [b + 0.5 * torch.randn(p.shape, generator=g) for p, b in zip(ours, base)]

    def run(o, params, steps):
        out = []
        for t in steps:
            for p, grad in zip(params, grads(t)):
                p.grad = grad.clone()
            o.reset_refresh_stats()
            o.step()
            out.append([m["spectral"] for m in o.refresh_stats()["matrices"].values()])
        return out

    run(opt, ours, range(5))
    saved = copy.deepcopy(opt.state_dict())
    twin = [p.detach().clone().requires_grad_() for p in ours]
    straight = run(opt, ours, range(5, 12))
    again = AdaptiveRowMuon(twin, **kw)
    again.load_state_dict(saved)
    assert run(again, twin, range(5, 12)) == straight
    for a, b in zip(ours, twin):
        assert torch.equal(a, b)
    assert any(any(step) for step in straight) and not all(all(step) for step in straight)


def _lagged_run(params, steps, opt, *, gradless=(), raise_before=(), seed: int = 1):
    """Steps of ``opt`` on seeded gradients; ``gradless``: (step, param index) pairs without a gradient;
    ``raise_before``: steps first tried with an inf gradient (raised on), then taken with the finite ones."""
    kinds = []
    for t in steps:
        g = torch.Generator().manual_seed(seed * 1000 + t)
        grads = [torch.randn(p.shape, generator=g) for p in params]
        if t in raise_before:
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            params[0].grad[0, 0] = float("inf")
            with pytest.raises(FloatingPointError):
                opt.step()
        for i, (p, grad) in enumerate(zip(params, grads)):
            p.grad = None if (t, i) in gradless else grad
        opt.reset_refresh_stats()
        opt.step()
        kinds.append([m["spectral"] for m in opt.refresh_stats()["matrices"].values()])
    return kinds


def test_a_lagged_signal_step_raised_on_changes_no_decision():
    """nonfinite="raise": a step raised on leaves the lagged signals as they were, so retrying it with finite
    gradients gives the run that never saw it (decisions and weights, bit for bit)."""
    kw = dict(threshold=0.35, k_min=1, k_max=8, signal_lag=1, lr=0.01, ns_dtype=torch.float32)
    ours, twin = _params(), _params()
    straight = _lagged_run(ours, range(30), AdaptiveRowMuon(ours, **kw))
    retried = _lagged_run(twin, range(30), AdaptiveRowMuon(twin, **kw), raise_before=set(range(4, 30, 3)))
    assert retried == straight
    assert all(torch.equal(a, b) for a, b in zip(ours, twin))
    assert any(any(step) for step in straight[1:]) and not all(all(step) for step in straight)


def test_a_lagged_signal_resumes_exactly_after_a_step_without_a_gradient():
    """A matrix without a gradient at the step before a checkpoint keeps its older signal: the live run and the run
    resumed from the state_dict decide alike (here the older signal is past the threshold at step 4)."""

    def make():
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(8, 6)) for _ in range(2)]
        return params, AdaptiveRowMuon(params, lr=0.02, signal_lag=1, threshold=0.5, ns_dtype=torch.float32)

    def run(params, opt, steps, g):
        kinds = []
        for t in steps:
            for i, p in enumerate(params):
                grad = torch.randn(8, 6, generator=g)
                p.grad = None if (t, i) == (3, 1) else grad
            opt.reset_refresh_stats()
            opt.step()
            kinds.append([m["spectral"] for m in opt.refresh_stats()["matrices"].values()])
        return kinds

    ours, opt = make()
    g = torch.Generator().manual_seed(1)
    run(ours, opt, range(4), g)
    saved, rng = copy.deepcopy(opt.state_dict()), g.get_state()
    assert "refresh_signal" in saved["state"][1]  # measured at step 2, before its step without a gradient
    twin, again = make()
    with torch.no_grad():
        for a, b in zip(twin, ours):
            a.copy_(b)
    straight = run(ours, opt, range(4, 10), g)
    again.load_state_dict(saved)
    assert run(twin, again, range(4, 10), g.set_state(rng)) == straight
    assert straight[0] == [0, 1]  # the older signal decides step 4
    assert all(torch.equal(a, b) for a, b in zip(ours, twin))


@pytest.mark.parametrize("bad", [2, -1, True, 0.5])
def test_signal_lag_other_than_0_or_1_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"signal_lag must be 0 or 1"):
        AdaptiveRowMuon(_params(), signal_lag=bad)
    with pytest.raises(ValueError, match=r"signal_lag \(parameter group 0\) must be 0 or 1"):
        AdaptiveRowMuon([{"params": _params(), "signal_lag": bad}])
