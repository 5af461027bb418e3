"""The guard on real DeepSpeed ZeRO-2 and ZeRO-3 engines, with and without ZeRO-Offload (the optimizer on the CPU):
two CPU processes (gloo), bf16, torch's Adam.

The last rank alone gets an inf in its own gradient partition after the reduce-scatter and before
``engine.step``; the guard, gating ``engine.step`` (``rl_guard/adapters/deepspeed.py``), must take the same
decision on both ranks and the step must leave every weight (module and fp32 master partition) bit for bit
unchanged (every rank's bf16 weights and fp32 master partition), through DeepSpeed's own overflow path.
"""

from __future__ import annotations

import pytest
from launch import run_ranks

pytestmark = pytest.mark.slow  # two processes importing deepspeed, 12 engines: about 60 s


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("ds_zero_worker.py", 2, tmp_path_factory.mktemp("zero"), ",".join(STAGES), timeout=480)


STAGES = ["2", "3", "2-offload", "3-offload"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("action", ["skip_step", "checkpoint_and_halt", "rollback"])
def test_inf_gradient_on_one_rank_drops_the_update_everywhere(ranks, stage, action):
    runs = [r[f"zero{stage}_{action}"] for r in ranks]
    fault = runs[0]["fault_step"]
    for rank, run in enumerate(runs):
        steps = run["steps"]
        healthy = steps[0]
        # healthy step: applied; the guard's norm over ZeRO partitions equals DeepSpeed's own global norm
        assert healthy["action"] is None and healthy["before"]["module"] != healthy["after"]["module"]
        assert healthy["grad_norm"] == pytest.approx(healthy["ds_grad_norm"], rel=1e-6)
        # update probe over the fp32 master partitions (small enough to be read whole, so exact): the parameter
        # norm before each step, and step 0's update reported with step 1
        for s in steps:
            assert s["probe_param_norm"] == pytest.approx(s["exact_param_norm"], rel=1e-6)
        assert steps[0]["exact_update_rel"] > 0
        assert steps[1]["probe_update_rel"] == pytest.approx(steps[0]["exact_update_rel"], rel=1e-5)
        bad = steps[fault]
        assert bad["grad_nonfinite"] >= 1 and bad["action"] == action and not bad["apply"]
        if action == "rollback":  # back to the snapshot after step 0, the weights step 1 started from (the restored
            # checkpoint also resets the engine's skipped_steps counter)
            assert bad["after"] == steps[1]["before"] and bad["before"] != bad["after"]
            assert run["rollbacks"] == 1
        else:  # the update that fired was dropped: weights and fp32 master partitions bitwise unchanged
            assert bad["after"] == bad["before"]
            assert bad["skipped_steps"] == 1  # through DeepSpeed's overflow path: no optimizer step, LR held
        assert bad["after"]["finite"]
        if action == "checkpoint_and_halt":
            assert bad["stop"] and len(steps) == fault + 1
            assert run["checkpoint"].endswith(f"step_{fault:08d}/rank{rank}.pt")
        else:  # the run continues and the next update is applied
            nxt = steps[fault + 1]
            assert nxt["action"] is None and nxt["apply"] and nxt["after"]["module"] != nxt["before"]["module"]
    # the same decision and metrics on every rank at every step; under ZeRO-2 every rank holds the same full weights
    assert [[(s["action"], s["grad_nonfinite"], s["grad_norm"]) for s in run["steps"]] for run in runs] == [
        [(s["action"], s["grad_nonfinite"], s["grad_norm"]) for s in runs[0]["steps"]]
    ] * 2
    if stage.startswith("2"):
        assert all(len(set(s["after"]["module"])) == 1 for s in runs[0]["steps"])


def test_a_second_rollback_restores_the_snapshot_the_first_one_kept(ranks):
    """A snapshot every step, ``keep: 3``, ``confirm_steps: 2``: the fault at step 3 restores the snapshot labelled
    1 and abandons 2 and 3, and the fault at step 6 needs snapshot 1 again. Pruning the tags on disk by count kept
    the 4 newest, abandoned ones included, and removed 1 before that second rollback; on disk there must be exactly
    the tags the guard still offers."""
    for run in (r[f"zero{STAGES[0]}_rollback_twice"] for r in ranks):
        steps = run["steps"]
        assert [s["action"] for s in steps] == [None, None, None, "rollback", None, None, "rollback", None]
        assert run["rollbacks"] == 2 and run["internal_failures"] == 0
        assert steps[3]["after"] == steps[1]["before"] and steps[6]["after"] == steps[1]["before"]
        assert steps[6]["before"] != steps[6]["after"] and all(s["after"]["finite"] for s in steps)
        # 0: the starting state, a snapshot from the first check on (pushed out of the ring of 3 at step 3)
        assert [s["offered"] for s in steps] == [[0, 1], [0, 1, 2], [1, 2, 3], [1], [1, 5], [1, 5, 6], [1], [1, 8]]
        assert all(s["tags"] == [f"rl_guard_step{n}" for n in s["offered"]] for s in steps)
