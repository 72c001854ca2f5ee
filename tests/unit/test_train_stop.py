"""A stop signal saves a checkpoint at the next logging step and ends the run; the resumed run equals an
uninterrupted one; a second Ctrl-C stops at once; the handlers are put back after the run."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.train_runs import records, tiny_config, without_timing

from dimuon.dit import list_checkpoints
from dimuon.train import train
from dimuon.train.loop import Trainer
from dimuon.train.run import main as train_main
from dimuon.train.stop import STOP_SIGNALS, RunStopped

pytestmark = pytest.mark.usefixtures("one_thread")

OVERRIDES: dict[str, Any] = dict(
    steps=10, log_interval=3, ckpt_interval=0, val_interval=5, optimizer="periodic_row_muon"
)


@pytest.fixture
def signals_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, signal.Signals]]:
    """Send this process the signal mapped to a 0-based step at the start of that step."""
    plan: dict[int, signal.Signals] = {}
    original = Trainer.train_step

    def step(self: Trainer, s: int) -> None:
        if s in plan:
            os.kill(os.getpid(), plan[s])
        original(self, s)

    monkeypatch.setattr(Trainer, "train_step", step)
    yield plan


def state(run: Path, step: int) -> dict[str, Any]:
    return torch.load(run / f"checkpoints/step_{step:07d}/state.pt", weights_only=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_saves_a_checkpoint_at_the_next_logging_step_and_resume_is_exact(
    sig: signal.Signals, signals_at: dict[int, signal.Signals], tmp_path: Path
) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(tiny_config(straight, **OVERRIDES))
    signals_at[3] = sig  # during step 4 (1-based): the next logging step is 6
    with pytest.raises(RunStopped) as info:
        train(tiny_config(stopped, **OVERRIDES))
    assert info.value.status == 128 + sig
    assert str(info.value).startswith(f"stopped by {sig.name} after step 6 of 10, checkpoint ")
    assert info.value.hint == f"continue with dimuon train --resume {stopped}"
    assert [s for s, _ in list_checkpoints(stopped)] == [6]  # --ckpt-interval 0: the stop's checkpoint alone
    assert records(stopped)[-1]["kind"] == "stopped" and records(stopped)[-1]["signal"] == sig.name

    signals_at.clear()
    train(tiny_config(stopped, resume=str(stopped), **OVERRIDES))
    a, b = state(straight, 10), state(stopped, 10)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    # The same log, less the stop's checkpoint and its own record.
    extra = [r for r in records(stopped) if r["kind"] in ("checkpoint", "stopped") and r["step"] == 6]
    assert [r["kind"] for r in extra] == ["checkpoint", "stopped"]
    kept = [r for r in records(stopped) if r not in extra]
    assert without_timing(kept) == without_timing(records(straight))


def test_a_signal_at_a_checkpoint_step_saves_no_second_checkpoint(
    signals_at: dict[int, signal.Signals], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    signals_at[4] = signal.SIGTERM  # during step 5: step 6 logs and saves its checkpoint anyway
    with pytest.raises(RunStopped):
        train(tiny_config(run, **{**OVERRIDES, "ckpt_interval": 6}))
    assert [r["step"] for r in records(run) if r["kind"] == "checkpoint"] == [6]


def test_the_cli_exits_with_128_plus_the_signal_and_says_how_to_continue(
    signals_at: dict[int, signal.Signals], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    signals_at[0] = signal.SIGTERM
    args = ["--model", "DiT-T/4", "--batch-size", "16", "--steps", "6", "--log-interval", "2", "--val-interval", "0"]
    code = train_main([*args, "--sample-count", "2", "--sample-steps", "1", "--no-progress", "--out", str(run)])
    err = capfd.readouterr().err
    assert code == 143, err
    assert "dimuon train: SIGTERM: saving a checkpoint at the next logging step, then stopping" in err
    assert f"dimuon train: stopped by SIGTERM after step 2 of 6, checkpoint {run / 'checkpoints'}" in err
    assert f"dimuon train: continue with dimuon train --resume {run}" in err
    assert train_main(["--resume", str(run), "--no-progress"]) == 0
    assert [s for s, _ in list_checkpoints(run)] == [2, 6]


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(
    signals_at: dict[int, signal.Signals], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    signals_at.update({3: signal.SIGINT, 4: signal.SIGINT})  # the second before the logging step 6
    args = ["--model", "DiT-T/4", "--batch-size", "16", "--steps", "10", "--log-interval", "3", "--val-interval", "0"]
    code = train_main([*args, "--ckpt-interval", "0", "--no-progress", "--out", str(run)])
    assert code == 130
    assert "Ctrl-C again stops it at once" in capfd.readouterr().err
    assert list_checkpoints(run) == []


def test_signals_repeated_other_than_ctrl_c_change_nothing(
    signals_at: dict[int, signal.Signals], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    signals_at.update({3: signal.SIGTERM, 4: signal.SIGUSR1})  # the first one decides
    with pytest.raises(RunStopped) as info:
        train(tiny_config(run, **OVERRIDES))
    assert info.value.signum == signal.SIGTERM and [s for s, _ in list_checkpoints(run)] == [6]


def test_the_handlers_are_put_back_after_the_run(tmp_path: Path) -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    train(tiny_config(tmp_path / "run", steps=2, log_interval=1, val_interval=0, ckpt_interval=0))
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
