"""Peers side by side: the call-boundary counter on a fake 4-rank group, the peer registry, the harness helpers,
and every installed peer stepping in one process (skipped, with the reason, where a peer cannot run)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from dimuon.bench.peers import (
    PEERS,
    CallCounter,
    GradientSnapshot,
    Peer,
    bf16_note,
    build_peer,
    check_names,
    count_collectives,
    first_step,
    fold_kinds,
    muon_and_rest,
    probe,
    registry,
    start_peer,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's deprecations of old names

WORLD, RANK = 4, 1  # this process plays rank 1 of 4 on torch's fake backend (collectives do nothing)
F32 = 4


@pytest.fixture(scope="module")
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    yield
    dist.destroy_process_group()


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n)


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# (name, call, kind, logical bytes on rank 1 of 4) -- the formulas of the module docstring.
CASES = [
    ("all_gather_single", lambda: dist.all_gather_single(torch.empty(20), _ones(5)), "all_gather", 3 * 5 * F32),
    (
        "all_gather_into_tensor",
        lambda: dist.all_gather_into_tensor(torch.empty(20), _ones(5)),
        "all_gather",
        3 * 5 * F32,
    ),
    (
        "all_gather list",
        lambda: dist.all_gather([torch.empty(3) for _ in range(WORLD)], _ones(3)),
        "all_gather",
        3 * 3 * F32,
    ),
    ("all_reduce", lambda: dist.all_reduce(_ones(8)), "all_reduce", 2 * 8 * F32 * 3 // 4),
    (
        "reduce_scatter_single",
        lambda: dist.reduce_scatter_single(torch.empty(2), _ones(8)),
        "reduce_scatter",
        8 * F32 * 3 // 4,
    ),
    (
        "all_to_all_single, uneven",
        lambda: dist.all_to_all_single(torch.empty(8), _ones(8), [1, 2, 3, 2], [2] * 4),
        "all_to_all",
        (1 + 3 + 2) * F32,
    ),
    ("all_to_all_single, even", lambda: dist.all_to_all_single(torch.empty(8), _ones(8)), "all_to_all", 6 * F32),
    (
        "all_to_all list",
        lambda: dist.all_to_all([torch.empty(2) for _ in range(WORLD)], [_ones(2)] * WORLD),
        "all_to_all",
        3 * 2 * F32,
    ),
    ("broadcast, receiver", lambda: dist.broadcast(_ones(3), src=0), "broadcast", 3 * F32),
    ("broadcast, source", lambda: dist.broadcast(_ones(3), src=RANK), "broadcast", 0),
    ("gather, not destination", lambda: dist.gather(_ones(2), None, dst=0), "gather", 0),
    (
        "gather, destination",
        lambda: dist.gather(_ones(2), [torch.empty(2) for _ in range(WORLD)], dst=RANK),
        "gather",
        3 * 2 * F32,
    ),
    ("scatter, receiver", lambda: dist.scatter(_ones(2), None, src=0), "scatter", 2 * F32),
    ("reduce, destination", lambda: dist.reduce(_ones(4), dst=RANK), "reduce", 2 * (4 * F32 * 3 // 4)),
    (
        "funcol all_gather_single",
        lambda: _waited(funcol.all_gather_single(_ones(4), 0, dist.group.WORLD)),
        "all_gather",
        3 * 4 * F32,
    ),
    (
        "funcol all_reduce",
        lambda: _waited(funcol.all_reduce(_ones(4), "sum", dist.group.WORLD)),
        "all_reduce",
        2 * 4 * F32 * 3 // 4,
    ),
    (
        "funcol reduce_scatter",
        lambda: _waited(funcol.reduce_scatter_single(_ones(8), "sum", 0, dist.group.WORLD)),
        "reduce_scatter",
        8 * F32 * 3 // 4,
    ),
    (
        "funcol all_to_all_single",
        lambda: _waited(funcol.all_to_all_single(_ones(8), None, None, dist.group.WORLD)),
        "all_to_all",
        6 * F32,
    ),
    (
        "funcol broadcast, receiver",
        lambda: _waited(funcol.broadcast(_ones(5), 0, dist.group.WORLD)),
        "broadcast",
        5 * F32,
    ),
    (
        "funcol, ranks as a list",
        lambda: _waited(funcol.all_reduce(_ones(4), "sum", [0, 1, 2, 3])),
        "all_reduce",
        2 * 4 * F32 * 3 // 4,
    ),
]


# The single-tensor calls that torch builds before 2.13 lack (a CUDA machine's torch may be older than 2.13).
ABSENT = {
    name
    for name, (module, attr) in {
        "all_gather_single": (dist, "all_gather_single"),
        "reduce_scatter_single": (dist, "reduce_scatter_single"),
        "funcol all_gather_single": (funcol, "all_gather_single"),
        "funcol reduce_scatter": (funcol, "reduce_scatter_single"),
    }.items()
    if not hasattr(module, attr)
}


@pytest.mark.parametrize(
    ("name", "call", "kind", "expected"),
    [pytest.param(*c, id=c[0], marks=pytest.mark.skipif(c[0] in ABSENT, reason=f"torch has no {c[0]}")) for c in CASES],
)
def test_each_collective_is_booked_once_with_its_textbook_bytes(fake_group, name, call, kind, expected):
    with count_collectives() as counter:
        call()
    assert counter.stats() == {kind: {"calls": 1, "bytes": expected}}


def test_object_collectives_count_one_call_with_the_bytes_they_move(fake_group):
    with count_collectives() as counter:
        dist.all_gather_object([None] * WORLD, {"a": 1})
    stats = counter.stats()
    assert list(stats) == ["all_gather_object"] and stats["all_gather_object"]["calls"] == 1
    assert stats["all_gather_object"]["bytes"] >= 3 * 8  # at least the other ranks' int64 sizes


def test_a_name_imported_from_torch_distributed_is_counted_and_restored(fake_group, monkeypatch):
    peer = types.ModuleType("dimuon_test_peer")
    peer.gather, peer.all_reduce = dist.gather, dist.all_reduce  # as `from torch.distributed import gather`
    monkeypatch.setitem(sys.modules, peer.__name__, peer)
    original = dist.all_reduce
    with count_collectives() as counter:
        peer.gather(_ones(2), None, dst=0)
        peer.all_reduce(_ones(2))
    assert counter.stats() == {"gather": {"calls": 1, "bytes": 0}, "all_reduce": {"calls": 1, "bytes": 12}}
    assert peer.all_reduce is original and dist.all_reduce is original
    peer.all_reduce(_ones(2))  # outside the block: not counted
    assert counter.total_bytes() == 12


def test_a_wrapper_kept_by_a_module_imported_while_counting_passes_through_then_counts_again(fake_group, monkeypatch):
    with count_collectives():
        late = types.ModuleType("dimuon_test_late")
        late.all_reduce = dist.all_reduce  # bound while the functions are wrapped
        monkeypatch.setitem(sys.modules, late.__name__, late)
    late.all_reduce(_ones(2))  # the left-over wrapper only forwards
    with count_collectives() as counter:
        late.all_reduce(_ones(2))
    assert counter.stats() == {"all_reduce": {"calls": 1, "bytes": 12}}


def test_one_counting_block_at_a_time_and_restored_after_an_error(fake_group):
    original = dist.all_reduce
    with pytest.raises(ValueError, match="boom"), count_collectives():
        assert dist.all_reduce is not original
        raise ValueError("boom")
    assert dist.all_reduce is original
    with count_collectives(), pytest.raises(RuntimeError, match="already active"), count_collectives():
        pass
    with count_collectives():  # usable again
        pass


def test_fold_kinds_merges_the_check_into_its_kind_and_drops_times():
    own = {
        "all_gather": {"calls": 2, "bytes": 30, "exposed_s": 0.1},
        "all_reduce": {"calls": 1, "bytes": 8, "exposed_s": 0.0},
        "all_reduce[check]": {"calls": 1, "bytes": 6, "exposed_s": 0.2},
    }
    assert fold_kinds(own) == {"all_gather": {"calls": 2, "bytes": 30}, "all_reduce": {"calls": 2, "bytes": 14}}
    counter = CallCounter()
    counter.record("all_reduce", 1, 6)
    counter.reset()
    assert counter.stats() == {} and counter.total_bytes() == 0


# ------------------------------------------------------------------------------------- registry


def _fake_peer(key: str, distribution: str, module: str, **kw) -> Peer:
    def builder(mod, muon, rest, lr):
        raise AssertionError("not built")

    return Peer(
        key,
        f"{key} label",
        distribution,
        module,
        "bfloat16",
        "test",
        "test",
        builder,
        kw.pop("read_version", "0"),
        **kw,
    )


def test_a_missing_package_is_a_row_that_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(PEERS, "ghost", _fake_peer("ghost", "dimuon-no-such-package", "dimuon_no_such_module"))
    status = probe("ghost")
    assert not status.runnable and status.version is None
    assert status.reason == "cannot run here: dimuon-no-such-package is not installed (pip install 'dimuon[peers]')"


def test_an_import_failure_a_cuda_only_peer_and_an_unsupported_setting_say_why(monkeypatch):
    monkeypatch.setitem(PEERS, "noimport", _fake_peer("noimport", "torch", "dimuon_no_such_module"))
    assert probe("noimport").reason.startswith(
        "cannot run here: import dimuon_no_such_module fails: ModuleNotFoundError"
    )
    monkeypatch.setitem(PEERS, "gpu", _fake_peer("gpu", "torch", "torch", needs_cuda="a CUDA kernel"))
    assert probe("gpu", "cpu").reason == "cannot run here: needs a CUDA device: a CUDA kernel"
    torch_version = torch.__version__.split("+")[0]
    monkeypatch.setitem(
        PEERS,
        "shardonly",
        _fake_peer(
            "shardonly", "torch", "torch", read_version=torch_version, unsupported={"local": "no single-process path"}
        ),
    )
    assert probe("shardonly", "cpu", "local").reason == "cannot run here: in one process: no single-process path"
    assert probe("shardonly", "cpu", "fsdp2").runnable
    # The limit was read from one version's source: another version is tried instead.
    monkeypatch.setitem(
        PEERS,
        "newer",
        _fake_peer("newer", "torch", "torch", read_version="0.0.1", unsupported={"local": "no single-process path"}),
    )
    assert probe("newer", "cpu", "local").runnable


def test_torch_muon_is_always_there_with_its_version_and_bf16_ns():
    status = probe("torch_muon")
    assert status.runnable and status.version == torch.__version__ and status.ns_dtype == "bfloat16"


def test_unknown_peer_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"--peers got unknown peer\(s\) \['sgd'\]; choose from \['torch_muon'"):
        check_names(["sgd", "heavyball"])


# ------------------------------------------------------------------------------------- harness


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def test_gradient_snapshot_puts_back_changed_and_dropped_gradients():
    model = _small_model()
    before = [p.grad.clone() for p in model.parameters()]
    snapshot = GradientSnapshot(model.parameters())
    params = list(model.parameters())
    params[0].grad.mul_(3)
    params[1].grad = None
    params[2].grad = torch.zeros_like(params[2])
    snapshot.restore()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_first_step_reports_a_failing_step_in_one_line_and_restores_gradients():
    model = _small_model()
    snapshot = GradientSnapshot(model.parameters())
    before = next(model.parameters()).grad.clone()

    class Broken:
        def step(self):
            next(model.parameters()).grad.zero_()
            raise NameError("name 'muon_update' is not defined\nmore")

    assert first_step(Broken(), snapshot) == "its step fails: NameError: name 'muon_update' is not defined"
    assert torch.equal(next(model.parameters()).grad, before)


def test_start_peer_turns_a_refusing_constructor_into_the_reason(monkeypatch):
    def refuse(mod, muon, rest, lr):
        raise ValueError("Unsupported mesh dimension: 2")

    monkeypatch.setitem(
        PEERS, "refusing", dataclasses.replace(_fake_peer("refusing", "torch", "torch"), builder=refuse)
    )
    model = _small_model()
    opt, status, error = start_peer("refusing", *muon_and_rest(model), 1e-3, GradientSnapshot(model.parameters()))
    assert opt is None and status.runnable
    assert error == "its constructor fails: ValueError: Unsupported mesh dimension: 2"
    opt, status, error = start_peer("torch_muon", *muon_and_rest(model), 1e-3, GradientSnapshot(model.parameters()))
    assert opt is not None and status.runnable and error is None


def test_bf16_note_says_whether_this_cpu_has_bf16_units():
    assert "fast here" in bf16_note(["avx2", "amx_bf16"])
    assert "without bf16 units: slow here" in bf16_note(["avx2"])
    assert bf16_note([], "cuda") == "bf16 NS"


@pytest.mark.parametrize("key", list(PEERS))
def test_every_installed_peer_builds_and_steps_in_one_process(key):
    status = probe(key, "cpu", "local")
    if not status.runnable:
        pytest.skip(status.reason)
    model = _small_model()
    muon, rest = muon_and_rest(model)
    assert [tuple(p.shape) for p in muon] == [(32, 32), (32, 32)] and len(rest) == 4
    before = [p.detach().clone() for p in model.parameters()]
    snapshot = GradientSnapshot(model.parameters())
    opt = build_peer(key, muon, rest, lr=1e-2)
    assert first_step(opt, snapshot) is None
    snapshot.restore()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # every parameter moved


def test_registry_hyperparameters_match_dimuon_defaults():
    from dimuon.optim import Muon

    defaults = Muon([nn.Parameter(torch.zeros(2, 2))], lr=1.0).defaults
    assert defaults["momentum"] == registry.MOMENTUM and defaults["ns_steps"] == registry.NS_STEPS
    assert (defaults["adamw_betas"], defaults["adamw_eps"]) == (registry.ADAMW_BETAS, registry.ADAMW_EPS)
