"""Faults injected into real GRPOTrainer runs: each is caught by the expected rule, the action happens, and no
parameter (nor any update the optimizer applies) is ever non-finite (``FiniteCheck`` asserts at every step)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rl_guard.demo.run import demo_config

PRESET = demo_config("rollback", console_every=None)


def fired_at(run, step: int) -> dict[str, str]:
    """Rules that fired in the step that began at global_step ``step`` (the guard writes it as ``step + 1``)."""
    return {i["rule"]: i["action"] for i in run.incidents() if i["step"] == step + 1}


def assert_update_dropped(states, step: int) -> None:
    """Weights and optimizer moments are bit-identical before and after the step (the LR schedule may move)."""
    before, after = states.begin[step], states.end[step]
    for name, tensor in before["model"].items():
        assert torch.equal(tensor, after["model"][name]), name
    assert before["optimizer"]["state"].keys() == after["optimizer"]["state"].keys()
    for idx, moments in before["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, after["optimizer"]["state"][idx][key]), (idx, key)


def assert_update_applied(states, step: int) -> None:
    before, after = states.begin[step], states.end[step]
    assert any(not torch.equal(t, after["model"][n]) for n, t in before["model"].items())


def test_inf_grad_skips_the_step(grpo_run, step_states, tmp_path):
    states = step_states(steps=(3, 4))
    run = grpo_run(tmp_path, 6, guard=PRESET, fault="inf_grad", at_step=3, extra_callbacks=[states])
    assert run.injector.injected_at == [3]
    fired = fired_at(run, 3)
    assert fired["nonfinite_grad"] == "skip_step"
    assert set(fired.values()) <= {"skip_step", "warn"}, fired
    assert_update_dropped(states, 3)
    assert_update_applied(states, 4)  # training goes on
    assert run.trainer.state.global_step == 6 and run.guard.controller.skipped_steps == 1
    record = next(m for m in run.metrics() if m["step"] == 4)
    assert record["rl_guard/grad/nonfinite"] == 1 and record["rl_guard/grad/norm"] == math.inf


def test_nan_reward_skips_the_step_although_trl_logs_a_finite_reward(grpo_run, step_states, tmp_path):
    states = step_states(steps=(2, 3))
    run = grpo_run(
        tmp_path,
        4,
        guard=PRESET,
        fault="nan_reward",
        at_step=2,
        extra_callbacks=[states],
        num_iterations=1,
        steps_per_generation=1,
    )  # a generation (and rewards) every step
    assert run.injector.injected_at == [2]
    assert {r: a for r, a in fired_at(run, 2).items() if a != "warn"} == {"nonfinite_rewards": "skip_step"}
    assert_update_dropped(states, 2)
    assert_update_applied(states, 3)
    guard_record = next(m for m in run.metrics() if m["step"] == 3)
    assert guard_record["rl_guard/input/rewards/nonfinite"] == 1
    assert all(m["rl_guard/input/rewards/nonfinite"] == 0 for m in run.metrics() if m["step"] != 3)
    # TRL sums reward functions with nansum and drops NaN from its logs: its view of that step looks healthy.
    trl_log = next(h for h in run.trainer.state.log_history if h.get("step") == 3 and "reward" in h)
    assert math.isfinite(trl_log["reward"])


def test_ratio_drift_halts_with_a_loadable_checkpoint(grpo_run, step_states, same_state, tmp_path):
    states = step_states(steps=(3,))
    # steps_per_generation=2: step 3 trains on rollouts (and behaviour log-probs) buffered at step 2, before
    # the injector perturbs the weights at the start of step 3.
    run = grpo_run(
        tmp_path,
        8,
        guard=demo_config("halt", console_every=None),
        fault="ratio_drift",
        at_step=3,
        extra_callbacks=[states],
        num_iterations=1,
        steps_per_generation=2,
    )
    assert run.injector.injected_at == [3]
    acted = {i["rule"]: i for i in run.incidents() if i["action"] != "warn"}
    assert acted and {i["step"] for i in acted.values()} == {4}  # the trainer's step 4 began at global_step 3
    assert set(acted) <= {
        "update_too_far",
        "ratio_extreme",
        "behaviour_mismatch",
        "weights_changed_outside_optimizer",
        "logprob_jump",
        "entropy_spike",
        "weights_corrupted",
        "param_norm_jump",
    }, acted
    assert "weights_changed_outside_optimizer" in acted  # the weights moved without an optimizer step
    assert {i["action"] for i in acted.values()} == {"checkpoint_and_halt"}
    assert run.trainer.state.global_step == 4  # stopped at the step that fired, not max_steps
    assert_update_dropped(states, 3)
    for incident in acted.values():
        if incident["op"] == ">":
            assert incident["value"] > incident["threshold"], incident
    ckpt = torch.load(incident["checkpoint"], map_location="cpu", weights_only=True)
    assert ckpt["step"] == 4 and ckpt["reason"] == "checkpoint_and_halt"
    for name, tensor in run.trainer.model.state_dict().items():
        assert torch.equal(ckpt["model"][name], tensor), name
    same_state(ckpt["optimizer"]["state"], states.end[3]["optimizer"]["state"], "optimizer moments")
    assert ckpt["guard"]["controller"]["step"] == 4
    # The trainer saved its own checkpoint of the halted state too (``control.should_save``).
    assert (Path(run.trainer.args.output_dir) / "checkpoint-4" / "trainer_state.json").is_file()
