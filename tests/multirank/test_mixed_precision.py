"""The harness's FSDP2 layout under ``--precision bf16``: parameters all-gathered and computed in bf16, shards and
gradient reductions in fp32 (half the all-gather bytes; the optimizer steps fp32 as before)."""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import precision_scenarios as ps

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(("param_dtype", "compute"), [(torch.bfloat16, "torch.bfloat16"), (None, "torch.float32")])
def test_bf16_all_gathers_and_computes_in_bf16_and_reduces_into_fp32_shards(param_dtype, compute):
    for seen in run_gloo(ps.dtypes_in_a_step, 2, param_dtype, timeout_s=240):
        # The flow time reaches the timestep embedder in fp32: cast to bf16, 0.9955 and 0.9975 would be one time.
        expect = {"compute": compute, "stored": "torch.float32", "grad": "torch.float32", "time": "torch.float32"}
        assert seen == {**expect, "times_apart": True}
