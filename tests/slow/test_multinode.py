"""The multi-node recipe of docs/training.md on one machine: two torchrun agents as two "nodes" (c10d
rendezvous on loopback), HSDP with one replica per node; then the run resumes under FSDP x TP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dimuon.bench.launch import free_port

pytestmark = pytest.mark.slow

ARGS = [
    "--model",
    "DiT-T/2",
    "--dataset",
    "digits",
    "--batch-size",
    "16",
    "--val-interval",
    "4",
    "--val-samples",
    "16",
    "--sample-count",
    "4",
    "--sample-steps",
    "2",
    "--ckpt-interval",
    "4",
    "--log-interval",
    "2",
    "--no-progress",
    "--threads",
    "1",
]


def _two_nodes(out: Path, *flags: str) -> list[subprocess.CompletedProcess]:
    """Start both agents (each a "node" of 2 processes) and wait for them."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "dimuon-test",
                "-m",
                "dimuon.cli",
                "train",
                *ARGS,
                "--out",
                str(out),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_train_hsdp_then_resume_under_fsdp_x_tp(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for result in _two_nodes(run, "--steps", "4", "--parallel.dp-replicate", "2"):
        assert result.returncode == 0, result.stderr[-3000:]
    start = next(r for r in _records(run) if r["kind"] == "start")
    assert start["world_size"] == 4 and start["parallel"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}
    train = [r for r in _records(run) if r["kind"] == "train"]
    # Every replica refreshes its own matrices: only the 4-byte non-finite vote crosses nodes, one all-reduce over
    # the world (ring: 2(W-1)/W x 4 = 6 bytes at W = 4), none over dp_replicate alone.
    by_dim = train[0]["comm_bytes_per_step_by_mesh_dim"]
    assert "dp_replicate" not in by_dim and by_dim["world"] == 6
    assert by_dim["dp_shard"] > 0
    # Resume the 4-rank HSDP checkpoint under FSDP 2 x TP 2 on the same two nodes.
    for result in _two_nodes(
        run,
        "--steps",
        "6",
        "--parallel.dp-replicate",
        "1",
        "--parallel.dp-shard",
        "2",
        "--parallel.tp",
        "2",
        "--resume",
        str(run),
    ):
        assert result.returncode == 0, result.stderr[-3000:]
    starts = [r for r in _records(run) if r["kind"] == "start"]
    assert starts[-1]["step"] == 4 and starts[-1]["parallel"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert (run / "checkpoints" / "step_0000006").is_dir()
