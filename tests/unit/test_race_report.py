"""scripts/race_report.py: curves read from run directories, time to AdamW's quality (interpolated, bounded,
never reached), spreads over seeds, ablation tables and the FD cost of a longer K, and the plots written."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.example_modules import import_script
from tests.race_records import record, row, write_run

from dimuon.io import save_grid


def load_report():
    """scripts/race_report.py as the module ``race_report``, the name scripts/race.py imports it by."""
    return import_script("race_report")


rr = load_report()


def curve(name="a", steps=(500, 1000, 1500, 2000), fds=(100.0, 60.0, 40.0, 30.0), step_ms=200.0, seed=0):
    return rr.Curve(name, name.split("-")[0], 0.01, seed, list(steps), list(fds), [None] * len(steps), step_ms, None)


def test_reach_interpolates_between_evaluations():
    got = rr.reach(curve(), 50.0)  # 60 at 1000, 40 at 1500: half way
    assert got["reached"] and got["eval_step"] == 1500 and got["step"] == pytest.approx(1250.0)
    assert not got["bounded"] and got["time_s"] == pytest.approx(1250 * 0.2)


def test_reach_at_the_first_evaluation_is_an_upper_bound_and_never_is_none():
    first = rr.reach(curve(), 150.0)
    assert first["step"] == 500 and first["bounded"]
    never = rr.reach(curve(), 10.0)
    assert not never["reached"] and never["step"] is None and never["time_s"] is None


def test_target_is_the_quality_every_baseline_seed_reaches():
    assert rr.target_fd([curve(fds=(90, 50, 40, 35)), curve(fds=(90, 50, 45, 44))]) == 44
    assert rr.target_fd([]) is None


def test_spread():
    assert rr.spread([1.0, None, 3.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert rr.spread([None])["mean"] is None


def test_optimizer_summary_times_each_optimizer_to_adamws_quality():
    curves = {
        "adamw": [curve("adamw-s0", fds=(90, 60, 50, 40)), curve("adamw-s1", fds=(90, 60, 50, 45), seed=1)],
        "muon": [curve("muon-s0", fds=(60, 45, 35, 30)), curve("muon-s1", fds=(90, 80, 70, 60), seed=1)],
    }
    rows = [
        row("adamw-s0", "adamw", 0.01, 0, 40),
        row("adamw-s1", "adamw", 0.01, 1, 45),
        row("muon-s0", "muon", 0.01, 0, 30),
        row("muon-s1", "muon", 0.01, 1, 60),
    ]
    opts = {n: {"lr": 0.01, "seeds": [0, 1], "runs": [f"{n}-s0", f"{n}-s1"]} for n in ("adamw", "muon")}
    got = rr.optimizer_summary(record(rows, opts), curves)
    assert got["target_fd"] == 45
    adamw, muon = got["optimizers"]["adamw"], got["optimizers"]["muon"]
    assert adamw["steps_to_target"]["mean"] == pytest.approx((1750 + 2000) / 2)  # 50 -> 40 crosses 45 half way
    assert muon["reached_target"] == 1 and muon["steps_to_target"]["mean"] == pytest.approx(1000)
    assert muon["time_to_target_s_ratio"] is None  # 1 of 2 seeds got there: no ratio, as in the levels table
    assert adamw["time_to_target_s_ratio"] == 1.0
    assert muon["fd_last_change"]["mean"] == pytest.approx((30 / 35 + 60 / 70) / 2 - 1)
    assert muon["fd"] == {"mean": 45.0, "min": 30.0, "max": 60.0, "n": 2} and muon["fd_ratio"] == pytest.approx(
        45 / 42.5
    )
    text = rr.render_main(got)
    assert "1 never" in text and "45.00 (30.00..60.00)" in text
    curves["muon"][1] = curve("muon-s1", fds=(90, 80, 70, 44), seed=1)  # both seeds get there: a ratio
    muon = rr.optimizer_summary(record(rows, opts), curves)["optimizers"]["muon"]
    assert muon["reached_target"] == 2
    assert muon["steps_to_target_ratio"] == pytest.approx(muon["steps_to_target"]["mean"] / 1875)
    assert muon["time_to_target_s_ratio"] is not None


def test_a_seed_without_a_curve_is_not_counted_as_never_reaching_the_target():
    """A row kept from a record made before curves were kept has no curve: the table says how many curves it has,
    and counts only those as never getting there."""
    curves = {"adamw": [curve("adamw-s0", fds=(90, 60, 50, 40))], "muon": [curve("muon-s0", fds=(60, 45, 38, 35))]}
    rows = [row(f"{n}-s{s}", n, 0.01, s, 40) for n in ("adamw", "muon") for s in (0, 1, 2)]
    opts = {n: {"lr": 0.01, "seeds": [0, 1, 2], "runs": [f"{n}-s{s}" for s in (0, 1, 2)]} for n in ("adamw", "muon")}
    got = rr.optimizer_summary(record(rows, opts), curves)
    adamw, muon = got["optimizers"]["adamw"], got["optimizers"]["muon"]
    assert adamw["curves"] == 1 and rr.reached_cell(adamw) == "; 1 of 3 seeds' curves here"
    assert muon["reached_target"] == 1 and rr.reached_cell(muon) == "; 1 of 3 seeds' curves here"
    curves["muon"][0] = curve("muon-s0", fds=(60, 50, 45, 42))
    muon = rr.optimizer_summary(record(rows, opts), curves)["optimizers"]["muon"]
    assert rr.reached_cell(muon) == "; 1 never; 1 of 3 seeds' curves here"


def test_published_inception_fds_are_cut_to_the_runs_of_the_main_table():
    table = {
        "muon": {
            "fd_mean": 0,
            "fd_min": 0,
            "fd_max": 0,
            "runs": [{"run": "m-s0", "fd": 8.0}, {"run": "old", "fd": 50}],
        },
        "adamw": {"fd_mean": 70, "fd_min": 70, "fd_max": 70, "runs": [{"run": "old-a", "fd": 70.0}]},
    }
    got = rr.inception_of_runs(table, {"m-s0", "m-s1"})
    assert got == {"muon": {"fd_mean": 8.0, "fd_min": 8.0, "fd_max": 8.0, "runs": [{"run": "m-s0", "fd": 8.0}]}}


def test_side_by_side_step_times_replace_the_runs_own_when_they_cover_every_optimizer():
    step_record = {
        "rows": [
            {"optimizer": "adamw", "world": 1, "status": "ok", "step_ms": 100.0, "opt_ms": 5.0},
            {"optimizer": "muon", "world": 1, "status": "ok", "step_ms": 150.0, "opt_ms": 50.0},
            {"optimizer": "muon", "world": 4, "status": "ok", "step_ms": 900.0, "opt_ms": 500.0},
            {"optimizer": "torch_muon", "world": 1, "status": "failed"},
        ]
    }
    times = rr.step_times(step_record)
    assert times == {"adamw": {"step_ms": 100.0, "opt_ms": 5.0}, "muon": {"step_ms": 150.0, "opt_ms": 50.0}}
    curves = {
        "adamw": [curve("adamw-s0", fds=(90, 60, 50, 40), step_ms=300.0)],
        "muon": [curve("muon-s0", fds=(60, 45, 35, 30), step_ms=500.0)],
    }
    timed, basis = rr.timed_by(curves, times)
    assert basis == "side by side" and [c[0].step_ms for c in timed.values()] == [100.0, 150.0]
    assert rr.timed_by({**curves, "torch_muon": curves["muon"]}, times)[1] == "run medians"  # never mixed
    assert rr.timed_by(curves, {})[0]["muon"][0].step_ms == 500.0
    rows = [row("adamw-s0", "adamw", 0.01, 0, 40), row("muon-s0", "muon", 0.01, 0, 30)]
    opts = {n: {"lr": 0.01, "seeds": [0], "runs": [f"{n}-s0"]} for n in ("adamw", "muon")}
    got = rr.optimizer_summary(record(rows, opts), timed, side_by_side=times)
    muon = got["optimizers"]["muon"]
    assert got["time_basis"] == "side by side" and got["target_fd"] == 40
    assert muon["step_ms"]["mean"] == 150.0 and muon["opt_ms"]["mean"] == 50.0
    assert muon["run_step_ms"]["mean"] == 100.0  # the record row's own median, kept beside
    assert muon["time_to_target_s"]["mean"] == pytest.approx(1250 * 0.150)  # 45 -> 35 crosses 40 half way
    assert got["optimizers"]["adamw"]["time_to_target_s"]["mean"] == pytest.approx(2000 * 0.100)
    assert "step ms (side by side)" in rr.render_main(got)
    assert rr.ranking(got) == ["muon", "adamw"]


def test_ablation_summary_and_the_fd_cost_of_a_longer_period():
    rows = [
        row("k2-s0", "prm/k2", 0.01, 0, 30),
        row("k2-s1", "prm/k2", 0.01, 1, 32, val_loss_ema=0.21),
        row("k3-s0", "prm/k3", 0.01, 0, 33, val_loss_ema=0.21),
        row("k3-s1", "prm/k3", 0.01, 1, 33, val_loss_ema=0.21),
        row("k3-half", "prm/k3", 0.005, 0, 40),
        {**row("k4-s0", "prm/k4", 0.01, 0, None), "status": "failed"},
    ]
    summary = rr.ablation_summary(record(rows, {"prm/k2": {}, "prm/k3": {}, "prm/k4": {}}))
    assert summary["prm/k3"]["0.01"]["fd"]["mean"] == 33 and summary["prm/k3"]["0.005"]["seeds"] == [0]
    assert summary["prm/k4"]["0.01"]["fd"]["n"] == 0
    assert rr.relative_change(summary, "prm/k2", "prm/k3", "0.01") == pytest.approx(33 / 31 - 1)
    assert rr.relative_change(summary, "prm/k3", "prm/k4", "0.01") is None
    assert rr.relative_change(summary, "prm/k2", "prm/k3", "0.01", "val_loss_ema") == pytest.approx(0.21 / 0.205 - 1)
    assert "prm/k3 | 0.005 | 1 | 40.00 | 0.2000 |" in rr.render_ablation(summary)
    assert rr.best_entries(summary) == {
        "0.01": {"fd": "prm/k2", "val_loss_ema": "prm/k2"},
        "0.005": {"fd": "prm/k3", "val_loss_ema": "prm/k3"},
    }


def test_load_curves_reads_the_records_series_at_the_best_lr(tmp_path):
    write_run(tmp_path, "adamw-lr0.01-s0", [80, 50], grid=True, losses=[0.3, 0.25, 0.22, 0.2])
    write_run(tmp_path, "adamw-lr0.003-s0", [90, 70], grid=False)
    rows = [
        row("adamw-lr0.01-s0", "adamw", 0.01, 0, 50, run_dir="gone/elsewhere"),
        row("adamw-lr0.003-s0", "adamw", 0.003, 0, 70, run_dir="gone/elsewhere"),
        row("muon-lr0.01-s0", "muon", 0.01, 0, 40, run_dir="gone/elsewhere"),  # no directory, no curve: left out
        row(
            "prm-lr0.01-s0",
            "prm",
            0.01,
            0,
            40,
            run_dir="gone/elsewhere",
            curve={"steps": [500], "fd": [40], "active_time_s": [9.0], "loss_steps": [250], "val_loss_ema": [0.3]},
        ),  # no directory: the curve its row carries
    ]
    opts = {"adamw": {"lr": 0.01}, "muon": {"lr": 0.01}, "prm": {"lr": 0.01}}
    curves = rr.load_curves(record(rows, opts), tmp_path)
    assert list(curves) == ["adamw", "prm"]
    (published,) = curves["prm"]
    assert published.fds == [40] and published.series("val_loss_ema") == ([250], [0.3]) and published.grid is None
    (c,) = curves["adamw"]
    assert c.steps == [500, 1000] and c.fds == [80, 50] and c.active_time_s == [60.0, 120.0] and c.grid
    assert c.series("val_loss_ema") == ([250, 500, 750, 1000], [0.3, 0.25, 0.22, 0.2])
    assert len(rr.load_curves(record(rows, opts), tmp_path, best_lr_only=False)["adamw"]) == 2


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    grid = tmp_path / "g.png"
    save_grid(torch.zeros(4, 1, 8, 8), grid)
    curves = {
        "adamw": [curve("adamw-s0"), curve("adamw-s1", fds=(110, 70, 45, 35), seed=1)],
        "muon": [rr.Curve("muon-s0", "muon", 0.01, 0, [500, 1000], [50, 20], [None, None], 150.0, str(grid))],
    }
    assert rr.plot_fd_vs_time(curves, tmp_path / "t.png", 35.0, "title").is_file()
    assert rr.plot_sample_grids(curves, tmp_path / "s.png").is_file()
    assert rr.plot_sample_grids({"adamw": curves["adamw"]}, tmp_path / "none.png") is None
    rows = [row(c.name, n, 0.01, c.seed, c.fds[-1]) for n, cs in curves.items() for c in cs]
    opts = {n: {"lr": 0.01, "seeds": [c.seed for c in cs], "runs": [c.name for c in cs]} for n, cs in curves.items()}
    assert rr.plot_time_to_quality(rr.optimizer_summary(record(rows, opts), curves), tmp_path / "q.png").is_file()
    summary = rr.ablation_summary(
        record(
            [row("a", "prm/g0.1", 0.01, 0, 30), row("b", "prm/g1", 0.01, 0, 40), row("c", "prm/g1", 0.005, 0, 35)],
            {"prm/g0.1": {}, "prm/g1": {}},
        )
    )
    assert rr.plot_ablation(
        summary, {"prm/g0.1": (0.1, ""), "prm/g1": (1.0, "")}, tmp_path / "a.png", "gamma", log_x=True
    ).is_file()
    assert rr.plot_ablation(summary, {"prm/g0.1": ("x", ""), "prm/g1": ("y", "")}, tmp_path / "c.png", "v").is_file()
    assert rr.plot_ablation(summary, {}, tmp_path / "empty.png", "v") is None


def test_time_to_each_of_adamws_quality_levels():
    curves = {
        "adamw": [curve("adamw-s0", fds=(90, 60, 50, 40)), curve("adamw-s1", fds=(80, 70, 45, 42), seed=1)],
        "muon": [curve("muon-s0", fds=(60, 45, 44, 43)), curve("muon-s1", fds=(65, 50, 48, 41), seed=1)],
    }
    levels = rr.quality_levels(curves["adamw"])
    assert levels == [
        {"step": 500, "fd": 90},
        {"step": 1000, "fd": 70},
        {"step": 1500, "fd": 50},
        {"step": 2000, "fd": 42},
    ]  # what every seed has reached by then; the last is the target
    assert levels[-1]["fd"] == rr.target_fd(curves["adamw"])
    got = rr.time_to_levels(curves)
    assert [lv["step"] for lv in got["levels"]] == [1000, 1500, 2000]  # the first evaluation measures nothing
    muon = got["optimizers"]["muon"]
    assert muon[0]["bounded"] == 2 and muon[0]["time_s"]["mean"] == pytest.approx(100)  # both at step 500
    assert muon[1]["reached"] == 2 and muon[1]["bounded"] == 0
    assert muon[1]["steps"]["mean"] == pytest.approx((500 + 500 * 10 / 15 + 1000) / 2)  # 60 -> 45 and 65 -> 50
    assert muon[2]["reached"] == 1 and muon[2]["ratio"] is None
    adamw = got["optimizers"]["adamw"]
    assert adamw[1]["steps"]["mean"] == pytest.approx((1500 + 1400) / 2)  # 70 -> 45 crosses 50 at 1400
    assert adamw[1]["ratio"] == 1.0 and muon[1]["ratio"] == pytest.approx(muon[1]["steps"]["mean"] / 1450)
    text = rr.render_levels(got)
    assert "FD 70.00 (adamw step 1000)" in text and "<=100 s (<=" in text and "1 of 2 seeds" in text
    dense = rr.dense_levels(got["levels"], n=3)
    assert [round(lv["fd"], 6) for lv in dense] == [70, round((70 * 42) ** 0.5, 6), 42]
    assert rr.time_to_levels(curves, levels=dense)["levels"] == dense
    assert rr.time_to_levels(curves, metric="val_loss_ema")["optimizers"] == {}  # no losses: left out


def with_losses(c, losses, steps=(250, 500, 750, 1000)):
    return replace(c, loss_steps=list(steps), losses=list(losses))


def test_time_to_each_of_adamws_loss_levels():
    """The same levels read off the EMA validation loss (every validation pass, 250 steps apart): AdamW's worst
    seed's loss so far at each step, the time to it interpolated between passes."""
    curves = {
        "adamw": [
            with_losses(curve("adamw-s0"), (0.40, 0.30, 0.26, 0.24)),
            with_losses(curve("adamw-s1", seed=1), (0.42, 0.32, 0.25, 0.23)),
        ],
        "muon": [
            with_losses(curve("muon-s0", step_ms=100.0), (0.30, 0.25, 0.22, 0.21)),
            with_losses(curve("muon-s1", step_ms=100.0, seed=1), (0.33, 0.27, 0.23, 0.22)),
        ],
    }
    levels = rr.quality_levels(curves["adamw"], "val_loss_ema")
    assert levels == [
        {"step": 250, "val_loss_ema": 0.42},
        {"step": 500, "val_loss_ema": 0.32},
        {"step": 750, "val_loss_ema": 0.26},
        {"step": 1000, "val_loss_ema": 0.24},
    ]
    got = rr.time_to_levels(curves, metric="val_loss_ema")
    assert got["metric"] == "val_loss_ema" and [lv["step"] for lv in got["levels"]] == [500, 750, 1000]
    muon = got["optimizers"]["muon"]
    # 0.32: seed 0 at its first pass (bounded), seed 1 from 0.33 at 250 to 0.27 at 500: 250 + 250 / 6
    assert muon[0]["bounded"] == 1 and muon[0]["steps"]["mean"] == pytest.approx((250 + 250 + 250 / 6) / 2)
    # 0.24: seed 0 from 0.25 at 500 to 0.22 at 750, seed 1 from 0.27 at 500 to 0.23 at 750
    assert muon[2]["steps"]["mean"] == pytest.approx((500 + 250 / 3 + 500 + 250 * 3 / 4) / 2)
    assert muon[2]["ratio"] == pytest.approx(
        muon[2]["time_s"]["mean"] / got["optimizers"]["adamw"][2]["time_s"]["mean"]
    )
    text = rr.render_levels(got)
    assert "EMA val loss 0.3200 (adamw step 500)" in text
    dense = rr.dense_levels(got["levels"], n=3, metric="val_loss_ema")
    assert dense[0]["val_loss_ema"] == 0.32 and dense[-1]["val_loss_ema"] == pytest.approx(0.24)
    with pytest.raises(ValueError, match="metric must be one of"):
        curves["adamw"][0].series("loss")


def test_the_frontier_plot_takes_seeds_whose_mean_lands_an_ulp_outside_them(tmp_path):
    pytest.importorskip("matplotlib")
    from dimuon.bench.quality_report import plot_fd_frontier

    share = 0.1  # three equal shares whose float mean exceeds each of them
    assert sum([share] * 3) / 3 > share
    summary = {
        "muon": {
            "fd": 30.0,
            "fd_min": 30.0,
            "fd_max": 30.0,
            "spectral_fraction": sum([share] * 3) / 3,
            "runs": ["a", "b", "c"],
        }
    }
    rows = [{"name": n, "optimizer": "muon", "status": "ok", "fd": 30.0, "spectral_fraction": share} for n in "abc"]
    assert plot_fd_frontier(summary, rows, tmp_path / "f.png", cost="spectral_fraction").is_file()


def test_error_bars_clamp_a_mean_an_ulp_outside_its_values():
    from dimuon.metrics.plots import error_bars

    mean = sum([0.1] * 3) / 3
    (below, above) = error_bars([mean, 5.0], [0.1, 4.0], [0.1, 7.0])
    assert mean > 0.1 and above == [0.0, 2.0]  # the bar above the mean would be an ulp negative
    assert below == [mean - 0.1, 1.0] and error_bars([0.1], [mean], [mean]) == [[0.0], [mean - 0.1]]


def test_time_to_quality_bars_take_seeds_timed_alike(tmp_path):
    pytest.importorskip("matplotlib")
    t = sum([0.1] * 3) / 3  # three seeds bounded at the same evaluation: equal times, a mean an ulp above
    summary = {
        "target_fd": 40.0,
        "optimizers": {
            "muon": {
                "time_to_target_s": {"mean": t, "min": 0.1, "max": 0.1, "n": 3},
                "seeds": [0, 1, 2],
                "reached_target": 3,
                "steps_to_target": {"mean": 500.0},
                "time_to_target_s_ratio": 0.5,
            }
        },
    }
    assert rr.plot_time_to_quality(summary, tmp_path / "t.png").is_file()


def test_adaptive_settings_are_held_against_the_fixed_periods_at_their_share_of_newton_schulz_steps(tmp_path):
    def rows(entry, share, losses, lr=0.01):
        return [
            row(f"{entry}-s{s}", entry, lr, s, 30.0, val_loss_ema=v, spectral_fraction=share)
            for s, v in enumerate(losses)
        ]

    fixed = rr.ablation_summary(
        record(
            rows("prm/k1", 1.0, (0.170, 0.172))
            + rows("prm/k2", 0.5, (0.172, 0.174))
            + rows("prm/k4", 0.25, (0.176, 0.178))
            + rows("prm/k4", 0.25, (0.19,), lr=0.005),  # an lr the other schedule did not run at: left out
            {"prm/k1": {}, "prm/k2": {}, "prm/k4": {}},
        )
    )
    adaptive = rr.ablation_summary(
        record(
            rows("ada/t0.2", 0.75, (0.168, 0.169))  # fixed at 0.75: 0.172 (0.171..0.173): below
            + rows("ada/t0.3", 0.375, (0.173, 0.176))  # fixed: 0.175 (0.174..0.176): inside
            + rows("ada/t0.5", 0.3, (0.180, 0.181))  # fixed: 0.1762 (0.1752..0.1772): above
            + rows("ada/t0.9", 0.1, (0.2, 0.2)),  # below the fixed span
            {"ada/t0.2": {}, "ada/t0.3": {}, "ada/t0.5": {}, "ada/t0.9": {}},
        )
    )
    frontier = rr.refresh_frontier({"fixed": fixed, "adaptive": adaptive}, {"prm/k2": "K=2", "ada/t0.2": "t 0.2"})
    assert list(frontier) == ["0.01"]
    by_entry = {r["entry"]: r for r in frontier["0.01"]}
    assert by_entry["prm/k2"]["setting"] == "K=2" and "verdict" not in by_entry["prm/k2"]
    assert by_entry["ada/t0.2"]["fixed"]["mean"] == pytest.approx(0.172)
    assert [by_entry[f"ada/t{t}"]["verdict"] for t in ("0.2", "0.3", "0.5", "0.9")] == [
        "below",
        "inside the seed ranges",
        "above",
        "outside the fixed span",
    ]
    assert by_entry["ada/t0.9"]["fixed"] is None
    table = rr.render_frontier(frontier)
    assert "| 0.01 | adaptive | t 0.2 | 0.750 (0.750..0.750) | 0.1685 (0.1680..0.1690) |" in table
    assert rr.plot_frontier(frontier, tmp_path / "f.png").is_file()
    assert rr.plot_frontier({"0.01": []}, tmp_path / "none.png") is None
