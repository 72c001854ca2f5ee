"""``torch.compile(opt.step, fullgraph=True)``: no graph break and one graph per step kind once warm, the eager
step's values; the settings that read the device on the host at every step break the graph there.

Dynamo's graphs are run by a counting backend here (the traced ops, run as they are); inductor's code is checked
under ``slow`` (its C++ compile takes tens of seconds on a CPU).
"""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
from functorch.compile import make_boxed_func
from golden_steps import OPTIMIZERS, form, make_optimizer, make_params, set_grads
from torch._dynamo.backends.common import aot_autograd
from torch.utils import _pytree as pytree

STEPS = 11  # eager steps 0-1 make the state; compiled steps 2-10 (2 skipped: a NaN) take every kind 3 times
KINDS = {"muon": 1, "periodic_row_muon": 2, "muon_bp": 2}
ADAMW = ("bias", "norm")


def _run(name: str, compiled: bool, backend: object = "eager") -> tuple[dict, list[int]]:
    """The weights after STEPS steps (from step 2 on compiled) and the graphs compiled after each step."""
    torch._dynamo.reset()
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(1)
        return gm.forward if backend == "eager" else torch._inductor.compile(gm, inputs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps = make_params()
        opt = make_optimizer(name, ps, "skip")
        step = torch.compile(opt.step, fullgraph=True, backend=counting) if compiled else opt.step
        seen = []
        for t in range(STEPS):
            set_grads(ps, t, "skip")
            (step if t >= 2 else opt.step)()
            seen.append(len(graphs))
    return {n: p.detach().clone() for n, p in ps.items()}, seen


def _check(name: str, backend: object, exact: bool) -> None:
    want, _ = _run(name, compiled=False)
    got, seen = _run(name, compiled=True, backend=backend)
    # torch adds "capturable" to each group at the first compiled call and the step counter turns dynamic at the
    # second: two warm-up graphs, then one per step kind, and none after the first period
    assert seen[-1] <= KINDS[name] + 2, seen
    assert seen[-1] == seen[-1 - int(OPTIMIZERS[name].get("k", OPTIMIZERS[name].get("period", 1)))], seen
    for key, value in want.items():
        if exact and key not in ADAMW:
            assert torch.equal(got[key], value), key
        else:  # the eager AdamW group takes torch's fused kernel, which a graph does not trace
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)


def test_compiled_muon_step_is_one_graph_and_the_eager_values() -> None:
    _check("muon", "eager", exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["periodic_row_muon", "muon_bp"])
def test_compiled_step_is_one_graph_per_kind_and_the_eager_values(name: str) -> None:
    _check(name, "eager", exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KINDS))
def test_inductor_step_keeps_the_eager_values(name: str) -> None:
    _check(name, "inductor", exact=False)


def _graph_inputs(name: str) -> dict[str, int]:
    """Over a period and one step more, compiled from the first step in the accelerator form (a state_dict loaded
    back before the last): the graph inputs the step mutates in place, those of them that are not static addresses
    by inductor's own reckoning (the metadata it reads), and the inputs that a graph of an earlier step returned."""
    torch._dynamo.reset()
    counts = {"mutated": 0, "not static": 0, "carried": 0}
    earlier: dict[int, weakref.ref] = {}  # the tensors the graphs of the steps before returned
    latest: dict[int, weakref.ref] = {}  # and those of this step's

    def record(gm: torch.fx.GraphModule, inputs: list) -> object:
        meta = torch._guards.TracingContext.get().fw_metadata
        mutated = set(meta.mutated_inp_runtime_indices)
        counts["mutated"] += len(mutated)
        counts["not static"] += len(mutated - set(meta.static_input_indices))
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        compiled = aot_autograd(fw_compiler=record)(gm, inputs)

        def run(*args: object) -> object:
            counts["carried"] += sum(1 for a in args if id(a) in earlier and earlier[id(a)]() is a)
            out = compiled(*args)
            latest.update((id(t), weakref.ref(t)) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

        return run

    with warnings.catch_warnings(), form("accelerator"):
        warnings.simplefilter("ignore")
        ps = make_params()
        opt = make_optimizer(name, ps, "skip")
        step = torch.compile(opt.step, fullgraph=name in KINDS, backend=backend)
        options = OPTIMIZERS[name]
        period = int(options.get("k", options.get("period", options.get("k_max", 1))))  # AdaptiveRowMuon's longest
        for t in range(period + 1):
            set_grads(ps, t, "skip")
            if t == period:  # new state tensors: the step compiles again, and they must be static too
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            earlier.update(latest)
            latest.clear()
            step()
    return counts


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "muon_bp" else pytest.mark.slow) for n in OPTIMIZERS]
)  # MuonBP by default: a full and a block step, and a plan made under the graph (its block regions)
def test_a_compiled_step_can_replay_as_cuda_graphs(name: str) -> None:
    """CUDA graphs (``mode="reduce-overhead"``) replay in place only over static inputs: inductor skips them for a
    graph that mutates any other input. The step marks its state static the way torch's optimizers do (dynamo runs
    ``_init_group`` eagerly, then marks every state tensor), from the first step and again after a load. And a
    replay overwrites what the graph returned the replay before, so no step may read a tensor an earlier one's
    graph returned (the skip counter is counted in place)."""
    counts = _graph_inputs(name)
    assert counts["mutated"] > 0, counts  # the momenta, the AdamW moments and counters
    assert counts["not static"] == 0 and counts["carried"] == 0, counts


@pytest.mark.parametrize(("name", "nonfinite"), [("muon", "raise"), ("adaptive_row_muon", "skip")])
def test_host_reads_are_the_one_graph_break(name: str, nonfinite: str) -> None:
    """``nonfinite="raise"`` reads the vote on the host at every step, and AdaptiveRowMuon its signals once a step
    has references to measure them against (the third here: two eager steps first): a plain ``torch.compile`` breaks
    the graph there (the eager values: test_optim_execution.py), ``fullgraph=True`` refuses them."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps = make_params()
        opt = make_optimizer(name, ps, nonfinite)
        for t in range(2):
            set_grads(ps, t, "raise")
            opt.step()
        set_grads(ps, 2, "raise")
        with pytest.raises(torch._dynamo.exc.Unsupported, match="tolist"):
            torch.compile(opt.step, fullgraph=True, backend="eager")()
