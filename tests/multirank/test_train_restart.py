"""``torchrun --max-restarts 1`` with ``dimuon train --resume auto`` as a cluster fails: 2 gloo ranks, rank 1
killed with SIGKILL mid-run (as it begins step 6 of 8, on the first attempt only); torchrun restarts both ranks
with the same command, which resumes from the newest complete checkpoint (step 4) and finishes with exit 0 and
the final weights of an uninterrupted run, bitwise. And as a scheduler stops a job: SIGTERM to torchrun, which
passes it to both ranks; they save a checkpoint at the next logging step and leave before torchrun's 30 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dimuon.dit.checkpoint import list_checkpoints, load_model_for_eval
from dimuon.train.run import main as train_main
from tests.train_runs import records, without_timing

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # three torchrun attempts: 50-80 s on 2 shared cores

KILLED = Path(__file__).with_name("killed_rank.py")
ARGS = [
    "--model",
    "DiT-T/2",
    "--dataset",
    "digits",
    "--batch-size",
    "16",
    "--steps",
    "8",
    "--warmup-steps",
    "3",
    "--ckpt-interval",
    "4",
    "--log-interval",
    "2",
    "--val-interval",
    "4",
    "--val-samples",
    "16",
    "--sample-count",
    "4",
    "--sample-steps",
    "2",
    "--threads",
    "1",
    "--no-progress",
    "--resume",
    "auto",
]


def _torchrun(out: Path, *program: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 --max-restarts 1 PROGRAM train ARGS --out OUT``.

    Each attempt gets its own rendezvous store, as docs/training.md's recipe says: with the store torch 2.13's
    agent shares by default, a restarted attempt can read the killed one's addresses and fail or hang while
    joining the process group (pytorch/pytorch#135712).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.5",
            *program,
            "train",
            *ARGS,
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        timeout=300,
    )


def test_a_rank_killed_mid_run_is_restarted_by_torchrun_and_resumes_bitwise(tmp_path: Path) -> None:
    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    result = _torchrun(straight, "-m", "dimuon.cli")
    assert result.returncode == 0, result.stdout[-4000:]
    result = _torchrun(restarted, str(KILLED), "6")
    log = result.stdout
    assert result.returncode == 0, log[-6000:]

    # The first attempt started the run; rank 1 died in step 6, so torchrun restarted both ranks with the same
    # command, which continued from step 4, the newest complete checkpoint.
    assert f"--resume auto: {restarted} holds no run yet, so a new run starts there at step 0" in log
    assert (
        f"--resume auto: resumed from {restarted}/checkpoints/step_0000004 at step 4, the newest complete "
        "checkpoint in --out"
    ) in log, log[-6000:]
    starts = [r for r in records(restarted) if r["kind"] == "start"]
    assert [(r["step"], Path(r["resumed_from"]).name) for r in starts] == [(0, ""), (4, "step_0000004")]
    assert sorted(p.name for p in (restarted / "checkpoints").iterdir()) == ["step_0000004", "step_0000008"]

    for use_ema in (True, False):
        a, _ = load_model_for_eval(straight / "checkpoints" / "step_0000008", use_ema=use_ema)
        b, _ = load_model_for_eval(restarted / "checkpoints" / "step_0000008", use_ema=use_ema)
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), (use_ema, name)
    assert without_timing(records(straight)) == without_timing(records(restarted))


def test_sigterm_to_torchrun_stops_both_ranks_at_one_checkpoint_that_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    at = ARGS.index("--steps") + 1
    args = [*ARGS[:at], "100000", *ARGS[at + 1 :]]  # far more steps than it reaches
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, "--monitor-interval", "0.5", "-m", "dimuon.cli", "train", *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stops = [r for r in records(out) if r["kind"] == "stopped"]
    assert len(stops) == 1 and stops[0]["signal"] == "SIGTERM", log[-4000:]
    step = stops[0]["step"]
    assert step % 2 == 0 and [s for s, _ in list_checkpoints(out)][-1] == step  # a logging step, saved
    assert log.count(f"dimuon train: stopped by SIGTERM after step {step} of 100000") == 1  # rank 0 alone
    # The checkpoint is complete: it resumes (in one process; DCP reshards) and trains on.
    assert train_main(["--resume", str(out), "--steps", str(step + 2), "--no-progress"]) == 0
    assert [s for s, _ in list_checkpoints(out)][-1] == step + 2
