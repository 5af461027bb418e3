"""Ranks that disagree raise on every rank instead of mis-merging, crashing a collective, or hanging."""

from __future__ import annotations

import dist_scenarios as sc
import pytest

from rl_guard.stats import ranks as rg_dist

WORLDS = [2, 3]


@pytest.mark.parametrize("world", WORLDS)
def test_different_layouts_raise_rank_mismatch_on_every_rank(launched, world):
    run = launched(world)
    assert run.returncodes == [0] * world  # no gloo abort (size-mismatched collectives kill the process)
    for rec in run.scenario("mismatch"):
        assert rec["raised"] == "RankMismatch", rec
        assert "different statistics layouts" in rec["message"]
        # every rank read the fixed-size header and stopped there: none entered the SUM collective
        assert [(c[0], c[1], c[2]) for c in rec["calls"]] == [
            ("all_reduce", "RedOpType.MAX", rg_dist.HEADER + rg_dist.MAX_SLOTS)
        ]


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_abstains_does_not_leave_the_others_waiting(launched, world):
    ranks = launched(world).scenario("abstain")
    for rec in ranks:
        assert [c[2] for c in rec["first"]["calls"]] == [rg_dist.HEADER + rg_dist.MAX_SLOTS]
        assert rec["first"]["internal_failures"] == 1  # healthy ranks took the guard's failure path (fail-open)
        assert rec["first"]["action"] is None
        assert [c[1] for c in rec["next_calls"]] == ["RedOpType.MAX", "RedOpType.SUM"]
    want = sum(float(b.mask.sum()) for r in range(world) for b, _ in sc.rank_batches(5, 1, r))
    assert all(rec["next_tokens"] == want for rec in ranks)  # the next step merges normally
