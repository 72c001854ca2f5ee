"""Loss curves of a run from its JSONL records, as PNGs (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dimuon.io import save_figure_atomic

__all__ = ["plot_losses"]


def _series(records: Sequence[dict[str, Any]], kind: str, key: str, x: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[key]) for r in records if r.get("kind") == kind and r.get(key) is not None and x in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot_losses(records: Sequence[dict[str, Any]], out_dir: str | Path, title: str = "") -> list[Path]:
    """Train and validation loss against step and against training time; returns the PNG paths.

    Training time is ``active_time_s``: wall-clock time spent in training steps, without
    validation, sampling and checkpointing, so that optimizers compare on the time they cost.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for x, xlabel, name in (
        ("step", "step", "loss_vs_step.png"),
        ("active_time_s", "training wall-clock time (s, without eval/sampling/checkpoints)", "loss_vs_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for kind, key, label, style in (
            ("train", "loss", "train loss", {"alpha": 0.6, "lw": 1}),
            ("val", "val_loss", "val loss", {"marker": "o", "lw": 1.5}),
            ("val", "val_loss_ema", "val loss (EMA weights)", {"marker": "s", "lw": 1.5}),
        ):
            xs, ys = _series(records, kind, key, x)
            if xs:
                ax.plot(xs, ys, label=label, **style)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("flow-matching loss")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if title:
            ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        save_figure_atomic(fig, out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written
