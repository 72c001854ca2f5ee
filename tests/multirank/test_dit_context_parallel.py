"""dimuon's DiT with its tokens split over 2 gloo context-parallel ranks against one process: the output, the
gradients averaged over the ranks (as FSDP averages them), eval-mode forwards on whole sequences, and three
optimizer steps under FSDP2 over the ``cp`` ranks."""

import pytest
import torch

from dimuon.bench.launch import run_gloo
from dimuon.optim import build, param_groups

from . import dit_cp_scenarios as cs
from . import mesh_scenarios as ms

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_gloo(cs.context_parallel, 2, timeout_s=300)


@pytest.fixture(scope="module")
def one_process() -> dict:
    out, grads = cs.loss_and_grads(ms.dit_model())
    model = ms.dit_model()
    opt = build("periodic_row_muon", param_groups(model), lr=ms.LR, k=2, ns_dtype=torch.float32)
    first = ms.dit_train(model, opt)
    muon = {n for g in param_groups(model) if g["algorithm"] == "muon" for n, _ in g["params"]}
    return {"out": out, "grads": grads, "fsdp_out": first, "params": ms.full_params(model), "muon": muon}


def test_split_tokens_give_the_one_process_output_and_gradients(runs, one_process) -> None:
    for rank in runs:
        split = rank["split"]
        torch.testing.assert_close(split["out"], one_process["out"], rtol=0, atol=1e-6)
        torch.testing.assert_close(split["eval_out"], one_process["out"], rtol=0, atol=1e-6)
        for name, grad in one_process["grads"].items():
            torch.testing.assert_close(split["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fsdp_over_cp_trains_as_one_process(runs, one_process) -> None:
    for rank in runs:
        fsdp = rank["fsdp"]
        assert (fsdp["out"] - one_process["fsdp_out"]).abs().max() <= 1e-5
        # Muon's matrices only: AdamW's first steps turn rounding in zero gradients (the key bias) into +-lr.
        for name in one_process["muon"]:
            assert (fsdp["params"][name] - one_process["params"][name]).abs().max() <= 1e-5, name
