"""Start-up errors that only a sharded run can hit are reported on every rank, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from dimuon.optim.distributed.launch import run_gloo

from . import train_scenarios as sc

pytestmark = pytest.mark.multirank


def test_one_process_baseline_is_refused_under_fsdp(tmp_path: Path) -> None:
    base = dict(model="DiT-T/2", dataset="digits", optimizer="torch_muon", batch_size=16, steps=2, progress=False)
    messages = run_gloo(sc.config_error, 2, base, str(tmp_path / "run"))
    assert all(m is not None and m.startswith("--optimizer torch_muon: torch_muon runs in one process only")
               for m in messages), messages
