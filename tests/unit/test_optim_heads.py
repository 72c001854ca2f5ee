"""Column splits (per-head output projections), per-head helpers and stacked matrices (experts), held to the
reference implementation for every optimizer; validation, state_dict round trips, one batched call per stack."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from dimuon.optim import (
    DIT_FUSED_SPLITS,
    AdaptiveRowMuon,
    FlattenedParameterWarning,
    HeadSplits,
    Muon,
    MuonBP,
    PeriodicRowMuon,
    StepKind,
    dit_per_head_splits,
    param_groups,
    per_head_splits,
)
from dimuon.optim.reference import ReferenceMuon

pytestmark = pytest.mark.usefixtures("one_thread")

S, R = StepKind.SPECTRAL, StepKind.ROWNORM

# Per configuration: the shapes of its parameters and their group options. Tall and wide logical matrices,
# uneven chunks, a square matrix cut into tall chunks, stacked matrices of one, several and 4-D slices.
CONFIGS = {
    "cols": (
        [(24, 40), (12, 30), (16, 16)],
        [{"col_split_sizes": 4}, {"col_split_sizes": (10, 20)}, {"col_split_sizes": 2}],
    ),
    "rows_and_cols": (
        [(24, 40), (18, 12)],
        [{"split_sizes": 3, "col_split_sizes": 4}, {"split_sizes": (6, 12), "col_split_sizes": 3}],
    ),
    "stacked": ([(3, 8, 12), (2, 12, 8), (4, 5, 5), (1, 6, 10)], [{"stacked": True}] * 4),
    "stacked_split": (
        [(3, 12, 8), (2, 8, 3, 4)],
        [{"stacked": True, "split_sizes": 2, "col_split_sizes": 2}, {"stacked": True, "col_split_sizes": (4, 8)}],
    ),
    # One-column and one-row logical matrices: a RowNorm factor of shape (1, 1) is a column one in an (r, 1) chunk.
    "one_column_or_row": (
        [(6, 1), (3, 4, 1), (5, 1), (1, 6)],
        [{"split_sizes": (2, 4)}, {"stacked": True}, {"split_sizes": 5}, {"col_split_sizes": (2, 4)}],
    ),
}
OPTIMIZERS = {
    "muon": (Muon, "muon", {}),
    "prm": (PeriodicRowMuon, "periodic_row_muon", {"k": 2, "gamma": 0.5}),
    "bp": (MuonBP, "muon_bp", {"period": 3, "blocks": (2, 2), "block_lr_ratio": 0.7}),
    "arm": (AdaptiveRowMuon, "adaptive_row_muon", {"threshold": 0.05, "k_min": 1, "k_max": 4}),
}


def _params(shapes, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(shapes, t: int, base: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fixed direction per parameter plus noise: the momenta settle, so the adaptive schedule takes both kinds."""
    g = torch.Generator().manual_seed(2000 + t)
    return [b + 0.5 * torch.randn(*s, generator=g) for s, b in zip(shapes, base)]


def _references(params, options, schedule: str, kw: dict, lr_scale: str) -> list[ReferenceMuon]:
    return [
        ReferenceMuon([p], lr=0.01, weight_decay=0.1, lr_scale=lr_scale, schedule=schedule, **kw, **o)
        for p, o in zip(params, options)
    ]


@pytest.mark.parametrize("lr_scale", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_optimizer_matches_the_reference(optimizer, config, lr_scale):
    cls, schedule, kw = OPTIMIZERS[optimizer]
    shapes, options = CONFIGS[config]
    ours, theirs = _params(shapes), _params(shapes)
    opt = cls(
        [{"params": [p], **o} for p, o in zip(ours, options)],
        lr=0.01,
        weight_decay=0.1,
        lr_scale=lr_scale,
        ns_dtype=torch.float32,
        **kw,
    )
    oracles = _references(theirs, options, schedule, kw, lr_scale)
    base = [torch.randn(*s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    decisions, expected = [], []
    for t in range(8):
        for p, q, grad in zip(ours, theirs, _grads(shapes, t, base)):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.reset_refresh_stats()
        opt.step()
        for oracle in oracles:
            oracle.step()
        decisions.append([S if m["spectral"] else R for m in opt.refresh_stats()["matrices"].values()])
        expected.append([o.decisions[-1][0] for o in oracles])
    if optimizer == "arm":
        assert decisions == expected
        assert {k for step in decisions for k in step} == {S, R}  # both kinds were taken
    for x, y in zip(ours, theirs):
        assert ((x - y).norm() / y.norm()).item() <= 1e-5, (x.shape, ((x - y).norm() / y.norm()).item())


def _step_once(opt, params, grads) -> list[torch.Tensor]:
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return [b - p.detach() for p, b in zip(params, before)]


def test_column_chunks_are_orthogonalized_apart():
    w = nn.Parameter(torch.zeros(8, 24))  # three (8, 8) heads side by side, as in an output projection
    g = torch.randn(8, 24, generator=torch.Generator().manual_seed(0))
    opts = dict(lr=1.0, momentum=0.0, nesterov=False, lr_scale="none", ns_coefficients="polar_express", ns_steps=10)
    (d,) = _step_once(Muon([{"params": [w], "col_split_sizes": 3}], **opts), [w], [g])
    for chunk in d.split(8, dim=1):
        sv = torch.linalg.svdvals(chunk)
        assert sv.min() > 0.9 and sv.max() < 1.1  # each head's columns are (nearly) orthogonal on their own
    whole = nn.Parameter(torch.zeros(8, 24))
    (d,) = _step_once(Muon([whole], **opts), [whole], [g])
    assert min(torch.linalg.svdvals(c).min() for c in d.split(8, dim=1)) < 0.8  # not so without the split


def test_a_column_split_changes_which_rows_rownorm_normalizes():
    # A (16, 16) output projection in 4 heads: each (16, 4) chunk is tall, so its oriented rows are the columns
    # of W, each normalized on its own; unsplit, the square matrix normalizes the rows of W.
    g = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    opts = dict(lr=1.0, k=10, gamma=1.0, momentum=0.0, nesterov=False, lr_scale="none")
    split, plain = nn.Parameter(torch.zeros(16, 16)), nn.Parameter(torch.zeros(16, 16))
    opt_split = PeriodicRowMuon([{"params": [split], "col_split_sizes": 4}], **opts)
    opt_plain = PeriodicRowMuon([plain], **opts)
    for opt, p in ((opt_split, split), (opt_plain, plain)):
        _step_once(opt, [p], [g])  # t = 0: spectral
    (d_split,) = _step_once(opt_split, [split], [g])  # t = 1: RowNorm
    (d_plain,) = _step_once(opt_plain, [plain], [g])
    torch.testing.assert_close(d_split.norm(dim=0), torch.ones(16))  # every column of every head: unit norm
    torch.testing.assert_close(d_plain.norm(dim=1), torch.ones(16))  # unsplit: every row
    assert not torch.allclose(d_split.norm(dim=1), torch.ones(16), atol=1e-2)
    # A wide chunk (4, 16) of a (4, 32) matrix: rows of the chunk, i.e. half rows of W, each of unit norm.
    w = nn.Parameter(torch.zeros(4, 32))
    opt = PeriodicRowMuon([{"params": [w], "col_split_sizes": 2}], **opts)
    gw = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    _step_once(opt, [w], [gw])
    (d,) = _step_once(opt, [w], [gw])
    torch.testing.assert_close(d.reshape(4, 2, 16).norm(dim=2), torch.ones(4, 2))


def test_the_shape_scale_is_that_of_each_chunk():
    # match_rms_adamw: 0.2 sqrt(max(m, n)) of the chunk. A (6, 40) matrix in 4 column chunks of (6, 10):
    # 0.2 sqrt(10) per chunk, against 0.2 sqrt(40) for the whole matrix.
    g = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    w = nn.Parameter(torch.zeros(6, 40))
    opt = PeriodicRowMuon(
        [{"params": [w], "col_split_sizes": 4}], lr=1.0, k=10, gamma=1.0, momentum=0.0, nesterov=False
    )
    _step_once(opt, [w], [g])
    (d,) = _step_once(opt, [w], [g])  # RowNorm: each of the 6 rows of each (6, 10) chunk has norm = the scale
    torch.testing.assert_close(d.reshape(6, 4, 10).norm(dim=2), torch.full((6, 4), 0.2 * 10**0.5))


def test_stacked_matrices_take_one_batched_newton_schulz_call(monkeypatch):
    import dimuon.optim.distributed.engine as engine

    calls = []
    original = engine.newton_schulz

    def recording(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(engine, "newton_schulz", recording)
    experts, more = nn.Parameter(torch.randn(6, 8, 16)), nn.Parameter(torch.randn(2, 8, 16))
    opt = Muon([{"params": [experts, more], "stacked": True}], lr=0.01)
    _step_once(opt, [experts, more], [torch.randn(6, 8, 16), torch.randn(2, 8, 16)])
    assert calls == [(8, 8, 16)]  # every (8, 16) expert of both parameters in one call


def test_stacked_is_each_matrix_apart_and_the_default_stays_flattened():
    g = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(4))
    stacked, flat = nn.Parameter(torch.zeros(3, 8, 12)), nn.Parameter(torch.zeros(3, 8, 12))
    opts = dict(lr=1.0, momentum=0.0, nesterov=False, lr_scale="none", ns_coefficients="polar_express", ns_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlattenedParameterWarning)
        opt = Muon([{"params": [stacked], "stacked": True}], **opts)
    (d,) = _step_once(opt, [stacked], [g])
    for expert in d:
        sv = torch.linalg.svdvals(expert)
        assert sv.min() > 0.9 and sv.max() < 1.1  # each (8, 12) expert orthogonal on its own
    with pytest.warns(FlattenedParameterWarning, match=r"give its group stacked=True"):
        opt = Muon([flat], **opts)
    (d,) = _step_once(opt, [flat], [g])
    torch.testing.assert_close(torch.linalg.svdvals(d.reshape(3, 96)), torch.ones(3), atol=0.1, rtol=0)


@pytest.mark.parametrize(
    ("group", "exc", "match"),
    [
        (
            {"col_split_sizes": 5},
            ValueError,
            r"col_split_sizes=5 for parameter 'params\[0\] of group 0' must divide its 12 columns evenly",
        ),
        (
            {"col_split_sizes": (4, 4)},
            ValueError,
            r"col_split_sizes=\(4, 4\) .* must be positive and sum to its 12 "
            "columns",
        ),
        ({"col_split_sizes": 0}, ValueError, r"col_split_sizes \(parameter group 0\) must be None, a chunk count"),
        ({"col_split_sizes": "4"}, ValueError, r"col_split_sizes \(parameter group 0\) must be None"),
        ({"split_sizes": [2, -1]}, ValueError, r"split_sizes \(parameter group 0\) must be None, a chunk count"),
        ({"stacked": 1}, TypeError, r"stacked \(parameter group 0\) must be a bool, got 1"),
        (
            {"stacked": True},
            ValueError,
            r"stacked=True for parameter 'params\[0\] of group 0' with shape \(4, 12\).*"
            "at least 3 dimensions",
        ),
        ({"col_split_size": 3}, ValueError, r"'col_split_size' \(did you mean 'col_split_sizes'\?\)"),
    ],
)
def test_bad_split_options_name_the_parameter_and_what_is_allowed(group, exc, match):
    with pytest.raises(exc, match=match):
        Muon([{"params": [nn.Parameter(torch.randn(4, 12))], **group}])


def test_splits_of_a_stacked_parameter_cut_each_matrix():
    with pytest.raises(ValueError, match=r"split_sizes=3 for parameter 'experts' must divide its 8 rows"):
        Muon([{"params": [("experts", nn.Parameter(torch.randn(3, 8, 4)))], "stacked": True, "split_sizes": 3}])
    with pytest.raises(ValueError, match=r"col_split_sizes=3 for parameter 'experts' must divide its 4 columns"):
        Muon([{"params": [("experts", nn.Parameter(torch.randn(3, 8, 4)))], "stacked": True, "col_split_sizes": 3}])


def _model_params():
    g = torch.Generator().manual_seed(7)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in [(16, 24), (18, 8), (3, 8, 6), (6,)]]


def _groups(params) -> list[dict]:
    proj, qkv, experts, bias = params
    return [
        {"params": [proj], "col_split_sizes": 3},
        {"params": [qkv], "split_sizes": 3, "col_split_sizes": 2},
        {"params": [experts], "stacked": True, "col_split_sizes": 2},
        {"params": [bias], "algorithm": "adamw"},
    ]


def _train(opt, params, start: int, stop: int) -> None:
    for t in range(start, stop):
        g = torch.Generator().manual_seed(300 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trip_resumes_bitwise(name):
    cls, _, kw = OPTIMIZERS[name]
    a, b = _model_params(), _model_params()
    opt_a = cls(_groups(a), lr=0.02, weight_decay=0.1, **kw)
    _train(opt_a, a, 0, 3)
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    for p, q in zip(a, b):
        q.data.copy_(p.data)
    opt_b = cls(_groups(b), lr=0.02, weight_decay=0.1, **kw)
    buffer.seek(0)
    opt_b.load_state_dict(torch.load(buffer, weights_only=False))
    assert [g["col_split_sizes"] for g in opt_b.param_groups] == [3, 2, 2, None]
    assert [g["stacked"] for g in opt_b.param_groups] == [False, False, True, False]
    twin = copy.deepcopy(opt_a)
    _train(opt_a, a, 3, 7)
    _train(opt_b, b, 3, 7)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert twin.param_groups[2]["stacked"] is True
    if name == "arm":  # the staleness reference: two sums per row, column range and stacked matrix's row
        assert opt_a.state[a[0]]["refresh_row_sums"].shape == (16, 2 * 3)
        assert opt_a.state[a[2]]["refresh_row_sums"].shape == (3, 2 * 2 * 8)


@pytest.mark.parametrize(
    ("gi", "key", "now"),
    [(0, "col_split_sizes", 2), (0, "col_split_sizes", None), (1, "split_sizes", 2), (2, "stacked", False)],
)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_loading_the_state_of_other_matrix_options_is_refused_naming_the_option(name, gi, key, now):
    """Every optimizer alike: a state_dict saved under other row/column splits or stacking is refused with the saved
    and the current value (neither loaded with the saved value put back silently, nor refused for a shape)."""
    cls, _, kw = OPTIMIZERS[name]
    params = _model_params()
    opt = cls(_groups(params), lr=0.02, **kw)
    _train(opt, params, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    then = saved["param_groups"][gi][key]
    other = _groups(params)
    other[gi][key] = now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlattenedParameterWarning)  # the experts unstacked
        target = cls(other, lr=0.02, **kw)
    with pytest.raises(
        ValueError,
        match=rf"^parameter group {gi} was saved with {key}={then!r} and is built here with {key}={now!r}: .*; "
        rf"construct the optimizer with {key}={then!r} to load this state_dict$",
    ):
        target.load_state_dict(saved)
    assert target.param_groups[gi][key] == now and target.param_groups[gi]["step"] == 0  # nothing was loaded


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_load_takes_the_saved_hyperparameters_and_another_spelling_of_the_same_splits(name):
    cls, _, kw = OPTIMIZERS[name]
    params = _model_params()
    opt = cls(_groups(params), lr=0.02, momentum=0.9, **kw)
    _train(opt, params, 0, 2)
    other = _groups(params)
    other[0]["col_split_sizes"] = (8, 8, 8)  # the 3 column chunks of 24, spelt out
    other[1]["split_sizes"] = [6, 6, 6]
    target = cls(other, lr=0.5, momentum=0.5, **kw)
    target.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["lr"] for g in target.param_groups] == [0.02] * 4  # ordinary options come from the state, as torch's
    assert [g["momentum"] for g in target.param_groups] == [0.9] * 4
    assert target.param_groups[0]["col_split_sizes"] == 3


def test_a_row_sums_shape_that_does_not_fit_is_refused_naming_the_expected_shape():
    params = _model_params()
    opt = AdaptiveRowMuon(_groups(params), lr=0.02)
    _train(opt, params, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["refresh_row_sums"] = torch.zeros(16, 2)
    with pytest.raises(
        ValueError,
        match=r"does not fit parameter 'params\[0\] of group 0': its 'refresh_row_sums' has shape \(16, 2\), "
        r"expected \(16, 6\) for the parameter \(16, 24\)",
    ):
        AdaptiveRowMuon(_groups(params), lr=0.02).load_state_dict(saved)


# ----------------------------------------------------------------------------------------- the helpers


def test_per_head_splits_of_every_registry_dit():
    from dimuon.dit.model import DIT_MODELS, build_dit, dit_arch

    for name in DIT_MODELS:
        with torch.device("meta"):
            model = build_dit(name)
        heads = dit_arch(name)["num_heads"]
        found = per_head_splits(model)
        depth = dit_arch(name)["depth"]
        assert found.split_sizes == {f"blocks.{i}.attn.qkv.weight": 3 * heads for i in range(depth)}, name
        assert found.rules == {
            f"blocks.{i}.attn.proj.weight": {"algorithm": "muon", "col_split_sizes": heads} for i in range(depth)
        }, name
        patterns = dit_per_head_splits(heads)
        assert patterns.split_sizes == {"*attn.qkv.weight": 3 * heads}
        groups = param_groups(model, rules=patterns.rules, split_sizes=patterns.with_split_sizes(DIT_FUSED_SPLITS))
        by_name = {n: g for g in groups for n, _ in g["params"]}
        assert by_name["blocks.0.attn.qkv.weight"]["split_sizes"] == 3 * heads  # refines the 3-way split
        assert by_name["blocks.0.attn.proj.weight"]["col_split_sizes"] == heads
        assert by_name["blocks.0.adaLN_modulation.1.weight"]["split_sizes"] == 6
        assert by_name == {
            n: g
            for g in param_groups(model, rules=found.rules, split_sizes=found.with_split_sizes(DIT_FUSED_SPLITS))
            for n, _ in g["params"]
        }


def test_per_head_is_off_by_default_and_trains_a_dit_like_the_reference():
    from dimuon.dit.model import build_dit

    torch.manual_seed(0)
    model = build_dit("DiT-T/2", input_size=8, num_classes=10)
    assert all("col_split_sizes" not in g and g.get("split_sizes") is None for g in param_groups(model))
    heads = per_head_splits(model)
    opt = Muon(
        param_groups(model, rules=heads.rules, split_sizes=heads.split_sizes),
        lr=0.02,
        lr_scale="original",
        ns_dtype=torch.float32,
    )
    proj, qkv = model.blocks[0].attn.proj.weight, model.blocks[0].attn.qkv.weight
    oracle_proj = ReferenceMuon([nn.Parameter(proj.detach().clone())], lr=0.02, col_split_sizes=2)
    oracle_qkv = ReferenceMuon([nn.Parameter(qkv.detach().clone())], lr=0.02, split_sizes=6)
    for t in range(3):
        g = torch.Generator().manual_seed(t)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for oracle, p in ((oracle_proj, proj), (oracle_qkv, qkv)):
            oracle.params[0].grad = p.grad.clone()
            oracle.step()
        opt.step()
    for oracle, p in ((oracle_proj, proj), (oracle_qkv, qkv)):
        assert ((p - oracle.params[0]).norm() / p.norm()).item() <= 1e-5


def test_per_head_splits_of_diffusers_attention():
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    found = per_head_splits(model)
    prefix = "transformer_blocks.{}.attn1."
    assert found.split_sizes == {prefix.format(i) + f"to_{x}.weight": 2 for i in range(2) for x in "qkv"}
    assert found.rules == {
        prefix.format(i) + "to_out.0.weight": {"algorithm": "muon", "col_split_sizes": 2} for i in range(2)
    }
    groups = param_groups(model, rules=found.rules, split_sizes=found.split_sizes)
    opt = PeriodicRowMuon(groups, lr=0.01, k=2)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_per_head_splits_of_other_attention_modules():
    class GroupedQueryAttention(nn.Module):  # diffusers' layout with fewer key/value heads and joint attention
        def __init__(self) -> None:
            super().__init__()
            self.heads = 4
            self.to_q, self.to_k, self.to_v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
            self.add_q_proj = nn.Linear(32, 32)
            self.to_out = nn.ModuleList([nn.Linear(32, 32), nn.Dropout(0.0)])
            self.to_add_out = nn.Linear(32, 24)

    found = per_head_splits(
        nn.ModuleDict(
            {"gqa": GroupedQueryAttention(), "mha": nn.MultiheadAttention(16, 4), "one": nn.MultiheadAttention(8, 1)}
        )
    )
    assert found.split_sizes == {
        "gqa.to_q.weight": 4,
        "gqa.to_k.weight": 2,
        "gqa.to_v.weight": 2,
        "gqa.add_q_proj.weight": 4,
        "mha.in_proj_weight": 12,
        "one.in_proj_weight": 3,
    }
    assert {k: v["col_split_sizes"] for k, v in found.rules.items()} == {
        "gqa.to_out.0.weight": 4,
        "gqa.to_add_out.weight": 4,
        "mha.out_proj.weight": 4,
    }  # one head: no column split
    assert not per_head_splits(nn.Linear(4, 4))
    assert dit_per_head_splits(1) == HeadSplits({"*attn.qkv.weight": 3})
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        dit_per_head_splits(0)
    assert HeadSplits({"a": 2}).with_split_sizes({"a": 3, "b": 4}) == {"a": 2, "b": 4}


def test_an_attention_module_used_twice_is_split_per_head_under_its_first_name():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            attn = nn.MultiheadAttention(16, 4)
            self.layers = nn.ModuleList([attn, attn])  # one block, applied twice (weights shared)

    groups = param_groups(Shared(), per_head=True)
    found = {n: (g.get("split_sizes"), g.get("col_split_sizes")) for g in groups for n, p in g["params"] if p.ndim == 2}
    assert found == {"layers.0.in_proj_weight": (12, None), "layers.0.out_proj.weight": (None, 4)}
