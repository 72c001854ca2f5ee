"""How fast each matrix's spectral direction goes stale during a real run, and which cheap signal tells.

Trains the ``dimuon train`` demo (DiT-XS/4 on MNIST, 1000 steps) with ``PeriodicRowMuon`` at ``k=1``, so a
fresh spectral direction ``O_t = NS(U_t)`` exists at every step. Every ``--anchor`` steps each matrix keeps
a reference (its Nesterov momentum ``U_s`` and direction ``O_s``), and at every step after it the probe
records, per matrix:

- ``truth``: ``1 - cos(O_t, O_s)``, how far the spectral direction has moved since the reference
  (needs a Newton-Schulz per step: what an adaptive schedule cannot afford);
- ``drift``: ``||U_t - U_s|| / ||U_s||``, the relative change of the momentum (reference: ``U_s``);
- ``drift_bf16``: the same with ``U_s`` stored in bf16 (half the reference memory);
- ``rownorm_misalign``: ``1 - cos(RowNorm(U_t), O_s)`` (reference: ``O_s``);
- ``align_drop``: ``1 - cos(U_t, O_s) / cos(U_s, O_s)`` (reference: ``O_s`` and one scalar);
- ``rownorm_gap``: ``1 - cos(RowNorm(U_t), O_t)``, how far a RowNorm step is from the spectral one (context).

The raw records go to ``<out>/staleness.jsonl``; the summary (correlations with ``truth`` across matrices
at equal age, mean curves by layer type, depth and phase of training) to ``--json`` and the plots to
``--png-prefix``. ``--analyze-only`` rereads the raw records. Command of the committed results:

    python scripts/staleness_study.py --out runs/staleness --threads 1 \
        --json docs/results/staleness-mnist-xs4.json --png-prefix docs/results/staleness-mnist-xs4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dimuon.io import read_jsonl, save_figure_atomic, write_text_atomic
from dimuon.optim.linalg import newton_schulz, row_normalize

CANDIDATES = ("drift", "drift_bf16", "rownorm_misalign", "align_drop")
SIGNALS = ("truth", *CANDIDATES, "rownorm_gap")
LAYER_TYPES = ("qkv", "proj", "fc1", "fc2", "adaLN", "t-MLP")
PHASES = ((0, 100), (100, 400), (400, 1000))
PROBE_AGE = 4  # the age whose value per anchor window the evolution plot shows


def layer_of(name: str) -> tuple[str, int]:
    """(layer type, depth) of a DiT parameter name; the final layer's adaLN sits one block past the last."""
    if name.startswith("t_embedder"):
        return "t-MLP", -1
    if name.startswith("final_layer"):
        return "adaLN", 99
    depth = int(re.match(r"blocks\.(\d+)\.", name).group(1))
    for key, kind in (("qkv", "qkv"), ("attn.proj", "proj"), ("fc1", "fc1"), ("fc2", "fc2"), ("adaLN", "adaLN")):
        if key in name:
            return kind, depth
    raise ValueError(f"unknown layer {name!r}")


def _cos(a: Tensor, b: Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp(min=1e-30))


def _ratio(a: float, b: float) -> float:
    return a / b if b != 0 else math.inf


def _drift(u: Tensor, ref: Tensor) -> float:
    ref = ref.float()
    return _ratio(float((u - ref).square().sum().sqrt()), float(ref.square().sum().sqrt()))


class Probe:
    """A step pre-hook: recomputes ``U_t`` and ``O_t`` as the optimizer will, and writes the signals."""

    def __init__(self, opt: torch.optim.Optimizer, anchor: int, sink) -> None:
        self.group = next(g for g in opt.param_groups if g["algorithm"] == "muon")
        self.opt, self.anchor, self.sink = opt, anchor, sink
        self.ref: dict[str, Any] | None = None

    def momenta(self) -> list[Tensor]:
        """The Nesterov momentum each matrix will see at this step, 2-D."""
        g, out = self.group, []
        beta = g["momentum"]
        for p in g["params"]:
            m = self.opt.state[p]["momentum_buffer"]
            grad = p.grad.to(m.dtype)
            m_next = m.lerp(grad, 1.0 - beta)
            u = grad.lerp(m_next, beta) if g["nesterov"] else m_next
            out.append(u.reshape(u.shape[0], -1))
        return out

    def __call__(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = self.group["step"]
        us = self.momenta()
        os_ = [newton_schulz(u, steps=self.group["ns_steps"], dtype=torch.float32) for u in us]
        rs = [row_normalize(u) for u in us]
        if self.ref is not None:
            values: dict[str, list[float]] = defaultdict(list)
            for i, (u, o, r) in enumerate(zip(us, os_, rs)):
                u_ref, o_ref = self.ref["u"][i], self.ref["o"][i]
                values["truth"].append(1.0 - _cos(o, o_ref))
                values["drift"].append(_drift(u, u_ref))
                values["drift_bf16"].append(_drift(u, self.ref["u_bf16"][i]))
                values["rownorm_misalign"].append(1.0 - _cos(r, o_ref))
                values["align_drop"].append(1.0 - _ratio(_cos(u, o_ref), self.ref["cos_uo"][i]))
                values["rownorm_gap"].append(1.0 - _cos(r, o))
            self.sink.write(
                json.dumps(
                    {
                        "step": step,
                        "age": step - self.ref["step"],
                        "lr": float(self.group["lr"]),
                        **{k: [round(v, 6) for v in vs] for k, vs in values.items()},
                    }
                )
                + "\n"
            )
        if step % self.anchor == 0 and step > 0:  # at step 0 adaLN-Zero leaves most momenta at zero
            self.ref = {
                "step": step,
                "u": [u.clone() for u in us],
                "o": os_,
                "u_bf16": [u.to(torch.bfloat16) for u in us],
                "cos_uo": [_cos(u, o) for u, o in zip(us, os_)],
            }


def run(args: argparse.Namespace) -> list[str]:
    """Train the demo with the probe attached; returns the Muon matrices' names."""
    from dimuon.train.config import TrainConfig
    from dimuon.train.distributed import setup
    from dimuon.train.loop import Trainer
    from dimuon.train.optim_options import OptimOptions
    from dimuon.train.plan import resolve

    cfg = TrainConfig(
        out=str(args.out),
        steps=args.steps,
        optimizer="periodic_row_muon",
        optim=OptimOptions(k=1),
        threads=args.threads,
        overwrite=True,
        progress=not args.no_progress,
        ckpt_interval=0,
    )
    plan = resolve(cfg)
    trainer = Trainer(plan, setup(cfg.device, cfg.threads))
    with open(Path(args.out) / "staleness.jsonl", "w") as sink:
        probe = Probe(trainer.opt, args.anchor, sink)
        names = list(probe.group["param_names"])
        sink.write(json.dumps({"kind": "header", "names": names, "anchor": args.anchor, "config": plan.record}) + "\n")
        trainer.opt.register_step_pre_hook(probe)
        trainer.fit()
    return names


# ------------------------------------------------------------------------------------------------ analysis


def _ranks(x: Tensor) -> Tensor:
    return x.argsort().argsort().double()


def _pearson(a: Tensor, b: Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp(min=1e-30))


def analyze(raw: Path, anchor_default: int) -> dict[str, Any]:
    records = read_jsonl(raw)
    header = next(r for r in records if r.get("kind") == "header")
    rows = [r for r in records if "age" in r]
    names = header["names"]
    layers = [layer_of(n) for n in names]
    data = {k: torch.tensor([r[k] for r in rows], dtype=torch.float64) for k in SIGNALS}  # (steps, matrices)
    steps = torch.tensor([r["step"] for r in rows])
    ages = torch.tensor([r["age"] for r in rows])
    summary: dict[str, Any] = {
        "anchor": header.get("anchor", anchor_default),
        "matrices": names,
        "layers": [list(x) for x in layers],
        "steps": int(steps.max()) + 1,
    }
    # Does a candidate rank the matrices by staleness as the truth does? Spearman across the matrices at
    # each step (equal age for all of them), averaged over steps; and Pearson over every (step, matrix).
    truth = data["truth"]
    corr: dict[str, Any] = {}
    for key in (*CANDIDATES, "rownorm_gap"):
        per_step = [_pearson(_ranks(data[key][i]), _ranks(truth[i])) for i in range(len(rows))]
        by_age = {}
        for a in sorted(set(ages.tolist())):
            sel = [i for i in range(len(rows)) if ages[i] == a]
            by_age[str(a)] = round(sum(per_step[i] for i in sel) / len(sel), 4)
        corr[key] = {
            "spearman_across_matrices_mean": round(sum(per_step) / len(per_step), 4),
            "spearman_across_matrices_by_age": by_age,
            "pearson_all": round(_pearson(data[key].flatten(), truth.flatten()), 4),
            "spearman_all": round(_pearson(_ranks(data[key].flatten()), _ranks(truth.flatten())), 4),
        }
    corr["drift_bf16_vs_drift_max_abs_diff"] = float((data["drift_bf16"] - data["drift"]).abs().max())
    summary["correlation_with_truth"] = corr
    # Mean signal per layer type, phase of training and age (the curves of the age plot).
    curves: dict[str, Any] = {}
    for key in SIGNALS:
        per_type: dict[str, Any] = {}
        for kind in LAYER_TYPES:
            cols = [j for j, (k, _) in enumerate(layers) if k == kind]
            per_phase = {}
            for lo, hi in PHASES:
                pts = {}
                for a in sorted(set(ages.tolist())):
                    sel = (ages == a) & (steps >= lo) & (steps < hi)
                    if sel.any():
                        pts[str(a)] = round(float(data[key][sel][:, cols].mean()), 5)
                per_phase[f"{lo}-{hi}"] = pts
            per_type[kind] = per_phase
        curves[key] = per_type
    summary["mean_by_type_phase_age"] = curves
    # The value at PROBE_AGE in every anchor window, per matrix (the evolution plot).
    sel = ages == PROBE_AGE
    summary["at_age"] = {
        "age": PROBE_AGE,
        "steps": steps[sel].tolist(),
        **{k: {n: [round(v, 5) for v in data[k][sel][:, j].tolist()] for j, n in enumerate(names)} for k in SIGNALS},
    }
    # Ages at which each signal first passes a level, per matrix (what a threshold rule would pick).
    return summary


def plot(summary: dict[str, Any], prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, layers = summary["matrices"], [tuple(x) for x in summary["layers"]]
    written = []
    # 1. Evolution over training, at a fixed age, by layer type (columns) and depth (colour).
    shown = ("truth", "drift", "rownorm_misalign", "align_drop", "rownorm_gap")
    fig, axes = plt.subplots(
        len(shown),
        len(LAYER_TYPES),
        figsize=(3.0 * len(LAYER_TYPES), 2.3 * len(shown)),
        dpi=70,
        sharex=True,
        sharey="row",
    )
    at = summary["at_age"]
    depths = sorted({d for _, d in layers if d >= 0})
    cmap = plt.get_cmap("viridis")
    for row, key in enumerate(shown):
        for col, kind in enumerate(LAYER_TYPES):
            ax = axes[row][col]
            for name, (k, d) in zip(names, layers):
                if k != kind:
                    continue
                colour = "black" if d < 0 else cmap(depths.index(d) / max(1, len(depths) - 1)) if d in depths else "red"
                label = "t-MLP" if d < 0 else ("final" if d == 99 else f"block {d}")
                ax.plot(at["steps"], at[key][name], color=colour, lw=1, label=label)
            if row == 0:
                ax.set_title(kind)
            if col == 0:
                ax.set_ylabel(key, fontsize=9)
            if row == len(shown) - 1:
                ax.set_xlabel("step")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[0][LAYER_TYPES.index("adaLN")].legend(fontsize=6, ncol=2)
    fig.suptitle(
        f"Signals at age {at['age']} (steps since the reference) over training; DiT-XS/4 on MNIST, "
        "Muon steps (PeriodicRowMuon k=1)",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(f"{prefix}-evolution.png")
    save_figure_atomic(fig, path)
    plt.close(fig)
    written.append(path)
    # 2. Growth with age, by layer type, early and late in training.
    curves = summary["mean_by_type_phase_age"]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.4 * len(shown), 3.2), dpi=80)
    styles = {f"{lo}-{hi}": s for (lo, hi), s in zip(PHASES, (":", "--", "-"))}
    for ax, key in zip(axes, shown):
        for t_i, kind in enumerate(LAYER_TYPES):
            for phase, pts in curves[key][kind].items():
                ax.plot(
                    [int(a) for a in pts],
                    list(pts.values()),
                    styles[phase],
                    color=f"C{t_i}",
                    label=f"{kind}" if phase == f"{PHASES[-1][0]}-{PHASES[-1][1]}" else None,
                )
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("age (steps since the reference)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, title="steps 400-1000 (solid);\n100-400 dashed, 0-100 dotted", title_fontsize=6)
    fig.tight_layout()
    path = Path(f"{prefix}-vs-age.png")
    save_figure_atomic(fig, path)
    plt.close(fig)
    written.append(path)
    return written


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/staleness"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--anchor", type=int, default=16, help="steps between references")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--analyze-only", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="summary JSON (default <out>/staleness-summary.json)")
    parser.add_argument("--png-prefix", default=None, help="plot path prefix (default <out>/staleness)")
    args = parser.parse_args()
    if not args.analyze_only:
        run(args)
    summary = analyze(args.out / "staleness.jsonl", args.anchor)
    summary["machine"] = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "command": "python scripts/staleness_study.py " + " ".join(a for a in __import__("sys").argv[1:]),
    }
    out_json = args.json or args.out / "staleness-summary.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_json, json.dumps(summary, indent=1) + "\n")
    for p in plot(summary, args.png_prefix or str(args.out / "staleness")):
        print(p)
    corr = summary["correlation_with_truth"]
    for key in (*CANDIDATES, "rownorm_gap"):
        print(
            f"{key:18s} spearman across matrices {corr[key]['spearman_across_matrices_mean']:+.3f}  "
            f"pearson all {corr[key]['pearson_all']:+.3f}"
        )
    print("max |drift_bf16 - drift|:", corr["drift_bf16_vs_drift_max_abs_diff"])


if __name__ == "__main__":
    main()
