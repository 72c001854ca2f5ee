"""Spectral refreshes send the momentum in Newton-Schulz's dtype (bf16 on CUDA; forced here): the directions are
bitwise those of an fp32 payload (Newton-Schulz rounds the matrix to bf16 first), for half the bytes; the owner
sends directions back unscaled in bf16 where a bucket's matrices share one lr scale, and scaled in fp32 where not."""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import payload_scenarios as ps

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(
    ("refresh", "col_split"),
    [
        ("gather", (6, 10)),
        ("owner", None),
        pytest.param("owner", 2, marks=pytest.mark.slow),  # between the two others: one scale, columns split
        ("owner", (6, 10)),
    ],
    ids=["gather", "owner_one_scale", "owner_even_columns", "owner_uneven_columns"],
)
def test_bf16_payloads_give_the_fp32_payloads_directions_for_half_the_bytes(refresh, col_split):
    narrow = run_gloo(ps.run, 2, refresh, None, col_split, timeout_s=240)
    wide = run_gloo(ps.run, 2, refresh, torch.float32, col_split, timeout_s=240)
    for a, b in zip(narrow, wide):
        for name in ps.SHAPES:
            assert torch.equal(a["params"][name], b["params"][name]), (refresh, name)
    kind = "all_gather" if refresh == "gather" else "all_to_all"
    sent, sent_wide = (
        sum(v for rank in r for k, v in rank["bytes"].items() if k.startswith(kind)) for r in (narrow, wide)
    )  # what arrives at either rank
    if refresh == "gather" or col_split is None or col_split == 2:  # one lr scale per bucket: bf16 both ways
        assert sent * 2 == sent_wide
    else:  # the fused matrix's uneven column chunks have two lr scales: its bucket's way back stays fp32
        assert sent_wide / 2 < sent < sent_wide
