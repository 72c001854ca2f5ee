"""An optimizer built before ``fully_shard`` on a one-rank gloo mesh: its steps change nothing, and say so once."""

from __future__ import annotations

import pytest

from dimuon.bench.launch import run_gloo

from . import user_script_scenarios as sc

pytestmark = pytest.mark.multirank


def test_an_optimizer_built_before_fully_shard_warns_once_that_its_steps_find_no_gradient() -> None:
    (result,) = run_gloo(sc.built_before_fully_shard, 1, timeout_s=120)
    assert result["replaced"] == "DTensor" and result["unchanged"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "found no gradient on any of its 6 parameters" in result["warnings"][0]
    assert "fully_shard" in result["warnings"][0]
