"""Generation quality during training (--eval.*): same numbers and series as `dimuon eval`, training untouched."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dimuon.dit import list_checkpoints, load_model_for_eval
from dimuon.eval.run import main as eval_main
from dimuon.io import RunLayout
from dimuon.metrics.generation import SampleSettings, generate_samples, iter_samples
from dimuon.metrics.results import load_results
from dimuon.train import ConfigError, TrainConfig, train
from dimuon.train.config import EvalOptions, config_from_dict, config_to_dict, validate
from dimuon.train.gen_eval import rank_slice
from dimuon.train.run import parse_config

METRICS = ("fd", "precision", "recall", "density", "coverage")
EVAL_FLAGS = ["--num-samples", "30", "--sample-steps", "2", "--cfg", "2.0", "--batch-size", "16", "--no-progress"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One feature cache for the module: the digits classifier trains once."""
    return tmp_path_factory.mktemp("feature-cache")


def eval_options(cache_dir: Path, **overrides: Any) -> EvalOptions:
    base: dict[str, Any] = dict(interval=3, num_samples=30, sample_steps=2, cfg=2.0, batch_size=16, cache_dir=cache_dir)
    return EvalOptions(**{**base, **overrides})


def tiny_config(out: Path, cache_dir: Path, **overrides: Any) -> TrainConfig:
    """DiT-T/2 on 8x8 digits, 6 steps, evaluated at steps 3 and 6 (where checkpoints are taken too)."""
    evals = overrides.pop("eval", {})
    base: dict[str, Any] = dict(
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
        out=str(out),
        eval=eval_options(cache_dir, **evals),
    )
    return TrainConfig(**{**base, **overrides})


def gen_records(run: Path) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "gen_eval"]


def series(run: Path) -> dict[str, Any]:
    (ev,) = load_results(run / "eval" / "results.json")["evaluations"].values()
    return ev


def scores(entries: list[dict[str, Any]]) -> list[tuple]:
    return [(e["step"], *(e[m] for m in METRICS)) for e in entries]


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, dict[str, Any]]:
    run = tmp_path_factory.mktemp("gen-eval") / "run"
    return run, train(tiny_config(run, cache_dir))


# --------------------------------------------------------------------------------------------------
# What the run writes
# --------------------------------------------------------------------------------------------------


def test_run_logs_and_stores_generation_quality_at_the_interval(evaluated_run) -> None:
    run, summary = evaluated_run
    recs = gen_records(run)
    assert [r["step"] for r in recs] == [3, 6]
    assert all(r["feature_space"].startswith("classifier-digits8") and r["num_samples"] == 30 for r in recs)
    ev = series(run)
    assert scores(ev["entries"]) == [(r["step"], *(r[m] for m in METRICS)) for r in recs]
    assert ev["settings"]["num_samples"] == 30 and ev["settings"]["ema"] is True
    assert ev["reference"]["fd"] < min(r["fd"] for r in recs)  # the data itself beats a 6-step model
    assert summary["fd"] == recs[-1]["fd"]
    for name in ("results.md", "fd_vs_step.png", "fd_vs_time.png"):
        assert (run / "eval" / name).is_file(), name
    grids = sorted(p.name for p in (run / "eval" / "grids").rglob("*.png"))
    assert grids == ["step_0000003.png", "step_0000006.png"]


def test_every_file_an_evaluated_run_writes_is_one_dimuon_recognises_as_its_own(evaluated_run, cache_dir) -> None:
    run = RunLayout(evaluated_run[0])
    assert run.foreign_files() == []  # so --overwrite can replace all of it, and nothing else
    cached = sorted(cache_dir.iterdir())  # the files of <run>/eval/feature_cache when the cache is the run's own
    assert len(cached) >= 2 and all(run.owns(run.feature_cache / p.name) for p in cached)


def test_in_training_scores_equal_dimuon_eval_of_the_checkpoints(evaluated_run, cache_dir, tmp_path, capsys) -> None:
    """The EMA weights the loop scores are the ones the checkpoint holds: a fresh `dimuon eval` agrees exactly."""
    run, _ = evaluated_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "eval")
    assert eval_main(["--run", str(copy), "--cache-dir", str(cache_dir), *EVAL_FLAGS]) == 0
    assert series(copy)["settings"] == series(run)["settings"]
    assert scores(series(copy)["entries"]) == scores(series(run)["entries"])


def test_dimuon_eval_with_equal_flags_skips_the_steps_scored_in_training(evaluated_run, cache_dir, capsys) -> None:
    run, _ = evaluated_run
    before = scores(series(run)["entries"])
    assert eval_main(["--run", str(run), "--cache-dir", str(cache_dir), *EVAL_FLAGS]) == 0
    assert "evaluated 0, skipped 2" in capsys.readouterr().out
    assert scores(series(run)["entries"]) == before


def test_raw_weights_are_scored_with_no_ema(cache_dir, tmp_path) -> None:
    run = tmp_path / "raw"
    train(tiny_config(run, cache_dir, steps=3, eval={"ema": False}))
    (entry,) = series(run)["entries"]
    ema_model, _ = load_model_for_eval(run / "checkpoints" / "step_0000003", use_ema=True)
    raw_model, _ = load_model_for_eval(run / "checkpoints" / "step_0000003", use_ema=False)
    assert series(run)["settings"]["ema"] is False
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "eval")
    assert eval_main(["--run", str(copy), "--cache-dir", str(cache_dir), "--no-ema", *EVAL_FLAGS]) == 0
    assert scores(series(copy)["entries"]) == scores([entry])
    assert any(not torch.equal(a, b) for a, b in zip(ema_model.state_dict().values(), raw_model.state_dict().values()))


# --------------------------------------------------------------------------------------------------
# Training is not disturbed; resuming rewrites exactly what came after the checkpoint
# --------------------------------------------------------------------------------------------------


def test_evaluation_does_not_change_training(evaluated_run, cache_dir, tmp_path) -> None:
    run, summary = evaluated_run
    plain = train(tiny_config(tmp_path / "plain", cache_dir, eval={"interval": 0}))
    assert not (tmp_path / "plain" / "eval").exists()
    assert (plain["train_loss"], plain["val_loss"], plain["val_loss_ema"]) == (
        summary["train_loss"],
        summary["val_loss"],
        summary["val_loss_ema"],
    )
    a, _ = load_model_for_eval(run / "checkpoints" / "step_0000006")
    b, _ = load_model_for_eval(tmp_path / "plain" / "checkpoints" / "step_0000006")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_resumed_run_scores_like_an_uninterrupted_one(evaluated_run, cache_dir, tmp_path) -> None:
    run, _ = evaluated_run
    resumed = tmp_path / "resumed"
    train(tiny_config(resumed, cache_dir), stop_after=4)
    assert [e["step"] for e in series(resumed)["entries"]] == [3]
    train(tiny_config(resumed, cache_dir, resume=str(resumed)))
    assert scores(series(resumed)["entries"]) == scores(series(run)["entries"])
    assert [r["step"] for r in gen_records(resumed)] == [3, 6]


def test_resuming_in_place_from_an_earlier_checkpoint_drops_later_scores(evaluated_run, cache_dir, tmp_path) -> None:
    run, _ = evaluated_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_0000006")
    train(tiny_config(copy, cache_dir, steps=4, resume=str(copy), eval={"interval": 0}))
    assert [s for s, _ in list_checkpoints(copy)] == [3, 4]
    assert [e["step"] for e in series(copy)["entries"]] == [3]
    assert not (
        copy
        / "eval"
        / "grids"
        / next(iter(load_results(copy / "eval" / "results.json")["evaluations"]))
        / "step_0000006.png"
    ).exists()
    assert [r["step"] for r in gen_records(copy)] == [3]


# --------------------------------------------------------------------------------------------------
# Splitting the samples over ranks, and the flags
# --------------------------------------------------------------------------------------------------


@given(n=st.integers(0, 500), world=st.integers(1, 16))
def test_rank_slices_tile_the_samples_evenly(n: int, world: int) -> None:
    slices = [rank_slice(n, r, world) for r in range(world)]
    assert slices[0][0] == 0 and slices[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
    sizes = [hi - lo for lo, hi in slices]
    assert max(sizes) - min(sizes) <= 1


def test_sample_slices_concatenate_to_the_full_set() -> None:
    torch.manual_seed(0)
    from dimuon.dit import build_dit

    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    settings = SampleSettings(num_samples=13, sample_steps=2, cfg_scale=2.0)
    full = generate_samples(model, settings, (1, 8, 8), 10, batch_size=5, progress=False)
    parts = [
        torch.cat(list(iter_samples(model, settings, (1, 8, 8), 10, 5, progress=False, start=lo, stop=hi)))
        for lo, hi in (rank_slice(13, r, 3) for r in range(3))
    ]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"sample range \[5, 14\)"):
        next(iter_samples(model, settings, (1, 8, 8), 10, start=5, stop=14))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval.interval", "-1"], "--eval.interval must be an integer >= 0"),
        (["--eval.interval", "5", "--eval.num-samples", "3"], "--eval.num-samples must be >= 4"),
        (["--eval.interval", "5", "--eval.num-real", "5"], "--eval.num-real must be >= 6"),
        (["--eval.interval", "5", "--eval.sample-steps", "0"], "--eval.sample-steps must be >= 1"),
        (["--eval.interval", "5", "--eval.features", "dinov2"], "--eval.features dinov2 needs --eval.dinov2-weights"),
        (
            ["--eval.interval", "5", "--eval.features", "dinov2", "--eval.dinov2-weights", "/nope.pth"],
            "--eval.dinov2-weights /nope.pth: no such file",
        ),
    ],
)
def test_bad_eval_flags_fail_at_start_up_naming_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(parse_config(flags))


def test_eval_flags_are_only_checked_when_evaluation_is_on() -> None:
    validate(parse_config(["--eval.features", "dinov2"]))  # interval 0: nothing to load


def test_eval_options_survive_the_saved_config(tmp_path: Path) -> None:
    cfg = parse_config(["--eval.interval", "7", "--eval.cache-dir", str(tmp_path), "--eval.no-ema"])
    again = config_from_dict(json.loads(json.dumps(config_to_dict(cfg), default=str)))
    assert again == cfg and isinstance(again.eval.cache_dir, Path)
    with pytest.raises(ConfigError, match=r"eval\.bogus"):
        config_from_dict({**config_to_dict(cfg), "eval": {"bogus": 1}})
