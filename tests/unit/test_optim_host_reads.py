"""The non-finite vote on the device: no host read inside ``step()`` with ``nonfinite="skip"`` (the staleness signals
of AdaptiveRowMuon apart, its own one read), at most one with ``"raise"``; a skipped step leaves every state tensor
bitwise as it was, and the run goes on as one that never saw the bad step, the schedule slot it took apart.

Host reads are counted by the census's own tracer (``dimuon.bench.census.tracing``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dimuon.bench.census import tracing
from dimuon.bench.peers import CallCounter, count_collectives
from dimuon.optim import AdaptiveRowMuon, Muon, MuonBP, PeriodicRowMuon, param_groups

FAMILY = {
    "muon": (Muon, {}),
    "periodic_row_muon": (PeriodicRowMuon, {"k": 3}),
    "muon_bp": (MuonBP, {"period": 2, "blocks": 2}),
    "adaptive_row_muon": (AdaptiveRowMuon, {"k_min": 1, "k_max": 3, "threshold": 0.0}),
}
SIGNAL_SITE = "core.py:read"  # a schedule's host read of its signals (StepContext.read)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make(name: str, **options):
    torch.manual_seed(0)
    model = Net()
    cls, schedule = FAMILY[name]
    return model, cls(param_groups(model), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, **{**schedule, **options})


def backward(model: nn.Module, step: int, bad: bool = False) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 5, generator=g)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    if bad:
        model.fc1.weight.grad[1, 2] = float("nan")
        model.fc2.bias.grad[0] = float("inf")  # an AdamW parameter too


def traced_step(opt) -> tuple[dict[str, int], BaseException | None]:
    """Host reads of one ``opt.step()`` by site, and what it raised."""
    raised = None
    with count_collectives(CallCounter()) as counter, tracing(counter) as tally:
        try:
            opt.step()
        except FloatingPointError as e:
            raised = e
    return dict(tally.read_sites), raised


def snapshot(model: nn.Module, opt) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("fused", [None, False], ids=["fused_adamw", "foreach_adamw"])
@pytest.mark.parametrize("name", FAMILY)
def test_skip_reads_nothing_on_the_host(name, fused, bad):
    model, opt = make(name, nonfinite="skip", adamw_fused=fused)
    for t in range(2):  # the engine is built, AdaptiveRowMuon's matrices come to the ages that need a signal
        backward(model, t)
        opt.step()
    backward(model, 2, bad)
    before = snapshot(model, opt)
    sites, raised = traced_step(opt)
    assert raised is None
    assert {site: n for site, n in sites.items() if SIGNAL_SITE not in site} == {}, sites
    assert sum(sites.values()) == (1 if name == "adaptive_row_muon" else 0), sites
    if bad:  # weights, momenta, AdamW moments and counters, references: bitwise as they were
        assert bitwise_equal(snapshot(model, opt), before)
    assert opt.skipped_steps == int(bad)


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("name", FAMILY)
def test_raise_reads_once(name, bad):
    model, opt = make(name)
    for t in range(2):
        backward(model, t)
        opt.step()
    backward(model, 2, bad)
    before = snapshot(model, opt)
    phase = [g["step"] for g in opt.param_groups]
    sites, raised = traced_step(opt)
    assert sum(sites.values()) == 1, sites  # the vote (with the staleness signals, where a schedule reads them)
    if bad:
        assert isinstance(raised, FloatingPointError) and "non-finite gradient in" in str(raised)
        assert bitwise_equal(snapshot(model, opt), before)
        assert [g["step"] for g in opt.param_groups] == phase  # a raised step takes no slot
    else:
        assert raised is None


@pytest.mark.parametrize("name", FAMILY)
def test_raise_names_the_parameter_from_its_one_read(name):
    model, opt = make(name)
    backward(model, 0)
    model.fc2.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in fc2\.weight"):
        opt.step()


@pytest.mark.parametrize("fused", [None, False], ids=["fused_adamw", "foreach_adamw"])
@pytest.mark.parametrize("name", FAMILY)
def test_after_a_skipped_step_the_run_is_one_that_never_saw_it_but_for_the_slot(name, fused):
    # Run a sees a bad step at t = 2; run b does not, and is only given the slot a's skipped step took: the step
    # counter of every group and (AdaptiveRowMuon) the matrices' ages, both host numbers a cannot correct.
    model_a, opt_a = make(name, nonfinite="skip", adamw_fused=fused)
    model_b, opt_b = make(name, nonfinite="skip", adamw_fused=fused)
    for t in range(6):
        backward(model_a, t, bad=t == 2)
        opt_a.step()
        if t == 2:
            for ga, gb in zip(opt_a.param_groups, opt_b.param_groups):
                gb["step"] = ga["step"]
            for pa, pb in zip(model_a.parameters(), model_b.parameters()):
                if "refresh_age" in opt_a.state[pa]:
                    opt_b.state[pb]["refresh_age"] = opt_a.state[pa]["refresh_age"]
            continue
        backward(model_b, t)
        opt_b.step()
        assert bitwise_equal(snapshot(model_a, opt_a), snapshot(model_b, opt_b)), t
    assert opt_a.skipped_steps == 1 and opt_b.skipped_steps == 0


@pytest.mark.parametrize("name", FAMILY)
def test_skip_and_raise_take_the_same_finite_steps_bit_for_bit(name):
    # The masked kernels compute what the plain ones do where the vote passes (torch's fused AdamW in both).
    runs = [make(name, nonfinite=policy) for policy in ("skip", "raise")]
    for t in range(5):
        for model, opt in runs:
            backward(model, t)
            opt.step()
    assert bitwise_equal(snapshot(*runs[0]), snapshot(*runs[1]))


def test_the_skip_count_stays_on_the_device_until_read_and_loads_from_a_number():
    model, opt = make("periodic_row_muon", nonfinite="skip")
    for t in range(4):
        backward(model, t, bad=t % 2 == 1)
        opt.step()
    counter = opt._votes["pending_skips"]
    assert isinstance(counter, torch.Tensor)  # counted, not read
    saved = copy.deepcopy(opt.state_dict())  # saving reads it
    assert [g["skipped_steps"] for g in saved["param_groups"]] == [2, 2]
    assert opt._votes["pending_skips"] is counter and int(counter) == 0  # zeroed in place, kept for the next steps
    assert opt.skipped_steps == 2
    backward(model, 4, bad=True)
    opt.step()
    assert opt._votes["pending_skips"] is counter and opt.skipped_steps == 3
    fresh = make("periodic_row_muon", nonfinite="skip")[1]
    fresh.load_state_dict(saved)  # an int per group, as every checkpoint holds it
    assert fresh.skipped_steps == 2
    backward(model, 5, bad=True)
    opt.step()  # one skip counted on the device, then replaced by the loaded counts
    opt.load_state_dict(saved)
    assert opt._votes["pending_skips"] is counter and opt.skipped_steps == 2


@pytest.mark.parametrize("name", FAMILY)
def test_a_sharded_step_reads_the_host_only_where_the_set_of_muon_gradients_changes(name):
    # Under a sharded engine the ranks must step the same Muon parameters: the vote carries whether each rank's set
    # of gradients changed since the last step, still in its one 4-byte all-reduce. A step whose set did not change
    # reads nothing (with "skip"); one where it changed reads the vote, and where every rank's changed, the ranks
    # agree on the new set with one more all-reduce. On torch's fake backend the collectives leave every flag as
    # this rank voted it, as if every rank had dropped the same gradient: its parameter is then left alone.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dimuon.bench.census import fake_rank

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    cls, schedule = FAMILY[name]
    with fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        gen = torch.Generator().manual_seed(0)
        params = {
            n: nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)], src_data_rank=None))
            for n, s in {"w0": (8, 6), "w1": (6, 8), "w2": (10, 4)}.items()
        }
        opt = cls(list(params.items()), lr=0.02, ns_dtype=torch.float32, nonfinite="skip", refresh="gather", **schedule)
        reads, votes = [], []
        for t, dropped in enumerate([(), (), ("w0",), ("w0",), (), ()]):
            for n, p in params.items():
                g = torch.zeros(p.shape) if n not in dropped else None
                p.grad = None if g is None else distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
            before = params["w0"].to_local().clone()
            with count_collectives(CallCounter()) as counter, tracing(counter) as tally:
                opt.step()
            reads.append(sum(n for site, n in tally.read_sites.items() if SIGNAL_SITE not in site))
            votes.append([(c.kind, c.dtype, c.buffer_bytes) for c in tally.collectives if c.kind == "all_reduce"][:2])
            if dropped:  # every rank dropped it: left alone, as one process leaves a parameter without gradient
                assert torch.equal(params["w0"].to_local(), before), t
        assert reads == [0, 0, 2, 0, 2, 0]  # the vote and the agreement, where the set changed
        vote = ("all_reduce", "uint8", 4)  # [taken, finite, unchanged, changed]
        agree = ("all_reduce", "uint8", 6)  # two flags per Muon parameter: has a gradient, has none
        for t, found in enumerate(votes):
            assert found[0] == vote, (t, found)
            if t in (2, 4):
                assert found[1] == agree, (t, found)
        assert opt.skipped_steps == 0
