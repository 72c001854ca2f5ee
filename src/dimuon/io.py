"""Files and runs: atomic writes under one policy, JSONL records, image grids and the run-directory layout.

The lowest layer beside ``dimuon.optim``: it imports nothing else of dimuon, and every module that
writes a file or touches a run directory goes through it.

- Atomic writes (:func:`atomic_path` and the writers built on it): the data goes to a temporary file
  in the target's directory, is flushed and fsynced, renamed over the target, and the directory is
  fsynced; on any failure the temporary file is removed. A reader sees the old file or the new one,
  never half of one, and a kill leaves at most a hidden ``.<name>.*.tmp`` file beside it.
- Strict JSON everywhere: every JSON file and JSONL record goes through :func:`to_json`, which writes
  a non-finite number (NaN, +-inf) as ``null``, so any JSON parser reads what dimuon writes.
- JSONL: :class:`JsonlLog` appends one record per line and flushes it; :func:`read_jsonl` is the one
  parser, and skips a torn line (a write cut short by a kill).
- :class:`RunLayout` names every file of a run directory once, marks a directory as a run
  (:attr:`RunLayout.marker`, written when dimuon creates the run) and tells dimuon's own files from
  anything else there (:meth:`RunLayout.owned_files`, :meth:`RunLayout.clear`); step-numbered files
  (``step_0000250.png``, ``checkpoints/step_0000250/``) are named by :func:`step_name` and parsed by
  :func:`step_of`.
- :func:`unwritable_reason` and :func:`free_bytes` let commands refuse an output they cannot write
  before any work starts.
- :func:`lock_file` and :func:`locked`: ``flock`` on a lock file, for files two processes may update (a run's
  ``eval/results.json``) and for the run directory itself (``dimuon.train.rundir.RunLock``).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import fnmatch
import io
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "OWNED_FILES",
    "SUPERSEDED_SUFFIX",
    "JsonlLog",
    "RunLayout",
    "atomic_path",
    "free_bytes",
    "fsync_dir",
    "json_ready",
    "lock_file",
    "locked",
    "make_grid",
    "move_checkpoint",
    "read_jsonl",
    "read_tensors",
    "remove_checkpoint",
    "remove_steps_after",
    "save_figure_atomic",
    "save_grid",
    "step_name",
    "step_of",
    "to_json",
    "truncate_jsonl",
    "unlock_file",
    "unwritable_reason",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_tensors_atomic",
    "write_text_atomic",
]


# --------------------------------------------------------------------------------------------------
# Strict JSON
# --------------------------------------------------------------------------------------------------


def json_ready(obj: Any) -> Any:
    """``obj`` with non-finite floats as ``None`` and NumPy / one-element torch scalars as Python numbers.

    Containers are copied (tuples become lists, as JSON has them); other objects are left to the
    serializer's ``default``.
    """
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic) or (isinstance(obj, torch.Tensor) and obj.numel() == 1):
        return json_ready(obj.item())
    return obj


def to_json(obj: Any, indent: int | None = None) -> str:
    """Strict JSON text of ``obj``: non-finite numbers become ``null``, paths and other objects strings."""
    return json.dumps(json_ready(obj), indent=indent, default=str, allow_nan=False)


# --------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------


def read_json_object(path: str | Path, flag: str, holding: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in the file ``flag`` names; a ValueError names the flag and the file where it cannot be read,
    is not JSON or holds something other than an object (``holding`` says what it should hold)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not a text file (not UTF-8)") from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} {path} must hold {holding}, not a JSON {type(obj).__name__}")
    return obj


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask (read by setting it, so set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on a clean exit it replaces ``path`` durably.

    For writers that need a file name (``safetensors``, ``torch.save``). The parent directory is
    created if needed; if the block raises, the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_umask())  # a new file's mode under the user's umask (mkstemp's is owner-only)
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented strict JSON (:func:`to_json`) atomically; returns the path."""
    return write_text_atomic(path, to_json(obj, indent=2) + "\n")


def save_figure_atomic(fig: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """Render a matplotlib figure in the format of ``path``'s suffix and write it atomically."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".") or "png", **savefig_kwargs)
    return write_bytes_atomic(path, buf.getvalue())


def write_tensors_atomic(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write tensors as a safetensors file with ``meta`` (JSON) in its metadata, atomically; returns the path."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"meta": to_json(meta)})
    return Path(path)


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the ``meta`` dict of a file written by :func:`write_tensors_atomic`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return tensors, meta


# --------------------------------------------------------------------------------------------------
# JSONL records
# --------------------------------------------------------------------------------------------------


def _parsed_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(line, record)`` of every parseable line; a torn line is skipped."""
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield line, json.loads(line)
        except json.JSONDecodeError:
            continue


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file (none if it does not exist); a torn line (a write cut short) is skipped."""
    path = Path(path)
    return [record for _, record in _parsed_lines(path)] if path.is_file() else []


def truncate_jsonl(path: str | Path, max_step: int) -> int:
    """Keep only records with ``step <= max_step`` (a resumed run rewrites the rest); return how many went."""
    path = Path(path)
    if not path.is_file():
        return 0
    total = len(path.read_text(encoding="utf-8").splitlines())
    kept = [line for line, record in _parsed_lines(path) if int(record.get("step", 0)) <= max_step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))
    return total - len(kept)


class JsonlLog:
    """Append-only JSONL log: one record per line, flushed at once so a killed run keeps what it wrote."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line of strict JSON (:func:`to_json`) and flush it."""
        self._file.write(to_json(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# --------------------------------------------------------------------------------------------------
# Image grids
# --------------------------------------------------------------------------------------------------


def make_grid(images: torch.Tensor, nrow: int | None = None, pad: int = 2, background: float = -1.0) -> np.ndarray:
    """Tile images (N, C, H, W) in [-1, 1] into a uint8 array (rows, cols) or (rows, cols, 3).

    ``nrow`` images per row (default: a square-ish grid), ``pad`` pixels of ``background`` (a value in
    [-1, 1]: -1 black, 1 white) around each. One channel gives grayscale, three RGB; other channel
    counts (latents) show the channel mean in grayscale.
    """
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"expected a non-empty (N, C, H, W) batch, got shape {tuple(images.shape)}")
    x = images.detach().float().cpu()
    if x.shape[1] not in (1, 3):
        x = x.mean(dim=1, keepdim=True)
    n, c, h, w = x.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    rows = math.ceil(n / nrow)
    grid = torch.full((c, rows * (h + pad) + pad, nrow * (w + pad) + pad), float(background), device="cpu")
    for i in range(n):
        r, col = divmod(i, nrow)
        top, left = pad + r * (h + pad), pad + col * (w + pad)
        grid[:, top : top + h, left : left + w] = x[i]
    pixels = ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (C, rows, cols)
    return pixels[0].numpy() if c == 1 else pixels.permute(1, 2, 0).numpy()


def save_grid(
    images: torch.Tensor,
    path: str | Path,
    nrow: int | None = None,
    scale: int = 1,
    pad: int = 2,
    background: float = -1.0,
) -> Path:
    """Write ``make_grid(images, nrow, pad, background)`` as a PNG atomically (``scale``: nearest upscaling)."""
    from PIL import Image

    img = Image.fromarray(make_grid(images, nrow, pad, background))
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), resample=Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return write_bytes_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------------------------------
# Step-numbered names and the run directory
# --------------------------------------------------------------------------------------------------

_STEP_NAME = re.compile(r"^step_(\d{7})$")


def step_name(step: int, suffix: str = "") -> str:
    """``step_0000250`` (plus ``suffix``): the name of what a run writes after ``step`` optimizer steps."""
    return f"step_{step:07d}{suffix}"


def step_of(path: str | Path, suffix: str = "") -> int | None:
    """The step in a name made by :func:`step_name` with this ``suffix``, else None."""
    name = Path(path).name
    if suffix:
        if not name.endswith(suffix):
            return None
        name = name[: -len(suffix)]
    m = _STEP_NAME.match(name)
    return int(m.group(1)) if m else None


def remove_steps_after(directory: str | Path, step: int, suffix: str = ".png") -> list[Path]:
    """Delete the step-numbered files of ``directory`` written after ``step`` (a resumed run rewrites them).

    Only names :func:`step_name` makes are touched; returns the deleted paths.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    doomed = []
    for path in sorted(directory.iterdir()):
        written = step_of(path, suffix)
        if written is not None and written > step and path.is_file():
            doomed.append(path)
    for path in doomed:
        path.unlink()
    return doomed


_STEP_GLOB = "step_" + "[0-9]" * 7
# Checkpoint directories: complete, being assembled, and set aside by a resume from an earlier one.
SUPERSEDED_SUFFIX = ".superseded"
_CHECKPOINT_DIRS = (_STEP_GLOB, ".tmp-" + _STEP_GLOB, _STEP_GLOB + SUPERSEDED_SUFFIX)
# What a checkpoint holds: its manifest, a one-process state, or the DCP files of every rank.
_CHECKPOINT_FILES = ("meta.json", "state.pt", ".metadata", "__*_*.distcp")

# Every file dimuon writes in a run directory, relative to it ("*", "?", "[0-9]" match within one name).
# Atomic writes also leave, while they run, a hidden ".<name>.<random>.tmp" beside each of these.
OWNED_FILES: tuple[str, ...] = (
    ".dimuon-run.json",
    ".dimuon-lock",
    "config.json",
    "metrics.jsonl",
    *(f"checkpoints/{d}/{f}" for d in _CHECKPOINT_DIRS for f in _CHECKPOINT_FILES),
    f"samples/{_STEP_GLOB}.png",
    "plots/loss_vs_step.png",
    "plots/loss_vs_time.png",
    "plots/refreshes.png",
    "tensorboard/events.out.tfevents.*",
    "eval/results.json",
    "eval/results.md",
    "eval/.results.lock",
    "eval/fd_vs_step.png",
    "eval/fd_vs_time.png",
    f"eval/grids/*/{_STEP_GLOB}.png",
    "eval/feature_cache/classifier-*.safetensors",
    "eval/feature_cache/real-*.safetensors",
)


def _matches(parts: tuple[str, ...], pattern: str) -> bool:
    """Whether a relative path (its parts) matches a pattern of :data:`OWNED_FILES`, name by name."""
    wanted = pattern.split("/")
    if len(parts) != len(wanted) or not all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts[:-1], wanted[:-1])):
        return False
    name = parts[-1]
    names = [name]
    if name.endswith(".tmp"):  # a temporary of that name: "<name>.tmp" (DCP) or atomic_path's ".<name>.<random>.tmp"
        names.append(name[: -len(".tmp")])
        if name.startswith("."):
            names.append(name[1 : -len(".tmp")].rsplit(".", 1)[0])
    return any(fnmatch.fnmatchcase(n, wanted[-1]) for n in names)


def remove_checkpoint(path: str | Path) -> bool:
    """Delete a checkpoint directory's files (its manifest, state and DCP files, and their temporaries), then the
    directory where that leaves it empty; return whether it is gone. A file a user put there stays, with it."""
    path = Path(path)
    if not path.is_dir():
        return not path.exists()
    for f in path.iterdir():
        if f.is_file() and any(_matches((f.name,), pattern) for pattern in _CHECKPOINT_FILES):
            f.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()  # only when empty
    return not path.exists()


def move_checkpoint(path: str | Path, target: str | Path) -> None:
    """Rename checkpoint ``path`` to ``target``, replacing the checkpoint there (a user's files in it stay: then
    the checkpoint's files join them)."""
    path, target = Path(path), Path(target)
    if remove_checkpoint(target):
        os.replace(path, target)
        return
    for f in path.iterdir():
        os.replace(f, target / f.name)
    path.rmdir()


def _walk_files(root: Path) -> Iterator[Path]:
    """Every file (or link) under ``root``, in sorted order; directories are descended, links are not."""
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.is_symlink():
            yield from _walk_files(path)
        else:
            yield path


@dataclass(frozen=True)
class RunLayout:
    """Where every file of a run directory lives: ``dimuon train`` writes them, ``dimuon eval`` and the benchmarks
    read them.

    ```
    .dimuon-run.json         the marker: this directory is a dimuon run (written when the run is created)
    .dimuon-lock             locked by the process that trains the run
    config.json              the run's config            metrics.jsonl     one record per line
    checkpoints/step_N/      one directory per checkpoint samples/step_N.png sample grids
    plots/                   loss curves                 tensorboard/      with --tensorboard
    eval/results.json, results.md, fd_vs_*.png, grids/<series>/step_N.png, feature_cache/
    ```

    Only the files of :data:`OWNED_FILES` are dimuon's: a user's ``eval/run_eval.py`` or
    ``plots/fig1.png`` beside them is never touched.
    """

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # The top-level entries a run consists of (directories hold dimuon's files among, possibly, a user's).
    ENTRIES = ("config.json", "metrics.jsonl", "checkpoints", "samples", "plots", "tensorboard", "eval")
    MARKER = ".dimuon-run.json"
    LOCK = ".dimuon-lock"

    @property
    def marker(self) -> Path:
        """The file that makes a directory a dimuon run; written first when a run is created."""
        return self.root / self.MARKER

    @property
    def lock(self) -> Path:
        """The file the process training the run locks (:class:`dimuon.train.rundir.RunLock`); never deleted."""
        return self.root / self.LOCK

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def results(self) -> Path:
        return self.eval / "results.json"

    @property
    def results_lock(self) -> Path:
        """Locked while a process updates ``results.json`` (:func:`dimuon.metrics.results.update_results`)."""
        return self.eval / ".results.lock"

    @property
    def results_md(self) -> Path:
        return self.eval / "results.md"

    @property
    def feature_cache(self) -> Path:
        """The default cache of the feature classifier and the real-set features."""
        return self.eval / "feature_cache"

    def checkpoint(self, step: int) -> Path:
        """Final directory of the checkpoint taken after ``step`` optimizer steps."""
        return self.checkpoints / step_name(step)

    def superseded(self, step: int) -> Path:
        """Where a checkpoint later than a resumed run's start waits until the run replaces it."""
        return self.checkpoints / step_name(step, SUPERSEDED_SUFFIX)

    def sample_grid(self, step: int) -> Path:
        return self.samples / step_name(step, ".png")

    def eval_grids(self, key: str) -> Path:
        """Sample grids of the evaluation series ``key``."""
        return self.eval / "grids" / key

    def eval_grid(self, key: str, step: int) -> Path:
        return self.eval_grids(key) / step_name(step, ".png")

    def entries(self) -> list[Path]:
        """The top-level paths a run consists of (whether they exist or not)."""
        return [self.root / name for name in self.ENTRIES]

    def is_run(self) -> bool:
        """Whether the directory is a dimuon run: it holds the marker."""
        return self.marker.is_file()

    def mark(self, created_by: str) -> Path:
        """Make the directory (created if needed) a dimuon run: write the marker, naming what created it and when."""
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return write_json_atomic(self.marker, {"format": 1, "created_by": created_by, "created": stamp})

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` (inside the run directory) is a file dimuon writes there."""
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return False
        return any(_matches(parts, pattern) for pattern in OWNED_FILES)

    def owned_files(self) -> list[Path]:
        """dimuon's files in the directory (see :data:`OWNED_FILES`), in sorted order."""
        if not self.root.is_dir():
            return []
        return [p for p in _walk_files(self.root) if self.owns(p)]

    def foreign_files(self) -> list[Path]:
        """Everything else in the directory: files dimuon did not write there."""
        if not self.root.is_dir():
            return []
        return [p for p in _walk_files(self.root) if not self.owns(p)]

    def clear(self) -> list[Path]:
        """Delete dimuon's files (and the marker, not the lock) and then whatever directories they leave empty;
        return the deleted files. Anything else (a user's files, and the directories holding them) stays."""
        doomed = [p for p in self.owned_files() if p != self.lock]  # held by the process clearing it
        # The marker last: a clear cut short leaves a run that --overwrite can still clear.
        doomed.sort(key=lambda p: p == self.marker)
        for path in doomed:
            path.unlink()
        for directory in sorted(
            {d for p in doomed for d in p.parents if self.root in d.parents}, key=lambda d: len(d.parts), reverse=True
        ):
            with contextlib.suppress(OSError):
                directory.rmdir()  # only when empty
        return doomed


# --------------------------------------------------------------------------------------------------
# Output checks
# --------------------------------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable_reason(directory: str | Path) -> str | None:
    """Why files cannot be created in ``directory`` (creating it first if needed), or None if they can.

    Checks without writing anything: the directory, or the nearest existing parent it would be created
    in, must be a directory that this process may write to (a read-only file system fails this too).
    """
    directory = Path(directory)
    existing = _nearest_existing(directory)
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it is" if existing == directory.absolute() else f"its parent {existing} is"
        return f"{where} not writable (read-only file system or no write permission)"
    return None


def free_bytes(directory: str | Path) -> int:
    """Free bytes for this process on the file system ``directory`` is (or would be created) on."""
    return shutil.disk_usage(_nearest_existing(Path(directory))).free


# --------------------------------------------------------------------------------------------------
# Locks
# --------------------------------------------------------------------------------------------------

# What flock raises on a file system that takes no locks (some network or FUSE mounts).
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def lock_file(path: str | Path, wait: bool = True) -> int | None:
    """An exclusive ``flock`` on ``path`` (created if missing): its open descriptor, to close to release it.

    ``wait=False`` raises ``BlockingIOError`` when another process holds it. On a file system without locks the
    descriptor is closed and None returned, with a warning. The kernel drops the lock when the process ends, however
    it ends; the file stays (deleting a lock file another process may be opening would break the lock).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError) or e.errno not in NO_LOCKS:
            raise
        warnings.warn(f"{path}: the file system takes no locks ({e}); nothing keeps another process out", stacklevel=2)
        return None
    return fd


def unlock_file(fd: int | None) -> None:
    """Release a lock taken by :func:`lock_file`."""
    if fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (waiting for it) for the ``with`` block."""
    fd = lock_file(path)
    try:
        yield
    finally:
        unlock_file(fd)
