"""Persistent faults end the run: a run with no learning signal stops early with its reason, and an update dropped
step after step (NaN rewards for good) checkpoints and halts instead of skipping to max_steps."""

from __future__ import annotations

from pathlib import Path

PRESET = str(Path(__file__).resolve().parents[2] / "rl_guard" / "presets" / "grpo.yaml")
ON_POLICY = dict(beta=0.0, num_iterations=1, steps_per_generation=1)


def test_no_learning_signal_stops_early(grpo_run, tmp_path):
    # Every reward 0 (and completions of at most 4 words, so no length penalty): every group has zero spread.
    run = grpo_run(
        tmp_path, 40, guard=PRESET, fault="reward_scale", at_step=0, factor=0.0, max_completion_length=4, **ON_POLICY
    )
    acted = [i for i in run.incidents() if i["action"] != "warn"]
    assert [(i["rule"], i["action"], i["step"]) for i in acted] == [("no_learning_signal", "early_stop", 20)]
    assert "no_signal_steps = 20 >= 20 at step 20" in acted[0]["message"]
    assert run.trainer.state.global_step == 20  # stopped there, not at max_steps


def test_nan_rewards_for_good_halt_after_max_consecutive_skips(grpo_run, tmp_path):
    run = grpo_run(tmp_path, 30, guard=PRESET, fault="nan_rewards", at_step=4, **ON_POLICY)
    acted = [i for i in run.incidents() if i["action"] != "warn" and i["rule"] == "nonfinite_rewards"]
    assert [i["step"] for i in acted] == [5, 6, 7, 8, 9]  # the fault starts in the step that begins at global_step 4
    assert [i["action"] for i in acted] == ["skip_step"] * 4 + ["checkpoint_and_halt"]
    assert "(5 consecutive dropped updates, max_consecutive_skips=5)" in acted[-1]["message"]
    assert Path(acted[-1]["checkpoint"]).is_file()
    assert run.trainer.state.global_step == 9
