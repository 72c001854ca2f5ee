"""Resume: every flag that may change is applied to the running optimizer and EMA, every other one is refused,
and ``--resume`` finds what to continue (a checkpoint, the run in --out, or step 0 of a run without one)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.train_runs import tiny_config

from dimuon.dit import list_checkpoints
from dimuon.optim import build
from dimuon.train import ConfigError, OptimOptions, TrainConfig, train
from dimuon.train.config import (
    FROZEN_ON_RESUME,
    FROZEN_OPTIM_ON_RESUME,
    check_resume_flags,
    config_from_dict,
    config_to_dict,
)
from dimuon.train.distributed import DistEnv
from dimuon.train.loop import Trainer
from dimuon.train.optim_options import OPTION_SPECS, optimizer_kwargs
from dimuon.train.plan import resolve
from dimuon.train.run import main as train_main
from dimuon.train.run import parse_config, with_resume_value

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = DistEnv(rank=0, world=1, device=torch.device("cpu"))

# A value other than the default for every --optim.* flag. A new optimizer option must get one here: the
# test below then shows that a resumed run applies it (or the option is declared frozen on resume).
CHANGED_OPTIM = {
    "weight_decay": 0.1,
    "betas": (0.8, 0.9),
    "eps": 1e-6,
    "amsgrad": True,
    "maximize": True,
    "foreach": False,
    "capturable": True,
    "differentiable": True,
    "fused": True,
    "momentum": 0.9,
    "nesterov": False,
    "lr_scale": "original",
    "ns_coefficients": "polar_express",
    "ns_steps": 4,
    "ns_dtype": "bfloat16",
    "ns_algorithm": "gram",
    "refresh": "gather",
    "bucket_mb": 4.0,
    "comm_dtype": "bfloat16",
    "ns_compile": True,
    "kernels": "torch",
    "k": 7,
    "gamma": 0.5,
    "period": 3,
    "blocks": 2,
    "block_lr_ratio": 0.5,
    "adjust_lr_fn": "original",
    "replica_refresh": "split",
    "threshold": 0.5,
    "k_min": 2,
    "k_max": 6,
    "signal_lag": 1,
}
# A value other than the saved one for every flag that cannot change on resume.
CHANGED_FROZEN = {
    "model": "DiT-T/2",
    "dataset": "digits",
    "data_path": "elsewhere",
    "image_size": 32,
    "channels": 1,
    "num_classes": 12,
    "class_dropout": 0.2,
    "optimizer": "muon_bp",
    "batch_size": 64,
    "seed": 1,
}
OPTIMIZERS = ("adamw", "muon", "periodic_row_muon", "muon_bp", "torch_muon")
GROUP_COUNTERS = {"params", "param_names", "step", "skipped_steps", "initial_lr"}
RUNTIME = ("nonfinite", "ns_compile", "adamw_fused", "kernels", "engine_options")


def tiny(out: Path, **overrides: Any) -> TrainConfig:
    """One step, saved; the smallest validation and sample budgets."""
    base = dict(steps=1, ckpt_interval=0, val_interval=0, val_samples=8, sample_count=10, sample_steps=1, batch_size=8)
    return tiny_config(out, **{**base, **overrides})


def options(opt: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Everything an optimizer runs with: the options of its groups, and how it runs (not saved in its state)."""
    groups = [{k: v for k, v in g.items() if k not in GROUP_COUNTERS} for g in opt.param_groups]
    return groups, {k: getattr(opt, k) for k in RUNTIME if hasattr(opt, k)}


def state_tensors(state: Any) -> list[list[float]]:
    """The tensors of an optimizer's state dict (not its options), as nested lists, in a fixed order."""
    if isinstance(state, dict):
        return [
            t
            for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))
            if k != "param_groups"
            for t in state_tensors(v)
        ]
    return [state.tolist()] if isinstance(state, torch.Tensor) else []


@pytest.fixture(scope="module", params=OPTIMIZERS)
def saved_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    """A one-step run of each optimizer, with every option at its default."""
    cfg = tiny(tmp_path_factory.mktemp(request.param) / "run", optimizer=request.param)
    train(cfg)
    return cfg


def test_every_optim_flag_has_a_changed_value_here() -> None:
    assert set(CHANGED_OPTIM) == set(OPTION_SPECS)
    assert set(CHANGED_FROZEN) == set(FROZEN_ON_RESUME)


def test_changed_optimizer_and_ema_flags_reach_the_running_optimizer_and_ema(
    saved_run: TrainConfig, tmp_path: Path
) -> None:
    name = saved_run.optimizer
    frozen = FROZEN_OPTIM_ON_RESUME.get(name, {})
    changed = {k: v for k, v in CHANGED_OPTIM.items() if name in OPTION_SPECS[k].keywords and k not in frozen}
    cfg = dataclasses.replace(
        saved_run,
        out=str(tmp_path / "fork"),
        resume=saved_run.out,
        steps=2,
        optim=OptimOptions(**changed),
        ema_decay=0.5,
        ema_warmup=False,
    )
    trainer = Trainer(resolve(cfg), CPU)
    saved = torch.load(Path(saved_run.out) / "checkpoints/step_0000001/state.pt", weights_only=True)
    assert trainer.start == 1 and state_tensors(trainer.opt.state_dict()) == state_tensors(saved["optimizer"])

    def fresh(**flags: Any) -> torch.optim.Optimizer:
        return build(name, trainer.model, **optimizer_kwargs(name, OptimOptions(**flags), cfg.lr))

    assert options(trainer.opt) == options(fresh(**changed))
    for flag in changed:  # each flag on its own decides something the resumed optimizer runs with
        reverted = {k: v for k, v in changed.items() if k != flag}
        assert options(fresh(**reverted)) != options(trainer.opt), f"--optim.{flag} did not reach the optimizer"
    assert (trainer.ema.decay, trainer.ema.warmup) == (0.5, False)
    assert trainer.ema.num_updates == 1  # the saved EMA state itself continues
    recorded = json.loads((tmp_path / "fork" / "config.json").read_text())
    assert recorded["ema_decay"] == 0.5 and recorded["optim"]["weight_decay"] == 0.1


def test_every_frozen_flag_is_refused_naming_it_and_its_saved_value() -> None:
    saved = config_to_dict(TrainConfig(dataset="arrays", data_path="data.npz", optimizer="periodic_row_muon"))
    base = config_from_dict(saved)
    for flag, value in CHANGED_FROZEN.items():
        cfg = dataclasses.replace(base, **{flag: value})
        option = "--" + flag.replace("_", "-")
        with pytest.raises(
            ConfigError,
            match=f"^{option} cannot change on resume .*trained with {option} {saved[flag]}, this run asks for {value}",
        ):
            check_resume_flags(cfg, saved, "checkpoint X")
    check_resume_flags(dataclasses.replace(base, data_path="./data.npz", lr=0.5, steps=9, ema_decay=0.1), saved, "X")


def test_optimizer_options_the_saved_state_depends_on_are_refused() -> None:
    saved = config_to_dict(TrainConfig(optimizer="adamw"))
    base = config_from_dict(saved)
    for flag in FROZEN_OPTIM_ON_RESUME["adamw"]:
        cfg = dataclasses.replace(base, optim=OptimOptions(**{flag: CHANGED_OPTIM[flag]}))
        with pytest.raises(ConfigError, match=f"--optim.{flag} cannot change on resume of --optimizer adamw"):
            check_resume_flags(cfg, saved, "X")
    check_resume_flags(dataclasses.replace(base, optim=OptimOptions(amsgrad=False, fused=None)), saved, "X")


def test_resume_through_the_cli_applies_the_new_values_and_records_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(tiny(run))
    code = train_main(
        [
            "--resume",
            str(run),
            "--steps",
            "2",
            "--optim.k",
            "7",
            "--optim.gamma",
            "0.5",
            "--optim.weight-decay",
            "0.1",
            "--ema-decay",
            "0.5",
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    state = torch.load(run / "checkpoints/step_0000002/state.pt", weights_only=True)
    muon_groups = [g for g in state["optimizer"]["param_groups"] if g["algorithm"] == "muon"]
    assert {(g["k"], g["gamma"], g["weight_decay"]) for g in muon_groups} == {(7, 0.5, 0.1)}
    assert state["ema"]["decay"] == 0.5
    meta = json.loads((run / "checkpoints/step_0000002/meta.json").read_text())["config"]
    for recorded in (meta, json.loads((run / "config.json").read_text())):
        assert (
            recorded["optim"]["k"],
            recorded["optim"]["gamma"],
            recorded["optim"]["weight_decay"],
            recorded["ema_decay"],
        ) == (7, 0.5, 0.1, 0.5)

    assert train_main(["--resume", str(run), "--optimizer", "muon_bp", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dimuon train: error: --optimizer cannot change on resume") and "periodic_row_muon" in err
    assert [s for s, _ in list_checkpoints(run)] == [1, 2]


def test_resume_without_a_path_means_the_run_in_out(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert with_resume_value(["--out", str(run), "--resume"]) == ["--out", str(run), "--resume", str(run)]
    assert with_resume_value(["--resume", "--steps", "3"]) == ["--resume", TrainConfig().out, "--steps", "3"]
    assert with_resume_value(["--resume", "other"]) == ["--resume", "other"]
    train(tiny(run, steps=2, lr=0.003))
    cfg = parse_config(["--resume", "--out", str(run), "--steps", "5"])
    assert (cfg.resume, cfg.out, cfg.lr, cfg.steps) == (str(run), str(run), 0.003, 5)


def test_a_run_without_a_checkpoint_resumes_from_step_0_with_its_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=3, ckpt_interval=0, lr=0.003), stop_after=1)  # stopped before its first checkpoint
    assert list_checkpoints(run) == [] and (run / "config.json").is_file()
    with pytest.raises(ConfigError, match=r"already holds a run \(it has no checkpoint yet, so --resume restarts"):
        train(tiny(run, steps=3, lr=0.003))
    cfg = parse_config(["--resume", str(run), "--no-progress"])
    assert cfg.lr == 0.003 and cfg.steps == 3
    summary = train(cfg)
    assert summary["step"] == 3 and [s for s, _ in list_checkpoints(run)] == [3]
    starts = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "start"]
    assert [r["step"] for r in starts] == [0, 0]


def test_the_flags_changed_on_resume_are_recorded_with_their_old_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(tiny(run))
    args = ["--resume", str(run), "--steps", "2", "--lr", "0.002", "--optim.k", "7", "--eval.sample-steps", "3"]
    assert train_main([*args, "--no-progress"]) == 0
    changed = {"--optim.k": [None, 7], "--lr": [0.01, 0.002], "--steps": [1, 2], "--eval.sample-steps": [50, 3]}
    out = capsys.readouterr().out
    assert "dimuon train: changed on resume: --optim.k None -> 7, --lr 0.01 -> 0.002, --steps 1 -> 2, " in out
    starts = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "start"]
    assert "changed" not in starts[0]  # a new run
    assert starts[1]["changed"] == changed  # the config history: what ran before the resume, what runs after
    assert train_main(["--resume", str(run), "--steps", "3", "--no-progress"]) == 0  # the recorded values carry on
    starts = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "start"]
    assert starts[2]["changed"] == {"--steps": [2, 3]}


def test_a_relative_data_path_is_recorded_absolute_and_resumes_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data" / "digits.npz"
    data.parent.mkdir()
    images = np.random.default_rng(0).uniform(-1, 1, (40, 1, 8, 8)).astype(np.float32)
    np.savez(data, images=images, labels=np.arange(40) % 2)
    monkeypatch.chdir(tmp_path)
    flags = ["--model", "DiT-T/4", "--dataset", "arrays", "--batch-size", "8", "--log-interval", "1"]
    flags += ["--val-interval", "0", "--val-samples", "4", "--sample-count", "2", "--sample-steps", "1"]
    flags += ["--ckpt-interval", "1", "--warmup-steps", "1", "--no-progress"]
    assert train_main([*flags, "--data-path", "data/digits.npz", "--steps", "2", "--out", "run"]) == 0
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["data_path"] == str(data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a job script that starts in another directory
    assert train_main(["--resume", str(run), "--steps", "3", "--no-progress"]) == 0
    assert train_main(["--resume", str(run), "--steps", "4", "--data-path", str(data), "--no-progress"]) == 0
    assert [s for s, _ in list_checkpoints(run)] == [1, 2, 3, 4]


def test_a_frozen_flag_named_with_the_value_the_data_set_gave_the_run_is_no_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=2, ckpt_interval=2))  # no --image-size: the data set's own 28
    assert train_main(["--resume", str(run), "--steps", "3", "--image-size", "16", "--no-progress"]) == 2
    assert "was trained with --image-size 28 (its data set's, the flag not given), this run asks for 16" in (
        capsys.readouterr().err
    )
    assert train_main(["--resume", str(run), "--steps", "3", "--image-size", "28", "--no-progress"]) == 0


def test_a_value_the_resumed_run_had_is_not_refused_as_one_the_new_policy_ignores(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=2, ckpt_interval=2, nonfinite="skip", skip_limit=3))
    # --skip-limit 3 comes from the run's config: continued under --nonfinite raise it is simply unused.
    assert train_main(["--resume", str(run), "--steps", "3", "--nonfinite", "raise", "--no-progress"]) == 0
