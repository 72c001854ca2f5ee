"""`dimuon train --parallel.*` on gloo ranks: FSDP x TP trains as FSDP does, HSDP as FSDP over all ranks, and a
checkpoint saved under one layout resumes under another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dimuon.bench.launch import run_gloo

from . import train_scenarios as sc

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # about a minute of 4-rank training on 2 cores

BASE: dict[str, Any] = dict(
    model="DiT-T/2",
    dataset="digits",
    steps=6,
    batch_size=16,
    warmup_steps=2,
    log_interval=2,
    val_interval=6,
    val_samples=16,
    sample_count=4,
    sample_steps=2,
    ckpt_interval=4,
    progress=False,
    optimizer="periodic_row_muon",
    threads=1,
)
FOUR = {
    "fsdp4": {},
    "hsdp2x2": {"dp_replicate": 2},
    "fsdp2xtp2": {"dp_shard": 2, "tp": 2},
    "resumed_as_hsdp": {"dp_replicate": 2, "resume": "fsdp2xtp2/checkpoints/step_0000004"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("parallel")
    four = run_gloo(sc.parallel_runs, 4, BASE, str(root), FOUR, timeout_s=600)[0]
    two = run_gloo(sc.parallel_runs, 2, BASE, str(root), {"fsdp2": {}}, timeout_s=600)[0]
    return root, four, two


def test_tensor_parallel_trains_as_its_data_parallel_twin(runs) -> None:
    _, four, two = runs
    # FSDP 2 x TP 2 sees the data and noise of FSDP over 2 ranks; only the order of reductions differs.
    assert four["fsdp2xtp2"]["val_loss"] == pytest.approx(two["fsdp2"]["val_loss"], rel=1e-4)
    assert four["hsdp2x2"]["val_loss"] == pytest.approx(four["fsdp4"]["val_loss"], rel=1e-4)


def test_checkpoint_of_one_layout_resumes_under_another(runs) -> None:
    root, four, _ = runs
    resumed = four["resumed_as_hsdp"]
    assert resumed["step"] == BASE["steps"]
    # FSDP x TP and HSDP 2 x 2 see different data slices after the resume (2 vs 4 data-parallel ranks),
    # so the two runs only agree roughly; the resumed one started from the step-4 weights and phase.
    assert resumed["val_loss"] == pytest.approx(four["fsdp2xtp2"]["val_loss"], rel=0.2)
    assert (root / "resumed_as_hsdp" / "checkpoints" / "step_0000006").is_dir()
