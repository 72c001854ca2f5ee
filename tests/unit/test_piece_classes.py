"""The sharded step by class (dimuon.optim.distributed.piece_classes), on torch's fake process group (this process
plays one rank; collectives do nothing): RowNorm and block steps take the same Python calls at any matrix count,
and move the weights exactly as the per-job path does on every layout the plan takes (FSDP's rows, tensor
parallelism's rows and columns, both, uneven pieces, fused and column-split matrices, conv weights, stacked experts
over expert parallelism, FSDP's rows of each expert, both, and replicated)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dimuon.bench.host_probe import accelerator_form, dimuon_calls
from dimuon.bench.host_sharded import fake_sharded_parameter
from dimuon.optim import build
from dimuon.optim.adaptive import AdaptiveRowSchedule
from dimuon.optim.distributed.refresh import SpectralRefresh
from dimuon.optim.distributed.sharded import ShardedEngine

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WORLD, RANK = 8, 5


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    yield init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


def _sharded(shape: tuple[int, ...], mesh, placements, seed: int) -> nn.Parameter:
    """A parameter of ``shape`` laid out by ``placements`` on ``mesh``, with a gradient laid out alike."""
    return fake_sharded_parameter(shape, mesh, placements, torch.Generator().manual_seed(seed))


def _groups(mesh, copies: int) -> list[dict]:
    """Every layout the class plan takes, ``copies`` parameters of each."""
    from torch.distributed.tensor import Replicate, Shard

    fsdp, rows_tp, cols_tp = [Shard(0), Replicate()], [Shard(0), Shard(0)], [Shard(0), Shard(1)]
    plain = [
        ((24, 16), fsdp),  # rows over dp: wide, whole rows here
        ((40, 8), fsdp),  # tall: its column sums over dp
        ((10, 12), rows_tp),  # uneven pieces over dp x tp (some ranks hold none)
        ((12, 20), cols_tp),  # columns over tp: a wide matrix's row sums over tp
        ((30, 6), cols_tp),  # tall, rows over dp, columns over tp
        ((16, 4, 3, 3), fsdp),  # a conv weight, flattened to (16, 36)
    ]
    seed = iter(range(10_000))
    groups = [{"params": [_sharded(s, mesh, plc, next(seed)) for s, plc in plain for _ in range(copies)]}]
    fused = [_sharded((36, 12), mesh, fsdp, next(seed)) for _ in range(copies)]  # qkv, fused by rows
    groups.append({"params": fused, "split_sizes": (12, 12, 12)})
    col_split = [_sharded((16, 24), mesh, fsdp, next(seed)) for _ in range(copies)]  # fused by columns
    groups.append({"params": col_split, "col_split_sizes": (8, 16)})
    return groups + _expert_groups(mesh, copies, seed)


def _expert_groups(mesh, copies: int, seed=None) -> list[dict]:
    """Stacked ``(E, rows, cols)`` experts on every layout the class plan takes, ``copies`` parameters of each: this
    rank (2, 1) holds whole experts, some rows of each of its experts (one matrix of several regions), or none, and
    fused experts."""
    from torch.distributed.tensor import Replicate, Shard

    ep, ep2, rows, ep_rows = (
        [Shard(0), Replicate()],
        [Shard(0), Shard(0)],
        [Shard(1), Replicate()],
        [Shard(0), Shard(1)],
    )
    layouts = [
        ((8, 6, 10), ep),  # experts over dp: two whole wide experts here
        ((8, 10, 6), ep),  # whole tall experts
        ((8, 6, 10), ep2),  # experts over dp x tp: one here
        ((3, 6, 10), ep2),  # uneven: none here
        ((4, 8, 6), rows),  # each expert's rows over dp: tall, its column sums over dp
        ((4, 6, 10), ep_rows),  # experts over dp, each one's rows over tp: wide
        ((4, 10, 6), ep_rows),  # tall: column sums over tp
        ((4, 5, 10), ep_rows),  # rows split unevenly (3 and 2)
        ((2, 6, 10), ep_rows),  # no expert on this dp rank: nothing to map
        ((2, 6, 10), [Replicate(), Replicate()]),  # the whole parameter on every rank
    ]
    seed = iter(range(20_000, 30_000)) if seed is None else seed
    groups = [{"params": [_sharded(s, mesh, plc, next(seed)) for s, plc in layouts for _ in range(copies)]}]
    fused = [_sharded((4, 12, 16), mesh, plc, next(seed)) for plc in (rows, ep) for _ in range(copies)]
    groups.append({"params": fused, "split_sizes": (4, 8)})  # fused w1/w3, cut by dp's rows (3 each)
    return [{**g, "stacked": True} for g in groups]


def _fake_refresh(monkeypatch, seen: list | None = None) -> None:
    """A refresh whose directions are a fixed function of each job's update and placement: the fake group's
    all-gather leaves its buffers as they were, so a real refresh's values are undefined here (the parity tests on
    gloo hold them); ``seen`` collects what each refresh was handed (job and placement), step by step."""

    def fake(self, placed, config, memo=None):
        if seen is not None:
            seen.append(
                sorted((job.name, job.rows, job.cols, job.splits, plc.mine, plc.members) for job, plc in placed)
            )
        return [job.update.float() * (0.5 + 0.1 * len(plc.members) + 0.01 * job.rows) for job, plc in placed]

    monkeypatch.setattr(SpectralRefresh, "directions", fake)


def _run(name: str, groups: list[dict], options: dict, steps: int = 5) -> tuple[object, list[torch.Tensor]]:
    """``steps`` steps of optimizer ``name`` on ``groups``; the optimizer and every local piece after them."""
    opt = build(name, groups, lr=0.05, weight_decay=0.1, nonfinite="skip", **options)
    for _ in range(steps):
        opt.step()
    return opt, [p.to_local().clone() for g in groups for p in g["params"]]


CASES = [("periodic_row_muon", {"k": 2}), ("muon_bp", {"period": 2})]


@pytest.mark.parametrize("name,options", CASES, ids=[c[0] for c in CASES])
def test_memory_bound_steps_match_the_per_job_path_on_every_layout(mesh, monkeypatch, name, options):
    """Five steps (refreshes at 0, 2, 4; RowNorm or block steps at 1 and 3, the class path from step 1): every local
    piece equal, bit for bit, to the per-job path's (class plans turned off)."""
    _fake_refresh(monkeypatch)
    runs = []
    for planned in (True, False):
        if not planned:
            monkeypatch.setattr(ShardedEngine, "class_plan", lambda self, *args: None)
        groups = _groups(mesh, copies=2)
        if name == "muon_bp":  # whole experts cut by the blocks grid, as one process cuts them
            groups[-2]["blocks"] = 2
        opt, pieces = _run(name, groups, options)
        assert all((opt._plans.get(gi) is not None) == planned for gi in range(len(groups)))
        runs.append(pieces)
    for planned, unplanned in zip(*runs):
        assert torch.equal(planned, unplanned)


@pytest.mark.parametrize("refresh", ["gather", "owner"])
def test_expert_refreshes_match_the_per_job_path(mesh, monkeypatch, refresh):
    """Muon on stacked experts, five refreshes: the engine's refresh is handed the same jobs and placements as on
    the per-job path (a rank's experts as one row-sharded matrix where their rows are split, none where they are
    whole here or absent), and whole experts are orthogonalized here as the per-job path's local maps do, bit for
    bit."""
    runs, handed = [], []
    for planned in (True, False):
        seen: list = []
        _fake_refresh(monkeypatch, seen)
        if not planned:
            monkeypatch.setattr(ShardedEngine, "class_plan", lambda self, *args: None)
        groups = _expert_groups(mesh, copies=2)
        opt, pieces = _run("muon", groups, {"refresh": refresh})
        assert all((opt._plans.get(gi) is not None) == planned for gi in range(len(groups)))
        runs.append(pieces)
        handed.append(seen)
    assert handed[0] == handed[1] and handed[0]
    for planned, unplanned in zip(*runs):
        assert torch.equal(planned, unplanned)


@pytest.mark.parametrize("name,options", CASES, ids=[c[0] for c in CASES])
def test_memory_bound_steps_take_the_same_calls_at_any_matrix_count(mesh, monkeypatch, name, options):
    """The accelerator form of a RowNorm or block step: the Python calls made inside dimuon do not grow with the
    number of matrices (two copies of every layout against eight)."""
    _fake_refresh(monkeypatch)
    counts = []
    with accelerator_form():
        for copies in (2, 8):
            opt = build(name, _groups(mesh, copies), lr=0.05, nonfinite="skip", **options)
            for _ in range(3):  # refresh, memory-bound step (the plans made), refresh
                opt.step()
            counts.append(dimuon_calls(opt.step))
    assert counts[0] == counts[1], counts


# A refresh's work here grows with the classes this rank owns matrices of (the owner refresh's, and both refreshes'
# matrices held whole on every rank): enough copies that it owns several of every class in both counts (eight ranks in
# the largest group).
@pytest.mark.parametrize("refresh", ["gather", "owner"])
def test_refresh_steps_take_the_same_calls_at_any_matrix_count(mesh, refresh):
    """Muon's spectral step on a plan: what is static about the refresh (placements, buckets, classes, regions and
    the indices cutting them, the exchanges' counts, the regions of the matrices held whole) is kept with the plan,
    so its Python calls do not grow with the matrices either (every layout: FSDP's and tensor parallelism's,
    fused and column-split matrices, experts whole here, a rank's experts as one matrix of several regions with
    their rows split, fused experts, and parameters held whole on every rank; 16 copies of each against 40)."""
    from dimuon.bench.census import fake_collectives

    counts = []
    with accelerator_form(), fake_collectives():  # the fake backend's all-to-all and all-gather made to run
        for copies in (16, 40):
            groups = _groups(mesh, copies)
            opt = build("muon", groups, lr=0.05, nonfinite="skip", refresh=refresh)
            for _ in range(3):  # the per-job step, the plan made, its memo made
                opt.step()
            counts.append(dimuon_calls(opt.step))
            assert all(opt._plans[gi] is not None and opt._plans[gi].memo for gi in range(len(groups)))
    assert counts[0] == counts[1], counts


# Each matrix's spectral step at the latest every fourth step, sooner where its signal passes the threshold.
ADAPTIVE = {"k_min": 1, "k_max": 4, "threshold": 0.1}


def _own_refresh(monkeypatch, run: bool = False, seen: list | None = None) -> None:
    """The signs of ``U`` as the directions of spectral steps (the fake group's all-gather leaves its buffers as they
    were): a reference against which the staleness signal says something. With ``run`` the refresh runs first (its
    Python counted), its directions left unused; ``seen`` collects what each refresh was handed (job and placement)."""
    refresh = SpectralRefresh.directions

    def signs(self, placed, config, memo=None):
        if run:
            refresh(self, placed, config, memo)
        if seen is not None:
            seen.append(
                sorted((job.name, job.rows, job.cols, job.splits, plc.mine, plc.members) for job, plc in placed)
            )
        return [job.update.sign() for job, _ in placed]

    monkeypatch.setattr(SpectralRefresh, "directions", signs)


def _row_groups(mesh, copies: int) -> list[dict]:
    """The layouts of :func:`_groups` that keep rows whole (the adaptive schedule's row sums need them), experts
    left out (under the adaptive schedule they keep the per-job path)."""
    groups = [g for g in _groups(mesh, copies) if not g.get("stacked")]
    for group in groups:
        group["params"] = [p for p in group["params"] if not any(plc.is_shard(1) for plc in p.placements)]
    return groups


def _new_gradients(groups: list[dict], step: int) -> None:
    """Fresh gradients for every other parameter, ten times the last (their momentum turns: stale), the others'
    kept (their signal is zero up to rounding)."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for group in groups:
            for p in group["params"][::2]:
                local = p.grad.to_local()
                local.copy_(torch.randn(local.shape, generator=g) * 10.0 ** (step + 1))


def _adaptive_layouts(mesh, layouts: str, copies: int) -> list[dict]:
    """The plain layouts that keep rows whole (:func:`_row_groups`), or the stacked experts on every layout whose
    experts' rows split evenly (the schedule's row sums are laid out as the rows are)."""
    if layouts == "plain":
        return _row_groups(mesh, copies)
    groups = _expert_groups(mesh, copies)
    for group in groups:
        group["params"] = [p for p in group["params"] if p.shape[1] != 5]
    return groups


@pytest.mark.parametrize("lag,layouts", [(0, "plain"), (1, "plain"), (0, "experts")])
def test_adaptive_steps_match_the_per_job_path_on_every_layout(mesh, monkeypatch, lag, layouts):
    """AdaptiveRowMuon over eight steps (the class path from step 1): matrices refreshed by their signal, others
    only when forced, so that steps mix both kinds within classes; every local piece, momentum and piece of the
    schedule's state equal, bit for bit, to the per-job path's, and the same kinds taken (plain matrices, and
    stacked experts: whole here, a rank's experts with their rows split, none, and replicated); the refresh handed
    the same jobs and placements."""
    handed: list[list] = [[], []]
    signals: list[list[dict[int, float]]] = []  # per run and step, the signals read, by parameter
    stalest = AdaptiveRowSchedule._stalest

    def recorded(self, works, items, ctx):
        values = stalest(self, works, items, ctx)
        index = {id(p): k for k, p in enumerate(p for g in groups for p in g["params"])}
        signals[-1].append({index[id(works[wi].params[ji])]: v for (wi, ji), v in zip(items, values.tolist())})
        return values

    monkeypatch.setattr(AdaptiveRowSchedule, "_stalest", recorded)
    runs = []
    for planned in (True, False):
        _own_refresh(monkeypatch, seen=handed[len(runs)])
        if not planned:
            monkeypatch.setattr(ShardedEngine, "class_plan", lambda self, *args: None)
        signals.append([])
        groups = _adaptive_layouts(mesh, layouts, copies=2)
        opt = build(
            "adaptive_row_muon", groups, lr=0.05, weight_decay=0.1, nonfinite="skip", signal_lag=lag, **ADAPTIVE
        )
        for step in range(8):
            opt.step()
            _new_gradients(groups, step)
        assert all((opt._plans.get(gi) is not None) == planned for gi in range(len(groups)))
        params = [p for g in groups for p in g["params"]]
        names = ("momentum_buffer", "refresh_direction", "refresh_row_sums", "refresh_signal")
        state = [opt.state[p][k] for p in params for k in names]
        counts = {k: v["spectral"] for k, v in opt.refresh_stats()["matrices"].items()}
        runs.append(([p.to_local().clone() for p in params], [getattr(t, "_local_tensor", t) for t in state], counts))
    (weights, state, counts), (weights_job, state_job, counts_job) = runs
    assert counts == counts_job
    assert handed[0] == handed[1] and handed[0]
    assert signals[0] == signals[1]  # bit for bit, and finite ones among them
    assert any(0 < v < float("inf") for step in signals[0] for v in step.values())
    assert max(counts.values()) > 2 and min(counts.values()) == 2  # by signal, and only when forced (steps 0, 4)
    for planned, unplanned in zip(weights + state, weights_job + state_job):
        assert torch.equal(planned, unplanned)


# Copies of each layout compared: enough that every class refreshes several matrices (one alone takes a shortcut of
# one call less) and, for experts, that this rank owns some of the replicated ones in both counts and shares them the
# same way (a padded all-gather, not a broadcast per owner).
ADAPTIVE_COPIES = {"plain": (4, 8), "experts": (16, 24)}


@pytest.mark.parametrize("layouts", ["plain", "experts"])
def test_adaptive_steps_take_the_same_calls_at_any_matrix_count(mesh, monkeypatch, layouts):
    """AdaptiveRowMuon's step mixing both kinds (the signal read, the stale half refreshed, the rest RowNorm): its
    Python calls do not grow with the matrices, the refresh of a subset refreshed before kept with the plan as a
    plan of one kind keeps its own (the gather refresh on the layouts of the refresh test above, and on stacked
    experts; :data:`ADAPTIVE_COPIES`)."""
    from dimuon.bench.census import fake_collectives

    _own_refresh(monkeypatch, run=True)
    counts = []
    with accelerator_form(), fake_collectives():
        for copies in ADAPTIVE_COPIES[layouts]:
            groups = _adaptive_layouts(mesh, layouts, copies)[:1]
            opt = build("adaptive_row_muon", groups, lr=0.05, nonfinite="skip", refresh="gather", **ADAPTIVE)
            for step in range(3):  # all refreshed, then the stale half (twice: the plans and memo made)
                opt.step()
                _new_gradients(groups, step)
            counts.append(dimuon_calls(opt.step))
            assert all(plan is not None for plan in opt._plans.values())
            kinds = {k: v["spectral"] for k, v in opt.refresh_stats()["matrices"].items()}
            assert set(kinds.values()) == {1, 4}  # the stale half refreshed at every step, the rest at step 0
            assert all(len(plan.memo["subsets"]) == 1 for plan in opt._plans.values())  # the stale half's
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("refresh", ["gather", "owner"])
def test_adaptive_refresh_of_a_new_subset_takes_the_same_calls_at_any_matrix_count(mesh, monkeypatch, refresh):
    """A subset AdaptiveRowMuon refreshes for the first time (its memo and the refresh's owner plans forgotten
    before the counted step): its refresh is planned anew, with Python calls that do not grow with the matrices
    chosen (payload dtypes, owners, buckets and classes worked out by class, then looked up per matrix in
    comprehensions), on the layouts of the refresh test above, 32 copies of each against 48 (so that this rank owns
    several matrices of every class in both: one alone takes a shortcut of one call less)."""
    from dimuon.bench.census import fake_collectives

    _own_refresh(monkeypatch, run=True)
    counts = []
    with accelerator_form(), fake_collectives():
        for copies in (32, 48):
            groups = _row_groups(mesh, copies)
            opt = build("adaptive_row_muon", groups, lr=0.05, nonfinite="skip", refresh=refresh, **ADAPTIVE)
            for step in range(3):  # all refreshed, then the stale half
                opt.step()
                _new_gradients(groups, step)
            for plan in opt._plans.values():
                plan.memo["subsets"].clear()
            opt._engine._refresher._owner_plans.clear()
            counts.append(dimuon_calls(opt.step))
            assert all(len(plan.memo["subsets"]) == 1 for plan in opt._plans.values())  # planned at that step
    assert counts[0] == counts[1], counts


def test_subset_memos_are_kept_for_the_subsets_refreshed_last():
    """A plan's refreshed subsets each keep their refresh's static parts, at most SUBSET_MEMOS of them: a subset met
    again finds its own, the one used longest ago makes way for a new one."""
    from types import SimpleNamespace

    from dimuon.optim.distributed.piece_classes import SUBSET_MEMOS, subset_memo

    jobs = [object() for _ in range(SUBSET_MEMOS + 1)]
    plan = SimpleNamespace(memo={}, jobs=[])
    part = lambda *idx: SimpleNamespace(memo=plan.memo, jobs=[jobs[i] for i in idx])  # noqa: E731
    first = subset_memo(part(0, 1))
    assert subset_memo(part(0, 1)) is first
    second = subset_memo(part(1))
    assert second is not first
    for i in range(2, SUBSET_MEMOS + 1):  # one more subset than are kept
        subset_memo(part(i))
    assert len(plan.memo["subsets"]) == SUBSET_MEMOS
    assert subset_memo(part(1)) is second  # kept
    assert subset_memo(part(0, 1)) is not first  # the one used longest ago, made again


def test_a_state_dict_gathered_along_a_mesh_dimension_steps_as_one_laid_out_as_the_parameters(mesh):
    """A checkpoint may bring the momenta gathered along a mesh dimension (DCP stores head-wise pieces that way): the
    loaded state is laid out as the parameters again, and the plans made on load take those tensors, so the next
    steps equal those after loading the same state laid out as the parameters."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fsdp = [Shard(0), Replicate()]
    coordinate = mesh.get_coordinate()[0]
    runs = []
    for gathered in (False, True):
        params = [_sharded((24, 16), mesh, fsdp, seed) for seed in range(3)]
        opt = build("periodic_row_muon", [{"params": params}], lr=0.05, nonfinite="skip", k=2)
        for _ in range(3):
            opt.step()
        state = opt.state_dict()
        if gathered:  # this rank's rows in a whole matrix, replicated over dp: the rows it holds are its own
            for entry in state["state"].values():
                local = entry["momentum_buffer"].to_local()
                whole = torch.zeros(24, 16)
                whole[coordinate * 6 : coordinate * 6 + 6] = local
                entry["momentum_buffer"] = DTensor.from_local(whole, mesh, [Replicate(), Replicate()])
        loaded = build("periodic_row_muon", [{"params": params}], lr=0.05, nonfinite="skip", k=2)
        loaded.load_state_dict(state)
        for _ in range(2):
            loaded.step()
        assert all(loaded.state[p]["momentum_buffer"].placements == tuple(fsdp) for p in params)
        runs.append([loaded.state[p]["momentum_buffer"].to_local().clone() for p in params])
    for laid_out, gathered in zip(*runs):
        assert torch.equal(laid_out, gathered)
