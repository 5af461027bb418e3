"""A fault on one rank only: every rank takes the same action at the same step, in lockstep, and exits cleanly.

The tiny model is wrapped in DDP (gloo). The NaN reward is not part of the loss, so every rank's gradients stay
finite: only the merged statistics reveal it. The NaN gradient is set after backward (after DDP's all-reduce),
so only the faulty rank holds it.
"""

from __future__ import annotations

import math

import pytest
from dist_scenarios import FAULT_STEP

WORLDS = [2, 3]


def _lockstep(ranks: list) -> None:
    """Same steps, same actions, bit-identical weights and the same collectives on every rank."""
    steps = [[(s["step"], s["action"], s["after"], [c[:3] for c in s["calls"]]) for s in rec["steps"]] for rec in ranks]
    assert all(s == steps[0] for s in steps[1:])


@pytest.mark.parametrize("world", WORLDS)
def test_processes_exit_cleanly(launched, world):
    """Every rank went through every scenario and exited: whether each scenario passed is its own tests' to say."""
    run = launched(world)  # within LAUNCH_TIMEOUT: a rank still running then is killed and reads "timeout"
    assert run.returncodes == [0] * world, run.logs
    for res in run.results:
        assert "error" not in res, res["error"]
        assert set(run.scenarios) <= set(res) | set(res["failed"])


@pytest.mark.parametrize("world", WORLDS)
def test_nan_reward_on_one_rank_skips_on_all(launched, world):
    ranks = launched(world).scenario("skip")
    _lockstep(ranks)
    for rec in ranks:
        actions = [s["action"] for s in rec["steps"]]
        assert actions == [None] * FAULT_STEP + ["skip_step"] + [None] * (5 - FAULT_STEP)
        fault = rec["steps"][FAULT_STEP]
        assert fault["reward_nonfinite"] == 1.0  # counted once, on the faulty rank, seen by all
        assert fault["before"] == fault["after"]  # the update never reached the weights
        assert all(s["before"] != s["after"] for s in rec["steps"] if s["action"] is None)
        assert all(len(s["calls"]) == 2 for s in rec["steps"])


@pytest.mark.parametrize("world", WORLDS)
def test_nan_grad_on_one_rank_skips_on_all(launched, world):
    ranks = launched(world).scenario("grad")
    _lockstep(ranks)
    for rec in ranks:
        fault = rec["steps"][FAULT_STEP]
        assert fault["action"] == "skip_step" and fault["before"] == fault["after"]
        assert fault["grad_nonfinite"] == 1.0
        # the NaN travels through the MAX collective as +inf, so no rank sees a finite norm
        assert math.isinf(fault["grad_norm"])
        assert [s["action"] for s in rec["steps"]].count("skip_step") == 1


@pytest.mark.parametrize("world", WORLDS)
def test_halt_stops_all_ranks_at_the_same_step(launched, world):
    ranks = launched(world).scenario("halt")
    _lockstep(ranks)
    for rec in ranks:
        assert rec["raised"] is None
        assert [s["action"] for s in rec["steps"]][-1] == "checkpoint_and_halt"
        assert len(rec["steps"]) == FAULT_STEP + 1
        # the save adds one MAX all-reduce of a failure flag, on every rank
        assert [c[2] for c in rec["steps"][FAULT_STEP]["calls"]][2:] == [1]


@pytest.mark.parametrize("world", WORLDS)
def test_rollback_on_all_ranks_to_the_same_snapshot(launched, world):
    ranks = launched(world).scenario("rollback")
    _lockstep(ranks)
    for rec in ranks:
        steps = rec["steps"]
        assert [s["action"] for s in steps] == [None] * FAULT_STEP + ["rollback"] + [None] * (5 - FAULT_STEP)
        # the snapshot was taken after step 1 (2 healthy steps): weights and this rank's cursor come back from it
        assert steps[FAULT_STEP]["after"] == steps[1]["after"] != steps[FAULT_STEP]["before"]
        assert steps[FAULT_STEP]["cursor"] == steps[1]["cursor"] == 2
        assert steps[FAULT_STEP]["lr"] == steps[1]["lr"] * 0.5  # rollback.lr_scale
        assert len(steps) == 6  # training continues after the rollback
