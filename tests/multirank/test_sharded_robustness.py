"""Failures that must not split the ranks: non-finite gradients on one rank, tensors on the wrong device,
checkpoints taken before every parameter has stepped.

The device audit runs every engine path on 4 gloo ranks with CPU parameters while the default
device is "meta" around building the optimizer, stepping it and saving/loading its state: any tensor
the optimizer makes without ``device=`` lands on meta and the first op mixing it with real data fails
(naming the case), and every state tensor must sit on its parameter's device. This was chosen over
fake CUDA tensors (FakeTensorMode with a fake process group): on a CPU-only torch build fake CUDA
refuses the batched matmuls Newton-Schulz is made of, so it cannot run a step; the meta trap runs
every real collective and every real kernel. What it cannot see (a CUDA-only dtype or stream
choice) is covered by the CUDA-marked tests in tests/unit/test_optim_cuda.py.
"""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import scenarios as sc

pytestmark = pytest.mark.multirank

NONFINITE_CASES = [
    (f"{layout}_{mode}_at{bad}", layout, mode, bad)
    for layout in ("fsdp", "ddp")
    for mode in ("raise", "skip")
    for bad in (0, 2)
]


@pytest.fixture(scope="module")
def nonfinite():
    return run_gloo(sc.nonfinite_on_one_rank, 2, NONFINITE_CASES, timeout_s=180)


@pytest.mark.parametrize("case", NONFINITE_CASES, ids=lambda c: c[0])
def test_nan_on_one_rank_raises_or_skips_on_every_rank(nonfinite, case):
    key, _, mode, bad = case
    first, last = (r[key] for r in (nonfinite[0], nonfinite[-1]))
    for r in (first, last):
        assert [o.split(":")[0] for o in r["outcomes"]] == [
            "raised" if t == bad and mode == "raise" else "stepped" for t in range(3)
        ]
        assert r["skipped"] == (1 if mode == "skip" else 0)
        # A raised step takes no slot; a skipped one (decided on the device) takes its slot in the schedule.
        assert set(r["phase"]) == {2 if mode == "raise" else 3}
    if mode == "raise":
        assert "non-finite gradient in b.weight" in last["outcomes"][bad]
        assert "a parameter on another rank" in first["outcomes"][bad]
    for name, p in first["params"].items():
        assert torch.equal(p, last["params"][name]), name


def test_every_engine_path_keeps_tensors_on_their_parameters_device():
    results = run_gloo(sc.device_audit, 4, timeout_s=300)
    for rank_result in results:
        for key, (trapped, plain) in rank_result.items():
            for name, p in plain.items():
                assert torch.equal(trapped[name], p), (key, name)


def test_dcp_checkpoint_before_the_first_step_and_a_parameter_without_gradient_on_one_rank(tmp_path):
    # The state exists on every rank from construction: saving does not run DCP's zero-gradient
    # initialisation step (which would advance the schedule), and the keys never depend on what stepped.
    straight = run_gloo(sc.dcp_early_saves, 2, str(tmp_path), timeout_s=300)
    assert set(straight[0]["phase"]) == {0}
    assert straight[0]["keys"] == straight[1]["keys"] and straight[0]["keys"][0] == straight[0]["keys"][1]
    resumed = run_gloo(sc.dcp_early_resume, 2, str(tmp_path), timeout_s=300)
    for name, p in straight[0]["params"].items():
        assert torch.equal(resumed[0][name], p), name
