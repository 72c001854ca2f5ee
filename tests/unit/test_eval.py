"""`dimuon eval` and its core: seeded class-balanced sampling, cached real features, FD/PRDC per checkpoint."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.eval_runs import FAST_FLAGS, make_run, run_eval, tiny_dit

from dimuon.data import build_dataset
from dimuon.data.subsets import balanced_subset
from dimuon.dit import build_dit
from dimuon.dit.checkpoint import list_checkpoints
from dimuon.eval import run as run_module
from dimuon.eval.compare import compare_runs
from dimuon.eval.run import Config, active_time_from_metrics, main, select_checkpoints
from dimuon.io import remove_checkpoint
from dimuon.metrics import generation
from dimuon.metrics.generation import (
    GenerationEvaluator,
    SampleSettings,
    balanced_labels,
    generate_samples,
    load_images,
    sample_noise,
)
from dimuon.metrics.results import load_results
from dimuon.metrics.series import check_device

FAST = SampleSettings(num_samples=40, seed=0, sampler="heun", sample_steps=3, cfg_scale=2.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One feature cache for the module: the digits classifier trains once (a few seconds)."""
    return tmp_path_factory.mktemp("feature-cache")


@pytest.fixture(scope="module")
def evaluator(cache_dir) -> GenerationEvaluator:
    return GenerationEvaluator.for_dataset("digits", {}, FAST, cache_dir=cache_dir, batch_size=16, progress=False)


# --------------------------------------------------------------------------------------------------
# The core (no training code involved)
# --------------------------------------------------------------------------------------------------


def test_labels_cycle_through_classes_and_noise_is_per_sample() -> None:
    assert balanced_labels(23, 10).tolist() == [i % 10 for i in range(23)]
    assert torch.bincount(balanced_labels(1000, 10)).tolist() == [100] * 10
    full = sample_noise(5, 0, 12, (1, 8, 8))
    assert torch.equal(sample_noise(5, 7, 12, (1, 8, 8)), full[7:])  # a slice does not depend on where it starts
    assert torch.equal(sample_noise(5, 0, 12, (1, 8, 8)), full)
    other = sample_noise(6, 0, 12, (1, 8, 8))
    assert not torch.allclose(other, full)  # the seed matters (all of it, not only its low bits)
    assert not torch.allclose(full[0], full[1])
    assert abs(sample_noise(0, 0, 200, (1, 8, 8)).std().item() - 1.0) < 0.05


def test_samples_are_deterministic_and_independent_of_batch_size() -> None:
    model = tiny_dit(0)
    a = generate_samples(model, FAST, (1, 8, 8), 10, batch_size=40, progress=False)
    b = generate_samples(model, FAST, (1, 8, 8), 10, batch_size=7, progress=False)
    c = generate_samples(model, FAST, (1, 8, 8), 10, batch_size=40, progress=False)
    assert a.shape == (40, 1, 8, 8) and a.min() >= -1 and a.max() <= 1
    assert torch.equal(a, c)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    reseeded = SampleSettings(**{**FAST.__dict__, "seed": 1})
    d = generate_samples(model, reseeded, (1, 8, 8), 10, batch_size=40, progress=False)
    assert (a - d).abs().mean() > 0.1


def test_real_set_against_itself_scores_zero_fd_and_perfect_prdc(evaluator) -> None:
    val, _ = load_images(build_dataset("digits", split="val"))
    row = evaluator.score(val)  # the same extractor and cached real features a checkpoint is scored with
    assert row["feature_space"] == evaluator.feature_space and row["feature_space"].startswith("classifier-digits8-")
    assert abs(row["fd"]) < 1e-6
    assert row["precision"] == row["recall"] == row["coverage"] == 1.0
    assert row["density"] == pytest.approx(1.0)
    assert row["n_real"] == row["n_fake"] == len(val) == 180


def test_reference_is_far_below_an_untrained_model(evaluator) -> None:
    ref = evaluator.reference()
    assert ref["n_fake"] == FAST.num_samples
    noise = evaluator.evaluate(build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10))
    # An untrained DiT predicts zero velocity, so its "samples" are the starting noise (clamped).
    assert 0 < ref["fd"] < noise["fd"] / 3
    assert ref["precision"] > 0.7 > noise["precision"]
    for key in (
        "fd",
        "precision",
        "recall",
        "density",
        "coverage",
        "n_real",
        "n_fake",
        "sampler",
        "seed",
        "eval_s",
    ):
        assert key in noise


def test_streamed_evaluation_matches_generate_then_score(evaluator) -> None:
    model = tiny_dit(3)
    row, kept = evaluator.evaluate_with_samples(model, keep=25)
    images = evaluator.generate(model)
    assert torch.equal(kept, images[:25])
    full = evaluator.score(images)
    for m in ("fd", "precision", "recall", "density", "coverage"):
        assert row[m] == pytest.approx(full[m], rel=1e-6, abs=1e-9)
    assert row["eval_s"] >= row["sample_s"] > 0


def test_real_features_are_cached_by_dataset_and_extractor(cache_dir, evaluator, monkeypatch) -> None:
    files = sorted(p.name for p in cache_dir.iterdir())
    assert files == [
        f"{evaluator.feature_space}.safetensors",
        f"real-{generation.dataset_fingerprint('digits', {})}-val-n180-{evaluator.feature_space}.safetensors",
    ]

    def no_extraction(*args, **kwargs):
        raise AssertionError("real features should come from the cache")

    monkeypatch.setattr(generation, "extract_features", no_extraction)
    again = GenerationEvaluator.for_dataset("digits", {}, FAST, cache_dir=cache_dir, progress=False)
    assert torch.equal(again.real_feats, evaluator.real_feats)
    monkeypatch.undo()
    # Part of the split: the classes in turn (the split's first 50 hold no 4 and twelve 2s).
    fewer = GenerationEvaluator.for_dataset("digits", {}, FAST, cache_dir=cache_dir, num_real=50, progress=False)
    val = build_dataset("digits", split="val")
    chosen = balanced_subset(val.labels, 50)
    assert np.bincount(val.labels[chosen]).tolist() == [5] * 10
    torch.testing.assert_close(fewer.real_feats, evaluator.real_feats[torch.from_numpy(chosen)])
    assert fewer.real_subset == "class-balanced" and evaluator.real_subset is None
    assert (
        cache_dir / f"real-{generation.dataset_fingerprint('digits', {})}-val-n50-balanced-"
        f"{evaluator.feature_space}.safetensors"
    ).is_file()


# --------------------------------------------------------------------------------------------------
# Small helpers of the command
# --------------------------------------------------------------------------------------------------


def test_select_every_kth_checkpoint_and_always_the_latest() -> None:
    ckpts = [(s, Path(f"step_{s}")) for s in (10, 20, 30, 40, 50)]
    assert select_checkpoints(ckpts, 1) == ckpts
    assert [s for s, _ in select_checkpoints(ckpts, 2)] == [10, 30, 50]
    assert [s for s, _ in select_checkpoints(ckpts, 3)] == [10, 40, 50]
    assert select_checkpoints([], 2) == []
    assert select_checkpoints(ckpts, 1, latest=True) == [(50, Path("step_50"))]
    assert select_checkpoints([], 1, latest=True) == []
    with pytest.raises(ValueError):
        select_checkpoints(ckpts, 0)


def test_active_time_falls_back_to_the_last_logged_row(tmp_path) -> None:
    rows = [{"step": 0, "active_time_s": 0.0}, {"step": 10, "active_time_s": 4.5}, {"step": 20, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{partial")
    assert active_time_from_metrics(tmp_path, 15) == 4.5
    assert active_time_from_metrics(tmp_path, 10) == 4.5
    assert active_time_from_metrics(tmp_path / "missing", 10) is None


def test_help_lists_defaults_and_unknown_flags_are_rejected(capsys) -> None:
    from dimuon.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main(["eval", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--num-samples",
        "--sampler",
        "--features",
        "--dinov2-weights",
        "--every",
        "--latest",
        "--no-ema",
        "--compare",
    ):
        assert flag in out
    assert "1000" in out and "heun" in out
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["python -m dimuon.eval", "--help"]
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module("dimuon.eval", run_name="__main__")  # python -m dimuon.eval
    finally:
        sys.argv = argv
    assert exit_.value.code == 0 and "--every" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--run", ".", "--bogus-flag", "1"])
    assert exit_.value.code == 2
    assert main(["--run", ".", "--compare", "."]) == 2  # one mode at a time
    assert main(["--run", ".", "--features", "dinov2"]) == 2  # needs weights
    assert main(["--run", ".", "--num-samples", "1"]) == 2
    assert main(["--run", ".", "--device", "foo"]) == 2  # before a feature network is built
    assert "--device must be auto, cpu, cuda or cuda:N, got 'foo'" in capsys.readouterr().err
    assert main(["--run", ".", "--latest", "--every", "2"]) == 2  # one selection at a time
    assert "dimuon eval: error" in capsys.readouterr().err


def test_outputs_that_cannot_be_written_and_runs_without_checkpoints_are_error_lines(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval").write_text("a file where the results directory goes")
    assert main(["--run", str(run)]) == 2
    assert capsys.readouterr().err == (
        f"dimuon eval: error: --run: the results directory {run / 'eval'} cannot be "
        f"written: {run / 'eval'} is a file, not a directory\n"
    )
    assert main(["--compare", str(run), "--out", str(run / "eval" / "cmp")]) == 2
    assert "--out: the output directory" in capsys.readouterr().err
    (run / "eval").unlink()
    assert main(["--run", str(run), "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith(
        f"dimuon eval: error: no complete checkpoints under {run / 'checkpoints'}"
    )


# --------------------------------------------------------------------------------------------------
# End to end over a run directory written by the training code's checkpoint module
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return make_run(tmp_path / "run")


def only_series(run: Path) -> tuple[str, dict]:
    results = load_results(run / "eval" / "results.json")
    assert len(results["evaluations"]) == 1
    return next(iter(results["evaluations"].items()))


def test_eval_writes_results_table_and_plots(run_dir, cache_dir, capsys) -> None:
    assert run_eval(run_dir, cache_dir) == 0
    out = capsys.readouterr().out
    assert "evaluated 3, skipped 0" in out
    key, series = only_series(run_dir)
    s = series["settings"]
    assert s["feature_space"].startswith("classifier-digits8-") and s["num_real"] == 180
    assert (s["num_samples"], s["seed"], s["sampler"], s["sample_steps"], s["cfg_scale"], s["ema"]) == (
        40, 0, "heun", 3, 2.0, True,
    )  # fmt: skip
    entries = series["entries"]
    assert [e["step"] for e in entries] == [10, 20, 30]
    for e in entries:
        assert e["status"] == "ok" and e["feature_space"] == s["feature_space"]
        assert e["n_fake"] == 40 and e["n_real"] == 180
        assert e["fd"] > 0 and 0 <= e["precision"] <= 1 and 0 <= e["recall"] <= 1 and 0 <= e["coverage"] <= 1
        assert e["active_time_s"] is not None and e["wall_s"] > 0 and e["eval_s"] > 0
    assert series["reference"]["fd"] < min(e["fd"] for e in entries)
    md = (run_dir / "eval" / "results.md").read_text()
    assert s["feature_space"] in md and md.count("\n| 10 |") + md.count("\n| 20 |") + md.count("\n| 30 |") == 3
    for name in ("fd_vs_step.png", "fd_vs_time.png", f"grids/{key}/step_0000030.png"):
        assert (run_dir / "eval" / name).read_bytes()[:4] == b"\x89PNG"
    assert not list((run_dir / "eval").glob(".*.tmp"))


def test_second_run_skips_evaluated_checkpoints(run_dir, cache_dir, capsys) -> None:
    assert run_eval(run_dir, cache_dir) == 0
    before = only_series(run_dir)
    capsys.readouterr()
    assert run_eval(run_dir, cache_dir) == 0
    assert "evaluated 0, skipped 3" in capsys.readouterr().out
    assert only_series(run_dir) == before


def test_changed_settings_start_a_new_series(run_dir, cache_dir) -> None:
    assert run_eval(run_dir, cache_dir, "--every", "3") == 0  # steps 10 and 30 (the latest)
    (key0, first), = only_series(run_dir),  # fmt: skip
    assert [e["step"] for e in first["entries"]] == [10, 30]
    assert run_eval(run_dir, cache_dir, "--every", "3", "--seed", "1") == 0
    results = load_results(run_dir / "eval" / "results.json")["evaluations"]
    assert len(results) == 2 and results[key0] == first  # the old series is untouched
    (key1,) = set(results) - {key0}
    assert results[key1]["settings"]["seed"] == 1
    assert run_eval(run_dir, cache_dir, "--latest", "--seed", "2") == 0  # the latest checkpoint alone
    (key2,) = set(load_results(run_dir / "eval" / "results.json")["evaluations"]) - {key0, key1}
    assert [e["step"] for e in load_results(run_dir / "eval" / "results.json")["evaluations"][key2]["entries"]] == [30]
    assert [e["fd"] for e in first["entries"]] != [e["fd"] for e in results[key1]["entries"]]
    assert "seed 1" in (run_dir / "eval" / "results.md").read_text()


def test_same_settings_give_the_same_numbers(cache_dir, tmp_path) -> None:
    runs = [make_run(tmp_path / "run", steps=(10,))]
    for name in ("copy", "copy-batch7"):
        runs.append(Path(shutil.copytree(runs[0], tmp_path / name)))
    assert run_eval(runs[0], cache_dir, "--no-grid") == 0
    assert run_eval(runs[1], cache_dir, "--no-grid") == 0
    assert run_eval(runs[2], cache_dir, "--no-grid", "--batch-size", "7") == 0  # not a setting
    (key, first), (_, again), (key7, batch7) = (only_series(r) for r in runs)
    assert key == key7
    metrics = ("fd", "precision", "recall", "density", "coverage")
    assert [first["entries"][0][m] for m in metrics] == [again["entries"][0][m] for m in metrics]
    # Other batch shapes round differently inside the model, so only the last digits may move.
    assert [batch7["entries"][0][m] for m in metrics] == pytest.approx(
        [first["entries"][0][m] for m in metrics], rel=1e-6
    )


def test_corrupt_checkpoint_is_reported_and_the_others_evaluated(run_dir, cache_dir, capsys, caplog) -> None:
    state = dict(list_checkpoints(run_dir))[20] / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the manifest's SHA-256 no longer matches
    state.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="dimuon"):
        assert run_eval(run_dir, cache_dir) == 0
    assert any("step_0000020" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert "evaluated 2, skipped 0 (already in results.json), failed 1" in capsys.readouterr().out
    _, series = only_series(run_dir)
    status = {e["step"]: e["status"] for e in series["entries"]}
    assert status == {10: "ok", 20: "failed", 30: "ok"}
    assert "failed" in (run_dir / "eval" / "results.md").read_text()


def test_a_scored_checkpoint_that_fails_or_goes_away_later_keeps_its_score(
    cache_dir, tmp_path, capsys, monkeypatch
) -> None:
    run = make_run(tmp_path / "run", steps=(10, 20))
    assert run_eval(run, cache_dir, "--no-grid") == 0
    scores = {e["step"]: e["fd"] for e in only_series(run)[1]["entries"]}
    # The first checkpoint damaged after it was scored: it fails to load before the series is open.
    state = dict(list_checkpoints(run))[10] / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    capsys.readouterr()
    assert run_eval(run, cache_dir, "--no-grid") == 0
    assert "evaluated 0, skipped 2 (already in results.json), failed 0" in capsys.readouterr().out
    assert {e["step"]: (e["status"], e["fd"]) for e in only_series(run)[1]["entries"]} == {
        s: ("ok", fd) for s, fd in scores.items()
    }
    # Pruned by the training run between the listing and the load: gone, not failed, and its score stays.
    make_run(tmp_path / "run", steps=(30,))
    listed = run_module.list_checkpoints(run)

    def listed_then_pruned(where: Path):
        remove_checkpoint(Path(where) / "checkpoints" / "step_0000010")
        return listed

    monkeypatch.setattr(run_module, "list_checkpoints", listed_then_pruned)
    assert run_eval(run, cache_dir, "--no-grid") == 0
    assert "evaluated 1, skipped 1 (already in results.json), failed 0, gone 1" in capsys.readouterr().out
    monkeypatch.undo()
    assert run_eval(run, cache_dir, "--no-grid") == 0
    entries = {e["step"]: e["status"] for e in only_series(run)[1]["entries"]}
    assert entries == {10: "ok", 20: "ok", 30: "ok"}


def test_a_run_given_as_dot_is_named_and_recorded_as_itself(cache_dir, tmp_path, monkeypatch, capsys) -> None:
    run = make_run(tmp_path / "my-run", steps=(10,))
    monkeypatch.chdir(run)
    assert main(["--run", ".", "--cache-dir", str(cache_dir), "--no-grid", *FAST_FLAGS]) == 0
    assert (run / "eval" / "results.md").read_text().startswith("# Generation quality: `my-run`")
    assert json.loads((run / "eval" / "results.json").read_text())["run"] == str(run.resolve())
    assert main(["--compare", ".", "--out", str(tmp_path / "cmp"), *FAST_FLAGS]) == 0
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["runs"][0]["name"] == "my-run"


def test_run_without_checkpoints_fails_cleanly(tmp_path, capsys) -> None:
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert main(["--run", str(tmp_path / "empty"), "--no-progress"]) == 1
    assert "no complete checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "empty" / "eval" / "results.json").exists()


def test_compare_runs_tabulates_best_fd(run_dir, cache_dir, tmp_path, capsys) -> None:
    other = make_run(tmp_path / "other", seed=1)
    (other / "config.json").write_text(json.dumps({"optimizer": "muon"}))
    for run in (run_dir, other):
        assert run_eval(run, cache_dir) == 0
    out = tmp_path / "cmp"
    assert main(["--compare", str(run_dir), str(other), "--out", str(out), *FAST_FLAGS]) == 0
    record = json.loads((out / "compare.json").read_text())
    for r, run in zip(record["runs"], (run_dir, other)):
        _, series = only_series(run)
        assert r["summary"]["best_fd"] == min(e["fd"] for e in series["entries"])
    assert record["target_fd"] == max(r["summary"]["best_fd"] for r in record["runs"])
    assert (out / "compare_fd.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "compare.md").read_text()
    assert "| run | best FD" in md and "| other (muon) |" in md and "| run |" in md
    with pytest.raises(ValueError, match="no series"):
        compare_runs((run_dir,), Config(seed=7), tmp_path / "cmp7")
    # Scored again against a smaller real set: that newer series is not compared with the other run's full one.
    full = only_series(other)[1]["settings"]["num_real"]
    assert run_eval(run_dir, cache_dir, "--num-real", "20") == 0
    assert main(["--compare", str(run_dir), str(other), "--out", str(out), *FAST_FLAGS]) == 2
    err = capsys.readouterr().err
    assert f"different real sets (run: 20 images of digits (class-balanced), other (muon): {full} images" in err
    flags = ["--compare", str(run_dir), str(other), "--out", str(out), "--num-real", str(full), *FAST_FLAGS]
    assert main(flags) == 0
    assert json.loads((out / "compare.json").read_text())["target_fd"] == record["target_fd"]
    # The same name and size, another data set as built (e.g. another root or image size): refused too.
    path = other / "eval" / "results.json"
    results = json.loads(path.read_text())
    for ev in results["evaluations"].values():
        ev["settings"]["dataset"]["kwargs"]["image_size"] = 16
    path.write_text(json.dumps(results))
    assert main(flags) == 2
    assert f"other (muon): {full} images of digits (image_size=16)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "message"),
    [("auto", None), ("cpu", None), ("tpu", "--device must be auto, cpu, cuda or cuda:N, got 'tpu'")]
    + ([("cuda", "--device cuda: CUDA is not available here")] if not torch.cuda.is_available() else [])
    + ([("cuda:99", "--device cuda:99: this machine has")] if torch.cuda.is_available() else []),
)
def test_a_device_the_machine_lacks_is_refused_naming_the_flag(name: str, message: str | None) -> None:
    if message is None:
        check_device(name)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_device(name)
