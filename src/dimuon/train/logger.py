"""Run records on disk: atomic JSON files, a line-by-line JSONL log, optional TensorBoard events."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "JsonlLog",
    "TensorBoardLog",
    "atomic_write_bytes",
    "atomic_write_json",
    "read_jsonl",
    "tensorboard_available",
    "truncate_jsonl",
]


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling, flush it to disk, then rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON so that ``path`` always holds either the old or the new file."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, default=str) + "\n").encode())


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; a torn last line (a write cut short) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_jsonl(path: str | Path, max_step: int) -> int:
    """Keep only records with ``step <= max_step`` (a resumed run rewrites the rest); return how many went."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= max_step:
            kept.append(line)
    atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())
    return len(lines) - len(kept)


class JsonlLog:
    """Append-only JSONL log: one record per line, flushed at once so a killed run keeps what it wrote."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLog:
    """Scalars of the JSONL records mirrored to TensorBoard (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind", "train"), int(record["step"])
        for key, value in record.items():
            if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._writer.close()


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can be imported here."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
