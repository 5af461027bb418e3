"""The TRL callback on a real ``GRPOTrainer`` under accelerate + DeepSpeed ZeRO-2 and ZeRO-3 (CPU, gloo, torchrun).

accelerate runs ``engine.step()`` inside ``backward``, before ``on_pre_optimizer_step``; the guard must decide
inside ``engine.step`` instead. The last rank's backward at the fault step puts an inf into one gradient entry: the
decision must be the same on every rank and the step must leave the weights (module and fp32 master partition)
bit for bit as they were; the run then continues (skip) or stops after a checkpoint (halt).
"""

from __future__ import annotations

import importlib.util

import pytest
from launch import run_torchrun

pytestmark = [
    pytest.mark.slow,  # a torchrun launch of TRL + DeepSpeed: about 40 s
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl"),
]
FAULT_STEP = 1  # the script's constants (importing it here would import trl)
ROLLBACK_FAULTS = (3, 6)  # global_step at the start of the fault steps


@pytest.mark.parametrize(
    "stage, world, action", [(2, 1, "checkpoint_and_halt"), (2, 2, "skip_step"), (3, 2, "skip_step")]
)
def test_inf_gradient_dropped_before_deepspeed_applies_it(tmp_path, stage, world, action):
    ranks = run_torchrun("trl_deepspeed_run.py", world, tmp_path, action, str(stage))
    for r, res in enumerate(ranks):
        assert (res["world"], res["backend"], res["zero_stage"]) == (world, "gloo", stage)
        steps = {s["step"]: s for s in res["steps"]}
        assert steps[0]["decision"][1] is None and steps[0]["before"]["module"] != steps[0]["after"]["module"]
        # the update probe reads the fp32 master partitions (the tiny model's tensors are sampled, 1,024 elements
        # each: the norm is exact, the update within the probe's sampling error)
        for s in res["steps"]:
            assert s["probe_param_norm"] == pytest.approx(s["exact_param_norm"], rel=1e-6)
        assert steps[1]["probe_update_rel"] == pytest.approx(steps[0]["exact_update_rel"], rel=0.1)
        bad = steps[FAULT_STEP]
        assert bad["decision"] == [FAULT_STEP + 1, action]  # guard step n ends with global_step n
        assert bad["grad_nonfinite"] >= 1
        assert bad["after"] == bad["before"] and bad["after"]["finite"]  # weights and master partition untouched
        assert res["skipped"] == 1  # DeepSpeed's own overflow path took the step
        if action == "checkpoint_and_halt":
            assert res["global_step"] == FAULT_STEP + 1 and bad["stop"]
            assert res["checkpoint"].endswith(f"step_{FAULT_STEP + 1:08d}/rank{r}.pt")
        else:  # continues: the next update is applied
            nxt = steps[FAULT_STEP + 1]
            assert nxt["decision"][1] is None and nxt["after"]["module"] != nxt["before"]["module"]
    # one decision on every rank, and under ZeRO-2 one set of weights (ZeRO-3 ranks hold different partitions)
    shown = (lambda s: (s["decision"], s["after"]["module"])) if stage == 2 else (lambda s: s["decision"])
    assert len({str([shown(s) for s in res["steps"]]) for res in ranks}) == 1


def test_two_rollbacks_restore_the_same_deepspeed_snapshot_bit_for_bit(tmp_path):
    """ZeRO-2 on 2 ranks under a real GRPOTrainer: a snapshot (an engine checkpoint tag) after every healthy step,
    ``confirm_steps: 2``. The fault at guard step 4 rolls back to the snapshot from before step 2 (the newest one
    older than the two confirming updates) and abandons the newer ones; the fault at step 7 must find that same
    snapshot (the abandoned tags are gone from disk, so they cannot crowd it out) and restore it again. Each
    rollback leaves the module weights and the fp32 master partition exactly as they were at the start of step 2,
    and the trainer keeps counting to the end."""
    ranks = run_torchrun("trl_deepspeed_run.py", 2, tmp_path, "rollback_twice", "2")
    for r, res in enumerate(ranks):
        by_step = {s["decision"][0]: s for s in res["steps"]}
        faults = [g + 1 for g in ROLLBACK_FAULTS]
        assert [(s["decision"][0], s["restores"]) for s in res["steps"] if s["decision"][1] == "rollback"] == [
            (faults[0], 2),
            (faults[1], 2),
        ]
        for step in faults:
            assert by_step[step]["after"] == by_step[2]["before"] and by_step[step]["after"]["finite"]
            assert by_step[step]["grad_nonfinite"] >= 1
        # the steps between train on from the restored state; the last one is applied
        assert by_step[faults[0] + 1]["after"]["module"] != by_step[faults[0] + 1]["before"]["module"]
        # (DeepSpeed's skipped_steps is not checked: load_checkpoint restores the engine's counters too)
        assert res["global_step"] == 9
        offered = [s["offered"] for s in res["steps"]]
        assert offered[faults[0] - 1] == [2] and offered[faults[1] - 1] == [2]
        if r == 0:  # rank 0 removes what the ring forgets: on disk are exactly the tags the ring offers
            for s in res["steps"]:
                assert s["tags"] == sorted(f"rl_guard_step{n}" for n in s["offered"]), s["decision"]
    assert len({str([(s["decision"], s["after"]["module"]) for s in res["steps"]]) for res in ranks}) == 1
