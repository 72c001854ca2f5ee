"""`dimuon train --parallel.cp 2` on gloo ranks: context parallelism alone trains as one process, with FSDP
(``dp_shard 2 x cp 2``) as its data-parallel twin (FSDP over 2 ranks), with tensor parallelism (``cp 2 x tp 2``) as
one process, HSDP sharded over ``cp`` (``dp_replicate 2 x cp 2``) as FSDP over 2 ranks, and a run resumed from its
DCP checkpoint continues as the uninterrupted one, on the same layout and in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dimuon.bench.launch import run_gloo

from . import train_scenarios as sc
from .test_train_parallel import BASE

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # about a minute and a half of training on 2 cores

CKPT = "cp2/checkpoints/step_0000004"


def train_losses(run: Path) -> list[float]:
    """The ``loss`` of every train record of a run, in order."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def val_loss(run: Path) -> float:
    """The last validation loss of a run."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if r["kind"] == "val"][-1]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("context")
    run_gloo(
        sc.parallel_runs, 2, BASE, str(root), {"cp2": {"cp": 2}, "fsdp2": {}, "cp2_resumed": {"cp": 2, "resume": CKPT}}
    )
    run_gloo(sc.parallel_runs, 1, BASE, str(root), {"one": {}, "cp2_in_one": {"resume": CKPT}}, timeout_s=600)
    run_gloo(
        sc.parallel_runs,
        4,
        BASE,
        str(root),
        {
            "fsdp2xcp2": {"dp_shard": 2, "cp": 2},
            "hsdp2xcp2": {"dp_replicate": 2, "cp": 2},
            "cp2xtp2": {"cp": 2, "tp": 2},
        },
    )
    return root


@pytest.mark.parametrize(
    ("run", "twin"), [("cp2", "one"), ("cp2xtp2", "one"), ("fsdp2xcp2", "fsdp2"), ("hsdp2xcp2", "fsdp2")]
)
def test_context_parallel_trains_as_its_data_parallel_twin(root: Path, run: str, twin: str) -> None:
    got, want = train_losses(root / run), train_losses(root / twin)
    assert len(got) == len(want) == BASE["steps"] // BASE["log_interval"]
    assert got == pytest.approx(want, rel=1e-5, abs=0)  # measured: equal to the last bit of fp32
    assert val_loss(root / run) == pytest.approx(val_loss(root / twin), rel=1e-6)  # measured: <= 1e-8


def test_a_resume_on_the_context_parallel_layout_continues_the_run(root: Path) -> None:
    assert train_losses(root / "cp2_resumed")[-1] == pytest.approx(train_losses(root / "cp2")[-1], rel=1e-6)
    assert (root / "cp2_resumed" / "checkpoints" / "step_0000006").is_dir()


def test_the_context_parallel_checkpoint_resumes_in_one_process(root: Path) -> None:
    # cp 2 has one data-parallel rank, as one process: the same data and noise after the resume
    assert train_losses(root / "cp2_in_one")[-1] == pytest.approx(train_losses(root / "cp2")[-1], rel=1e-5)
    assert val_loss(root / "cp2_in_one") == pytest.approx(val_loss(root / "cp2"), rel=1e-6)
