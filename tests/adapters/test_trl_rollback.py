"""Rollback through TRL: an LR blow-up is caught before its first update, the healthy snapshot is restored bit for
bit (model, optimizer, scheduler, RNG), TRL regenerates its rollouts, and training resumes with every later step
finite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_guard.demo.run import demo_config

STEPS, FAULT_STEP = 12, 6


@pytest.fixture(scope="module")
def rolled_back(grpo_run, step_states, tmp_path_factory):
    from rl_guard.adapters.trl import RLGuardCallback

    # lr_scale 1.0 so the restored state must equal the snapshot exactly (no LR rescaling after the restore).
    yaml_text = demo_config("rollback", console_every=None, rollback={"max_rollbacks": 3, "lr_scale": 1.0})
    tmp = tmp_path_factory.mktemp("rollback")
    callback = RLGuardCallback(yaml_text, run_dir=str(tmp / "guard"))
    recorder = step_states(guard=callback)
    run = grpo_run(tmp, STEPS, guard=callback, fault="lr_blowup", at_step=FAULT_STEP, extra_callbacks=[recorder])
    return run, recorder


# The guard numbers steps as the trainer's global_step after the step (1-based); StepStates and the injector use
# the global_step at which the step began (0-based): guard step n is recorder index n - 1.
def rollback_step(run) -> int:
    steps = sorted({i["step"] for i in run.incidents() if i["action"] == "rollback"})
    assert len(steps) == 1, run.incidents()
    return steps[0]


def test_lr_blowup_is_caught_before_its_update_and_rolled_back(rolled_back):
    run, _ = rolled_back
    assert run.injector.injected_at == [FAULT_STEP]
    step = rollback_step(run)
    # The blown-up LR is invisible in the gradients, but the learning rate itself is read before optimizer.step().
    assert step == FAULT_STEP + 1
    rules = {i["rule"] for i in run.incidents() if i["step"] == step and i["action"] == "rollback"}
    assert "lr_jump" in rules, rules
    assert run.guard.controller.rollbacks == 1


def test_restore_is_bitwise(rolled_back, same_state):
    run, rec = rolled_back
    step = rollback_step(run) - 1  # recorder index
    restored_to = rec.snapshot_steps[step - 1][-1]  # the newest healthy snapshot before the rollback
    assert restored_to <= FAULT_STEP + 1, "a snapshot taken after the blow-up would restore the fault"
    healthy = rec.end[restored_to - 2]  # snapshot N = the state before guard step N = after recorder index N - 2
    after = rec.end[step]
    for part in ("model", "optimizer", "scheduler"):
        same_state(healthy[part], after[part], part)
        same_state(healthy[part], rec.latest_snapshot[step][part], f"snapshot {part}")
    assert torch.equal(healthy["rng"]["torch"], after["rng"]["torch"])
    assert np.array_equal(healthy["rng"]["numpy"], after["rng"]["numpy"])
    assert healthy["rng"]["python"] == after["rng"]["python"]
    # The blown-up learning rate is gone with the restored optimizer and scheduler.
    assert after["optimizer"]["param_groups"][0]["lr"] == healthy["optimizer"]["param_groups"][0]["lr"]


def test_training_resumes_finite(rolled_back):
    run, rec = rolled_back
    step = rollback_step(run)
    assert run.trainer.state.global_step == STEPS and run.checker.steps_checked == STEPS
    later = [m for m in run.metrics() if m["step"] > step]
    assert len(later) == STEPS - step
    for m in later:
        assert math.isfinite(m["rl_guard/loss/value"]) and math.isfinite(m["rl_guard/grad/norm"]), m["step"]
        assert m["rl_guard/loss/nonfinite"] == 0 and m["rl_guard/grad/nonfinite"] == 0
    assert not [i for i in run.incidents() if i["step"] > step and i["action"] != "warn"]
    final, restored = rec.end[STEPS - 1]["model"], rec.end[step - 1]["model"]
    assert any(not torch.equal(t, restored[n]) for n, t in final.items()), "no update after the rollback"
