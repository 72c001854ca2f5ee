"""The CPU's step-to-step buffers (dimuon.optim.workspace): lending and giving back, Newton-Schulz taking its
temporaries from them with the same values, and an optimizer whose steps reuse them instead of allocating."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dimuon.optim import build, linalg
from dimuon.optim.workspace import Workspace


def test_a_buffer_given_back_is_lent_again_and_one_lent_is_never_lent_twice():
    ws = Workspace()
    a = ws.empty((4, 8), torch.float32, "cpu")
    b = ws.empty((4, 8), torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr() and ws.lent == 2
    ws.give_back(a[1:])  # a view of a lent buffer gives the buffer back
    c = ws.empty((8, 4), torch.float32, "cpu")  # any shape and dtype of those bytes
    assert c.data_ptr() == a.data_ptr() and c.is_contiguous() and ws.lent == 2
    assert ws.empty((4, 8), torch.bfloat16, "cpu").data_ptr() not in (a.data_ptr(), b.data_ptr())  # both lent
    ws.give_back(torch.zeros(3))  # not lent here: ignored
    ws.release()
    assert ws.lent == 0 and ws.held_bytes == 2 * 32 * 4 + 32 * 2
    assert {ws.empty((4, 8), torch.float32, "cpu").data_ptr() for _ in range(2)} == {a.data_ptr(), b.data_ptr()}
    assert ws.empty((0, 8), torch.float32, "cpu").numel() == 0 and ws.lent == 2  # nothing to keep: not lent
    small = ws.empty((4, 4), torch.bfloat16, "cpu")  # 32 bytes: the free 64-byte buffer is at most twice that
    tiny = ws.empty((2,), torch.bfloat16, "cpu")  # 4 bytes: no free buffer small enough, a new one
    assert small.data_ptr() != tiny.data_ptr() and ws.held_bytes == 2 * 32 * 4 + 32 * 2 + 4


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 16, 48), (3, 48, 16), (16, 48)], ids=["wide", "tall", "2d"])
def test_newton_schulz_from_a_workspace_gives_the_same_values_and_keeps_only_the_result(shape, dtype, algorithm):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    before = x.clone()
    ws = Workspace()
    for _ in range(2):  # the second call takes the buffers the first gave back
        got = linalg.newton_schulz(x, algorithm=algorithm, dtype=dtype, buffers=ws)
        assert torch.equal(got, linalg.newton_schulz(x, algorithm=algorithm, dtype=dtype))
        assert torch.equal(x, before)
        assert ws.lent == 1  # the buffer the result lies in, until the caller gives it back
        ws.give_back(got)
    assert ws.lent == 0 and ws.held_bytes > 0


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 24))


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("muon", {"ns_dtype": torch.bfloat16}),
        ("muon", {"ns_algorithm": "gram"}),
        ("periodic_row_muon", {"k": 2}),
        ("muon_bp", {"period": 2, "blocks": 2}),
    ],
    ids=["muon_bf16", "muon_gram", "prm", "muon_bp"],
)
def test_cpu_steps_reuse_their_buffers_and_move_the_weights_as_without_them(name, options):
    """From the second period on a step allocates no new buffer (the workspace holds the same bytes), and the
    weights are bitwise those of the same optimizer allocating every temporary afresh."""
    models = [_model(), _model()]
    opts = [build(name, m, lr=0.02, **options) for m in models]
    opts[1]._map_buffers = None  # the reference: no workspace
    held = []
    for t in range(6):
        g = torch.Generator().manual_seed(t)
        batch = torch.randn(8, 24, generator=g)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
        held.append(opts[0]._map_buffers.held_bytes)
    assert held[0] > 0 and held[2:] == [held[2]] * 4
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
