"""Generation quality during FSDP2 training on 2 gloo ranks: the ranks split the samples, the scores match one
process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dimuon.bench.launch import run_gloo
from dimuon.eval.run import main as eval_main
from dimuon.metrics.results import load_results
from dimuon.train.config import EvalOptions

from . import train_scenarios as sc

pytestmark = pytest.mark.multirank

METRICS = ("fd", "precision", "recall", "density", "coverage")


def _series(run: Path) -> dict:
    (ev,) = load_results(run / "eval" / "results.json")["evaluations"].values()
    return ev


def test_two_rank_scores_equal_a_single_process_eval_of_the_checkpoints(tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache"
    base = dict(
        model="DiT-T/2",
        dataset="digits",
        batch_size=16,
        steps=6,
        warmup_steps=2,
        log_interval=3,
        val_interval=3,
        val_samples=16,
        sample_count=10,
        sample_steps=2,
        ckpt_interval=3,
        progress=False,
        eval=EvalOptions(interval=3, num_samples=31, sample_steps=2, cfg=2.0, batch_size=16, cache_dir=cache),
    )
    run = tmp_path / "run"
    summaries = run_gloo(sc.train_once, 2, base, str(run))
    assert summaries[0]["fd"] == summaries[1]["fd"]  # every rank gets the recorded entry
    entries = _series(run)["entries"]
    assert [e["step"] for e in entries] == [3, 6] and all(e["world_size"] == 2 for e in entries)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "gen_eval"] == [3, 6]

    # One process scores the DCP checkpoints' EMA weights: the same samples (each rank drew a slice).
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "eval")
    flags = ["--num-samples", "31", "--sample-steps", "2", "--cfg", "2.0", "--batch-size", "16", "--no-progress"]
    assert eval_main(["--run", str(copy), "--cache-dir", str(cache), *flags]) == 0
    single = _series(copy)["entries"]
    assert _series(copy)["settings"] == _series(run)["settings"]
    for a, b in zip(entries, single, strict=True):
        assert a["step"] == b["step"]
        assert a["fd"] == pytest.approx(b["fd"], rel=1e-4)
        for m in METRICS[1:]:
            assert a[m] == pytest.approx(b[m], abs=1 / 31 + 1e-9), m  # at most one sample on the k-NN border
