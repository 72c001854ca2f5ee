"""python -m dimuon.bench.host_calls: calls per step counted in one process, on FSDP2's fake ranks and on stacked
experts laid out over fake ranks (rank 0's step), and its flags refused with what they allow."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from dimuon.bench import host_calls
from dimuon.bench.census import fake_rank

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WORLD = 16  # ep_efsdp: experts over ep=8, each expert's rows over efsdp=2


@pytest.fixture
def no_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")


@pytest.mark.parametrize(
    ("layout", "mesh", "local"),
    [("ep", (WORLD,), [(1, 4, 8), (1, 8, 2)]), ("ep_efsdp", (8, 2), [(1, 4, 16), (1, 8, 4)])],
)
def test_expert_weights_are_rank_0_s_pieces_of_the_layout(no_group, layout, mesh, local):
    """Wide and tall in turn; rank 0 holds one whole expert over ``ep``, or four rows of one expert whose rows the
    ``efsdp`` ranks split."""
    with fake_rank(0, WORLD):
        params = host_calls.expert_weights(3, layout, WORLD)
        assert [tuple(p.device_mesh.shape) for p in params] == [mesh] * 3
        assert [tuple(p.to_local().shape) for p in params] == [local[0], local[1], local[0]]
        assert all(p.grad.placements == p.placements and p.grad.to_local().abs().sum() > 0 for p in params)
        split = [pl.dim for pl in params[0].placements]
        assert split == ([0] if layout == "ep" else [0, 1])


def test_the_experts_table_has_a_row_per_optimizer_and_refresh_on_each_layout(no_group, monkeypatch, capsys):
    """Every row counted for real (a few steps each), at two weight counts: the memory-bound steps and the gather
    refresh flat in the weights (the owner refresh's grow with the classes rank 0 owns matrices of, not asserted)."""
    monkeypatch.setattr(host_calls, "EXPERT_WEIGHTS", (4, 8))
    monkeypatch.setattr(host_calls, "step_calls", functools.partial(host_calls.step_calls, steps=3, warmup=4))
    host_calls.main(["--sharded", str(WORLD), "--experts"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["optimizer", "4", "8", "8/4"]
    rows = {}
    for line in lines[1:]:  # "muon [ep W=16] gather    153    153    1.00x"
        where, (refresh, *counts) = line.split("]")[0], line.split("]")[1].split()
        rows[f"{where}] {refresh}"] = counts
    expected = [
        f"{name} [{layout} W={WORLD}] {refresh}"
        for layout in host_calls.EXPERT_LAYOUTS
        for name in host_calls.OPTIMIZERS
        for refresh in ("gather", "owner")
    ]
    assert list(rows) == expected
    for title, (small, large, _) in rows.items():
        assert float(small) > 0
        if title.endswith("gather"):
            assert small == large, title


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experts"], "--experts needs --sharded W, a multiple of 8 and >= 16"),
        (["--sharded", "12", "--experts"], "got --sharded 12"),
        (["--sharded", "1"], "--sharded must be a world size >= 2, got 1"),
    ],
)
def test_bad_flags_are_refused_naming_what_they_allow(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        host_calls.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_one_process_table_counts_every_optimizer_within_the_host_target(monkeypatch, capsys):
    """The default table, a few steps a row: every optimizer at 20, 140 and 560 matrices, its calls at 140 within
    1.5x of those at 20 and at most 1,500 (CONTRIBUTING.md's target)."""
    monkeypatch.setattr(host_calls, "step_calls", functools.partial(host_calls.step_calls, steps=6, warmup=6))
    host_calls.main([])
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["optimizer", "20", "140", "560", "560/20"]
    assert [line.split()[0] for line in lines] == list(host_calls.OPTIMIZERS)
    for line in lines:
        at_20, at_140 = (float(c) for c in line.split()[1:3])
        assert at_140 <= min(1.5 * at_20, 1500), line
