"""dimuon bench step under torchrun on 2 gloo ranks: FSDP2 rows with the optimizer's bytes, torch_muon's reason."""

import json

import pytest

from dimuon.bench import step

pytestmark = pytest.mark.multirank


def test_fsdp2_rows_carry_the_optimizers_bytes(tmp_path):
    out = tmp_path / "out"
    code = step.main(
        [
            "--model",
            "DiT-T/4",
            "--batch-size",
            "8",
            "--window",
            "2",
            "--windows",
            "1",
            "--worlds",
            "2",
            "--optimizers",
            "adamw",
            "muon",
            "torch_muon",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    rows = {r["optimizer"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert code == 0, {k: r.get("tail") for k, r in rows.items()}
    assert rows["adamw"]["world_size"] == rows["muon"]["world_size"] == 2
    assert rows["adamw"]["comm_bytes_per_step"] == 0 < rows["muon"]["comm_bytes_per_step"]
    assert rows["torch_muon"]["status"] == "not run" and "refuses sharded" in rows["torch_muon"]["error"]
