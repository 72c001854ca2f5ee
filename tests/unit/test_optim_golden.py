"""The optimizers held to the values they computed when the golden-steps net was made (``golden_steps.py`` says how
to regenerate them): every optimizer, both non-finite policies, the CPU and the accelerator form, straight through
and across a state_dict round trip saved mid-period. Bit for bit: the step's order of float ops is part of what it
guards."""

from __future__ import annotations

import warnings

import pytest
import torch
from golden_steps import DATA, FORMS, NONFINITE, OPTIMIZERS, run

GOLDEN = torch.load(DATA)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("nonfinite", NONFINITE)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_keep_their_values(name: str, nonfinite: str, form: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, resumed = run(name, nonfinite, form)
    want = GOLDEN[f"{name}/{nonfinite}"]
    assert got["spectral"] == want["spectral"]
    assert got["skipped"] == want["skipped"] == (1 if nonfinite == "skip" else 0)
    for key, value in want["weights"].items():
        assert torch.equal(got["weights"][key], value), key
        assert torch.equal(resumed[key], value), f"{key} after the round trip"


def test_the_net_covers_every_step_kind() -> None:
    """Each schedule took both of its kinds (spectral and the other) on some matrix in the stored run."""
    for name in OPTIMIZERS:
        counts = GOLDEN[f"{name}/raise"]["spectral"]
        assert {"wide", "tall", "conv", "qkv", "stack"} <= set(counts)
        spectral = sum(s for s, _ in counts.values())
        steps = sum(n for _, n in counts.values())
        assert 0 < spectral <= steps
        assert (spectral < steps) == (name != "muon"), name
