"""``torch.compile(opt.step)`` of a sharded optimizer (FSDP2 on 2 gloo ranks, ``nonfinite="skip"``): the eager
step's values, graph breaks only where a collective is issued or waited for, no recompilation once every step kind
has run, and on warm steps no op that moves data outside a graph or a collective: the collectives may split the
graph, never the math between them."""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import compile_scenarios as cs

pytestmark = pytest.mark.multirank

# Step 0 eager (it makes the state), the others compiled, the last two profiled. A step kind compiles again while
# dynamo turns the numbers that change (step counters, sizes) dynamic; once warm, every kind has run without that.
STEPS = 7
SLOW_STEPS = 11  # more shape classes: MuonBP's kinds take up to step 5 to warm up
PROFILED = 2
# Where a compiled step may break its graph: the optimizer's collectives and the waits for them, nothing else.
BOUNDARIES = {
    f"{cls}.{method}"
    for cls, methods in {
        "Collectives": ("all_gather", "all_reduce", "all_max", "all_true", "all_to_all", "broadcast", "broadcasts"),
        "_TimedWork": ("wait",),
        "_AllWork": ("wait",),
    }.items()
    for method in methods
}


def _check(model: str, name: str, opts: dict, expected: set[str], steps: int = STEPS, backend: str = "eager") -> None:
    results = run_gloo(cs.compiled_and_eager, 2, model, name, opts, steps, PROFILED, backend, timeout_s=900)
    rtol = 0 if backend == "eager" else 1e-5  # inductor's kernels may round otherwise
    for rank, result in enumerate(results):
        eager, compiled = result["eager"], result["compiled"]
        for key, want in eager["weights"].items():
            torch.testing.assert_close(compiled["weights"][key], want, rtol=rtol, atol=1e-6, msg=f"rank {rank} {key}")
        assert compiled["comm"] == eager["comm"], rank  # every collective issued and counted as eagerly
        reasons = compiled["reasons"]
        assert set(reasons) <= BOUNDARIES, (rank, reasons)
        assert expected <= set(reasons), (rank, reasons)  # the collectives of these step kinds did split the graph
        graphs = compiled["graphs"]
        assert graphs[-1] == graphs[-1 - PROFILED], (rank, graphs)  # warm: the profiled steps compiled nothing
        assert compiled["outside"] == [{}] * PROFILED, (rank, compiled["outside"])


def test_compiled_step_on_a_mesh_splits_only_at_collectives() -> None:
    """PeriodicRowMuon, k=2, refresh by all-gather: the vote's, RowNorm's and the refresh's collectives."""
    expected = {"Collectives.all_true", "Collectives.all_reduce", "Collectives.all_gather"}
    _check("tiny", "periodic_row_muon", {"k": 2, "refresh": "gather"}, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "opts", "expected"),
    [
        ("periodic_row_muon", {"k": 2, "refresh": "gather"}, {"Collectives.all_reduce", "Collectives.all_gather"}),
        ("periodic_row_muon", {"k": 2, "refresh": "owner"}, {"Collectives.all_reduce", "Collectives.all_to_all"}),
        ("muon_bp", {"period": 2, "refresh": "gather"}, {"Collectives.all_gather"}),
        ("muon_bp", {"period": 2, "refresh": "owner"}, {"Collectives.all_to_all"}),
        ("muon", {"refresh": "gather"}, {"Collectives.all_gather"}),
        ("muon", {"refresh": "owner"}, {"Collectives.all_to_all"}),
    ],
)
def test_every_compiled_step_on_a_mesh_splits_only_at_collectives(name: str, opts: dict, expected: set[str]) -> None:
    _check("odd", name, opts, expected | {"Collectives.all_true"}, SLOW_STEPS)


@pytest.mark.slow
def test_inductor_step_on_a_mesh_keeps_the_eager_values() -> None:
    """The default case with inductor's code (its C++ compile takes tens of seconds on a CPU)."""
    expected = {"Collectives.all_true", "Collectives.all_reduce", "Collectives.all_gather"}
    _check("tiny", "periodic_row_muon", {"k": 2, "refresh": "gather"}, expected, backend="inductor")
