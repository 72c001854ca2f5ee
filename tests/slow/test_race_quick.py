"""The race's quick preset end to end (digits, a tiny DiT, a few steps): the sweep, then the seeds and the K
ablation at its best lrs, every part's report written, the optimizers timed side by side, the seeds' runs scored in
Inception space, and the race's report built from them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "race.py"


def test_quick_race_runs_its_parts(tmp_path):
    for part in ("sweep", "seeds", "step", "long", "k"):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--part", part, "--quick", "--out", str(tmp_path), "--jobs", "2"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        record = json.loads((tmp_path / part / "results.json").read_text())
        assert all(r["status"] == "ok" for r in record.get("runs", record.get("rows"))), part
    seeds = json.loads((tmp_path / "seeds" / "results.json").read_text())
    assert {len(s["seeds"]) for s in seeds["optimizers"].values()} == {3}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--part", "inception", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    inception = json.loads((tmp_path / "inception.json").read_text())
    assert set(inception) == set(seeds["optimizers"]) and all(len(t["runs"]) == 3 for t in inception.values())
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--part", "report", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "race.json").read_text())
    assert report["main_part"] == "seeds" and set(report["main"]["optimizers"]) == set(seeds["optimizers"])
    assert all(len(c) == 3 for c in report["curves"].values()) and report["inception"] == inception
    assert report["main"]["time_basis"] == "side by side" and (tmp_path / "report" / "step.json").is_file()
    assert report["long"]["steps"] == 12 and set(report["long"]["optimizers"]) == set(seeds["optimizers"])
    assert set(report["ablations"]) == {"k"} and set(report["k_costs"][next(iter(report["k_costs"]))]) == {
        "K=2->3",
        "K=3->4",
    }
    for name in (
        "fd_vs_time.png",
        "fd_vs_time_long.png",
        "time_to_quality.png",
        "samples.png",
        "fd_vs_k.png",
        "race.md",
    ):
        assert (tmp_path / "report" / name).is_file(), name

    # A fresh checkout holds only the published report: the best lrs, the finished runs and the report's numbers
    # come from it, and nothing trains again.
    fresh, published = tmp_path / "fresh", tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--part", "k", "--quick", "--out", str(fresh), "--report-dir", str(published)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kept = json.loads((fresh / "k" / "results.json").read_text())
    assert {r["action"] for r in kept["runs"]} == {"kept"} and not (fresh / "k" / "runs").exists()
    md = (published / "race.md").read_text()
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--part",
            "report",
            "--quick",
            "--out",
            str(fresh),
            "--report-dir",
            str(published),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "taken as published" in done.stdout and (published / "race.md").read_text() == md
