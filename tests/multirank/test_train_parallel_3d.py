"""`dimuon train --parallel.dp-replicate 2 --parallel.dp-shard 2 --parallel.tp 2` on 8 gloo ranks: HSDP over tensor
parallelism trains as its data-parallel twin (HSDP 2 x 2 on 4 ranks), resumes mid-run as the uninterrupted run, and
its DCP checkpoint loads on (2, 2), on (4,) and in one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from dimuon.bench.launch import run_gloo

from . import train_scenarios as sc
from .test_train_parallel import BASE

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # about two minutes of 8-rank training on 2 cores

THREE_D = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
CKPT = "hsdp2x2xtp2/checkpoints/step_0000004"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict, dict]:
    root = tmp_path_factory.mktemp("parallel3d")
    eight = run_gloo(
        sc.parallel_runs,
        8,
        BASE,
        str(root),
        {"hsdp2x2xtp2": THREE_D, "resumed_3d": {**THREE_D, "resume": CKPT}},
        timeout_s=900,
    )[0]
    four = run_gloo(
        sc.parallel_runs,
        4,
        BASE,
        str(root),
        {
            "hsdp2x2": {"dp_replicate": 2},
            "from_3d_hsdp": {"dp_replicate": 2, "resume": CKPT},
            "from_3d_fsdp": {"resume": CKPT},
        },
        timeout_s=900,
    )[0]
    one = run_gloo(sc.parallel_runs, 1, BASE, str(root), {"from_3d_one": {"resume": CKPT}}, timeout_s=900)[0]
    return root, eight, four, one


def test_hsdp_x_tp_trains_as_its_data_parallel_twin(runs) -> None:
    _, eight, four, _ = runs
    # 2 x 2 x 2 sees the data and noise of the 4 data-parallel ranks of HSDP 2 x 2; only reduction orders differ.
    assert eight["hsdp2x2xtp2"]["val_loss"] == pytest.approx(four["hsdp2x2"]["val_loss"], rel=1e-4)


def test_a_resume_on_the_same_mesh_continues_the_run(runs) -> None:
    root, eight, _, _ = runs
    assert eight["resumed_3d"]["step"] == BASE["steps"]
    assert eight["resumed_3d"]["val_loss"] == pytest.approx(eight["hsdp2x2xtp2"]["val_loss"], rel=1e-6)
    assert (root / "resumed_3d" / "checkpoints" / "step_0000006").is_dir()


def test_the_checkpoint_loads_on_two_one_and_zero_mesh_dimensions(runs) -> None:
    _, eight, four, one = runs
    for resumed in (four["from_3d_hsdp"], four["from_3d_fsdp"], one["from_3d_one"]):
        assert resumed["step"] == BASE["steps"]
        # the same step-4 weights and phase; the data slices differ with the data-parallel degree
        assert resumed["val_loss"] == pytest.approx(eight["hsdp2x2xtp2"]["val_loss"], rel=0.2)
    # HSDP 2 x 2 sees the same data as the 3-D mesh: the resumed run ends where the 3-D run does
    assert four["from_3d_hsdp"]["val_loss"] == pytest.approx(eight["hsdp2x2xtp2"]["val_loss"], rel=1e-4)
