"""torchtitan's optimizer container over pipeline stages: each gloo rank holds one model part (its parameters plain
or sharded over the stage's own data-parallel mesh, never over ``pp``), two stages of one or two data-parallel ranks
each; every stage follows one process stepping both parts, and a resume from torchtitan's checkpoint manager
continues it bitwise equal."""

from __future__ import annotations

import pytest
import torch

from dimuon.bench.launch import run_gloo

pytest.importorskip("torchtitan.components.optimizer", reason="needs torchtitan (see README: torchtitan)")

from . import pipeline_scenarios as sc

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
CASES = [(2, "plain"), (2, "fsdp"), (4, "fsdp")]  # (ranks: 2 stages x data-parallel ranks, layout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {
        world: run_gloo(
            sc.stages,
            world,
            str(tmp_path_factory.mktemp(f"pipeline{world}")),
            tuple(layout for w, layout in CASES if w == world),
            timeout_s=300,
        )
        for world in sorted({w for w, _ in CASES})
    }


@pytest.fixture(scope="module")
def single():
    return sc.one_process()


@pytest.mark.parametrize(("world", "layout"), CASES)
def test_each_stage_follows_one_process_stepping_its_part(runs, single, world, layout) -> None:
    ranks = [rank[layout]["straight"] for rank in runs[world]]
    last = [r["losses"] for r in ranks[world // sc.STAGES :]]  # the last stage's ranks, each on its batch slice
    assert [sum(step) / len(step) for step in zip(*last)] == pytest.approx(single["losses"], rel=1e-5)
    if layout == "fsdp":
        assert all(any("Shard(dim=0)" in p for p in r["placements"]) for r in ranks)
    for r in ranks:  # every collective, the vote included, within the stage: nothing over pp or the world
        assert set(r["comm"]) <= {"dp_shard"}, r["comm"]
        if world // sc.STAGES > 1:
            assert r["comm"]["dp_shard"]["all_reduce[check]"] == sc.STEPS  # one vote per step
    seen = set()
    for r in ranks:
        for name, value in r["params"].items():
            assert (value - single["params"][name]).abs().max().item() <= 1e-5, name
            seen.add(name)
    assert seen == set(single["params"])  # the stages hold every parameter between them
    moved = sc.model_part(0).blocks["0"].fc1.weight
    assert not torch.allclose(single["params"]["blocks.0.fc1.weight"], moved)  # the steps moved the weights


@pytest.mark.parametrize(("world", "layout"), CASES)
def test_a_resume_from_the_checkpoint_continues_each_stage_bitwise(runs, world, layout) -> None:
    for rank in runs[world]:
        straight, resumed = rank[layout]["straight"], rank[layout]["resumed"]
        assert resumed["phases"] == [sc.SAVE_AT]  # every group continues at the saved phase
        assert resumed["losses"] == straight["losses"][sc.SAVE_AT :]
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), name
