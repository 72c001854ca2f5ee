"""``dimuon eval --samples-cache``: a checkpoint's samples are drawn once and reused by a later scoring of the same
checkpoint with the same sampling settings (another feature space or real set), giving the same numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.eval_runs import make_run, run_eval

from dimuon.eval import samples_cache
from dimuon.metrics import generation
from dimuon.metrics.results import load_results

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One feature cache for the module: the digits classifier trains once (a few seconds)."""
    return tmp_path_factory.mktemp("feature-cache")


def _entries(run: Path, num_real: int | None) -> list[dict]:
    series = load_results(run / "eval" / "results.json")["evaluations"].values()
    (found,) = [s for s in series if s["settings"]["num_real"] == num_real]
    return found["entries"]


def _no_sampling(*args, **kwargs):
    raise AssertionError("sampled although the samples were cached")


def test_a_second_scoring_reuses_the_samples_and_scores_them_alike(cache_dir, tmp_path, monkeypatch) -> None:
    run = make_run(tmp_path / "run", steps=(10, 20))
    fresh = Path(shutil.copytree(run, tmp_path / "fresh"))
    samples = tmp_path / "samples"
    assert run_eval(run, cache_dir, "--samples-cache", str(samples), "--no-grid") == 0
    assert len(list(samples.glob(f"*{samples_cache.SUFFIX}"))) == 2  # one file per checkpoint
    assert [e["samples_reused"] for e in _entries(run, 180)] == [False, False]
    # Another real set (a new series): the stored samples are scored, none drawn.
    with monkeypatch.context() as m:
        m.setattr(generation, "iter_samples", _no_sampling)
        assert run_eval(run, cache_dir, "--samples-cache", str(samples), "--no-grid", "--num-real", "120") == 0
    reused = _entries(run, 120)
    assert [e["samples_reused"] for e in reused] == [True, True]
    # The same series drawn afresh, without the cache, in a copy of the run: the same numbers, bit for bit.
    assert run_eval(fresh, cache_dir, "--no-grid", "--num-real", "120") == 0
    drawn = _entries(fresh, 120)
    assert [e["fd"] for e in drawn] == [e["fd"] for e in reused]
    assert [e["precision"] for e in drawn] == [e["precision"] for e in reused]
    assert "samples_reused" not in drawn[0]


def test_other_sampling_settings_or_changed_weights_draw_anew(cache_dir, tmp_path) -> None:
    run = make_run(tmp_path / "run", steps=(10,))
    samples = tmp_path / "samples"
    assert run_eval(run, cache_dir, "--samples-cache", str(samples), "--no-grid") == 0
    assert run_eval(run, cache_dir, "--samples-cache", str(samples), "--no-grid", "--seed", "1") == 0
    assert len(list(samples.glob(f"*{samples_cache.SUFFIX}"))) == 2  # another seed: other images
    (checkpoint,) = (run / "checkpoints").iterdir()
    meta = checkpoint / "meta.json"
    meta.write_text(meta.read_text() + " ")  # any byte of the checkpoint is part of the key
    key = samples_cache.samples_key(checkpoint, _settings(), "cpu")
    assert samples_cache.load_samples(samples, key) is None


def _settings():
    from dimuon.eval.run import Config

    return Config(num_samples=40, sample_steps=3, cfg=2.0)


def test_an_unwritable_samples_cache_is_refused_at_start_up(tmp_path, capsys) -> None:
    run = make_run(tmp_path / "run", steps=(10,))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert run_eval(run, tmp_path / "features", "--samples-cache", str(blocker / "sub")) == 2
    assert "--samples-cache" in capsys.readouterr().err
