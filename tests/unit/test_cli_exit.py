"""``dimuon``'s dispatch: a rank that joined a process group leaves with its command's status, without the
interpreter's teardown; ``--version``; ``dimuon.cli.parse`` returns a command's config without running it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import dimuon
from dimuon.cli import BENCHMARKS, COMMANDS, main, parse

PROGRAM = """
import socket, sys
import torch.distributed as dist
from dimuon.cli import leave_if_distributed
leave_if_distributed(5)  # no process group yet: returns
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
print("joined", flush=True)
sys.stdout.write("buffered")
leave_if_distributed(3)
print("not reached")
"""


def test_a_rank_leaves_with_its_status_and_its_output_flushed():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "joined\nbuffered" and "not reached" not in done.stdout


DESTROYED = """
import socket, sys
import torch.distributed as dist
from dimuon.cli import leave_if_distributed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.destroy_process_group()  # as dimuon train does when it made the group
sys.stdout.write("done")
leave_if_distributed(4)
print("not reached", flush=True)
"""


def test_a_torchrun_rank_whose_group_is_gone_still_leaves_without_teardown():
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
    done = subprocess.run(
        [sys.executable, "-c", DESTROYED], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 4, done.stderr[-2000:]
    assert done.stdout == "done"
    without = {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}
    plain = subprocess.run(
        [sys.executable, "-c", DESTROYED], capture_output=True, text=True, timeout=120, check=False, env=without
    )
    assert "not reached" in plain.stdout  # not a torchrun rank, no group: the command returns as usual


def test_version_is_printed_and_listed_in_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        assert capsys.readouterr().out == f"dimuon {dimuon.__version__}\n"
    assert main(["--help"]) == 0
    assert "dimuon --version" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        parse(["-V"])
    assert info.value.code == 0 and capsys.readouterr().out == f"dimuon {dimuon.__version__}\n"


def test_the_installed_command_prints_the_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dimuon.cli", "--version"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout == f"dimuon {dimuon.__version__}\n", done.stderr[-2000:]


# Every command and benchmark with flags that need no files: parse returns its config and runs nothing.
PARSED = {
    ("train", "--lr", "2e-3"): ("TrainConfig", "lr", 2e-3),
    ("sample", "--ckpt", "RUN", "--n", "8"): ("SampleConfig", "n", 8),
    ("eval", "--run", "RUN", "--every", "2"): ("Config", "every", 2),
    ("groups", "--model", "DiT-S/2", "--rule", "x_embedder=muon"): ("GroupsConfig", "model", "DiT-S/2"),
    ("plan", "--model", "DiT-4B", "--gpus", "64", "--layout", "hsdp"): ("Config", "gpus", 64),
    ("bench", "optimizer", "--model", "DiT-S/2"): ("Config", "model", "DiT-S/2"),
    ("bench", "comm", "--world", "2"): ("Config", "world", 2),
    ("bench", "quality", "--train-args", "--ema-decay 0.9"): ("Config", "train_args", "--ema-decay 0.9"),
    ("bench", "gpu", "--device", "cpu", "--quick"): ("Config", "quick", True),
    ("bench", "step", "--worlds", "1", "--train-args", "--precision bf16"): (
        "Config",
        "train_args",
        "--precision bf16",
    ),
    ("bench", "census", "--fake-worlds", "64"): ("Config", "fake_worlds", (64,)),
    ("bench", "traffic", "--depth", "2"): ("Config", "depth", 2),
    ("bench", "host", "--matrices", "20", "140", "--compile-matrices", "20"): ("Config", "matrices", (20, 140)),
}


def test_parse_returns_every_commands_config_and_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert {argv[0] if argv[0] != "bench" else argv[1] for argv in PARSED} == {*COMMANDS, *BENCHMARKS}
    for argv, (kind, field, value) in PARSED.items():
        cfg = parse(argv)
        assert type(cfg).__name__ == kind and getattr(cfg, field) == value, argv
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--learning-rate", "0.1"], "--learning-rate"),  # the parser refuses the flag
        (["bench", "optimizer", "--peers", "sgd"], "dimuon bench optimizer: error: --peers got unknown peer"),
        (["bench", "census", "--gloo-worlds", "1"], "dimuon bench census: error: --gloo-worlds"),
        (["groups", "--rule", "x=sgd"], "dimuon groups: error: --rule x=sgd"),
        (["plan", "--gpus", "0"], "dimuon plan: error: --gpus must be >= 1"),
        (["train", "--resume", "no-such-run"], "dimuon train: error: no-such-run: no such checkpoint"),
        (["bench", "nosuch"], "dimuon bench: expected one of"),
        (["nosuch"], "dimuon: unknown command 'nosuch'"),
    ],
)
def test_parse_exits_2_with_the_commands_message(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_parse_may_leave_a_resumed_runs_config_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = parse(["train", "--resume", "RUN", "--lr", "1e-2"], saved_defaults=False)
    assert cfg.resume == "RUN" and cfg.lr == 1e-2


def test_main_exit_statuses_of_the_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0 and main(["bench", "--help"]) == 0
    assert main(["bench"]) == 2 and main(["nosuch"]) == 2
    assert "dimuon: unknown command 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--version"], ["plan", "--help"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(argv: list[str]) -> None:
    # `dimuon plan | head`: the pipe's reader is gone before dimuon writes (its end is closed at once, while the
    # child is still importing); dimuon stops with a pipe's status, no traceback.
    child = subprocess.Popen(
        [sys.executable, "-m", "dimuon.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    stderr = child.stderr.read()
    assert child.wait(timeout=120) == 141, stderr[-2000:]
    assert stderr == ""
