"""scripts/race.py: the invocations of each part, the best lrs from the sweep, seed 0 linked from the sweep."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "race.py"


@pytest.fixture
def race(monkeypatch):
    spec = importlib.util.spec_from_file_location("race", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(module.subprocess, "run", lambda cmd, check=False: calls.append(cmd) or Done())
    module.calls = calls
    return module


def flags(cmd: list[str], name: str) -> list[str]:
    """The values after ``name`` up to the next flag."""
    i = cmd.index(name) + 1
    out = []
    while i < len(cmd) and not cmd[i].startswith("--"):
        out.append(cmd[i])
        i += 1
    return out


def write_sweep(out: Path, lrs: dict[str, tuple[float, list[float]]]) -> None:
    (out / "sweep" / "runs").mkdir(parents=True)
    summary = {name: {"lr": lr, "lrs_tried": tried} for name, (lr, tried) in lrs.items()}
    (out / "sweep" / "results.json").write_text(json.dumps({"optimizers": summary}))
    for name, (lr, _) in lrs.items():
        (out / "sweep" / "runs" / f"{name}-lr{lr:g}-s0").mkdir()


def test_sweep_brackets_each_optimizer_and_gives_muon_bp_its_blocks(race, tmp_path):
    assert race.main(["--part", "sweep", "--out", str(tmp_path)]) == 0
    (cmd,) = race.calls
    assert cmd[cmd.index("--steps") + 1] == "2000" and flags(cmd, "--seeds") == ["0"]
    assert flags(cmd, "--optimizers") == list(race.MAIN)
    assert flags(cmd, "--lr-grid") == ["adamw=0.001,0.003,0.01", "muon_bp=0.001,0.003,0.01"]
    assert flags(cmd, "--train-args-of") == ["muon_bp=--optim.blocks 4"]
    assert cmd[cmd.index("--eval.cache-dir") + 1] == str(tmp_path / "feature_cache")


def test_seeds_and_ablations_take_the_sweeps_best_lrs(race, tmp_path, capsys):
    best = {"adamw": (3e-3, [1e-3, 3e-3, 1e-2]), "torch_muon": (1e-2, [3e-3, 1e-2, 2e-2]),
            "muon": (1e-2, [3e-3, 1e-2, 2e-2]), "periodic_row_muon": (2e-2, [3e-3, 1e-2, 2e-2]),
            "muon_bp": (3e-3, [1e-3, 3e-3, 1e-2])}
    write_sweep(tmp_path, best)
    assert race.main(["--part", "seeds", "--out", str(tmp_path)]) == 0
    assert "periodic_row_muon's best lr 0.02 is on the edge of its grid" in capsys.readouterr().out
    seeds = race.calls[-1]
    assert flags(seeds, "--lr-grid") == [f"{n}={lr:g}" for n, (lr, _) in best.items()]
    assert flags(seeds, "--seeds") == ["0", "1", "2"]
    linked = tmp_path / "seeds" / "runs" / "muon-lr0.01-s0"
    assert linked.is_symlink() and linked.resolve() == (tmp_path / "sweep" / "runs" / "muon-lr0.01-s0").resolve()
    assert race.main(["--part", "gamma", "--out", str(tmp_path)]) == 0
    gamma = race.calls[-1]
    assert flags(gamma, "--lrs") == ["0.02", "0.01"] and flags(gamma, "--seeds") == ["0", "1"]
    assert "periodic_row_muon/g0.05" in flags(gamma, "--optimizers")
    assert "periodic_row_muon/g1=--optim.gamma 1" in flags(gamma, "--train-args-of")
    assert race.main(["--part", "bp", "--out", str(tmp_path)]) == 0
    bp = dict(a.split("=", 1) for a in flags(race.calls[-1], "--train-args-of"))
    assert shlex.split(bp["muon_bp/p10-r0.5"]) == ["--optim.blocks", "4", "--optim.period", "10",
                                                    "--optim.block-lr-ratio", "0.5"]


def test_later_parts_need_the_sweep(race, tmp_path):
    with pytest.raises(SystemExit, match=r"sweep/results\.json is missing: run --part sweep first"):
        race.main(["--part", "k", "--out", str(tmp_path)])
