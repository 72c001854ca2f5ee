"""Loss curves and refresh decisions of a run from its JSONL records, as PNGs (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dimuon.io import save_figure_atomic

__all__ = ["plot_losses", "plot_refreshes"]


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


def plot_refreshes(records: Sequence[dict[str, Any]], out_dir: str | Path, title: str = "") -> list[Path]:
    """Share of spectral steps per matrix over training (a heat map: matrices by log window) and overall;
    ``refreshes.png``, or nothing for an optimizer without per-matrix refresh statistics."""
    windows = [r for r in records if r.get("kind") == "train" and "refresh" in r]
    if not windows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(windows[-1]["refresh"]["matrices"])
    grid = [[w["refresh"]["matrices"].get(n, float("nan")) for w in windows] for n in names]
    steps = [w["step"] for w in windows]
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(9, 3 + 0.12 * len(names)),
        dpi=100,
        sharex=True,
        layout="constrained",
        gridspec_kw={"height_ratios": [max(3, 0.12 * len(names)), 1.5]},
    )
    edges = [0, *steps]
    image = top.pcolormesh(edges, range(len(names) + 1), grid, vmin=0, vmax=1, cmap="viridis", shading="flat")
    every = max(1, len(names) // 40)
    top.set_yticks([i + 0.5 for i in range(0, len(names), every)], names[::every], fontsize=6)
    top.invert_yaxis()
    fig.colorbar(image, ax=[top, bottom], label="share of spectral steps", fraction=0.03, pad=0.01)
    bottom.plot(steps, [w["refresh"]["spectral_fraction"] for w in windows], lw=1.2)
    bottom.set_ylim(0, 1.05)
    bottom.set_ylabel("all matrices")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    top.set_title(
        f"{title + ': ' if title else ''}spectral (Newton-Schulz) steps per matrix and log window", fontsize=9
    )
    path = Path(out_dir) / "refreshes.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure_atomic(fig, path)
    plt.close(fig)
    return [path]
