"""scripts/race.py: the invocations of each part, the best lrs from the sweep, seed 0 linked from the sweep."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tyro
from tests.race_records import record, row, write_run

from dimuon.bench.quality import check_config, expand_grid, join_flag_values
from dimuon.bench.quality_config import Config as QualityConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "race.py"


def load_race(monkeypatch: pytest.MonkeyPatch) -> Any:
    spec = importlib.util.spec_from_file_location("race", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "race", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def race(monkeypatch):
    module = load_race(monkeypatch)
    calls = []

    class Done:
        returncode = 0

    children(monkeypatch, module, lambda cmd, check=False: calls.append(cmd) or Done())
    module.calls = calls
    return module


def children(monkeypatch: pytest.MonkeyPatch, race: Any, fake: Callable[..., Any]) -> None:
    """Let ``fake(cmd)`` (an object with a ``returncode``, as subprocess.run gives) stand in for the dimuon commands
    the script runs."""
    monkeypatch.setattr(race, "run_child", lambda cmd: fake(cmd).returncode)


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
    assert flags(cmd, "--lr-grid") == [
        "adamw=0.001,0.003,0.01",
        "periodic_row_muon=0.001,0.003,0.01,0.02",
        "muon_bp=0.0003,0.001,0.003,0.01,0.02",
    ]
    assert flags(cmd, "--train-args-of") == ["muon_bp=--optim.blocks 4"]
    assert cmd[cmd.index("--eval.cache-dir") + 1] == str(tmp_path / "feature_cache") and "--report-only" not in cmd
    assert race.main(["--part", "sweep", "--out", str(tmp_path), "--report-only"]) == 0
    assert race.calls[-1][-1] == "--report-only"


def test_seeds_and_ablations_take_the_sweeps_best_lrs(race, tmp_path, capsys):
    best = {
        "adamw": (3e-3, [1e-3, 3e-3, 1e-2]),
        "torch_muon": (1e-2, [3e-3, 1e-2, 2e-2]),
        "muon": (1e-2, [3e-3, 1e-2, 2e-2]),
        "periodic_row_muon": (2e-2, [3e-3, 1e-2, 2e-2]),
        "muon_bp": (3e-3, [1e-3, 3e-3, 1e-2]),
    }
    write_sweep(tmp_path, best)
    assert race.main(["--part", "seeds", "--out", str(tmp_path)]) == 0
    assert "periodic_row_muon's best lr 0.02 is on the edge of its grid" in capsys.readouterr().out
    seeds = race.calls[-1]
    assert flags(seeds, "--lr-grid") == [f"{n}={lr:g}" for n, (lr, _) in best.items()]
    assert flags(seeds, "--seeds") == ["0", "1", "2"]
    linked = tmp_path / "seeds" / "runs" / "muon-lr0.01-s0"
    assert linked.is_symlink() and linked.resolve() == (tmp_path / "sweep" / "runs" / "muon-lr0.01-s0").resolve()
    (tmp_path / "seeds" / "runs" / "periodic_row_muon-lr0.02-s1").mkdir()
    assert race.main(["--part", "gamma", "--out", str(tmp_path)]) == 0
    gamma = race.calls[-1]
    # gamma 0.15 at the best lr is the main race's PeriodicRowMuon: its seeds' runs linked, not trained again
    for seed, target in (
        (0, tmp_path / "sweep" / "runs" / "periodic_row_muon-lr0.02-s0"),
        (1, tmp_path / "seeds" / "runs" / "periodic_row_muon-lr0.02-s1"),
    ):
        linked = tmp_path / "gamma" / "runs" / f"periodic_row_muon-g0.15-lr0.02-s{seed}"
        assert linked.is_symlink() and linked.resolve() == target.resolve()
    assert flags(gamma, "--lrs") == ["0.02"] and flags(gamma, "--seeds") == ["0", "1"]
    assert "periodic_row_muon/g0.05" in flags(gamma, "--optimizers")
    assert "periodic_row_muon/g1=--optim.gamma 1" in flags(gamma, "--train-args-of")
    assert race.main(["--part", "long", "--out", str(tmp_path)]) == 0
    longer = race.calls[-1]
    assert flags(longer, "--steps") == ["4000"] and flags(longer, "--seeds") == ["0"]
    assert flags(longer, "--lr-grid") == flags(seeds, "--lr-grid") and flags(longer, "--optimizers") == list(race.MAIN)
    assert longer[longer.index("--out") + 1] == str(tmp_path / "long")
    assert race.main(["--part", "bp", "--out", str(tmp_path)]) == 0
    bp = dict(a.split("=", 1) for a in flags(race.calls[-1], "--train-args-of"))
    assert shlex.split(bp["muon_bp/p10_r0.5"]) == [
        "--optim.blocks",
        "4",
        "--optim.period",
        "10",
        "--optim.block-lr-ratio",
        "0.5",
    ]


def test_every_parts_command_passes_the_quality_benchs_flag_checks(race, tmp_path):
    """The commands are built here and checked there: a label or flag the bench rejects stops a part hours into
    a race, so every part's command goes through ``dimuon bench quality``'s own parsing and checks."""
    write_sweep(tmp_path, {name: (1e-2, [3e-3, 1e-2, 2e-2]) for name in race.MAIN})
    gamma_runs = [  # lr_gamma starts from a finished gamma ablation
        {"name": f"periodic_row_muon-g{g:g}-lr0.01-s{s}", "status": "ok", "val_loss_ema": 0.2 - 0.01 * g}
        for g in race.GAMMAS
        for s in race.ABLATION_SEEDS
    ]
    (tmp_path / "gamma").mkdir()
    (tmp_path / "gamma" / "results.json").write_text(json.dumps({"runs": gamma_runs}))
    for part in ("sweep", "seeds", "long", *race.ABLATIONS):
        assert race.main(["--part", part, "--out", str(tmp_path)]) == 0
        cmd = race.calls[-1]
        assert cmd[1:5] == ["-m", "dimuon.cli", "bench", "quality"], cmd[:5]
        cfg = tyro.cli(QualityConfig, args=join_flag_values(cmd[5:]))
        check_config(cfg)  # raises FlagError naming the flag
        assert len(expand_grid(cfg)) >= len(flags(cmd, "--optimizers")), part


def test_step_times_the_race_side_by_side_once(race, tmp_path, capsys):
    assert race.main(["--part", "step", "--out", str(tmp_path), "--report-only"]) == 0
    assert race.calls == [] and "not measured yet" in capsys.readouterr().out
    assert race.main(["--part", "step", "--out", str(tmp_path)]) == 0
    (cmd,) = race.calls
    assert cmd[3:5] == ["bench", "step"] and flags(cmd, "--worlds") == ["1"] and flags(cmd, "--threads") == ["1"]
    assert flags(cmd, "--model") == ["DiT-XS/4"] and flags(cmd, "--batch-size") == ["32"]
    assert flags(cmd, "--optimizers") == list(race.MAIN)
    assert flags(cmd, "--train-args-of") == ["muon_bp=--optim.blocks 4"] and flags(cmd, "--repeats") == ["3"]
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "results.json").write_text(json.dumps({"rows": [{"status": "ok"}]}))
    assert race.main(["--part", "step", "--out", str(tmp_path)]) == 0
    assert len(race.calls) == 1 and "is measured" in capsys.readouterr().out


def test_later_parts_need_the_sweep(race, tmp_path):
    with pytest.raises(SystemExit, match=r"sweep/results\.json is missing: run --part sweep first"):
        race.main(["--part", "k", "--out", str(tmp_path)])


def test_report_builds_the_tables_and_plots_from_the_parts_done(race, tmp_path):
    pytest.importorskip("matplotlib")
    seeds = tmp_path / "seeds"
    rows, optimizers = [], {}
    for name, fds in {"adamw": [[80, 50], [85, 55]], "muon": [[50, 35], [55, 40]]}.items():
        for seed, curve in enumerate(fds):
            run = f"{name}-lr0.01-s{seed}"
            losses = [c / 200 for c in curve for _ in (0, 1)]  # a validation pass every 250 steps
            write_run(seeds, run, curve, grid=True, losses=losses)
            rows.append(row(run, name, 0.01, seed, curve[-1]))
        optimizers[name] = {"lr": 0.01, "seeds": [0, 1], "runs": [f"{name}-lr0.01-s{s}" for s in (0, 1)]}
    main = {
        **record(rows, optimizers),
        "config": {"model": "DiT-T/2", "dataset": "digits", "batch_size": 16, "steps": 1000},
        "machine": {"cpu_model": "cpu", "torch": "2"},
    }
    (seeds / "results.json").write_text(json.dumps(main))
    k_rows = [
        row(f"k{k}-s{s}", f"periodic_row_muon/k{k}", 0.01, s, fd, spectral_fraction=1 / k)
        for k, fds in {2: (30, 32), 3: (33, 33), 4: (36, 36)}.items()
        for s, fd in enumerate(fds)
    ]
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "results.json").write_text(
        json.dumps(record(k_rows, {f"periodic_row_muon/k{k}": {} for k in (2, 3, 4)}))
    )
    adaptive_rows = [  # a threshold that refreshes 40% of its steps at a lower loss than K=2 and K=3 there
        row(f"t0.35-s{s}", "adaptive_row_muon/t0.35", 0.01, s, 31, val_loss_ema=0.19, spectral_fraction=0.4)
        for s in (0, 1)
    ]
    (tmp_path / "adaptive").mkdir()
    (tmp_path / "adaptive" / "results.json").write_text(
        json.dumps(record(adaptive_rows, {"adaptive_row_muon/t0.35": {}}))
    )
    long_rows = []
    for name, curve in {"adamw": [60, 45, 40, 30], "muon": [40, 38, 36, 35]}.items():
        write_run(tmp_path / "long", f"{name}-lr0.01-s0", curve, grid=False)
        long_rows.append(row(f"{name}-lr0.01-s0", name, 0.01, 0, curve[-1]))
    (tmp_path / "long" / "results.json").write_text(
        json.dumps(
            {
                **record(
                    long_rows, {n: {"lr": 0.01, "seeds": [0], "runs": [f"{n}-lr0.01-s0"]} for n in ("adamw", "muon")}
                ),
                "config": {"model": "DiT-T/2", "dataset": "digits", "batch_size": 16, "steps": 2000},
            }
        )
    )
    (tmp_path / "inception.json").write_text(
        json.dumps(
            {
                "muon": {
                    "fd_mean": 9.0,
                    "fd_min": 8.0,
                    "fd_max": 10.0,
                    "runs": [{"run": f"muon-lr0.01-s{s}", "fd": fd} for s, fd in ((0, 8.0), (1, 10.0))],
                }
            }
        )
    )
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "results.json").write_text(
        json.dumps(
            {
                "command": "dimuon bench step --x",
                "rows": [
                    {"optimizer": name, "world": 1, "status": "ok", "step_ms": ms, "opt_ms": 1.0}
                    for name, ms in (("adamw", 100.0), ("muon", 120.0))
                ],
            }
        )
    )
    fd_rows = {
        (f"{name}-lr0.01-s{t}", space, s): {
            "run": f"{name}-lr0.01-s{t}",
            "optimizer": name,
            "lr": 0.01,
            "train_seed": t,
            "sample_seed": s,
            "space": space,
            "step": 1000,
            "fd": base + t + 0.5 * s,
            "scored_from": "x",
        }
        for name, base in (("adamw", 30.0), ("muon", 20.0))
        for t in (0, 1)
        for space in ("classifier", "inception")
        for s in (0, 1)
    }
    race.write_fd(argparse.Namespace(out=tmp_path), "2000", fd_rows, {"adamw": 0.01, "muon": 0.01})
    dest = tmp_path / "published"
    assert race.main(["--part", "report", "--out", str(tmp_path), "--report-dir", str(dest)]) == 0
    got = json.loads((dest / "race.json").read_text())
    assert got["main"]["time_basis"] == "side by side" and (dest / "step.json").is_file()
    assert (dest / "fd.json").is_file() and (dest / "fd_spread.png").is_file()
    fd_md = (dest / "race.md").read_text()
    assert "## FD that can resolve (fd: final checkpoints, 2000 samples, both feature spaces)" in fd_md
    assert "| muon | 0.01 | classifier | 4 | 20.75 | 0.50 (2%) | 0.25 |" in fd_md
    assert "| classifier | adamw | muon | -10.00 | 1.00 | yes |" in fd_md
    assert got["curves"]["muon"][0]["step_ms"] == 120.0
    assert got["main_part"] == "seeds" and got["sweep"] is None and got["main"]["target_fd"] == 55
    assert got["k_costs"]["0.01"]["K=2->3"]["fd"] == pytest.approx(33 / 31 - 1)
    assert got["k_costs"]["0.01"]["K=3->4"] == {"fd": pytest.approx(36 / 33 - 1), "val_loss_ema": 0.0}
    assert len(got["curves"]["muon"]) == 2
    for name in (
        "fd_vs_time.png",
        "time_to_quality.png",
        "time_to_levels.png",
        "time_to_loss_levels.png",
        "samples.png",
        "fd_vs_k.png",
        "loss_vs_refresh.png",
        "seeds.json",
        "k.json",
        "adaptive.json",
    ):
        assert (dest / name).is_file(), name
    (threshold,) = [r for r in got["refresh_frontier"]["0.01"] if r["schedule"] == "AdaptiveRowMuon"]
    assert threshold["setting"] == "threshold 0.35" and threshold["verdict"] == "below"
    md = (dest / "race.md").read_text()
    assert "## AdaptiveRowMuon against fixed K (the same lr)" in md
    assert "| 0.01 | PeriodicRowMuon (fixed K) | K=3 | 0.333 (0.333..0.333) | 0.2000 (0.2000..0.2000) | - | - |" in md
    assert "9.00 (8.00..10.00)" in md and "K=2->3: FD +6.5%, EMA val loss +0.0%" in md
    assert "measured side by side" in md and "`dimuon bench step --x`" in md
    assert "Lowest mean over seeds: lr 0.01: FD k2, EMA val loss k2." in md
    assert "### Time to each of AdamW's quality levels" in md and "| FD 55.00 (adamw step 1000) |" in md
    assert "### Time to each of AdamW's EMA validation losses" in md
    assert "| EMA val loss 0.2750 (adamw step 1000) |" in md and got["loss_levels"]["metric"] == "val_loss_ema"
    assert got["long"]["steps"] == 2000 and got["long"]["target_fd"] == 30 and (dest / "fd_vs_time_long.png").is_file()
    assert "at 1000 steps (main table) muon < adamw; at 2000 steps adamw < muon." in md


def test_a_fresh_checkout_resumes_and_republishes_from_the_published_records(race, tmp_path, capsys):
    """Only ``<report-dir>`` survives (a clone of the published report): the parts take the best lrs and the
    finished runs from its records, and the report keeps every published number while adding a new part."""
    pytest.importorskip("matplotlib")
    test_report_builds_the_tables_and_plots_from_the_parts_done(race, tmp_path / "first")
    dest = tmp_path / "first" / "published"
    before = json.loads((dest / "race.json").read_text())
    md_before = (dest / "race.md").read_text()
    samples = (dest / "samples.png").read_bytes()
    (dest / "sweep.json").write_text(
        json.dumps({"optimizers": {name: {"lr": 1e-2, "lrs_tried": [3e-3, 1e-2, 2e-2]} for name in race.MAIN}})
    )
    fresh = tmp_path / "fresh"
    assert race.main(["--part", "k", "--out", str(fresh), "--report-dir", str(dest)]) == 0
    cmd = race.calls[-1]
    assert flags(cmd, "--keep-rows-of") == [str(dest / "k.json")] and flags(cmd, "--lrs") == ["0.01"]
    assert race.main(["--part", "gamma", "--out", str(fresh), "--report-dir", str(dest)]) == 0
    assert "--keep-rows-of" not in race.calls[-1]  # nothing of it published yet
    (dest / "sweep.json").unlink()

    g_rows = [
        row(f"g{g}-s{s}", f"periodic_row_muon/g{g:g}", 0.01, s, fd)
        for g, fds in {0.1: (30, 31), 0.15: (29, 33)}.items()
        for s, fd in enumerate(fds)
    ]
    (fresh / "gamma").mkdir(parents=True)
    (fresh / "gamma" / "results.json").write_text(
        json.dumps(
            {
                **record(g_rows, {f"periodic_row_muon/g{g:g}": {} for g in (0.1, 0.15)}),
                "machine": {"cpu_model": "other cpu", "torch": "2"},
            }
        )
    )
    stale = json.loads((dest / "race.json").read_text())  # Inception FDs of runs no longer in the main table
    stale["inception"]["muon"]["runs"].append({"run": "muon-lr0.003-s0", "fd": 50.0})
    stale["inception"]["adamw"] = {"fd_mean": 70.0, "fd_min": 70.0, "fd_max": 70.0, "runs": [{"run": "x", "fd": 70}]}
    (dest / "race.json").write_text(json.dumps(stale))
    capsys.readouterr()
    assert race.main(["--part", "report", "--out", str(fresh), "--report-dir", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "taken as published" in out and "seeds.json" in out and "FD curves of adamw, muon" in out
    got = json.loads((dest / "race.json").read_text())
    for key in ("main", "levels", "curves", "inception", "long", "k_costs", "step_command"):
        assert got[key] == before[key], key
    assert (dest / "samples.png").read_bytes() == samples and str(dest / "samples.png") in got["outputs"]
    assert (dest / "fd_vs_gamma.png").is_file() and (dest / "gamma.json").is_file()
    md = (dest / "race.md").read_text()
    assert md.startswith(md_before.split("## Ablation")[0])
    assert "Measured on other cpu, torch 2, not the main race's machine." in md
    assert "Lowest mean over seeds: lr 0.01: FD g0.1, EMA val loss g0.1." in md
    assert md.count("Measured on") == 1  # the k ablation ran on the main race's machine
    g_rows[0]["machine"] = {"cpu_model": "cpu", "torch": "2"}  # kept from a record of the main race's machine
    (fresh / "gamma" / "results.json").write_text(
        json.dumps(
            {
                **record(g_rows, {f"periodic_row_muon/g{g:g}": {} for g in (0.1, 0.15)}),
                "machine": {"cpu_model": "other cpu", "torch": "2"},
            }
        )
    )
    assert race.main(["--part", "report", "--out", str(fresh), "--report-dir", str(dest)]) == 0
    md = (dest / "race.md").read_text()
    assert "Measured on cpu, torch 2 (1 run); other cpu, torch 2 (3 runs), not the main race's machine." in md


def test_report_needs_a_sweep_or_seeds_record(race, tmp_path):
    with pytest.raises(SystemExit, match=r"no .*sweep/results\.json yet"):
        race.main(["--part", "report", "--out", str(tmp_path)])


def test_select_trains_the_finer_grid_on_two_seeds_keeping_what_other_parts_trained(race, tmp_path, capsys):
    published = tmp_path / "published"
    published.mkdir()
    sweep_rows = [row(f"{n}-lr{lr:g}-s0", n, lr, 0, 20.0, command="x") for n in race.MAIN for lr in (1e-3, 1e-2)]
    seeds_rows = [row(f"{n}-lr0.01-s1", n, 1e-2, 1, 20.0, command="x") for n in race.MAIN]
    (published / "sweep.json").write_text(json.dumps({**record(sweep_rows, {}), "machine": {"cpu_model": "A"}}))
    (published / "seeds.json").write_text(json.dumps({**record(seeds_rows, {}), "machine": {"cpu_model": "B"}}))
    (tmp_path / "out" / "seeds" / "runs" / "muon-lr0.02-s1").mkdir(parents=True)  # a run here is linked
    assert race.main(["--part", "select", "--out", str(tmp_path / "out"), "--report-dir", str(published)]) == 0
    assert (tmp_path / "out" / "select" / "runs" / "muon-lr0.02-s1").is_symlink()
    cmd = race.calls[-1]
    assert flags(cmd, "--lrs") == ["0.003", "0.005", "0.01", "0.02"] and flags(cmd, "--seeds") == ["0", "1"]
    assert flags(cmd, "--select-by") == ["val_loss_ema"] and flags(cmd, "--optimizers") == list(race.MAIN)
    earlier = json.loads(Path(flags(cmd, "--keep-rows-of")[0]).read_text())
    kept = {r["name"]: r["machine"]["cpu_model"] for r in earlier["runs"]}
    assert kept == {**{f"{n}-lr0.01-s0": "A" for n in race.MAIN}, **{f"{n}-lr0.01-s1": "B" for n in race.MAIN}}
    cfg = tyro.cli(QualityConfig, args=join_flag_values(cmd[5:]))
    check_config(cfg)
    assert len(expand_grid(cfg)) == 5 * 4 * 2
    # the later parts take their lrs from the selection once it is finished, and refuse an unfinished one
    out = tmp_path / "out"
    grid = [row(f"{n}-lr{lr:g}-s{s}", n, lr, s, 20.0) for n in race.MAIN for lr in race.SELECT_LRS for s in (0, 1)]
    summary = {n: {"lr": 5e-3, "lrs_tried": list(race.SELECT_LRS)} for n in race.MAIN}
    (out / "select" / "results.json").write_text(json.dumps(record(grid[:-1], summary)))
    with pytest.raises(SystemExit, match=r"selection .* is not finished"):
        race.main(["--part", "seeds", "--out", str(out)])
    (out / "select" / "results.json").write_text(json.dumps(record(grid, summary)))
    assert race.main(["--part", "seeds", "--out", str(out)]) == 0
    assert flags(race.calls[-1], "--lr-grid") == [f"{n}=0.005" for n in race.MAIN]
    assert "note: best lrs from the sweep" not in capsys.readouterr().out


def test_fd_scores_the_chosen_runs_with_more_samples_and_says_which_gaps_resolve(race, tmp_path, monkeypatch):
    """Both feature spaces, two sampling seeds per checkpoint of the chosen lr's two training seeds; the record
    holds each optimizer's mean and half ranges and whether each gap exceeds the training seeds' ranges."""
    runs = [
        {"name": f"{o}-lr{lr:g}-s{s}", "optimizer": o, "lr": lr, "seed": s, "status": "ok"}
        for o in race.MAIN
        for lr in race.SELECT_LRS
        for s in race.SELECT_SEEDS
    ]
    summary = {o: {"lr": 1e-2, "lrs_tried": list(race.SELECT_LRS)} for o in race.MAIN}
    (tmp_path / "select" / "runs").mkdir(parents=True)
    (tmp_path / "select" / "results.json").write_text(json.dumps({"runs": runs, "optimizers": summary}))
    base = {"adamw": 30.0, "torch_muon": 20.0, "muon": 20.5, "periodic_row_muon": 25.0, "muon_bp": 22.0}

    class Done:
        returncode = 0

    def fake_eval(cmd, check=False):
        run = Path(flags(cmd, "--run")[0])
        space, samples, seed = flags(cmd, "--features")[0], flags(cmd, "--num-samples")[0], flags(cmd, "--seed")[0]
        optimizer, train_seed = run.name.split("-lr")[0], int(run.name[-1])
        order.append((int(seed), run.name, space))
        fd = base[optimizer] * (2 if space == "inception" else 1) + train_seed + 0.25 * int(seed)
        path = run / "eval" / "results.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        evals = json.loads(path.read_text())["evaluations"] if path.is_file() else {}
        settings = {"feature_space": f"{space}-x", "num_samples": int(samples), "sample_steps": 20, "seed": int(seed)}
        entry = {"step": 2000, "status": "ok", "fd": fd, "precision": 0.5, "recall": 0.5}
        evals[f"{space}-{samples}-{seed}"] = {"settings": settings, "entries": [entry]}
        path.write_text(json.dumps({"evaluations": evals}))
        return Done()

    trained, order = [], []

    def fake_subprocess(cmd, check=False):
        if "bench" in cmd:  # the chosen runs not here, trained again under <out>/fd/runs
            trained.append(cmd)
            for name, lr in (f.split("=") for f in flags(cmd, "--lr-grid")):
                for seed in flags(cmd, "--seeds"):
                    (tmp_path / "fd" / "runs" / f"{name}-lr{lr}-s{seed}" / "checkpoints" / "step_2000").mkdir(
                        parents=True
                    )
            return Done()
        return fake_eval(cmd, check)

    for o in race.MAIN:
        if o != "muon_bp":  # MuonBP's chosen runs are not here: trained again; AdamW's are the seeds part's
            for seed in race.SELECT_SEEDS:
                part = "seeds" if o == "adamw" else "select"
                (tmp_path / part / "runs" / f"{o}-lr0.01-s{seed}" / "checkpoints" / "step_2000").mkdir(parents=True)
    children(monkeypatch, race, fake_subprocess)
    assert race.main(["--part", "fd", "--out", str(tmp_path)]) == 0
    (bench,) = trained
    assert flags(bench, "--optimizers") == ["muon_bp"] and flags(bench, "--lr-grid") == ["muon_bp=0.01"]
    assert "--keep-rows-of" not in bench and "muon_bp=--optim.blocks 4" in flags(bench, "--train-args-of")
    result = json.loads((tmp_path / "fd.json").read_text())
    assert len(result["rows"]) == 5 * 2 * 2 * 2
    # every run scored with sampling seed 0 (both spaces, one after the other) before any with seed 1
    assert [o[0] for o in order] == sorted(o[0] for o in order) and order[0][2:] + order[1][2:] == (
        "classifier",
        "inception",
    )
    for o, part in (("muon_bp", "fd"), ("adamw", "seeds"), ("muon", "select")):
        assert {r["scored_from"] for r in result["rows"] if r["optimizer"] == o} == {
            str(tmp_path / part / "runs" / f"{o}-lr0.01-s{s}") for s in race.SELECT_SEEDS
        }
    assert result["samples"] == 2000 and set(result["optimizers"]) == set(race.MAIN)
    muon = result["optimizers"]["muon"]["classifier"]
    assert muon["mean"] == pytest.approx(20.5 + 0.5 + 0.125)
    assert muon["train_half_range"] == pytest.approx(0.5) and muon["sample_half_range"] == pytest.approx(0.125)
    assert len(muon["rows"]) == 4  # 2 training seeds x 2 sampling seeds, at the chosen lr only
    gaps = {(g["space"], g["a"], g["b"]): g for g in result["gaps"]}
    assert not gaps[("classifier", "muon", "torch_muon")]["resolved"]  # 0.5 apart, ranges 0.5 + 0.5
    assert gaps[("inception", "adamw", "muon")]["resolved"]  # 19 apart
    # scored again from scratch, the runs trained again by the first call are found under <out>/fd/runs
    (tmp_path / "fd.json").unlink()
    trained.clear()
    assert race.main(["--part", "fd", "--out", str(tmp_path)]) == 0
    assert trained == [] and json.loads((tmp_path / "fd.json").read_text())["rows"] == result["rows"]
    # a score already in the record is not measured again: a fresh checkout resumes from the published fd.json
    published = tmp_path / "published"
    published.mkdir()
    (published / "fd.json").write_text((tmp_path / "fd.json").read_text())
    (tmp_path / "fd.json").unlink()
    (published / "select.json").write_text((tmp_path / "select" / "results.json").read_text())
    fresh = tmp_path / "fresh"
    scored = []
    children(monkeypatch, race, lambda cmd, check=False: scored.append(cmd) or Done())
    assert race.main(["--part", "fd", "--out", str(fresh), "--report-dir", str(published)]) == 0
    assert scored == [] and json.loads((fresh / "fd.json").read_text())["rows"] == result["rows"]
    # --only: these optimizers alone, once their own selection is finished (MuonBP's still training here)
    children(monkeypatch, race, fake_subprocess)
    record_path = tmp_path / "select" / "results.json"
    partial = json.loads(record_path.read_text())
    partial["runs"] = [r for r in partial["runs"] if not (r["optimizer"] == "muon_bp" and r["seed"] == 1)]
    record_path.write_text(json.dumps(partial))
    assert race.main(["--part", "fd", "--out", str(tmp_path), "--only", "muon", "adamw"]) == 0
    assert set(json.loads((tmp_path / "fd.json").read_text())["optimizers"]) == {"muon", "adamw"}
    with pytest.raises(SystemExit, match="selection of muon_bp is not finished"):
        race.main(["--part", "fd", "--out", str(tmp_path), "--only", "muon_bp"])


def test_an_fd_part_stopped_after_one_sampling_seed_shows_no_sampling_spread_rather_than_zero(race):
    rows = [{"train_seed": t, "fd": 20.0 + t, "sample_seed": 0} for t in race.SELECT_SEEDS]
    summary = race.fd_summary(rows)
    assert summary["sample_half_range"] is None and summary["train_half_range"] == pytest.approx(0.5)
    record = {"optimizers": {"muon": {"classifier": summary}}, "lrs": {"muon": 0.01}, "gaps": []}
    assert race._race_report().render_fd_spread(record).splitlines()[-1].endswith("| 0.50 (2%) | - |")
    rows.append({"train_seed": 0, "fd": 21.0, "sample_seed": 1})
    assert race.fd_summary(rows)["sample_half_range"] == pytest.approx(0.5)
    assert race.fd_summary(rows)["mean"] == pytest.approx(20.75)  # the mean of each training seed's mean


def test_an_fd_part_stopped_after_one_training_seed_leaves_its_gaps_undecided(race):
    # One training seed has no training spread: its gaps are neither resolved nor not, until the second comes.
    one = race.fd_summary([{"train_seed": 0, "fd": 30.0, "sample_seed": 0}])
    two = race.fd_summary([{"train_seed": t, "fd": 25.0 + 4 * t, "sample_seed": 0} for t in (0, 1)])
    assert one["train_half_range"] is None
    (gap,) = race.fd_gaps({"adamw": {"classifier": two}, "muon": {"classifier": one}})
    assert gap["resolved"] is None and gap["noise"] is None and gap["gap"] == pytest.approx(3.0)
    record = {"optimizers": {"adamw": {"classifier": two}, "muon": {"classifier": one}}, "lrs": {"adamw": 1, "muon": 1}}
    lines = race._race_report().render_fd_spread({**record, "gaps": [gap]}).splitlines()
    assert lines[3] == "| muon | 1 | classifier | 1 | 30.00 | - | - |"
    assert lines[-1] == "| classifier | adamw | muon | +3.00 | - | - |"


def test_ablations_run_at_their_optimizers_chosen_lr_once_its_own_selection_is_finished(race, tmp_path):
    """PeriodicRowMuon's K ablation at its selected lr while other optimizers still train; its K=3 variant is the
    selection's own runs at that lr, linked."""
    write_select(race, tmp_path, {}, unfinished=lambda o, s: o == "muon_bp" and s == 1)  # MuonBP seed 1 training
    for seed in race.SELECT_SEEDS:
        (tmp_path / "select" / "runs" / f"periodic_row_muon-lr0.01-s{seed}").mkdir(parents=True)
    assert race.main(["--part", "k", "--out", str(tmp_path)]) == 0
    k = race.calls[-1]
    assert flags(k, "--lrs") == ["0.01"] and flags(k, "--seeds") == ["0", "1"]
    for seed in race.SELECT_SEEDS:
        linked = tmp_path / "k" / "runs" / f"periodic_row_muon-k3-lr0.01-s{seed}"
        target = tmp_path / "select" / "runs" / f"periodic_row_muon-lr0.01-s{seed}"
        assert linked.is_symlink() and linked.resolve() == target.resolve()
    with pytest.raises(SystemExit, match="selection of muon_bp is not finished"):
        race.main(["--part", "bp", "--out", str(tmp_path)])


def test_a_fresh_checkout_keeps_the_main_variant_from_the_published_selection(race, tmp_path):
    """Without the selection's run directories, the K=3 variant's rows come from the published select.json (the
    main race's command, no flags added), renamed to the ablation's names; the part's own published rows first."""
    published = tmp_path / "published"
    write_select(race, published, {})
    select = json.loads((published / "select" / "results.json").read_text())
    for r in select["runs"]:
        r["val_loss_ema"] = 0.17 + r["seed"] / 1000
    (published / "select.json").write_text(json.dumps(select))
    own = {"name": "periodic_row_muon-k3-lr0.01-s1", "status": "ok", "val_loss_ema": 0.5}  # already published
    (published / "k.json").write_text(json.dumps({"runs": [own]}))
    out = tmp_path / "out"
    assert race.main(["--part", "k", "--out", str(out), "--report-dir", str(published)]) == 0
    cmd = race.calls[-1]
    assert "periodic_row_muon/k3" in flags(cmd, "--optimizers")
    assert not any(a.startswith("periodic_row_muon/k3=") for a in flags(cmd, "--train-args-of"))
    kept = json.loads(Path(flags(cmd, "--keep-rows-of")[0]).read_text())["runs"]
    by_name = {r["name"]: r for r in kept}
    assert by_name["periodic_row_muon-k3-lr0.01-s0"]["trained_as"] == "periodic_row_muon-lr0.01-s0"
    assert by_name["periodic_row_muon-k3-lr0.01-s0"]["val_loss_ema"] == 0.17
    assert by_name["periodic_row_muon-k3-lr0.01-s1"]["val_loss_ema"] == 0.5
    assert not (out / "k" / "runs" / "periodic_row_muon-k3-lr0.01-s0").exists()


def test_seeds_at_the_selected_lrs_keep_the_selections_two_seeds_and_train_the_third(race, tmp_path):
    """Once the selection exists, ``seeds`` runs at its chosen lrs (``--only`` those optimizers whose selection is
    finished): seeds 0 and 1 linked from its runs, or kept from its published record where they are gone."""
    published = tmp_path / "published"
    write_select(race, published, {"adamw": 5e-3}, unfinished=lambda o, s: o == "muon_bp")
    (published / "select.json").write_text((published / "select" / "results.json").read_text())
    out = tmp_path / "out"
    (out / "select" / "runs" / "adamw-lr0.005-s0").mkdir(parents=True)  # here: linked
    argv = ["--part", "seeds", "--out", str(out), "--report-dir", str(published)]
    with pytest.raises(SystemExit, match="selection of muon_bp is not finished"):
        race.main(argv)
    assert race.main([*argv, "--only", "adamw", "muon"]) == 0
    cmd = race.calls[-1]
    assert flags(cmd, "--optimizers") == ["adamw", "muon"] and flags(cmd, "--seeds") == ["0", "1", "2"]
    assert flags(cmd, "--lr-grid") == ["adamw=0.005", "muon=0.01"] and "--train-args-of" not in cmd
    assert (out / "seeds" / "runs" / "adamw-lr0.005-s0").is_symlink()
    kept = {r["name"] for r in json.loads(Path(flags(cmd, "--keep-rows-of")[0]).read_text())["runs"]}
    assert kept == {"adamw-lr0.005-s1", "muon-lr0.01-s0", "muon-lr0.01-s1"}


def test_curves_trains_again_the_kept_runs_that_carry_no_curve(race, tmp_path):
    """``--curves``: a published row without its per-evaluation curve (the time-to-quality tables need it) is
    trained again rather than kept, from the other part's record and the part's own; rows with one stay kept."""
    published = tmp_path / "published"
    write_select(race, published, {"adamw": 5e-3})
    select = json.loads((published / "select" / "results.json").read_text())
    for r in select["runs"]:
        if r["name"] == "muon-lr0.01-s1":
            r["curve"] = {"steps": [500], "fd": [30.0]}
    (published / "select.json").write_text(json.dumps(select))
    own = [{"name": "adamw-lr0.005-s2", "status": "ok"}, {"name": "muon-lr0.01-s2", "status": "ok", "curve": {"x": 1}}]
    (published / "seeds.json").write_text(json.dumps({"runs": own}))
    argv = [
        "--part",
        "seeds",
        "--out",
        str(tmp_path / "out"),
        "--report-dir",
        str(published),
        "--only",
        "adamw",
        "muon",
    ]
    assert race.main(argv) == 0
    kept = {r["name"] for r in json.loads(Path(flags(race.calls[-1], "--keep-rows-of")[0]).read_text())["runs"]}
    assert {"adamw-lr0.005-s0", "adamw-lr0.005-s2", "muon-lr0.01-s1", "muon-lr0.01-s2"} <= kept
    assert race.main([*argv, "--curves"]) == 0
    kept = {r["name"] for r in json.loads(Path(flags(race.calls[-1], "--keep-rows-of")[0]).read_text())["runs"]}
    assert kept == {"muon-lr0.01-s1", "muon-lr0.01-s2"}
    # No other part's row is taken (the selection's runs all here, linked): the part's own published rows are
    # still sifted, not handed over whole with the ones that carry no curve.
    for name in ("adamw-lr0.005-s0", "adamw-lr0.005-s1", "muon-lr0.01-s0", "muon-lr0.01-s1"):
        (tmp_path / "out" / "select" / "runs" / name).mkdir(parents=True)
    assert race.main([*argv, "--curves"]) == 0
    kept = {r["name"] for r in json.loads(Path(flags(race.calls[-1], "--keep-rows-of")[0]).read_text())["runs"]}
    assert kept == {"muon-lr0.01-s2"}


def test_scale_selects_each_size_and_plots_the_gap_against_parameters(race, tmp_path, capsys):
    """Each size its own invocation (the race's model reusing the selection's runs), then the gap of the chosen
    lrs' mean losses with its range over seed pairings, per size whose selection is finished."""
    pytest.importorskip("matplotlib")
    write_select(race, tmp_path, {})
    for seed in race.SELECT_SEEDS:
        (tmp_path / "select" / "runs" / f"muon-lr0.01-s{seed}").mkdir(parents=True)
    loss = {"periodic_row_muon": {"DiT-T/4": 0.30, "DiT-XS/4": 0.20}, "muon": {"DiT-T/4": 0.25, "DiT-XS/4": 0.19}}
    for model in ("DiT-T/4", "DiT-XS/4"):
        runs, summary = [], {}
        for name in race.SCALE_OPTIMIZERS:
            for lr in race.SCALE_LRS:
                for seed in race.SELECT_SEEDS:
                    value = loss[name][model] * (1 + abs(lr - 1e-2) * 10) + 0.002 * seed
                    runs.append(row(f"{name}-lr{lr:g}-s{seed}", name, lr, seed, 20.0, val_loss_ema=value))
            summary[name] = {"lr": 1e-2, "selection": {"on_edge": False}}
        part = tmp_path / race.scale_part(model)
        part.mkdir(parents=True, exist_ok=True)
        (part / "results.json").write_text(json.dumps({"runs": runs, "optimizers": summary, "machine": {}}))
    assert race.main(["--part", "scale", "--out", str(tmp_path)]) == 0
    calls = race.calls[-3:]
    assert [c[c.index("--model") + 1] for c in calls] == list(race.SCALE_MODELS)
    assert all(flags(c, "--select-by") == ["val_loss_ema"] for c in calls)
    # the size past the race's model scores FD at its last step only; the others every 500 steps, as they ran
    assert [flags(c, "--eval.interval") for c in calls] == [["500"], ["500"], ["2000"]]
    xs = tmp_path / "scale-dit-xs4" / "runs" / "muon-lr0.01-s1"
    assert xs.is_symlink() and not (tmp_path / "scale-dit-t4" / "runs").exists()  # the race's model: linked
    got = json.loads((tmp_path / "scale.json").read_text())
    assert [s["model"] for s in got["sizes"]] == ["DiT-T/4", "DiT-XS/4"]  # DiT-S/4 has no record yet
    t4, xs4 = got["sizes"]
    assert t4["params"] < xs4["params"] == 1869072  # the race's model as dimuon train builds it
    assert xs4["gap"] == pytest.approx(0.201 / 0.191 - 1) and xs4["gap_min"] == pytest.approx(0.200 / 0.192 - 1)
    assert (tmp_path / "gap_vs_params.png").is_file()
    assert "DiT-XS/4 (1.87M parameters): PeriodicRowMuon - Muon +5.24%" in capsys.readouterr().out


def test_scale_widens_a_grid_past_the_edge_its_best_lr_sits_on_until_the_best_is_inside(race, tmp_path, monkeypatch):
    """PeriodicRowMuon's best at DiT-T/4 is the grid's top (2e-2): it alone gets 4e-2 (``--lr-grid``), and once
    4e-2 is worse the choice is inside and nothing more is trained; Muon's best, inside, keeps its grid."""
    from dimuon.bench.quality_report import selection

    write_select(race, tmp_path, {})
    part = tmp_path / race.scale_part("DiT-T/4")
    part.mkdir(parents=True)
    loss = {"periodic_row_muon": {5e-3: 0.24, 1e-2: 0.22, 2e-2: 0.21, 4e-2: 0.23}, "muon": {5e-3: 0.21, 1e-2: 0.20}}
    loss["muon"].update({2e-2: 0.22, 4e-2: 0.30})

    def write(lrs_of):
        runs = [
            row(f"{n}-lr{lr:g}-s{s}", n, lr, s, 20.0, val_loss_ema=loss[n][lr] + 0.001 * s)
            for n, lrs in lrs_of.items()
            for lr in lrs
            for s in race.SELECT_SEEDS
        ]
        summary = {
            n: {
                "lr": (sel := selection([r for r in runs if r["optimizer"] == n], "val_loss_ema"))["best"],
                "selection": sel,
            }
            for n in lrs_of
        }
        (part / "results.json").write_text(json.dumps({"runs": runs, "optimizers": summary, "machine": {}}))

    def bench(cmd, check=False):  # what the quality bench would leave: every run of its grid finished
        race.calls.append(cmd)
        grid = {n: list(race.SCALE_LRS) for n in race.SCALE_OPTIMIZERS}
        for item in flags(cmd, "--lr-grid") if "--lr-grid" in cmd else []:
            name, lrs = item.split("=")
            grid[name] = [float(x) for x in lrs.split(",")]
        write(grid)
        return type("Done", (), {"returncode": 0})()

    children(monkeypatch, race, bench)
    write({n: list(race.SCALE_LRS) for n in race.SCALE_OPTIMIZERS})
    assert race.main(["--part", "scale", "--out", str(tmp_path), "--scale-models", "DiT-T/4"]) == 0
    assert len(race.calls) == 2 and "--lr-grid" not in race.calls[0]
    assert flags(race.calls[1], "--lr-grid") == ["periodic_row_muon=0.005,0.01,0.02,0.04"]
    size = json.loads((tmp_path / "scale.json").read_text())["sizes"][0]
    prm = size["optimizers"]["periodic_row_muon"]
    assert (prm["lr"], prm["on_edge"], sorted(prm["lrs"])) == (0.02, False, ["0.005", "0.01", "0.02", "0.04"])
    assert size["optimizers"]["muon"]["lr"] == 0.01 and len(size["optimizers"]["muon"]["lrs"]) == 3


def test_scale_models_flag_runs_the_sizes_named_and_rejects_unknown_ones(race, tmp_path, capsys):
    """``--scale-models`` trains only the sizes named (a larger one left for a later invocation); a name not in the
    registry stops the script at start-up, naming the flag and the choices."""
    write_select(race, tmp_path, {})
    race.main(["--part", "scale", "--out", str(tmp_path), "--scale-models", "DiT-T/4", "DiT-XS/4"])
    calls = [c for c in race.calls if "--model" in c]
    assert [c[c.index("--model") + 1] for c in calls] == ["DiT-T/4", "DiT-XS/4"]
    with pytest.raises(SystemExit):
        race.main(["--part", "scale", "--out", str(tmp_path), "--scale-models", "DiT-Q/4"])
    err = capsys.readouterr().err
    assert "--scale-models: unknown model 'DiT-Q/4'" in err and "DiT-S/4" in err


def test_lr_gamma_takes_the_gamma_ablations_best_and_neighbours_at_three_lrs(race, tmp_path):
    """A 3 x 3 grid around the best gamma (by mean EMA validation loss): half, once and twice the chosen lr; the
    chosen lr's row is linked to the gamma ablation's runs, gamma 0.15 at the other lrs to the selection's."""
    write_select(race, tmp_path, {})
    with pytest.raises(SystemExit, match=r"gamma ablation at lr 0\.01 is not finished"):
        race.main(["--part", "lr_gamma", "--out", str(tmp_path)])
    loss = {0.05: 0.20, 0.1: 0.19, 0.15: 0.18, 0.3: 0.175, 0.6: 0.172, 1.0: 0.174}  # best: 0.6
    runs = [
        {"name": f"periodic_row_muon-g{g:g}-lr0.01-s{s}", "status": "ok", "val_loss_ema": v + 0.001 * s}
        for g, v in loss.items()
        for s in (0, 1)
    ]
    (tmp_path / "gamma").mkdir()
    (tmp_path / "gamma" / "results.json").write_text(json.dumps({"runs": runs}))
    for g in (0.3, 0.6, 1.0):
        for s in (0, 1):
            (tmp_path / "gamma" / "runs" / f"periodic_row_muon-g{g:g}-lr0.01-s{s}").mkdir(parents=True)
    assert race.main(["--part", "lr_gamma", "--out", str(tmp_path)]) == 0
    cmd = race.calls[-1]
    assert flags(cmd, "--optimizers") == [f"periodic_row_muon/g{g}" for g in ("0.3", "0.6", "1")]
    assert flags(cmd, "--lrs") == ["0.005", "0.01", "0.02"] and flags(cmd, "--seeds") == ["0", "1"]
    linked = tmp_path / "lr_gamma" / "runs" / "periodic_row_muon-g0.6-lr0.01-s1"
    assert linked.is_symlink() and linked.resolve().parent == (tmp_path / "gamma" / "runs").resolve()
    assert not (tmp_path / "lr_gamma" / "runs" / "periodic_row_muon-g0.6-lr0.02-s0").exists()  # trained
    # at the grid's top the neighbour is one step past it
    runs = [dict(r, val_loss_ema=0.1) if "-g1-" in r["name"] else r for r in runs]
    (tmp_path / "gamma" / "results.json").write_text(json.dumps({"runs": runs}))
    assert race.main(["--part", "lr_gamma", "--out", str(tmp_path)]) == 0
    assert flags(race.calls[-1], "--optimizers")[-1] == "periodic_row_muon/g2"
    assert "periodic_row_muon/g2=--optim.gamma 2" in flags(race.calls[-1], "--train-args-of")


def test_lr_gamma_in_a_fresh_checkout_keeps_the_published_gamma_ablations_rows(race, tmp_path):
    """Only the published records here: the best gamma from gamma.json, its chosen lr's rows kept, not trained."""
    published = tmp_path / "published"
    write_select(race, published, {})
    (published / "select.json").write_text((published / "select" / "results.json").read_text())
    loss = {0.05: 0.20, 0.1: 0.19, 0.15: 0.18, 0.3: 0.175, 0.6: 0.172, 1.0: 0.174}
    runs = [
        {"name": f"periodic_row_muon-g{g:g}-lr0.01-s{s}", "status": "ok", "val_loss_ema": v + 0.001 * s}
        for g, v in loss.items()
        for s in (0, 1)
    ]
    (published / "gamma.json").write_text(json.dumps({"runs": runs}))
    out = tmp_path / "out"
    assert race.main(["--part", "lr_gamma", "--out", str(out), "--report-dir", str(published)]) == 0
    cmd = race.calls[-1]
    assert flags(cmd, "--optimizers") == [f"periodic_row_muon/g{g}" for g in ("0.3", "0.6", "1")]
    kept = {r["name"] for r in json.loads(Path(flags(cmd, "--keep-rows-of")[0]).read_text())["runs"]}
    assert {f"periodic_row_muon-g{g}-lr0.01-s{s}" for g in ("0.3", "0.6", "1") for s in (0, 1)} <= kept
    assert all("-lr0.01-" in name for name in kept)  # half and twice the lr: trained


def test_the_adaptive_part_runs_at_periodic_row_muons_chosen_lr(race, tmp_path):
    write_select(race, tmp_path, {"periodic_row_muon": 5e-3})
    assert race.main(["--part", "adaptive", "--out", str(tmp_path)]) == 0
    cmd = race.calls[-1]
    assert flags(cmd, "--lrs") == ["0.005"]
    assert flags(cmd, "--optimizers") == [
        "adaptive_row_muon/t0.25",
        "adaptive_row_muon/t0.35",
        "adaptive_row_muon/t0.5",
    ]
    assert "adaptive_row_muon/t0.25=--optim.threshold 0.25" in flags(cmd, "--train-args-of")


def write_select(race, out: Path, lrs: dict[str, float], unfinished=lambda o, s: False) -> None:
    """A ``select`` record at ``out``: every optimizer's grid and seeds finished (but where ``unfinished``) and
    its chosen lr from ``lrs`` (1e-2 for an optimizer not named)."""
    grid = [
        {"name": f"{o}-lr{lr:g}-s{s}", "optimizer": o, "lr": lr, "seed": s, "status": "ok"}
        for o in race.MAIN
        for lr in race.SELECT_LRS
        for s in race.SELECT_SEEDS
        if not unfinished(o, s)
    ]
    summary = {o: {"lr": lrs.get(o, 1e-2), "lrs_tried": list(race.SELECT_LRS)} for o in race.MAIN}
    (out / "select").mkdir(parents=True, exist_ok=True)
    (out / "select" / "results.json").write_text(json.dumps({"runs": grid, "optimizers": summary}))


# A stand-in for a dimuon command: says it is ready, notes each SIGINT it gets, leaves at the first.
STAND_IN = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    with open(out / "interrupts", "a") as f:
        f.write("SIGINT\\n")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
(out / "ready").write_text("")
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupt_of_the_script_reaches_the_running_command_once_and_ends_the_call(monkeypatch, tmp_path, sig):
    race = load_race(monkeypatch)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def part(args):
        return race.run_child([sys.executable, "-c", STAND_IN, str(tmp_path)])

    def interrupt_once_ready() -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), sig)  # the script's own process, as `kill <pid>` or a scheduler would

    monkeypatch.setattr(race, "report", part)
    threading.Thread(target=interrupt_once_ready, daemon=True).start()
    start = time.monotonic()
    assert race.main(["--part", "report", "--out", str(tmp_path / "race")]) == 130
    assert time.monotonic() - start < 30  # the command left on the interrupt, not after its minute
    assert (tmp_path / "interrupts").read_text() == "SIGINT\n"  # passed on once, as SIGINT
    assert {s: signal.getsignal(s) for s in before} == before
