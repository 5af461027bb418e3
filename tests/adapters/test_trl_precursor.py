"""Precursor lead: under a gradual LR ramp the guard acts on a precursor rule while everything is still finite,
steps before an unguarded twin (same seed, same fault) first produces a non-finite gradient or weight."""

from __future__ import annotations

import math

from rl_guard.control.config import BUILTINS
from rl_guard.demo.run import demo_config

MAX_STEPS, RAMP_FROM = 24, 2
NONFINITE_RULES = set(BUILTINS) | {"nonfinite_rewards"}


def test_guard_acts_before_the_unguarded_twin_goes_nonfinite(grpo_run, finite_check, tmp_path):
    # The twin only records (and stops at) its first non-finite step; the guarded run asserts finiteness.
    twin = grpo_run(
        tmp_path / "twin", MAX_STEPS, fault="lr_ramp", at_step=RAMP_FROM, checker=finite_check(strict=False, stop=True)
    )
    assert twin.checker.first_nonfinite is not None, f"the ramp did not break the twin within {MAX_STEPS} steps"
    blowup_step, what = twin.checker.first_nonfinite

    guarded = grpo_run(
        tmp_path / "guarded",
        MAX_STEPS,
        guard=demo_config("halt", console_every=None),
        fault="lr_ramp",
        at_step=RAMP_FROM,
    )
    acted = [i for i in guarded.incidents() if i["action"] != "warn"]
    assert acted, "the guard never acted"
    act_step = acted[0]["step"] - 1  # written as the trainer's global_step after the step; the checker counts from 0
    first = [i for i in acted if i["step"] == act_step + 1]
    assert {i["rule"] for i in first}.isdisjoint(NONFINITE_RULES), first
    assert all(math.isfinite(i["value"]) for i in first), first
    assert act_step < blowup_step
    assert guarded.trainer.state.global_step == act_step + 1  # halted there
    for record in guarded.metrics():
        assert math.isfinite(record["rl_guard/loss/value"]) and math.isfinite(record["rl_guard/grad/norm"])
        assert record["rl_guard/grad/nonfinite"] == 0 and record["rl_guard/loss/nonfinite"] == 0
    # Same seed, same fault, and the guard changes nothing until it acts: the twins trained identically.
    losses = lambda run: [h["loss"] for h in run.trainer.state.log_history if "loss" in h][: act_step + 1]  # noqa: E731
    assert losses(guarded) == losses(twin)
    print(
        f"\nprecursor lead: guard acted at step {act_step} ({', '.join(i['rule'] for i in first)} -> "
        f"{first[0]['action']}); unguarded twin first non-finite {what} at step {blowup_step}; "
        f"lead = {blowup_step - act_step} steps"
    )
