"""FD plots of evaluation series: one run against step and active time, the axes every FD figure shares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dimuon.io import save_figure_atomic
from dimuon.metrics.registry import METRICS
from dimuon.metrics.results import ok_entries

__all__ = ["SAVE_KWARGS", "error_bars", "fd_axes", "plot_series"]

# How every FD figure is written (PNG).
SAVE_KWARGS: dict[str, Any] = {"dpi": 120, "bbox_inches": "tight"}


def error_bars(centres: Sequence[float], lows: Sequence[float], highs: Sequence[float]) -> list[list[float]]:
    """Matplotlib's ``xerr``/``yerr`` for bars from each low to each high around each centre; a mean of equal
    values can land an ulp outside them, so the lengths are clamped at 0 (matplotlib refuses negative ones)."""
    return [[max(0.0, c - lo) for c, lo in zip(centres, lows)], [max(0.0, hi - c) for c, hi in zip(centres, highs)]]


def fd_axes(ax: Any, fds: list[float]) -> None:
    """Label and grid an FD axis; a log scale (with plain tick labels) when the values span over 10x."""
    fd = METRICS["fd"]
    ax.set_ylabel(f"{fd.label} ({fd.axis_note})")
    ax.grid(True, alpha=0.3)
    pos = [f for f in fds if f > 0]
    if len(pos) == len(fds) and pos and max(pos) / min(pos) > 10:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)


def plot_series(ev: dict[str, Any], run_name: str, out_dir: Path) -> list[Path]:
    """``fd_vs_step.png`` and ``fd_vs_time.png`` of one series; the reference FD as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = ok_entries(ev["entries"])
    s, ref = ev["settings"], ev.get("reference")
    written = []
    for xkey, xlabel, name in (
        ("step", "training step", "fd_vs_step.png"),
        ("active_time_s", "active training time (s)", "fd_vs_time.png"),
    ):
        pts = [(e[xkey], e["fd"]) for e in entries if e.get(xkey) is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "o-", label=run_name)
        if ref:
            ax.axhline(ref["fd"], ls="--", color="gray", label=f"training data, N={ref['n_fake']}")
        ax.set_xlabel(xlabel)
        ax.set_title(
            f"FD in {s['feature_space']}\n{s['sampler']} {s['sample_steps']}, cfg {s['cfg_scale']:g}, "
            f"N={s['num_samples']}",
            fontsize=9,
        )
        fd_axes(ax, [p[1] for p in pts] + ([ref["fd"]] if ref else []))
        ax.legend(fontsize=8)
        save_figure_atomic(fig, out_dir / name, **SAVE_KWARGS)
        plt.close(fig)
        written.append(out_dir / name)
    return written
