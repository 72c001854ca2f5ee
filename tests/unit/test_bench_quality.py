"""`dimuon bench quality`: the grid, run states, the tables from run files, and one tiny grid end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dimuon.bench import quality, quality_report, quality_runs
from dimuon.bench.quality_config import Config, QualityEval, RunSpec
from dimuon.io import to_json
from dimuon.metrics.eval_settings import sampling_settings
from dimuon.train.config import config_to_dict
from dimuon.train.run import parse_config

SPACE = "classifier-digits8-0123abcd"
TINY = [
    "--dataset",
    "digits",
    "--model",
    "DiT-T/2",
    "--steps",
    "4",
    "--batch-size",
    "16",
    "--eval.interval",
    "2",
    "--eval.num-samples",
    "20",
    "--eval.sample-steps",
    "2",
    "--eval.batch-size",
    "20",
    "--threads",
    "1",
    "--no-progress",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(out: Path, **changes) -> Config:
    """The end-to-end task of this module as a Config (no run is started by building it)."""
    evals = QualityEval(num_samples=20, sample_steps=2, batch_size=20, interval=2)
    cfg = Config(
        optimizers=("adamw", "muon"),
        lrs=(1e-3, 1e-2),
        model="DiT-T/2",
        dataset="digits",
        steps=4,
        batch_size=16,
        eval=evals,
        threads=1,
        out=out,
        progress=False,
    )
    return dataclasses.replace(cfg, **changes)


# --------------------------------------------------------------------------------------------------
# Fabricated runs: the files dimuon train writes, with chosen numbers
# --------------------------------------------------------------------------------------------------

# Final FD per (optimizer, lr) at seed 0 (a seed adds 2 * seed); step time and optimizer time per optimizer.
FINAL_FD = {("adamw", 1e-3): 50.0, ("adamw", 1e-2): 40.0, ("muon", 1e-3): 30.0, ("muon", 1e-2): 35.0}
STEP_MS = {"adamw": 10.0, "muon": 14.0}
OPT_MS = {"adamw": 2.0, "muon": 6.0}


def series_settings(cfg: Config) -> dict:
    """A results series' settings as dimuon eval records them, for cfg's evaluation flags."""
    return {
        "feature_space": SPACE,
        "feature_key": SPACE,
        "dataset": {"name": cfg.dataset, "kwargs": {}},
        "num_real": 180,
        **sampling_settings(cfg.eval),
        "k_pr": 3,
        "k_dc": 5,
    }


def fabricate_run(cfg: Config, spec: RunSpec, last_step: int | None = None) -> Path:
    """A run directory as dimuon train leaves it after `last_step` (default: all steps), FD from FINAL_FD."""
    last = cfg.steps if last_step is None else last_step
    run_dir = cfg.out / "runs" / spec.name
    (run_dir / "eval").mkdir(parents=True, exist_ok=True)
    # the config dimuon train records: its command's flags as its parser reads them
    cmd = quality_runs.train_command(cfg, spec, quality.train_args_of(cfg).get(spec.optimizer, []))
    config = config_to_dict(parse_config(cmd[len(quality_runs.TRAIN) :]))
    (run_dir / "config.json").write_text(to_json(config))
    step_ms, final = STEP_MS[spec.optimizer], FINAL_FD[spec.optimizer, spec.lr] + 2 * spec.seed
    records = [
        {
            "kind": "train",
            "step": s,
            "loss": 1.0,
            "opt_ms": OPT_MS[spec.optimizer] + s % 2,
            "step_ms": step_ms,
            "active_time_s": s * step_ms / 1e3,
        }
        for s in range(1, last + 1)
    ]
    records.append({"kind": "val", "step": last, "val_loss": 0.6, "val_loss_ema": final / 100})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    entries = [
        {
            "step": s,
            "status": "ok",
            "active_time_s": s * step_ms / 1e3,
            "fd": final + 10 * (cfg.steps - s),
            "precision": 0.5,
            "recall": 0.4,
            "density": 0.9,
            "coverage": 0.6,
        }
        for s in range(2, last + 1, 2)
    ]
    series = {
        "settings": series_settings(cfg),
        "entries": entries,
        "updated": "2026-01-01T00:00:00+00:00",
        "reference": {"fd": 5.0, "n_fake": 20},
    }
    (run_dir / "eval" / "results.json").write_text(json.dumps({"format": 1, "evaluations": {"k1": series}}))
    checkpoint = run_dir / "checkpoints" / f"step_{last:07d}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "meta.json").write_text("{}")
    return run_dir


def spec_of(cmd: list[str]) -> RunSpec:
    """The grid point a dimuon train command trains."""

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    return RunSpec(value("--optimizer"), float(value("--lr")), int(value("--seed")))


@pytest.fixture
def fake_training(monkeypatch):
    """Replace the training processes by fabricated runs; muon at lr 1e-2, seed 1 fails. Returns the calls."""
    calls: list[list[str]] = []

    def launch(cmd, log_path, threads):
        calls.append(list(cmd))
        cfg_out = Path(cmd[cmd.index("--out") + 1]).parent.parent
        spec = spec_of(cmd)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if spec == RunSpec("muon", 1e-2, 1):
            log_path.write_text("line 1\ndimuon train: error: boom\n")
            return 2
        fabricate_run(tiny_config(cfg_out, seeds=(0, 1)), spec)
        return 0

    monkeypatch.setattr(quality_runs, "launch", launch)
    return calls


# --------------------------------------------------------------------------------------------------
# The grid and its flags
# --------------------------------------------------------------------------------------------------


def test_grid_runs_optimizers_side_by_side_with_per_optimizer_lrs(tmp_path):
    cfg = tiny_config(tmp_path, seeds=(0, 1), lr_grid=("adamw=3e-4,1e-3,3e-3",))
    names = [s.name for s in quality.expand_grid(cfg)]
    assert names[:5] == [
        "adamw-lr0.0003-s0",
        "muon-lr0.001-s0",
        "adamw-lr0.001-s0",
        "muon-lr0.01-s0",
        "adamw-lr0.003-s0",
    ]
    assert len(names) == 10 and names[5] == "adamw-lr0.0003-s1"
    assert quality.lr_grid(cfg) == {"adamw": (3e-4, 1e-3, 3e-3), "muon": (1e-3, 1e-2)}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["sgd=1e-3"], "--lr-grid expects NAME=LR"),
        (["adamw"], "--lr-grid expects NAME=LR"),
        (["adamw="], "--lr-grid expects NAME=LR"),
        (["muon_bp=1e-3"], "NAME one of \\['adamw', 'muon'\\]"),
        (["adamw=1e-3,fast"], "--lr-grid: 'fast' is not a number"),
        (["adamw=-1e-3"], "--lr-grid: learning rates must be positive"),
        (["adamw=1e-3", "adamw=1e-2"], "--lr-grid names adamw twice"),
    ],
)
def test_lr_grid_errors_name_the_flag(items, message):
    with pytest.raises(ValueError, match=message):
        quality.parse_lr_grid(items, ("adamw", "muon"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"optimizers": ("adamw", "sgd")}, "--optimizers must name distinct values from: adamw, muon"),
        ({"optimizers": ()}, "--optimizers must name"),
        ({"optimizers": ("muon", "lion/k2")}, "--optimizers must name distinct values .* \\(or NAME/LABEL"),
        ({"optimizers": ("muon", "periodic_row_muon/")}, "--optimizers must name distinct values"),
        ({"optimizers": ("muon", "periodic_row_muon/k 2")}, "--optimizers must name distinct values"),
        ({"model": "DiT-Q/2"}, "--model must be one of: .*DiT-T/2"),
        ({"dataset": "cifar"}, "--dataset must be one of: .*digits"),
        ({"lrs": (0.0,)}, "--lrs: learning rates must be positive"),
        ({"seeds": (0, 0)}, "--seeds must be distinct"),
        ({"steps": 0}, "--steps must be an integer >= 1"),
        ({"jobs": 0}, "--jobs must be an integer >= 1"),
        ({"lrs": (0.01, 0.010000000001)}, "the same run more than once"),
        ({"train_args": "--lr 1e-3"}, "--train-args: --lr is set by the benchmark; use --lrs or --lr-grid"),
        ({"train_args": "--eval.cfg 2"}, "--train-args: --eval.cfg is forwarded from this command's own"),
        ({"train_args": "--optim.k '3"}, "--train-args: No closing quotation"),
        ({"train_args_of": ("muon=--seed=3",)}, "--train-args-of: --seed is set by the benchmark; use --seeds"),
        ({"train_args_of": ("prm=--optim.k 3",)}, "--train-args-of expects NAME=FLAGS"),
    ],
)
def test_bad_options_are_rejected_before_any_run(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        quality.check_config(tiny_config(tmp_path, **changes))


def test_eval_flags_are_checked_with_their_eval_prefix(tmp_path):
    cfg = tiny_config(tmp_path)
    for field, value, message in (
        ("num_samples", 3, "--eval.num-samples must be >= 4"),
        ("interval", 0, "--eval.interval must be an integer >= 1"),
    ):
        bad = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, **{field: value}))
        with pytest.raises(ValueError, match=message):
            quality.check_config(bad)


def test_main_reports_bad_flags_with_status_2(tmp_path, capsys):
    assert quality.main(["--optimizers", "adamw", "lion", "--out", str(tmp_path)]) == 2
    assert "dimuon bench quality: error: --optimizers must name" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        quality.main(["--optimiser", "adamw"])
    assert info.value.code == 2
    assert not (tmp_path / "runs").exists()


def test_an_output_that_cannot_be_written_is_refused_before_any_run(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for flag in ("--out", "--eval.cache-dir"):
        target = tmp_path / "file" / "sub"
        extra = [flag, str(target)] if flag != "--out" else []
        out = target if flag == "--out" else tmp_path / "bench"
        assert quality.main(["--optimizers", "adamw", "--out", str(out), *extra]) == 2
        assert capsys.readouterr().err == (
            f"dimuon bench quality: error: {flag} {target} cannot be written: "
            f"{tmp_path / 'file'} is a file, not a directory\n"
        )
    assert not (tmp_path / "bench").exists()


def test_train_args_value_may_start_with_dashes():
    args = quality.join_flag_values(["--steps", "4", "--train-args", "--ema-decay 0.9", "--jobs", "2"])
    assert args == ["--steps", "4", "--train-args=--ema-decay 0.9", "--jobs", "2"]


def test_train_command_is_accepted_by_dimuon_train(tmp_path):
    cfg = tiny_config(tmp_path, train_args="--ema-decay 0.9", train_args_of=("muon=--optim.ns-steps 4",))
    extra = quality.train_args_of(cfg)
    cmd = quality_runs.train_command(cfg, RunSpec("muon", 1e-2, 3), extra["muon"])
    assert cmd[1:4] == ["-m", "dimuon.cli", "train"]
    train = parse_config(cmd[4:])
    assert (train.optimizer, train.lr, train.seed, train.model, train.steps) == ("muon", 1e-2, 3, "DiT-T/2", 4)
    assert train.out == str(tmp_path / "runs" / "muon-lr0.01-s3") and train.threads == 1 and not train.progress
    assert (train.eval.interval, train.eval.num_samples, train.eval.sample_steps) == (2, 20, 2)
    assert train.eval.cache_dir == tmp_path / "feature_cache"  # one cache for every run
    assert train.ema_decay == 0.9 and train.optim.ns_steps == 4
    assert extra["adamw"] == ["--ema-decay", "0.9"]
    assert quality_runs.train_command(cfg, RunSpec("muon", 1e-2, 3), [], "restart")[-1] == "--overwrite"
    assert quality_runs.train_command(cfg, RunSpec("muon", 1e-2, 3), [], "resume")[-2] == "--resume"


def test_default_eval_interval_and_threads(tmp_path):
    cfg = tiny_config(tmp_path, steps=1000, eval=QualityEval(), threads=None)
    assert quality_runs.eval_interval(cfg) == 250 and quality_runs.threads_per_run(cfg) is None
    assert quality_runs.threads_per_run(dataclasses.replace(cfg, jobs=64)) == 1
    assert Config().optimizers == ("adamw", "muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon", "torch_muon")


def test_notes_flag_muon_bp_without_blocks_and_a_missing_baseline(tmp_path):
    cfg = tiny_config(tmp_path, optimizers=("adamw", "muon_bp"))
    (note,) = quality.notes(cfg)
    assert "same steps as muon" in note and "muon_bp=--optim.blocks 4" in note
    assert quality.notes(dataclasses.replace(cfg, train_args_of=("muon_bp=--optim.blocks=4",))) == []
    (note,) = quality.notes(dataclasses.replace(cfg, optimizers=("muon",)))
    assert "adamw is not among --optimizers" in note


# --------------------------------------------------------------------------------------------------
# Run states and tables from run files
# --------------------------------------------------------------------------------------------------


def test_run_mode_follows_the_files(tmp_path):
    cfg = tiny_config(tmp_path)
    spec = RunSpec("adamw", 1e-3, 0)
    run_dir = cfg.out / "runs" / spec.name
    assert quality_runs.run_mode(run_dir, cfg.eval, cfg.steps) == "new"
    run_dir.mkdir(parents=True)
    (run_dir / quality_runs.LOG_NAME).write_text("$ dimuon train\n")
    assert quality_runs.run_mode(run_dir, cfg.eval, cfg.steps) == "new"
    (run_dir / "config.json").write_text("{}")
    assert quality_runs.run_mode(run_dir, cfg.eval, cfg.steps) == "restart"  # killed before its first checkpoint
    fabricate_run(cfg, spec, last_step=2)
    assert quality_runs.run_mode(run_dir, cfg.eval, cfg.steps) == "resume"
    fabricate_run(cfg, spec)
    assert quality_runs.run_mode(run_dir, cfg.eval, cfg.steps) == "done"
    other = dataclasses.replace(cfg.eval, num_samples=40)  # another series: the last step is not scored in it
    assert quality_runs.run_mode(run_dir, other, cfg.steps) == "evaluate"  # trained that far: dimuon eval scores it


def test_a_run_of_another_task_is_refused(tmp_path):
    cfg = tiny_config(tmp_path)
    spec = RunSpec("adamw", 1e-3, 0)
    fabricate_run(cfg, spec)
    assert quality_runs.foreign_run(cfg.out / "runs" / spec.name, cfg, spec) is None
    changed = dataclasses.replace(cfg, model="DiT-T/4")
    reason = quality_runs.foreign_run(cfg.out / "runs" / spec.name, changed, spec)
    assert "model 'DiT-T/2' (asked for 'DiT-T/4')" in reason
    outcome = quality_runs.execute(changed, spec, [])
    assert outcome.action == "refused" and outcome.command is None and "another --out" in outcome.error


def test_a_run_trained_with_other_train_args_is_refused_not_reused(tmp_path, fake_training, monkeypatch):
    """The run's config.json (as dimuon train recorded it) is held against this grid's command for it: other
    --train-args / --train-args-of refuse it, naming the run and the flags; how it is continued or evaluated
    does not."""
    cfg = tiny_config(
        tmp_path,
        optimizers=("adamw", "periodic_row_muon/kx"),
        lrs=(1e-2,),
        train_args="--ema-decay 0.5",
        train_args_of=("periodic_row_muon/kx=--optim.k 2",),
    )
    monkeypatch.setitem(FINAL_FD, ("periodic_row_muon/kx", 1e-2), 33.0)
    monkeypatch.setitem(STEP_MS, "periodic_row_muon/kx", 12.0)
    monkeypatch.setitem(OPT_MS, "periodic_row_muon/kx", 4.0)
    specs = quality.expand_grid(cfg)
    for spec in specs:
        fabricate_run(cfg, spec)
    extra = quality.train_args_of(cfg)
    assert [
        quality_runs.foreign_run(quality_runs.run_directory(cfg, s), cfg, s, extra[s.optimizer]) for s in specs
    ] == [
        None,
        None,
    ]
    # threads, jobs, progress and the evaluation settings may change: the run is still this grid's
    same = replace(cfg, threads=2, jobs=2, eval=replace(cfg.eval, num_samples=30, interval=4))
    assert all(
        quality_runs.foreign_run(quality_runs.run_directory(same, s), same, s, extra[s.optimizer]) is None
        for s in specs
    )

    changed = replace(cfg, train_args="--ema-decay 0.999", train_args_of=("periodic_row_muon/kx=--optim.k 4",))
    record = quality.run(changed)
    assert fake_training == []  # nothing launched: neither skipped as finished nor resumed under the new flags
    adamw, prm = record["runs"]
    assert (adamw["action"], adamw["status"], prm["action"], prm["status"]) == (
        "refused",
        "failed",
        "refused",
        "failed",
    )
    assert (
        f"{adamw['run_dir']} holds a run trained with other flags than this grid's for adamw-lr0.01-s0"
        in adamw["error"]
    )
    assert "--ema-decay 0.5 (asked for 0.999)" in adamw["error"] and "--optim.k" not in adamw["error"]
    assert "--optim.k 2 (asked for 4)" in prm["error"] and "another --out" in prm["error"]
    assert adamw["fd"] is None and prm["fd"] is None  # the old runs' numbers are not reported as the new flags'


def test_a_finished_run_is_evaluated_with_new_eval_settings_not_resumed(tmp_path, monkeypatch):
    """A run trained to its last step whose last step is not scored with this invocation's --eval.* settings:
    dimuon train --resume would have no step to take (and evaluate nothing), so dimuon eval scores it."""
    cfg = tiny_config(tmp_path, optimizers=("adamw",), lrs=(1e-2,))
    spec = RunSpec("adamw", 1e-2, 0)
    fabricate_run(cfg, spec)
    other = replace(cfg, eval=replace(cfg.eval, num_samples=30))
    calls = []

    def launch(cmd, log_path, threads):
        calls.append(list(cmd))
        if cmd[3] == "eval":
            fabricate_run(other, spec)  # the series of the new settings, as dimuon eval writes it
        return 0  # dimuon train --resume at the last step exits 0 having done nothing

    monkeypatch.setattr(quality_runs, "launch", launch)
    (row,) = quality.run(other)["runs"]
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "dimuon.cli", "eval", "--run"] and cmd[5] == row["run_dir"]
    assert cmd[cmd.index("--num-samples") + 1] == "30" and "--interval" not in " ".join(cmd)
    assert cmd[cmd.index("--cache-dir") + 1] == str(cfg.out / "feature_cache")  # the grid's one cache
    assert (row["action"], row["status"], row["eval_step"]) == ("evaluated", "ok", 4)
    assert row["launched"].endswith("--no-progress") and " train " in row["command"]
    calls.clear()
    (row,) = quality.run(other)["runs"]
    assert calls == [] and row["action"] == "skipped"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"train_args": "--ema-decay lots"}, "--train-args / --train-args-of adamw: dimuon train refuses these flags"),
        (
            {"train_args_of": ("muon=--optim.k 3",)},
            "--train-args / --train-args-of muon: --optimizer muon rejects its options",
        ),
        ({"train_args": "--skip-limit 3"}, "--train-args / --train-args-of adamw: --skip-limit 3 has no effect here"),
    ],
)
def test_train_args_dimuon_train_refuses_stop_the_grid_before_any_run(
    tmp_path, fake_training, capsys, changes, message
):
    cfg = tiny_config(tmp_path / "bench", **changes)
    with pytest.raises(quality.FlagError, match="^" + re.escape(message)):
        quality.check_config(cfg)
    code = quality.main([*TINY, "--out", str(cfg.out), "--optimizers", "adamw", "muon", *flag_args(changes)])
    assert code == 2 and fake_training == [] and not (cfg.out / "runs").exists()
    assert f"dimuon bench quality: error: {message}" in capsys.readouterr().err


def flag_args(changes: dict) -> list[str]:
    """The command-line flags of a tiny_config change of train_args / train_args_of."""
    out = [f"--train-args={changes['train_args']}"] if "train_args" in changes else []
    return out + (["--train-args-of", *changes["train_args_of"]] if "train_args_of" in changes else [])


def test_run_row_reads_costs_and_scores(tmp_path):
    cfg = tiny_config(tmp_path)
    spec = RunSpec("muon", 1e-3, 0)
    fabricate_run(cfg, spec)
    with open(cfg.out / "runs" / spec.name / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 4, "opt_ms": 100.0, "step_ms": 14.0}\n{"kind": "tra')  # resumed, torn
    row = quality_report.run_row(cfg, quality_runs.Outcome(spec, "skipped", returncode=0), [])
    assert row["status"] == "ok" and row["name"] == "muon-lr0.001-s0" and row["trained_steps"] == 4
    assert (row["fd"], row["best_fd"], row["best_fd_step"], row["eval_step"], row["evaluations"]) == (30, 30, 4, 4, 2)
    assert row["opt_ms"] == 7.0  # median of 7, 6, 7 and the rewritten step 4's 100
    assert row["step_ms"] == 14.0 and row["active_time_s"] == pytest.approx(0.056)
    assert row["val_loss_ema"] == 0.3 and row["reference_fd"] == 5.0 and row["feature_space"] == SPACE
    assert "--optimizer muon --lr 0.001 --seed 0" in row["command"] and row["launched"] is None


def test_best_lr_averages_seeds_and_ratios_use_adamw():
    rows = [
        {"optimizer": "adamw", "lr": 1e-3, "seed": 0, "status": "ok", "fd": 10.0, "opt_ms": 2.0, "active_time_s": 8.0},
        {"optimizer": "adamw", "lr": 1e-3, "seed": 1, "status": "ok", "fd": 30.0, "opt_ms": 2.0, "active_time_s": 8.0},
        {"optimizer": "adamw", "lr": 1e-2, "seed": 0, "status": "ok", "fd": 15.0, "opt_ms": 2.0, "active_time_s": 8.0},
        {"optimizer": "adamw", "lr": 1e-2, "seed": 1, "status": "ok", "fd": 17.0, "opt_ms": 2.0, "active_time_s": 8.0},
        {"optimizer": "muon", "lr": 1e-2, "seed": 0, "status": "ok", "fd": 8.0, "opt_ms": 5.0, "active_time_s": 10.0},
        {
            "optimizer": "muon",
            "lr": 1e-3,
            "seed": 0,
            "status": "failed",
            "fd": 1.0,
            "opt_ms": 5.0,
            "active_time_s": 10.0,
        },
    ]
    for i, (r, loss) in enumerate(zip(rows, (0.30, 0.34, 0.31, 0.31, 0.3, 0.1))):
        r.update(name=f"r{i}", best_fd=r["fd"], val_loss_ema=loss, step_ms=1.0)
    assert quality_report.best_lr(rows[:4], "fd") == 1e-2  # mean 16 beats mean 20, though 1e-3 has the best run
    assert quality_report.best_lr(rows[:4]) == 1e-2  # by EMA loss (the default): mean 0.31 beats 0.32
    rows[0]["val_loss_ema"] = 0.27
    assert quality_report.best_lr(rows[:4]) == 1e-3 and quality_report.best_lr(rows[:4], "fd") == 1e-2
    assert quality_report.best_lr(rows[5:]) is None
    sel = quality_report.selection(rows[:4], "val_loss_ema")
    assert sel["best"] == 1e-3 and sel["on_edge"] and sel["flat_with"] == [1e-2]  # 0.27..0.34 overlaps 0.31
    assert sel["lrs"]["0.001"] == {"mean": pytest.approx(0.305), "min": 0.27, "max": 0.34, "seeds": 2}
    rows[1]["val_loss_ema"] = 0.28
    assert quality_report.selection(rows[:4], "val_loss_ema")["flat_with"] == []  # 0.27..0.28 vs 0.31..0.31
    summary = quality_report.optimizer_summary(rows, ("adamw", "muon", "muon_bp"), select_by="fd")
    quality_report.add_ratios(summary)
    assert summary["adamw"]["fd"] == 16.0 and summary["adamw"]["seeds"] == [0, 1]
    assert (summary["adamw"]["fd_min"], summary["adamw"]["fd_max"]) == (15.0, 17.0)
    assert summary["muon"]["lr"] == 1e-2 and summary["muon"]["runs"] == ["r4"]
    assert summary["muon"]["fd_ratio"] == 0.5 and summary["muon"]["opt_ms_ratio"] == 2.5
    assert summary["muon"]["active_time_s_ratio"] == 1.25 and summary["adamw"]["fd_ratio"] == 1.0
    assert summary["muon_bp"]["lr"] is None and summary["muon_bp"]["fd_ratio"] is None
    no_baseline = quality_report.optimizer_summary(rows[4:], ("muon",))
    quality_report.add_ratios(no_baseline)
    assert no_baseline["muon"]["fd_ratio"] is None


def test_an_lr_with_a_failed_seed_is_not_compared_with_lrs_whose_seeds_all_finished():
    def row(lr: float, seed: int, loss: float, status: str = "ok") -> dict:
        return {"optimizer": "muon", "lr": lr, "seed": seed, "status": status, "val_loss_ema": loss}

    rows = [row(5e-3, 0, 0.1700), row(5e-3, 1, 0.1740), row(1e-2, 0, 0.1710), row(1e-2, 1, 0.1790, "failed")]
    rows += [row(2e-2, 0, 0.1800), row(2e-2, 1, 0.1810)]
    assert quality_report.best_lr(rows) == 5e-3  # 1e-2's one seed (0.1710) does not beat 5e-3's two (0.1720)
    sel = quality_report.selection(rows, "val_loss_ema")
    assert sel["short"] == [1e-2] and sel["best"] == 5e-3
    (line,) = quality_report.selection_lines({"muon": {"selection": sel}})
    assert "not every seed finished at 0.01: not compared" in line
    rows[3]["status"] = "ok"  # both seeds of 1e-2 in: it is compared (mean 0.1750)
    assert quality_report.best_lr(rows) == 5e-3 and quality_report.selection(rows, "val_loss_ema")["short"] == []
    only_short = [row(5e-3, 0, 0.2), row(5e-3, 1, 0.2, "failed"), row(1e-2, 0, 0.1), row(1e-2, 1, 0.1, "failed")]
    assert quality_report.best_lr(only_short) == 1e-2  # no lr has every seed: the rest are compared, and said so


def test_grid_is_tabulated_failures_reported_and_finished_runs_skipped(tmp_path, fake_training, capsys):
    cfg = tiny_config(tmp_path / "bench", seeds=(0, 1))
    record = quality.run(cfg, ["--fake"])
    assert len(fake_training) == 8
    rows = {r["name"]: r for r in record["runs"]}
    failed = rows["muon-lr0.01-s1"]
    assert failed["status"] == "failed" and failed["error"] == "dimuon train exited with status 2"
    assert failed["fd"] is None and failed["launched"].endswith("--eval.interval 2")
    err = capsys.readouterr().err
    assert "run muon-lr0.01-s1 failed: dimuon train exited with status 2" in err and "error: boom" in err
    assert all(r["status"] == "ok" for name, r in rows.items() if name != "muon-lr0.01-s1")
    curve = rows["adamw-lr0.01-s0"]["curve"]  # published with the row: a checkout without the run rebuilds it
    assert curve["steps"] == [2, 4] and curve["fd"] == [60.0, 40.0]
    assert curve["loss_steps"] == [4] and curve["val_loss_ema"] == [0.4] and len(curve["active_time_s"]) == 2
    assert failed["curve"]["steps"] == []

    adamw, muon = record["optimizers"]["adamw"], record["optimizers"]["muon"]
    assert (adamw["lr"], adamw["fd"], adamw["seeds"]) == (1e-2, 41.0, [0, 1])
    assert (muon["lr"], muon["fd"], muon["seeds"]) == (1e-3, 31.0, [0, 1])
    assert muon["fd_ratio"] == pytest.approx(31 / 41) and muon["opt_ms_ratio"] == pytest.approx(6.5 / 2.5)
    assert muon["active_time_s_ratio"] == pytest.approx(1.4)
    assert record["target_fd"] == 42.0 and muon["target_active_time_s_ratio"] == pytest.approx(1.4)
    assert record["eval_settings"]["feature_space"] == SPACE and record["machine"]["argv"] == ["--fake"]

    out = cfg.out
    for name in (
        "results.json",
        "results.md",
        "fd_vs_lr.png",
        "fd_vs_opt_ms.png",
        "best_lr/compare_fd.png",
        "best_lr/compare.json",
    ):
        assert (out / name).is_file(), name
    assert json.loads((out / "results.json").read_text())["runs"][0]["name"] == "adamw-lr0.001-s0"
    md = (out / "results.md").read_text()
    assert "| muon | 0.001 | 2 | 31.000 | 0.76 |" in md
    assert "| muon-lr0.01-s1 | failed |" in md and "- muon-lr0.01-s1: dimuon train exited with status 2" in md
    compared = json.loads((out / "best_lr" / "compare.json").read_text())
    assert sorted(Path(r["run"]).name for r in compared["runs"]) == [
        "adamw-lr0.01-s0",
        "adamw-lr0.01-s1",
        "muon-lr0.001-s0",
        "muon-lr0.001-s1",
    ]

    fake_training.clear()
    again = quality.run(cfg)
    assert [spec_of(c).optimizer + str(spec_of(c).seed) for c in fake_training] == ["muon1"]  # only the failed one
    assert {r["action"] for r in again["runs"] if r["name"] != "muon-lr0.01-s1"} == {"skipped"}


def test_report_only_rebuilds_the_record_from_the_runs_launching_nothing(tmp_path, fake_training):
    cfg = tiny_config(tmp_path / "bench", seeds=(0, 1))
    quality.run(cfg)  # muon at 1e-2, seed 1 fails
    fake_training.clear()
    (cfg.out / "results.json").unlink()
    record = quality.run(replace(cfg, report_only=True))
    assert fake_training == []
    rows = {r["name"]: r for r in record["runs"]}
    assert rows["muon-lr0.01-s1"]["status"] == "failed" and rows["muon-lr0.01-s1"]["action"] == "not run"
    assert "--report-only launches nothing" in rows["muon-lr0.01-s1"]["error"]
    assert {r["action"] for n, r in rows.items() if n != "muon-lr0.01-s1"} == {"skipped"}
    assert record["optimizers"]["muon"]["lr"] == 1e-3 and (cfg.out / "results.json").is_file()


def test_finished_rows_of_an_earlier_record_are_kept_where_their_runs_are_gone(tmp_path, fake_training, capsys):
    """A published record in a fresh checkout: its finished runs are not trained again, the failed one is, a run
    whose command differs is, and a run directory that is here wins over the record."""
    cfg = tiny_config(tmp_path / "first", seeds=(0, 1))
    first = quality.run(cfg)  # muon at 1e-2, seed 1 fails
    published = tmp_path / "published.json"
    earlier = {r["name"]: r for r in first["runs"]}
    earlier["adamw-lr0.001-s1"]["command"] += " --ema-decay 0.5"  # trained otherwise: not this grid's run
    earlier["adamw-lr0.01-s0"]["optimizer"] = "adamw/as-published"  # a row is spelled as this grid spells it
    published.write_text(json.dumps({**first, "runs": list(earlier.values())}))
    fresh = tiny_config(tmp_path / "fresh", seeds=(0, 1), keep_rows_of=published)
    fabricate_run(fresh, RunSpec("muon", 1e-3, 0))  # here already: read from its directory
    fake_training.clear()
    record = quality.run(fresh)
    trained = sorted(spec_of(c).optimizer + f"-{spec_of(c).lr:g}-s{spec_of(c).seed}" for c in fake_training)
    assert trained == ["adamw-0.001-s1", "muon-0.01-s1"]
    assert "adamw-lr0.001-s1 of " in capsys.readouterr().err
    rows = {r["name"]: r for r in record["runs"]}
    kept = rows["adamw-lr0.01-s0"]
    assert kept["action"] == "kept" and kept["kept_from"] == str(published) and kept["status"] == "ok"
    assert kept["optimizer"] == "adamw"
    assert kept["machine"] == first["machine"] and "machine" not in rows["adamw-lr0.001-s1"]
    assert kept["fd"] == earlier["adamw-lr0.01-s0"]["fd"] and kept["run_dir"] == str(fresh.out / "runs" / kept["name"])
    assert rows["muon-lr0.001-s0"]["action"] == "skipped" and rows["muon-lr0.01-s1"]["status"] == "failed"
    assert record["optimizers"]["muon"]["lr"] == 1e-3 and record["optimizers"]["adamw"]["fd"] == 41.0
    assert record["optimizers"]["adamw"]["target_active_time_s"] is None  # its runs are not here to compare
    fake_training.clear()
    again = {r["name"]: r for r in quality.run(replace(fresh, report_only=True))["runs"]}
    assert fake_training == [] and again["adamw-lr0.01-s0"]["action"] == "kept"
    assert again["adamw-lr0.001-s1"]["action"] == "skipped"  # trained in the fresh directory above


@pytest.mark.parametrize("content, message", [(None, "cannot be read"), ("[1]", "not a dimuon bench quality record")])
def test_keep_rows_of_must_be_a_record(tmp_path, content, message):
    path = tmp_path / "earlier.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(quality.FlagError, match=f"--keep-rows-of: .*{message}"):
        quality.check_config(tiny_config(tmp_path / "b", keep_rows_of=path))


def test_variants_of_one_optimizer_run_under_their_own_labels(tmp_path, monkeypatch):
    cfg = tiny_config(
        tmp_path,
        optimizers=("muon", "periodic_row_muon/k2", "periodic_row_muon/k4"),
        lrs=(1e-2,),
        train_args_of=("periodic_row_muon/k2=--optim.k 2", "periodic_row_muon/k4=--optim.k 4"),
    )
    specs = quality.expand_grid(cfg)
    assert [s.name for s in specs] == [
        "muon-lr0.01-s0",
        "periodic_row_muon-k2-lr0.01-s0",
        "periodic_row_muon-k4-lr0.01-s0",
    ]
    cmd = quality_runs.train_command(cfg, specs[1], quality.train_args_of(cfg)[specs[1].optimizer])
    assert cmd[cmd.index("--optimizer") + 1] == "periodic_row_muon" and cmd[-2:] == ["--optim.k", "2"]
    fraction = {"muon": 1.0, "periodic_row_muon/k2": 0.5, "periodic_row_muon/k4": 0.25}
    for entry, fd, ms in (("periodic_row_muon/k2", 33.0, 4.0), ("periodic_row_muon/k4", 38.0, 3.0)):
        monkeypatch.setitem(FINAL_FD, (entry, 1e-2), fd)
        monkeypatch.setitem(STEP_MS, entry, 12.0)
        monkeypatch.setitem(OPT_MS, entry, ms)
    by_dir = {quality_runs.run_directory(cfg, s): s for s in specs}

    def launch(cmd, log_path, threads):
        spec = by_dir[Path(cmd[cmd.index("--out") + 1])]
        run_dir = fabricate_run(cfg, spec)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        with_refresh = [
            {**r, "refresh": {"spectral_fraction": fraction[spec.optimizer], "matrices": {}}}
            if r["kind"] == "train"
            else r
            for r in map(json.loads, lines)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in with_refresh))
        return 0

    monkeypatch.setattr(quality_runs, "launch", launch)
    record = quality.run(cfg)
    assert {name: s["spectral_fraction"] for name, s in record["optimizers"].items()} == fraction
    assert [record["optimizers"][n]["fd"] for n in ("periodic_row_muon/k2", "periodic_row_muon/k4")] == [33.0, 38.0]
    assert (cfg.out / "fd_vs_opt_ms.png").is_file() and (cfg.out / "fd_vs_spectral.png").is_file()
    md = (cfg.out / "results.md").read_text()
    assert "| periodic_row_muon/k4 | 0.01 | 1 | 38.000 |" in md and "| periodic_row_muon-k4-lr0.01-s0 | ok |" in md


def test_interrupted_runs_resume_and_unstarted_ones_restart(tmp_path, fake_training):
    cfg = tiny_config(tmp_path, optimizers=("adamw",), lrs=(1e-3, 1e-2))
    fabricate_run(cfg, RunSpec("adamw", 1e-3, 0), last_step=2)
    (cfg.out / "runs" / "adamw-lr0.01-s0").mkdir(parents=True)
    (cfg.out / "runs" / "adamw-lr0.01-s0" / "metrics.jsonl").write_text("")
    record = quality.run(cfg)
    assert [r["action"] for r in record["runs"]] == ["resumed", "restarted"]
    assert fake_training[0][-2:] == ["--resume", str(cfg.out / "runs" / "adamw-lr0.001-s0")]
    assert fake_training[1][-1] == "--overwrite"
    assert record["optimizers"]["adamw"]["fd_ratio"] == 1.0


# --------------------------------------------------------------------------------------------------
# End to end: real dimuon train processes
# --------------------------------------------------------------------------------------------------


def test_end_to_end_tiny_grid(tmp_path, capsys):
    out = tmp_path / "bench"
    # Two tensor-parallel ranks pass the start-up check but not one process: AdamW's run fails, the other goes on.
    args = [
        *TINY,
        "--out",
        str(out),
        "--optimizers",
        "adamw",
        "periodic_row_muon",
        "--train-args-of",
        "adamw=--parallel.tp 2",
        "periodic_row_muon=--optim.k 2",
    ]
    assert quality.main(args) == 1
    captured = capsys.readouterr()
    assert "run adamw-lr0.01-s0 failed: dimuon train exited with status 2" in captured.err
    assert "must divide the world size 1" in captured.err  # the tail of the run's log
    record = json.loads((out / "results.json").read_text())
    adamw, prm = record["runs"]
    assert adamw["name"] == "adamw-lr0.01-s0" and adamw["status"] == "failed" and adamw["fd"] is None
    assert prm["name"] == "periodic_row_muon-lr0.01-s0" and prm["status"] == "ok" and prm["action"] == "started"
    assert (prm["eval_step"], prm["evaluations"], prm["trained_steps"]) == (4, 2, 4)
    assert prm["fd"] > 0 and 0 <= prm["precision"] <= 1 and prm["best_fd"] <= prm["fd"]
    assert prm["opt_ms"] > 0 and prm["step_ms"] >= prm["opt_ms"] and prm["active_time_s"] > 0
    assert prm["val_loss_ema"] > 0 and prm["feature_space"].startswith("classifier-digits8-")
    assert "| periodic_row_muon-lr0.01-s0 | ok |" in (out / "results.md").read_text()
    assert record["optimizers"]["periodic_row_muon"]["fd_ratio"] is None  # AdamW has no finished run
    assert list((out / "feature_cache").glob("classifier-*.safetensors"))  # one cache for the grid
    assert not (out / "runs" / prm["name"] / "eval" / "feature_cache").exists()
    assert "periodic_row_muon-lr0.01-s0" in captured.out

    assert quality.main(args) == 1  # finished run skipped, the failing one tried and reported again
    again = json.loads((out / "results.json").read_text())
    assert [r["action"] for r in again["runs"]] == ["restarted", "skipped"]  # its own flags: reused
    assert again["runs"][1]["fd"] == prm["fd"]
    log = (out / "runs" / prm["name"] / quality_runs.LOG_NAME).read_text()
    assert log.count("$ ") == 1 and "dimuon train: done, step 4" in log

    # Other --eval.* settings: the run trained to its last step is scored with them by dimuon eval, not resumed
    # (dimuon train would have no step left to take, so it would not evaluate), and the rerun after that skips it.
    other = list(args)
    other[other.index("--eval.num-samples") + 1] = "30"
    assert quality.main(other) == 1
    evaluated = json.loads((out / "results.json").read_text())["runs"][1]
    assert (evaluated["action"], evaluated["status"], evaluated["eval_step"]) == ("evaluated", "ok", 4)
    assert " -m dimuon.cli eval --run " in evaluated["launched"] and "--num-samples 30" in evaluated["launched"]
    assert evaluated["command"] == prm["command"].replace("--eval.num-samples 20", "--eval.num-samples 30")
    assert quality.main(other) == 1
    assert json.loads((out / "results.json").read_text())["runs"][1]["action"] == "skipped"


@pytest.mark.slow
def test_end_to_end_parallel_jobs_then_resume_with_more_steps(tmp_path):
    out = tmp_path / "bench"
    assert quality.main([*TINY, "--out", str(out), "--optimizers", "adamw", "muon", "--jobs", "2"]) == 0
    first = json.loads((out / "results.json").read_text())
    assert [r["status"] for r in first["runs"]] == ["ok", "ok"]
    assert first["optimizers"]["muon"]["fd_ratio"] > 0 and first["optimizers"]["muon"]["opt_ms_ratio"] > 0
    longer = [a if a != "4" else "6" for a in TINY]  # --steps 6: the run continues from its step-4 checkpoint
    assert quality.main([*longer, "--out", str(out), "--optimizers", "muon"]) == 0
    (muon,) = json.loads((out / "results.json").read_text())["runs"]
    assert (muon["action"], muon["eval_step"], muon["evaluations"], muon["trained_steps"]) == ("resumed", 6, 3, 6)


# --------------------------------------------------------------------------------------------------
# An interrupted grid
# --------------------------------------------------------------------------------------------------

# A stand-in for dimuon train: says it is ready, then waits; SIGUSR1 (its stop) makes it note it and exit 138.
STAND_IN = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    (out / "asked").write_text("SIGUSR1")
    sys.exit(128 + signum)
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGINT, signal.SIG_IGN)
(out / "ready").write_text("")
time.sleep(60)
"""


def test_an_interrupted_grid_starts_no_further_run_and_lets_the_running_one_stop(tmp_path, monkeypatch, capsys):
    def stand_in(cfg, spec, extra, mode="new"):
        run_dir = quality_runs.run_directory(cfg, spec)
        run_dir.mkdir(parents=True, exist_ok=True)
        return [sys.executable, "-c", STAND_IN, str(run_dir)]

    monkeypatch.setattr(quality_runs, "train_command", stand_in)
    cfg = tiny_config(tmp_path, jobs=1)
    specs = quality.expand_grid(cfg)
    assert len(specs) == 4
    first = quality_runs.run_directory(cfg, specs[0])

    def interrupt_once_running() -> None:
        deadline = time.monotonic() + 30
        while not (first / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the grid's own process, as `kill -INT <pid>` would

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        quality_runs.run_grid(cfg, specs, {o: [] for o in cfg.optimizers})
    assert time.monotonic() - start < 30  # the stand-in left on its stop, not after its minute
    assert (first / "asked").read_text() == "SIGUSR1"
    assert [s for s in specs if quality_runs.run_directory(cfg, s).exists()] == specs[:1]
    assert "waiting for 1 running run(s) to save a checkpoint and stop" in capsys.readouterr().err
