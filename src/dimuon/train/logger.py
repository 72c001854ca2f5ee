"""TensorBoard events mirroring the run's JSONL records (optional: needs the ``tensorboard`` package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TensorBoardLog", "tensorboard_available"]


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
