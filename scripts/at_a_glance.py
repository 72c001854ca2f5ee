"""The README's "at a glance": each optimizer's loss against AdamW and Muon, its optimizer time and its
communication against Muon's, read from the published records and drawn as one figure.

Nothing here is measured or typed in: every number comes from a committed record, so the README's table can be
checked against it (``tests/unit/test_at_a_glance.py``) and regenerated when a record is republished:

    python scripts/at_a_glance.py --plot docs/results/at-a-glance.png --json docs/results/at-a-glance.json

The records: the race's 3 seeds at each optimizer's selected lr and its adaptive ablation (EMA validation loss,
DiT-XS/4 on MNIST, 2000 steps), ``dimuon bench step`` on DiT-S/2 (optimizer time in one process; bytes per
step on 4 FSDP2 ranks, where every Muon-family refresh in that record is the gather refresh), and ``dimuon bench
host`` (the host's time per step in the accelerator form at 140 tiny matrices, DiT-XL/2's count, against torch's
foreach AdamW on the same tensors; periodic optimizers over their period).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
SEEDS = RESULTS / "race" / "seeds.json"
ADAPTIVE = RESULTS / "race" / "adaptive.json"
STEP = RESULTS / "step-dit-s2.json"
HOST = RESULTS / "host" / "host.json"
HOST_MATRICES = 140  # DiT-XL/2: 28 blocks x (qkv, proj, fc1, fc2, adaLN)
HOST_BASELINE = "adamw_foreach"
ADAPTIVE_VARIANT = "adaptive_row_muon/t0.35"  # the default threshold
BASELINE, REFERENCE = "adamw", "muon"
NOT_TIMED_ALIKE = ("torch_muon",)  # its Newton-Schulz ran in bf16, dimuon's in fp32 (the CPU default)


@dataclass(frozen=True)
class Row:
    """One optimizer's line of the table: losses over seeds and ratios measured side by side."""

    key: str
    label: str
    lr: float
    seeds: tuple[float, ...]  # final EMA validation loss of each seed
    opt_x_muon: float | None  # optimizer ms per step over Muon's, one process
    bytes_x_muon: float | None  # bytes per step over Muon's, 4 FSDP2 ranks
    host_x_adamw: float | None = None  # host ms per step over torch's foreach AdamW, 140 tiny matrices

    @property
    def loss(self) -> float:
        """The mean over seeds."""
        return statistics.fmean(self.seeds)


LABELS = {
    "adamw": "AdamW",
    "muon": "Muon",
    "periodic_row_muon": "PeriodicRowMuon K=3",
    "muon_bp": "MuonBP P=5",
    "adaptive_row_muon": "AdaptiveRowMuon",
    "torch_muon": "torch.optim.Muon",
}


def _losses(record: Mapping[str, Any], variant: str) -> tuple[float, ...]:
    """The final EMA validation loss of each finished seed of ``variant`` in a quality record."""
    losses = tuple(
        r["val_loss_ema"]
        for r in record["runs"]
        if r.get("status") == "ok" and r["name"].startswith(variant.replace("/", "-") + "-lr")
    )
    if not losses:
        raise ValueError(f"no finished run of {variant!r} in the record")
    return losses


def _step_rows(record: Mapping[str, Any], world: int) -> dict[str, Mapping[str, Any]]:
    return {r["optimizer"]: r for r in record["rows"] if r["world"] == world and r["status"] == "ok"}


def host_ratios(host: Mapping[str, Any] | None, matrices: int = HOST_MATRICES) -> dict[str, float]:
    """Each eager row's host ms per step over torch's foreach AdamW at ``matrices`` (AdamW's own row is 1)."""
    if host is None:
        return {}
    eager = {
        r["name"]: r["host_ms"]
        for r in host["rows"]
        if r["mode"] == "eager" and r["status"] == "ok" and r["matrices"] == matrices
    }
    if HOST_BASELINE not in eager:
        return {}
    out = {name: ms / eager[HOST_BASELINE] for name, ms in eager.items()}
    out["adamw"] = out.pop(HOST_BASELINE)
    return out


def rows(
    seeds: Mapping[str, Any],
    adaptive: Mapping[str, Any],
    step: Mapping[str, Any],
    host: Mapping[str, Any] | None = None,
) -> list[Row]:
    """The table's rows from the records (see the module docstring)."""
    one, four = _step_rows(step, 1), _step_rows(step, 4)
    host_x = host_ratios(host)

    def ratio(table: Mapping[str, Mapping[str, Any]], name: str, key: str) -> float | None:
        if name not in table or REFERENCE not in table:
            return None
        return table[name][key] / table[REFERENCE][key]

    out = []
    for key in ("adamw", "muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon", "torch_muon"):
        if key == "adaptive_row_muon":
            variant, lr = ADAPTIVE_VARIANT, adaptive["optimizers"][ADAPTIVE_VARIANT]["lr"]
            losses = _losses(adaptive, variant)
        else:
            lr, losses = seeds["optimizers"][key]["lr"], _losses(seeds, key)
        # torch.optim.Muon's step runs bf16 Newton-Schulz where dimuon's CPU default is fp32: not comparable.
        opt = None if key in NOT_TIMED_ALIKE else ratio(one, key, "opt_ms")
        bytes_x = ratio(four, key, "comm_bytes_per_step")
        out.append(Row(key, LABELS[key], lr, losses, opt, bytes_x, host_x.get(key)))
    return out


def _percent(x: float) -> str:
    """A relative change as the README prints it: one decimal, a true minus sign, no signed zero."""
    text = f"{x:+.1%}"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text.replace("-", "−")


def cells(row: Row, table: Sequence[Row]) -> dict[str, str]:
    """The README's cells for one row: loss against AdamW and Muon (mean over seeds), and the two ratios."""
    by_key = {r.key: r for r in table}
    vs = {ref: (row.loss / by_key[ref].loss - 1.0) for ref in (BASELINE, REFERENCE)}
    return {
        "loss vs AdamW": "-" if row.key == BASELINE else _percent(vs[BASELINE]),
        "loss vs Muon": "-" if row.key == REFERENCE else _percent(vs[REFERENCE]),
        "optimizer time vs Muon": "-" if row.opt_x_muon is None else f"{row.opt_x_muon:.2f}x",
        "communication vs Muon": "-" if row.bytes_x_muon is None else f"{row.bytes_x_muon:.2f}x",
        "host time vs AdamW": "-" if row.host_x_adamw is None else f"{row.host_x_adamw:.2f}x",
    }


def plot(table: Sequence[Row], path: Path, machines: str) -> Path:
    """Two panels: the loss of every seed with its mean, and optimizer time and bytes per step against Muon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dimuon.io import save_figure_atomic
    from dimuon.metrics.plots import SAVE_KWARGS

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    ys = range(len(table))
    for y, row in zip(ys, table):
        left.scatter(row.seeds, [y] * len(row.seeds), color="0.55", s=18, zorder=2)
        left.scatter([row.loss], [y], color="C0" if row.key != BASELINE else "C3", marker="|", s=400, zorder=3)
    left.set_yticks(list(ys), [f"{r.label}\n(lr {r.lr:g}, {len(r.seeds)} seeds)" for r in table], fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("final EMA validation loss (lower is better): each seed, and the mean")
    left.set_title("Quality: DiT-XS/4 on MNIST, 2000 steps", fontsize=10)
    left.grid(axis="x", alpha=0.3)

    shown = [r for r in table if r.key != BASELINE and (r.opt_x_muon is not None or r.bytes_x_muon is not None)]
    height = 0.38
    for i, row in enumerate(shown):
        for offset, value, colour, name in (
            (-height / 2, row.opt_x_muon, "C0", "optimizer time, one process"),
            (height / 2, row.bytes_x_muon, "C1", "bytes per step, 4 FSDP2 ranks"),
        ):
            if value is not None:
                right.barh(i + offset, value, height, color=colour, label=name if i == 0 else None)
                right.text(value + 0.02, i + offset, f"{value:.2f}", va="center", fontsize=8)
    right.set_yticks(range(len(shown)), [r.label for r in shown], fontsize=8)
    right.invert_yaxis()
    right.axvline(1.0, color="0.3", lw=0.8, ls="--")
    right.set_xlim(0, 1.2)
    right.set_xlabel("x Muon (lower is cheaper)")
    right.set_title("Cost per step: DiT-S/2, measured side by side", fontsize=10)
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.suptitle(f"dimuon at a glance (CPU measurements: {machines}; GPU timings pending)", fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.2)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def machines(*records: Mapping[str, Any]) -> str:
    """The CPUs the records were measured on, each named once."""
    names = dict.fromkeys(r["machine"].get("cpu_model") or "?" for r in records)
    return ", ".join(names)


def load(path: Path) -> dict[str, Any]:
    """One JSON record."""
    return json.loads(path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    parser.add_argument("--json", type=Path, help="write the rows here, with the records they come from")
    args = parser.parse_args(argv)
    seeds, adaptive, step, host = load(SEEDS), load(ADAPTIVE), load(STEP), load(HOST)
    table = rows(seeds, adaptive, step, host)
    header = [
        "optimizer",
        "lr",
        "loss vs AdamW",
        "loss vs Muon",
        "optimizer time vs Muon",
        "communication vs Muon",
        "host time vs AdamW",
    ]
    print("| " + " | ".join(header) + " |")
    for row in table:
        print("| " + " | ".join([row.label, f"{row.lr:g}", *cells(row, table).values()]) + " |")
    if args.json:
        from dimuon.io import write_json_atomic

        sources = [str(p.relative_to(ROOT)) for p in (SEEDS, ADAPTIVE, STEP, HOST)]
        write_json_atomic(args.json, {"sources": sources, "rows": [asdict(r) | {"loss": r.loss} for r in table]})
    if args.plot:
        plot(table, args.plot, machines(seeds, adaptive, step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
