"""The non-finite vote on 2 gloo ranks with FSDP2: no host read inside ``step()`` with ``nonfinite="skip"``
(AdaptiveRowMuon's read of its staleness signals apart), one with ``"raise"``, on finite gradients and on NaN on one
rank; a skipped or raised step leaves every rank's tensors bitwise as they were; and the vote is one 4-byte
all-reduce over the world, also on a 2-D mesh whose two groups used to take one each."""

import pytest

from dimuon.bench.launch import run_gloo

from . import nonfinite_scenarios as ns

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results():
    return run_gloo(ns.step_reads, 2, timeout_s=600)


def test_host_reads_per_step(results):
    for rank, per_rank in enumerate(results):
        for (dims, name, policy, bad), r in per_rank.items():
            key = (rank, dims, name, policy, bad)
            if policy == "skip":
                assert {s: n for s, n in r["sites"].items() if ns.SIGNAL_SITE not in s} == {}, (key, r["sites"])
                assert sum(r["sites"].values()) == (name == "adaptive_row_muon"), (key, r["sites"])
                assert r["skipped"] == int(bad) and not r["raised"], key
            else:
                assert sum(r["sites"].values()) == 1, (key, r["sites"])
                assert r["raised"] == bad, key
            if bad:  # every rank: nothing moved, the NaN was on the last one only
                assert r["unchanged"], key


def test_the_vote_is_one_all_reduce_over_the_world(results):
    for per_rank in results:
        for key, r in per_rank.items():
            assert [(kind, group, size) for kind, group, size, _ in r["votes"]] == [
                ("all_reduce", r["world_group"], 2)
            ], key
