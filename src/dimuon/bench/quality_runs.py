"""Launching and tracking the training runs of ``dimuon bench quality``: each grid point is one
``dimuon train`` process, its ``--eval.*`` flags spelled out, writing into ``<out>/runs/<name>/``
with its output in ``train.log``. This module builds that command, reads a run directory to decide
what this invocation does with it (skip it when its last step is evaluated, evaluate one trained to its last
step with ``dimuon eval`` when the ``--eval.*`` settings are new to it, resume it from its newest checkpoint,
restart one that never reached a checkpoint, refuse one of another task or trained with other flags), runs the
processes ``--jobs`` at a time and reports each failure with the tail of its log. It is kept apart
from the flag checking and from the report so that the subprocess and run-directory logic stands on
its own, and tests can replace ``launch`` with fabricated runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dimuon.bench.quality_config import Config, RunSpec, run_directory
from dimuon.bench.report import check_train_flags
from dimuon.dit.checkpoint import list_checkpoints
from dimuon.io import RunLayout
from dimuon.metrics.eval_settings import EvalSettings
from dimuon.metrics.results import load_results, ok_entries, pick_series
from dimuon.train.config import ConfigError, changed_on_resume
from dimuon.train.plan import TrainPlan
from dimuon.train.stop import STOP_SIGNALS

LOG_NAME = "train.log"
TAIL_LINES = 15
# dimuon train's exit status after a stop signal saved its state (dimuon.train.stop), and the signal's name.
STOPPED = {128 + sig: sig.name for sig in STOP_SIGNALS}
# What a run in each mode is reported as having been.
ACTIONS = {"new": "started", "resume": "resumed", "restart": "restarted", "evaluate": "evaluated"}
# The launcher of every run's ``dimuon train`` (its flags follow), and of ``dimuon eval``.
TRAIN = (sys.executable, "-m", "dimuon.cli", "train")
EVAL = (sys.executable, "-m", "dimuon.cli", "eval")


@dataclass
class Outcome:
    """What this invocation did with one run (skipped, started, resumed, restarted, evaluated, refused) and how it
    ended."""

    spec: RunSpec
    action: str
    command: list[str] | None = None
    returncode: int | None = None
    seconds: float = 0.0
    error: str | None = None


def eval_interval(cfg: Config) -> int:
    """Steps between evaluations: --eval.interval, or a quarter of the run."""
    return cfg.eval.interval if cfg.eval.interval is not None else max(1, cfg.steps // 4)


def threads_per_run(cfg: Config) -> int | None:
    """--threads, or with several jobs the cores shared out among them (None: torch's own choice)."""
    if cfg.threads is not None or cfg.jobs == 1:
        return cfg.threads
    return max(1, (os.cpu_count() or 1) // cfg.jobs)


def eval_flags(cfg: Config, prefix: str = "--eval.") -> list[str]:
    """Every evaluation setting as a ``dimuon train --eval.*`` flag, spelled out so each run records it; with
    ``prefix`` ``--``, as the flags of ``dimuon eval`` (which has no interval: it scores the checkpoints)."""
    values = {f.name: getattr(cfg.eval, f.name) for f in fields(cfg.eval)}
    values.update(interval=eval_interval(cfg), cache_dir=cfg.eval.cache_dir or cfg.out / "feature_cache")
    if prefix != "--eval.":
        del values["interval"]
    flags: list[str] = []
    for name, value in values.items():
        flag = prefix + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else prefix + "no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def train_command(cfg: Config, spec: RunSpec, extra: Sequence[str], mode: str = "new") -> list[str]:
    """The ``dimuon train`` command of one run; ``mode`` resume continues it, restart replaces its files."""
    run_dir = run_directory(cfg, spec)
    cmd = [
        *TRAIN,
        "--out",
        str(run_dir),
        "--optimizer",
        spec.base,
        "--lr",
        repr(spec.lr),
        "--seed",
        str(spec.seed),
        "--model",
        cfg.model,
        "--dataset",
        cfg.dataset,
        "--steps",
        str(cfg.steps),
        "--batch-size",
        str(cfg.batch_size),
        "--no-progress",
    ]
    threads = threads_per_run(cfg)
    if threads is not None:
        cmd += ["--threads", str(threads)]
    cmd += [*eval_flags(cfg), *extra]
    if mode == "resume":
        cmd += ["--resume", str(run_dir)]
    elif mode == "restart":
        cmd.append("--overwrite")
    return cmd


def train_plan(cfg: Config, spec: RunSpec, extra: Sequence[str]) -> TrainPlan:
    """The run of ``spec`` as ``dimuon train`` reads its flags (:func:`train_command`) at start-up; ValueError
    naming the optimizer's --train-args / --train-args-of and the flag ``dimuon train`` refuses."""
    argv = train_command(cfg, spec, extra)[len(TRAIN) :]
    return check_train_flags(argv, f"--train-args / --train-args-of {spec.optimizer}")


def eval_command(cfg: Config, spec: RunSpec, device: str = "auto") -> list[str]:
    """The ``dimuon eval`` command that scores a run's checkpoints with this grid's ``--eval.*`` settings (on
    ``device``, the one the run trained on), into the series an evaluation during training would have written."""
    cmd = [*EVAL, "--run", str(run_directory(cfg, spec)), *eval_flags(cfg, prefix="--"), "--device", device]
    threads = threads_per_run(cfg)
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return [*cmd, "--no-progress"]


def find_series(run_dir: Path, settings: EvalSettings) -> dict[str, Any] | None:
    """The run's evaluation series made with ``settings``, or None while it has none."""
    path = RunLayout(run_dir).results
    if not path.is_file():
        return None
    try:
        return pick_series(load_results(path), settings, path)[1]
    except ValueError:
        return None


def series_entries(series: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The successfully scored entries of a series, in step order (none without a series)."""
    return ok_entries(series["entries"]) if series else []


def is_finished(run_dir: Path, settings: EvalSettings, steps: int) -> bool:
    """Whether the run's last step is evaluated with ``settings``."""
    return any(e["step"] == steps for e in series_entries(find_series(run_dir, settings)))


def run_mode(run_dir: Path, settings: EvalSettings, steps: int) -> str:
    """done (last step evaluated), evaluate (trained to the last step, which is not evaluated with ``settings``),
    resume (a complete checkpoint before it), restart (files, no checkpoint) or new."""
    if is_finished(run_dir, settings, steps):
        return "done"
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        return "evaluate" if checkpoints[-1][0] >= steps else "resume"
    if run_dir.is_dir() and any(p.name != LOG_NAME for p in run_dir.iterdir()):
        return "restart"
    return "new"


# What may differ between a run's config.json and this grid's command for the run to be reused: how it is
# continued and shown (dimuon train's own HOW_CONTINUED aside), its threads, and its evaluation settings (a run
# trained to its last step is evaluated with the new ones, see :func:`run_mode`); --steps has its own rule.
REUSE_IGNORES = ("--progress", "--threads", "--steps")
REUSE_IGNORES_PREFIX = "--eval."


def saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The config a run directory's ``dimuon train`` recorded (config.json), None without a readable one."""
    path = RunLayout(run_dir).config
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a torn config is rewritten by the restarted run
    return saved if isinstance(saved, dict) else None


def foreign_run(run_dir: Path, cfg: Config, spec: RunSpec, extra: Sequence[str] = ()) -> str | None:
    """Why ``run_dir`` holds a run of another task, grid point, a longer schedule or other ``dimuon train`` flags
    (not to be reused), else None. The run's config.json is held against this grid's command for it
    (:func:`train_command` with ``extra``) as ``dimuon train`` parses it, the fields of :data:`REUSE_IGNORES`
    aside."""
    saved = saved_config(run_dir)
    if saved is None:
        return None
    want = train_plan(cfg, spec, extra).record
    try:
        changed = changed_on_resume(saved, want)
    except (ConfigError, TypeError) as exc:
        return f"{run_dir} holds a config.json that is not one of this dimuon train ({exc}); {_ELSEWHERE}"
    diff = [
        f"{flag} {was!r} (asked for {now!r})"
        for flag, (was, now) in changed.items()
        if flag not in REUSE_IGNORES and not flag.startswith(REUSE_IGNORES_PREFIX)
    ]
    if isinstance(saved.get("steps"), int) and saved["steps"] > cfg.steps:  # more steps continue a run; fewer cannot
        diff.append(f"--steps {saved['steps']} (asked for {cfg.steps})")
    if not diff:
        return None
    return (
        f"{run_dir} holds a run trained with other flags than this grid's for {spec.name}: {', '.join(diff)}; "
        f"{_ELSEWHERE}"
    )


_ELSEWHERE = "use another --out, or delete that directory to train the run again with these flags"


# ``dimuon train`` flags whose value is a path, which differs between checkouts of the same grid
PATH_FLAGS = ("--out", "--eval.cache-dir")


def comparable_command(command: str) -> list[str]:
    """A run's ``dimuon train`` command (shell-quoted) as two checkouts of the same grid spell it alike: without
    the interpreter and with the values of :data:`PATH_FLAGS` blanked."""
    tokens = shlex.split(command)[1:]
    return ["<path>" if flag in PATH_FLAGS else token for flag, token in zip([None, *tokens], tokens)]


def kept_rows(cfg: Config, specs: Sequence[RunSpec], extra: dict[str, list[str]]) -> tuple[dict[str, dict], list[str]]:
    """The rows of ``cfg.keep_rows_of`` kept rather than trained again: finished runs of that record whose
    directory is not here (nothing of theirs but a log), each trained with this grid's command, with the machine
    it trained on; and a note per finished run left out because its command differs."""
    if cfg.keep_rows_of is None:
        return {}, []
    record = load_record(cfg.keep_rows_of)
    earlier = {
        r["name"]: {**r, "machine": r.get("machine") or record.get("machine")}  # where it trained
        for r in record["runs"]
        if r.get("status") == "ok"
    }
    kept: dict[str, dict] = {}
    notes = []
    for spec in specs:
        row = earlier.get(spec.name)
        if row is None or run_mode(run_directory(cfg, spec), cfg.eval, cfg.steps) != "new":
            continue
        want = comparable_command(shlex.join(train_command(cfg, spec, extra[spec.optimizer])))
        if comparable_command(row.get("command") or "") != want:
            notes.append(f"{spec.name} of {cfg.keep_rows_of} is trained again: it was trained with another command")
            continue
        kept[spec.name] = row
    return kept, notes


def load_record(path: Path) -> dict[str, Any]:
    """A ``dimuon bench quality`` record (results.json); ValueError naming the file when it is not one."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read as a results.json: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("runs"), list):
        raise ValueError(f"{path} is not a dimuon bench quality record (it has no list of runs)")
    return record


_RUNNING: set[subprocess.Popen] = set()  # the training processes :func:`launch` waits for, from any thread
_RUNNING_LOCK = threading.Lock()


@contextlib.contextmanager
def _running(proc: subprocess.Popen) -> Iterator[None]:
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)


def signal_running(sig: signal.Signals) -> int:
    """Send ``sig`` to every training process :func:`launch` is waiting for; how many there were. SIGUSR1 asks
    ``dimuon train`` to save a checkpoint at its next logging step and exit; SIGKILL ends it at once."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    return len(running)


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (empty if it does not exist)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def launch(
    cmd: Sequence[str],
    log_path: Path,
    threads: int | None,
    timeout_s: float | None = None,
    env_extra: dict[str, str] | None = None,
) -> int:
    """Run one command with its output appended to ``log_path`` (after a ``$ command`` line); its exit status.

    With ``timeout_s`` the command runs in its own process group, which is killed (the command and every
    process it started) once that many seconds have passed; then ``subprocess.TimeoutExpired`` is raised.
    Without it the process is known to :func:`signal_running` while it runs. ``env_extra`` is added to the
    environment the command inherits.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        if timeout_s is None:
            proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
            with _running(proc):  # an interrupt of the grid asks it to stop (:func:`stop_grid`)
                try:
                    return proc.wait()
                except BaseException:  # interrupted while waiting in the main thread: as subprocess.run does
                    proc.kill()
                    proc.wait()
                    raise
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except BaseException:  # the time is up, or this process is interrupted: the group goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def _settled(cfg: Config, spec: RunSpec, extra: Sequence[str]) -> tuple[Outcome | None, str]:
    """A run's :func:`run_mode`, and its outcome when nothing is to be launched for it (another task's
    directory, or a run trained with other flags: refused; its last step evaluated: skipped)."""
    run_dir = run_directory(cfg, spec)
    foreign = foreign_run(run_dir, cfg, spec, extra)
    if foreign is not None:
        return Outcome(spec, "refused", error=foreign), "refused"
    mode = run_mode(run_dir, cfg.eval, cfg.steps)
    return (Outcome(spec, "skipped", returncode=0) if mode == "done" else None), mode


def execute(cfg: Config, spec: RunSpec, extra: Sequence[str]) -> Outcome:
    """Bring one run to its evaluated last step: skip it if it is there, evaluate it if it is trained that far,
    else start, resume or restart it."""
    settled, mode = _settled(cfg, spec, extra)
    if settled is not None:
        return settled
    run_dir = run_directory(cfg, spec)
    if mode == "evaluate":  # dimuon train has no step left to take, so it would not evaluate
        device = (saved_config(run_dir) or {}).get("device") or "auto"
        cmd, tool = eval_command(cfg, spec, str(device)), "dimuon eval"
    else:
        cmd, tool = train_command(cfg, spec, extra, mode), "dimuon train"
    start = time.perf_counter()
    try:
        code = launch(cmd, run_dir / LOG_NAME, threads_per_run(cfg))
    except OSError as exc:
        return Outcome(spec, ACTIONS[mode], cmd, None, time.perf_counter() - start, f"could not start: {exc}")
    outcome = Outcome(spec, ACTIONS[mode], cmd, code, time.perf_counter() - start)
    if code in STOPPED and mode != "evaluate":
        outcome.error = f"dimuon train stopped on {STOPPED[code]} after a checkpoint; the same command resumes it"
    elif code != 0:
        outcome.error = f"{tool} exited with status {code}"
    elif not is_finished(run_dir, cfg.eval, cfg.steps):
        outcome.error = f"{tool} finished without an evaluation of step {cfg.steps} with these --eval.* settings"
    return outcome


def inspect_run(cfg: Config, spec: RunSpec, extra: Sequence[str] = ()) -> Outcome:
    """What :func:`execute` would find, launching nothing: a finished run is skipped, any other is unfinished."""
    settled, _ = _settled(cfg, spec, extra)
    return settled or Outcome(
        spec, "not run", error=f"not finished (step {cfg.steps} not evaluated; --report-only launches nothing)"
    )


def failure_message(cfg: Config, outcome: Outcome) -> str:
    """A failed run's error, log path and the tail of its log."""
    log = run_directory(cfg, outcome.spec) / LOG_NAME
    tail = log_tail(log) if outcome.command else ""
    text = f"run {outcome.spec.name} failed: {outcome.error}"
    if tail:
        text += f"\n  last lines of {log}:\n" + "\n".join("    " + line for line in tail.splitlines())
    return text


def run_grid(cfg: Config, specs: Sequence[RunSpec], extra: dict[str, list[str]]) -> list[Outcome]:
    """Execute every run, ``--jobs`` at a time, reporting failures as they happen; outcomes in grid order.

    ``extra`` holds each optimizer's further ``dimuon train`` flags (``quality.train_args_of``)."""
    outcomes: dict[RunSpec, Outcome] = {}
    bar = tqdm(total=len(specs), unit="run", desc="quality bench", disable=not cfg.progress)
    pool = ThreadPoolExecutor(max_workers=cfg.jobs)
    try:
        futures = {pool.submit(execute, cfg, s, extra[s.optimizer]): s for s in specs}
        for future in as_completed(futures):
            outcome = future.result()
            outcomes[outcome.spec] = outcome
            if outcome.error:
                tqdm.write(failure_message(cfg, outcome), file=sys.stderr)
            bar.set_postfix_str(f"{outcome.spec.name} {outcome.action}", refresh=False)
            bar.update(1)
    except KeyboardInterrupt:
        stop_grid(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return [outcomes[s] for s in specs]


def stop_grid(pool: ThreadPoolExecutor) -> None:
    """On an interrupt: start no further run, and let the running ones save a checkpoint and stop (a second
    interrupt kills them)."""
    pool.shutdown(wait=False, cancel_futures=True)
    asked = signal_running(signal.SIGUSR1)
    if asked:
        print(
            f"dimuon bench quality: interrupted: waiting for {asked} running run(s) to save a checkpoint and stop "
            "(interrupt again to kill them)",
            file=sys.stderr,
        )
    try:
        pool.shutdown(wait=True)
    except KeyboardInterrupt:
        signal_running(signal.SIGKILL)
        raise
