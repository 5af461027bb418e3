"""group/: group sizes, correct/wrong/mixed shares, zero-std groups, token cost, correlation, pass@k."""

import math

import numpy as np
import pytest

# Five prompts: A all correct (3), B all wrong (2), C mixed (4), D a single sample, E no valid reward
# (one NaN reward, one environment error).
GROUPS = ["A"] * 3 + ["B"] * 2 + ["C"] * 4 + ["D"] + ["E"] * 2
REWARDS = [1, 1, 1, 0, 0, 1, 0, 1, 0, 1, math.nan, 1]
LENGTHS = [10, 10, 10, 20, 20, 5, 15, 5, 15, 30, 40, 40]
TERMS = ["success"] * 11 + ["environment_error"]
TEXTS = ["x", "x", "y", "z", "z", "a", "b", "c", "d", "q", "e", "f"]


def test_group_statistics_from_rewards(diag):
    m = diag(group_ids=GROUPS, rewards=REWARDS, lengths=LENGTHS, termination=TERMS, texts=TEXTS)
    assert m["group/count"] == 5
    assert m["group/size_mean"] == pytest.approx(12 / 5) and m["group/size_min"] == 1 and m["group/size_max"] == 4
    # correct = r > 0.5 * max valid r = 0.5. A 3/3, B 0/2, C 2/4, D 1/1, E empty.
    assert m["group/empty_frac"] == pytest.approx(1 / 5)
    assert m["group/all_correct_frac"] == pytest.approx(2 / 4)  # A, D over the 4 non-empty groups
    assert m["group/all_wrong_frac"] == pytest.approx(1 / 4)  # B
    assert m["group/mixed_frac"] == pytest.approx(1 / 4)  # C
    # zero std: A, B, D (single sample) over groups with a valid reward (A, B, C, D).
    assert m["group/zero_std_frac"] == pytest.approx(3 / 4)
    # no-signal tokens: A 30 + B 40 + D 30 + E 80 = 180 of 30 + 40 + 40 + 30 + 80 = 220.
    assert m["group/no_signal_token_frac"] == pytest.approx(180 / 220)
    # advantage = r - group mean: 0 in A, B, D; C (mean 0.5): +.5 -.5 +.5 -.5 at lengths 5 15 5 15; E out.
    # 10 points, mean length 140 / 10 = 14, mean advantage 0.
    # sum (l - 14) a = 2 * (-9)(0.5) + 2 * (1)(-0.5) = -10
    # sum (l - 14)^2 = 3*16 + 2*36 + 2*81 + 2*1 + 256 = 540; sum a^2 = 1  ->  r = -10 / sqrt(540)
    assert m["group/len_adv_corr"] == pytest.approx(-10 / math.sqrt(540))
    # distinct texts: A 2/3, B 1/2, C 1, D 1, E 1 (texts count even for system errors) -> (7/6 + 3) / 5 = 5/6.
    assert m["group/unique_frac"] == pytest.approx(5 / 6)
    assert "group/pass_at_k" not in m  # no outcome


def test_given_advantages_are_used_and_system_errors_dropped(diag):
    m = diag(
        group_ids=[0, 0, 1, 1],
        lengths=[1, 2, 3, 100],
        advantages=[1, 2, 3, -50],
        termination=["success", "success", "success", "infrastructure_error"],
    )
    assert m["group/len_adv_corr"] == pytest.approx(1.0)  # (1,1) (2,2) (3,3): the error sample is out


def test_pass_at_k_with_outcome(diag):
    # group 0: 4 successes (a 5th sample is a verifier error, excluded); group 1: 1 of 4; group 2: 0 of 2 valid
    # (its third outcome is NaN).
    groups = [0] * 5 + [1] * 4 + [2] * 3
    outcome = [1, 1, 1, 1, 0] + [1, 0, 0, 0] + [0, 0, math.nan]
    terms = ["success"] * 4 + ["verifier_error"] + ["success"] * 7
    m = diag(group_ids=groups, outcome=outcome, termination=terms)
    assert m["group/pass_at_k"] == pytest.approx(2 / 3)  # groups 0 and 1 have a success
    assert m["group/pass_pow_k"] == pytest.approx(1 / 3)  # only group 0 is all successes
    assert m["group/pass_at_1"] == pytest.approx((4 / 4 + 1 / 4 + 0 / 2) / 3)
    # Correctness comes from the outcome when given: one group each.
    assert m["group/all_correct_frac"] == m["group/all_wrong_frac"] == m["group/mixed_frac"] == pytest.approx(1 / 3)
    assert m["group/size_max"] == 5  # realised size counts every sample


def test_correctness_relative_to_best_reward(diag):
    m = diag(group_ids=[0, 0], rewards=[0.6, 0.2])  # threshold 0.3: one correct, one wrong
    assert m["group/mixed_frac"] == 1.0 and m["group/zero_std_frac"] == 0.0
    m = diag(group_ids=[0, 0], rewards=[-1.0, -2.0])  # best reward <= 0: nothing counts as correct
    assert m["group/all_wrong_frac"] == 1.0


def test_edge_groups_all_singletons_and_all_invalid(diag):
    m = diag(group_ids=["a", "b", "c"], rewards=[1.0, 0.0, 1.0], lengths=[3, 3, 3])
    assert m["group/size_mean"] == 1 and m["group/zero_std_frac"] == 1.0 and m["group/no_signal_token_frac"] == 1.0
    assert "group/len_adv_corr" not in m  # every advantage is 0: correlation undefined, left out
    m = diag(group_ids=[0, 0, 1], rewards=[math.nan] * 3, lengths=[1, 2, 3])
    assert m["group/empty_frac"] == 1.0 and m["group/no_signal_token_frac"] == 1.0
    assert "group/all_correct_frac" not in m and "group/zero_std_frac" not in m


def test_group_ids_as_tensor_and_numpy_match_lists(diag):
    torch = pytest.importorskip("torch")
    base = diag(group_ids=GROUPS[:10], rewards=REWARDS[:10], lengths=LENGTHS[:10])
    codes = [ord(g) for g in GROUPS[:10]]
    as_tensor = diag(
        group_ids=torch.tensor(codes),
        rewards=torch.tensor(REWARDS[:10], dtype=torch.bfloat16),
        lengths=np.array(LENGTHS[:10]),
    )
    assert as_tensor == pytest.approx(base)


def test_no_signal_steps_count_optimizer_steps_without_reward_spread_and_survive_a_resume():
    from rl_guard.diagnostics import RunDiagnostics, SampleBatch

    d = RunDiagnostics()
    assert d.no_signal_steps() == {}  # no batch with groups yet: nothing to report
    flat = SampleBatch(rewards=[1.0, 1.0, 0.0, 0.0], group_ids=[0, 0, 1, 1])
    spread = SampleBatch(rewards=[1.0, 0.0, 0.0, 0.0], group_ids=[0, 0, 1, 1])
    d.update(flat, step=1)
    # two optimizer steps on one generation batch count twice
    assert [d.no_signal_steps()["rl_guard/group/no_signal_steps"] for _ in range(2)] == [1.0, 2.0]
    resumed = RunDiagnostics()
    resumed.load_state_dict(d.state_dict())
    assert resumed.no_signal_steps()["rl_guard/group/no_signal_steps"] == 3.0
    resumed.update(spread, step=4)
    assert resumed.no_signal_steps()["rl_guard/group/no_signal_steps"] == 0.0
