"""The golden-steps net: every optimizer's weights after a few steps on a small model with fused, stacked and conv
matrices and an AdamW group, in the CPU and the accelerator form (``devices.cpu_path`` off), across a state_dict
round trip saved mid-period.

``python tests/unit/golden_steps.py`` (with ``PYTHONPATH=src``) writes ``tests/unit/data/golden_steps.pt``; the
values there are the ones the code computed when the net was made, and ``test_optim_golden.py`` holds the code to
them.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dimuon.optim import devices
from dimuon.optim.build import build

DATA = Path(__file__).parent / "data" / "golden_steps.pt"
STEPS, SAVE_AT, NAN_AT = 7, 4, 2  # saved mid-period (k = period = 3); a non-finite gradient at step 2 under "skip"
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "muon": {},
    "periodic_row_muon": {"k": 3, "gamma": 0.5},
    "muon_bp": {"period": 3, "blocks": 2, "block_lr_ratio": 0.7},
    "adaptive_row_muon": {"k_min": 1, "k_max": 4, "threshold": 0.6, "gamma": 0.5},
}
NONFINITE = ("raise", "skip")
FORMS = ("cpu", "accelerator")


def make_params() -> dict[str, torch.Tensor]:
    """The model's parameters: a plain wide and a tall matrix, a conv weight, a fused qkv, a stacked one, AdamW's."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "wide": (6, 10),
        "tall": (10, 6),
        "conv": (4, 3, 3, 3),
        "qkv": (12, 8),
        "stack": (3, 4, 6),
        "bias": (6,),
        "norm": (10,),
    }
    return {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in shapes.items()}


def make_groups(ps: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"params": [ps["wide"], ps["tall"], ps["conv"]], "param_names": ["wide", "tall", "conv"]},
        {"params": [ps["qkv"]], "param_names": ["qkv"], "split_sizes": (4, 4, 4), "col_split_sizes": 2},
        {"params": [ps["stack"]], "param_names": ["stack"], "stacked": True, "split_sizes": (1, 3)},
        {"params": [ps["bias"], ps["norm"]], "param_names": ["bias", "norm"], "algorithm": "adamw"},
    ]


def set_grads(ps: dict[str, torch.Tensor], step: int, nonfinite: str) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in ps.values():
        p.grad = torch.randn(p.shape, generator=g)
    if nonfinite == "skip" and step == NAN_AT:
        ps["qkv"].grad[1, 2] = float("nan")


@contextlib.contextmanager
def form(name: str) -> Iterator[None]:
    """The CPU form as it is, or the accelerator form: the device switch forced off, as the op census does."""
    original = devices.cpu_path
    if name == "accelerator":
        devices.cpu_path = lambda device: False
    try:
        yield
    finally:
        devices.cpu_path = original


def make_optimizer(name: str, ps: dict[str, torch.Tensor], nonfinite: str) -> torch.optim.Optimizer:
    options = dict(OPTIMIZERS[name], lr=0.02, weight_decay=0.1, nonfinite=nonfinite)
    return build(name, make_groups(ps), **options)


def run(name: str, nonfinite: str, form_name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What STEPS steps leave (the weights, each matrix's spectral steps, the steps skipped), and the weights after
    the same steps across a state_dict round trip at SAVE_AT."""
    with form(form_name):
        ps = make_params()
        opt = make_optimizer(name, ps, nonfinite)
        saved = None
        for step in range(STEPS):
            if step == SAVE_AT:
                saved = copy.deepcopy(opt.state_dict())
                weights = {n: p.detach().clone() for n, p in ps.items()}
            set_grads(ps, step, nonfinite)
            opt.step()
        qs = make_params()
        with torch.no_grad():
            for n, q in qs.items():
                q.copy_(weights[n])
        resumed = make_optimizer(name, qs, nonfinite)
        resumed.load_state_dict(saved)
        for step in range(SAVE_AT, STEPS):
            set_grads(qs, step, nonfinite)
            resumed.step()
    stats = {k: (v["spectral"], v["steps"]) for k, v in opt.refresh_stats()["matrices"].items()}
    out = {"weights": {n: p.detach().clone() for n, p in ps.items()}, "spectral": stats, "skipped": opt.skipped_steps}
    return out, {n: q.detach().clone() for n, q in qs.items()}


def compute() -> dict[str, dict[str, Any]]:
    """Today's values, from the CPU form (the two forms agree bit for bit, as the test checks)."""
    return {f"{n}/{nf}": run(n, nf, "cpu")[0] for n in OPTIMIZERS for nf in NONFINITE}


if __name__ == "__main__":
    torch.save(compute(), DATA)
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)", file=sys.stderr)
