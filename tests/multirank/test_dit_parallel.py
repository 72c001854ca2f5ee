"""dimuon's DiT under tensor parallelism, FSDP x TP and HSDP on 4 gloo ranks: the plan's placements, the same
model (saved names and values, outputs), and the same training as one process."""

import pytest

from dimuon.bench.launch import run_gloo
from dimuon.optim import build, param_groups

from . import mesh_scenarios as ms

pytestmark = pytest.mark.multirank

LAYOUTS = [(1, 1, 4), (1, 2, 2), (2, 2, 1)]


@pytest.fixture(scope="module")
def runs():
    return run_gloo(ms.dit_parallel, 4, LAYOUTS, timeout_s=600)


@pytest.fixture(scope="module")
def one_process():
    import torch

    model = ms.dit_model()
    saved = ms.full_params(model)
    opt = build("periodic_row_muon", param_groups(model), lr=ms.LR, k=2, ns_dtype=torch.float32)
    first = ms.dit_train(model, opt)
    return {
        "saved": saved,
        "out": first,
        "params": ms.full_params(model),
        "muon": {n for g in param_groups(model) if g["algorithm"] == "muon" for n, _ in g["params"]},
    }


def test_tensor_parallel_plan_placements(runs):
    tp, fsdp_tp = runs[0][(1, 1, 4)]["placements"], runs[0][(1, 2, 2)]["placements"]
    assert tp["blocks.0.attn.qkv.weight"] == "(_StridedShard(dim=0, sf=3),)"  # each rank its heads' q, k, v
    assert tp["blocks.0.attn.qkv.bias"] == "(Replicate(),)"
    assert tp["blocks.0.attn.proj.weight"] == tp["blocks.0.mlp.fc2.weight"] == "(Shard(dim=1),)"
    assert tp["blocks.0.mlp.fc1.weight"] == "(Shard(dim=0),)"
    assert tp["blocks.0.adaLN_modulation.1.weight"] == "plain"  # replicated over tp
    assert fsdp_tp["blocks.0.attn.qkv.weight"] == "(Shard(dim=1), _StridedShard(dim=0, sf=3))"
    assert fsdp_tp["blocks.0.mlp.fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert fsdp_tp["blocks.0.mlp.fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert fsdp_tp["blocks.0.adaLN_modulation.1.weight"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(map(str, d)))
def test_same_model_and_same_training_as_one_process(runs, one_process, layout):
    for rank_result in runs:
        r = rank_result[layout]
        assert r["saved"].keys() == one_process["saved"].keys()  # a checkpoint keeps its keys and values
        for name, value in one_process["saved"].items():
            assert r["saved"][name].equal(value), name
        assert (r["out"] - one_process["out"]).abs().max() <= 1e-5
        for name in one_process["muon"]:  # AdamW's first steps amplify rounding in near-zero gradients (k bias)
            assert (r["params"][name] - one_process["params"][name]).abs().max() <= 1e-4, name
