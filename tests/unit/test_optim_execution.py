"""How a step runs, not what it computes: fused AdamW, compiled Newton-Schulz, a compiled ``opt.step``, dtypes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dimuon.optim import Muon, PeriodicRowMuon, build
from dimuon.optim.distributed.collectives import CommCounter
from dimuon.optim.linalg import CompiledNewtonSchulz, compiled_newton_schulz, default_ns_dtype, newton_schulz

pytestmark = pytest.mark.usefixtures("one_thread")


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def run(model: nn.Module, step, opt: torch.optim.Optimizer, steps: int) -> None:
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        opt.zero_grad()
        model(torch.randn(5, 8, generator=g)).square().mean().backward()
        step()


def test_fused_adamw_group_matches_foreach_and_is_the_default_on_cpu(monkeypatch):
    import dimuon.optim.adamw_group as adamw_group

    kernels = []
    adamw = adamw_group.adamw_functional
    monkeypatch.setattr(
        adamw_group, "adamw_functional", lambda *a, **kw: kernels.append(kw["fused"]) or adamw(*a, **kw)
    )
    models = [small_model() for _ in range(3)]
    opts = [build("muon", m, lr=0.02, weight_decay=0.1, adamw_fused=f) for m, f in zip(models, (True, False, None))]
    for m, o in zip(models, opts):
        run(m, o.step, o, 4)
    assert kernels == [True] * 4 + [False] * 4 + [True] * 4  # None: torch has a fused kernel for CPU floats
    fused, foreach, default = (list(m.parameters()) for m in models)
    for a, b, c in zip(fused, foreach, default):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a, c)


@pytest.mark.parametrize(
    ("shape", "algorithm"), [((3, 12, 28), "gram"), ((2, 20, 12), "standard")], ids=["wide", "tall"]
)
def test_compiled_newton_schulz_matches_eager(shape, algorithm):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second call runs the compiled code
        eager = newton_schulz(x, 5, "quintic", algorithm, torch.float32)
        compiled = compiled_newton_schulz()(x, 5, "quintic", algorithm, torch.float32)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_compiled_newton_schulz_compiles_once_per_shape_past_the_recompile_limit():
    """More distinct shapes than dynamo's recompile limit (8), twice over: one static graph each, compiled once,
    none falling back to eager (a compile counter sees every shape's frame, and no frame again)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    ns = CompiledNewtonSchulz(backend=counter)
    shapes = [(4 + i, 12) for i in range(10)] + [(2, 8, 6)]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*shape, generator=gen) for shape in shapes]
    for _ in range(2):
        for x in inputs:
            torch.testing.assert_close(
                ns(x, 5, "quintic", "standard", torch.float32),
                newton_schulz(x, 5, "quintic", "standard", torch.float32),
            )
    assert ns.compiles == len(shapes) and counter.frame_count == len(shapes)


def test_ns_compile_steps_like_eager():
    a, b = small_model(), small_model()
    opt_a = PeriodicRowMuon(_groups(a), lr=0.02, k=2, ns_compile=True)
    opt_b = PeriodicRowMuon(_groups(b), lr=0.02, k=2)
    run(a, opt_a.step, opt_a, 3)
    run(b, opt_b.step, opt_b, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "schedule", "adamw_fused"),
    [
        ("periodic_row_muon", {"k": 2}, None),
        # compiling is the cost (15-25 s each): the default path (fused AdamW) runs always, the others with -m slow
        pytest.param("periodic_row_muon", {"k": 2}, False, marks=pytest.mark.slow),
        pytest.param(
            "adaptive_row_muon",
            {"threshold": 0.5, "k_min": 1, "k_max": 3},
            None,
            marks=pytest.mark.slow,
        ),  # the drifts' host read breaks the graph
    ],
    ids=["fused", "foreach", "adaptive"],
)
def test_compiled_step_matches_eager_with_adamw_groups(adamw_fused, name, schedule):
    # torch.compile(opt.step) over Muon and AdamW groups, a Tensor lr driven by a scheduler (no recompiles
    # for a new lr): the same parameters as the eager step within fp32 rounding.
    models = [small_model(), small_model()]
    opts = [
        build(name, m, lr=torch.tensor(0.02), weight_decay=0.1, adamw_fused=adamw_fused, **schedule) for m in models
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.8**s) for o in opts]
    compiled = torch.compile(opts[0].step)
    for t in range(4):
        for model, step, opt, sched in zip(models, (compiled, opts[1].step), opts, scheds):
            run_one(model, opt, t)
            step()
            sched.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opts[0].param_groups[0]["step"] == 4
    torch.testing.assert_close(opts[0].param_groups[0]["lr"], torch.tensor(0.02 * 0.8**4))


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
@pytest.mark.parametrize("name", ["muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon"])
def test_step_stores_no_attribute_on_the_optimizer(monkeypatch, name, nonfinite):
    # torch 2.11's compiler refuses an attribute store on an optimizer inside a compiled ``step`` (torch 2.13's
    # allows it, so the compiled-step tests above would not notice one): the step keeps what it updates in
    # containers built at construction, from its first call on.
    from dimuon.optim.core import MuonFamily

    stores: list[str] = []
    store = MuonFamily.__setattr__
    model = small_model()
    opt = build(name, model, lr=0.02, weight_decay=0.1, nonfinite=nonfinite)
    monkeypatch.setattr(
        MuonFamily, "__setattr__", lambda self, key, value: stores.append(key) or store(self, key, value)
    )
    run(model, opt.step, opt, 4)
    assert stores == []


def run_one(model: nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    opt.zero_grad()
    model(torch.randn(5, 8, generator=g)).square().mean().backward()


def _groups(model: nn.Module) -> list[dict]:
    weights = [p for p in model.parameters() if p.ndim == 2]
    return [{"params": weights}, {"params": [p for p in model.parameters() if p.ndim < 2], "algorithm": "adamw"}]


def test_default_newton_schulz_dtype_is_bf16_on_accelerators():
    assert default_ns_dtype(torch.device("cpu")) is torch.float32
    for device in ("cuda", "cuda:1", "xpu", "mps"):
        assert default_ns_dtype(torch.device(device)) is torch.bfloat16
    assert newton_schulz(torch.randn(4, 6)).dtype is torch.float32  # None: by the input's device


def test_bf16_newton_schulz_is_what_ns_dtype_none_runs_off_cpu(monkeypatch):
    # Stand in for a GPU: make the default pick bf16, and the step equals an explicit ns_dtype=bf16 step.
    import dimuon.optim.linalg as linalg

    monkeypatch.setattr(linalg, "default_ns_dtype", lambda device: torch.bfloat16)
    a, b = nn.Parameter(torch.randn(12, 20)), nn.Parameter(torch.randn(12, 20))
    b.data.copy_(a.data)
    g = torch.randn(12, 20)
    for p, opt in ((a, Muon([a], lr=0.1)), (b, Muon([b], lr=0.1, ns_dtype=torch.bfloat16))):
        p.grad = g.clone()
        opt.step()
    assert torch.equal(a, b)


def test_exposed_time_on_cpu_is_host_time():
    counter = CommCounter()
    with counter.exposed(("shard", "all_gather"), torch.device("cpu")):
        sum(range(10000))
    counter.record(("replicate", "all_gather"), 8)
    stats = counter.stats()["all_gather"]
    assert stats["exposed_s"] > 0 and (stats["calls"], stats["bytes"]) == (1, 8)  # summed over mesh dimensions
    by_dim = counter.stats_by_mesh_dim()
    assert by_dim["shard"]["all_gather"]["calls"] == 0 and by_dim["replicate"]["all_gather"]["bytes"] == 8
    counter.reset()
    assert counter.stats() == {} and counter.stats_by_mesh_dim() == {}


def test_deepcopy_of_a_compiled_options_optimizer_keeps_them():
    opt = Muon([nn.Parameter(torch.randn(4, 4))], ns_compile=True, adamw_fused=False)
    twin = copy.deepcopy(opt)
    assert (twin.ns_compile, twin.adamw_fused) == (True, False)


def test_broadcasts_go_out_as_one_group_launch_where_the_backend_groups(monkeypatch):
    # torch's fake backend groups as NCCL does (gloo cannot): three owners' broadcasts, one launch, each its bytes.
    import torch.distributed as dist

    from dimuon.bench.census import fake_rank
    from dimuon.optim.distributed import collectives

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    pieces = [(torch.zeros(3), 0), (torch.zeros(5), 1), (torch.zeros(2), 4)]
    with fake_rank(1, 8):
        assert collectives.groups_launches(None, torch.device("cpu"))
        counter = CommCounter()
        comm = collectives.Collectives(None, counter)
        comm.broadcasts(pieces).wait()
        grouped = counter.stats()["broadcast"]
        monkeypatch.setattr(collectives, "groups_launches", lambda group, device: False)
        counter.reset()
        comm.broadcasts(pieces).wait()
        one_each = counter.stats()["broadcast"]
    assert (grouped["calls"], grouped["launches"], grouped["bytes"]) == (3, 1, 4 * (3 + 2))  # rank 1 sends the 5
    assert (one_each["calls"], one_each["launches"], one_each["bytes"]) == (3, 3, 4 * (3 + 2))


@pytest.mark.parametrize(
    ("name", "schedule"),
    [("muon", {}), ("periodic_row_muon", {"k": 2}), ("muon_bp", {"period": 2}), ("adaptive_row_muon", {})],
)
def test_an_fp64_parameter_steps_alike_beside_an_fp32_one_of_its_shape(name, schedule):
    # Parameters are independent: an fp64 one steps bit for bit as alone when an fp32 one of its shape shares its
    # group. Its Nesterov momentum keeps its own fp64 batch (not the fp32 neighbour's), and Newton-Schulz batches
    # only matrices of one dtype (an fp64 one stacked into an fp32 batch was rounded).
    def run(neighbour: bool):
        g = torch.Generator().manual_seed(0)
        w64 = nn.Parameter(torch.randn(8, 6, generator=g, dtype=torch.float64) * 0.1)
        w32 = nn.Parameter(torch.randn(8, 6, generator=g) * 0.1)
        params = [("w32", w32), ("w64", w64)] if neighbour else [("w64", w64)]
        opt = build(name, params, lr=0.05, ns_dtype=torch.float64, **schedule)
        for t in range(4):
            gen = torch.Generator().manual_seed(100 + t)
            w64.grad = torch.randn(8, 6, generator=gen, dtype=torch.float64)
            w32.grad = torch.randn(8, 6, generator=gen)
            opt.step()
        return w64.detach().clone(), {key[3] for key in opt._workspace}

    alone, _ = run(False)
    beside, slot_dtypes = run(True)
    assert slot_dtypes == {torch.float32, torch.float64}  # one Nesterov batch per dtype
    assert torch.equal(alone, beside)


def test_the_flattened_group_of_a_stage_submesh_is_made_without_touching_the_mesh():
    # torch's fake backend (the census's, for 64 and 256 ranks in one process): a (pp, dp, tp) mesh whose (dp, tp)
    # submesh both dimensions of a parameter shard. Every rank makes every stage's group, in one order; none is
    # registered on the mesh (torch's redistribute would take it, and gets uneven (Shard(d), Shard(d)) wrong).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dimuon.bench.census import fake_rank
    from dimuon.optim.distributed.sharded import flattened_group

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with fake_rank(5, 8):
        root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        stage = root["dp", "tp"]
        group = flattened_group(stage, (0, 1))
        assert dist.get_process_group_ranks(group) == [4, 5, 6, 7]
        assert flattened_group(root["dp", "tp"], (0, 1)) is group  # made once, for every mesh object alike
        assert dist.get_process_group_ranks(flattened_group(root["pp", "tp"], (0, 1))) == [0, 1, 4, 5]
        assert flattened_group(root, (0, 1, 2)) is dist.group.WORLD  # the world's own group: nothing made
        assert root._flatten_mapping == {}
