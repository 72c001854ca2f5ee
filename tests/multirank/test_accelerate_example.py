"""examples/accelerate_fsdp2_dit.py on 2 gloo ranks: accelerate's FSDP2 plugin shards a diffusers DiT after the
PeriodicRowMuon was built and re-points its groups; the run equals one process training on the whole batch."""

from __future__ import annotations

import importlib.util

import pytest

from dimuon.bench.launch import run_gloo
from tests.example_modules import import_example

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs dimuon[accelerate]"),
]


def _example():
    return import_example("accelerate_fsdp2_dit")


def run_example(rank: int, world: int, steps: int) -> dict:
    return _example().train(steps=steps, fsdp_on_cpu=True)


def test_accelerate_fsdp2_run_equals_one_process() -> None:
    steps = 4  # spectral at 0 and 3 (k = 3), RowNorm at 1 and 2
    sharded = run_gloo(run_example, 2, steps, timeout_s=300)
    assert any("Shard(dim=0)" in p for p in sharded[0]["placements"])  # accelerate did shard the model
    single = _example().train(steps=steps)
    # The adapter wraps diffusers' model: its final conditioning map is Muon's, as every adaLN map is; its patch
    # embedding and output projection are still AdamW's.
    assert {"model.transformer_blocks.0.attn1.to_q.weight", "model.proj_out_1.weight"} <= set(single["muon"])
    assert not {"model.pos_embed.proj.weight", "model.proj_out_2.weight"} & set(single["muon"])
    for name, expect in single["weights"].items():
        # AdamW's first steps turn rounding in near-zero gradients (the attention keys' bias gets none in
        # exact arithmetic) into lr-sized steps: the Muon matrices carry the 1e-5 comparison.
        tol = 1e-5 if name in single["muon"] else 1e-3
        for rank_result in sharded:
            assert (rank_result["weights"][name] - expect).abs().max().item() <= tol, name
    assert sharded[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
