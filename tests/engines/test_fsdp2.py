"""The guard on real FSDP2 (``fully_shard``): two CPU processes (gloo), DTensor parameters and gradients.

Before shard-aware probing, the probe mixed DTensors and plain tensors and failed every step, leaving the run
unguarded in ``fail_mode: open``. Here the last rank alone gets an inf in its own gradient shard after FSDP's
reduce-scatter; both ranks must take the same decision and the step must leave every shard bit for bit unchanged
(skip, halt) or restore the snapshot (rollback). The guard's norm over the shards equals the norm of the full
gradient gathered from every rank.
"""

from __future__ import annotations

import pytest
from launch import run_ranks

pytestmark = pytest.mark.slow  # two processes, three short runs: about 25 s


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("fsdp2_worker.py", 2, tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.parametrize("action", ["skip_step", "checkpoint_and_halt", "rollback"])
def test_inf_in_one_shard_drops_the_update_on_every_rank(ranks, action):
    runs = [r[action] for r in ranks]
    fault = runs[0]["fault_step"]
    for rank, run in enumerate(runs):
        steps = run["steps"]
        assert all(s["failures"] == 0 for s in steps)  # never the guard's failure path: the run stays guarded
        assert steps[0]["action"] is None  # the reference-norm checks below run on at least one healthy step
        for s in steps:
            if s["action"] is None:  # healthy: the shards' sum of squares is the full gradient's
                assert s["grad_norm"] == pytest.approx(s["reference_norm"], rel=1e-12)
                # the update probe merges parameter shards the same way: its norm is the full parameters' norm
                assert s["param_norm"] == pytest.approx(s["reference_param_norm"], rel=1e-12)
                assert s["after"]["local"] != s["before"]["local"]
        bad = steps[fault]
        assert bad["action"] == action and bad["grad_nonfinite"] >= 1 and bad["after"]["finite"]
        if action == "rollback":  # back to the snapshot after step 0: the weights step 1 started from
            assert bad["after"] == steps[1]["before"] and run["rollbacks"] == 1
        else:
            assert bad["after"] == bad["before"]  # this rank's shard and the full weights, bitwise
        if action == "checkpoint_and_halt":
            assert bad["stop"] and len(steps) == fault + 1
            assert run["checkpoint"].endswith(f"step_{fault:08d}/rank{rank}.pt")
        else:
            assert not bad["stop"] and steps[fault + 1]["action"] is None
    assert runs[0]["steps"][fault]["action"] == runs[1]["steps"][fault]["action"]
    assert [s["after"]["full"] for s in runs[0]["steps"]] == [s["after"]["full"] for s in runs[1]["steps"]]
