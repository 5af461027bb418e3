"""term/ and reward/: taxonomy rates, system errors kept out of rewards, components, histogram shapes."""

import math

import numpy as np
import pytest

TERMS = [
    "success",
    "success",
    "task_failure",
    "timeout",
    "environment_error",
    "verifier_error",
    "infrastructure_error",
    "truncated_budget",
]


def test_termination_rates(diag):
    m = diag(termination=TERMS)
    # n = 8: success 2/8, every other listed class 1/8, invalid_action absent -> 0.
    assert m["term/success_rate"] == 0.25
    for t in (
        "task_failure",
        "timeout",
        "environment_error",
        "verifier_error",
        "infrastructure_error",
        "truncated_budget",
    ):
        assert m[f"term/{t}_rate"] == 0.125
    assert m["term/invalid_action_rate"] == 0.0
    assert m["term/system_error_rate"] == 0.375  # (1 + 1 + 1) / 8
    assert sum(v for k, v in m.items() if k.startswith("term/") and k != "term/system_error_rate") == 1.0


def test_unknown_termination_is_rejected(diag):
    with pytest.raises(ValueError, match="unknown termination.*allowed"):
        diag(termination=["success", "crashed"])


def test_system_errors_are_excluded_not_scored_zero(diag):
    # Indices 4, 5, 6 are system errors with reward 0 from a broken verifier / environment.
    m = diag(termination=TERMS, rewards=[1, 1, 0, 0, 0, 0, 0, 0])
    assert m["reward/n_valid"] == 5 and m["reward/system_error_excluded"] == 3
    assert m["trend/reward_mean"] == pytest.approx(0.4)  # (1 + 1 + 0 + 0 + 0) / 5, not 2 / 8 = 0.25
    assert m["reward/nonfinite_count"] == 0


def test_nonfinite_rewards_are_counted_and_left_out(diag):
    m = diag(rewards=[1.0, math.nan, 0.0, math.inf], termination=["success", "success", "task_failure", "success"])
    assert m["reward/nonfinite_count"] == 2 and m["reward/n_valid"] == 2
    assert m["trend/reward_mean"] == 0.5  # (1 + 0) / 2
    # A NaN on a system-error sample counts as excluded, not as a non-finite reward.
    m = diag(rewards=[1.0, math.nan], termination=["success", "verifier_error"])
    assert m["reward/nonfinite_count"] == 0 and m["reward/system_error_excluded"] == 1


def test_reward_components_mean_and_share(diag):
    m = diag(
        reward_components={
            "task": [1, 0, 1, 1],
            "format": [0.5, 0.5, 0.5, math.nan],
            "length": [-0.2, -0.4, -0.2, -0.2],
        }
    )
    # means: task 3/4 = 0.75, format 0.5 (NaN left out), length -1.0/4 = -0.25; sum of |means| = 1.5.
    assert m["reward/component/task/mean"] == pytest.approx(0.75)
    assert m["reward/component/format/mean"] == pytest.approx(0.5)
    assert m["reward/component/length/mean"] == pytest.approx(-0.25)
    assert m["reward/component/task/share"] == pytest.approx(0.5)  # 0.75 / 1.5
    assert m["reward/component/format/share"] == pytest.approx(1 / 3)  # 0.5 / 1.5
    assert m["reward/component/length/share"] == pytest.approx(-1 / 6)  # -0.25 / 1.5


def test_component_share_left_out_when_all_means_are_zero(diag):
    m = diag(reward_components={"a": [0, 0], "b": [1, -1]})
    assert m["reward/component/a/mean"] == 0 and m["reward/component/b/mean"] == 0
    assert "reward/component/a/share" not in m


def _shape(diag, rewards):
    m = diag(rewards=rewards)
    flags = {s: m[f"reward/shape_{s}"] for s in ("all_zero", "all_one", "heavy_tail", "mixed_sign")}
    return flags, m["reward/shape"], m.get("reward/kurtosis")


def test_shape_all_zero_sparse_binary(diag):
    # 19 zeros + one 1 (n = 20): 95% zeros > 90%. Bernoulli p = 0.05: excess kurtosis (1 - 6pq) / pq
    # = (1 - 0.285) / 0.0475 = 15.0526 > 6, so heavy_tail is set as well; the code takes all_zero first.
    flags, code, kurt = _shape(diag, [0.0] * 19 + [1.0])
    assert flags == {"all_zero": 1, "all_one": 0, "heavy_tail": 1, "mixed_sign": 0} and code == 1
    assert kurt == pytest.approx(0.715 / 0.0475)


def test_shape_boundary_exactly_ninety_percent_is_not_flagged(diag):
    flags, code, kurt = _shape(diag, [0.0] * 9 + [1.0])  # 9/10 zeros is not > 0.9; n = 10 < 12: no kurtosis
    assert flags == {"all_zero": 0, "all_one": 0, "heavy_tail": 0, "mixed_sign": 0} and code == 0 and kurt is None


def test_shape_all_one_and_constant_zero(diag):
    flags, code, _ = _shape(diag, [1.0] * 19 + [0.0])  # 95% at the max 1
    assert flags["all_one"] == 1 and flags["all_zero"] == 0 and code == 2
    flags, code, kurt = _shape(diag, [0.0] * 20)  # max 0 is not "lenient": only all_zero; no spread, no kurtosis
    assert flags == {"all_zero": 1, "all_one": 0, "heavy_tail": 0, "mixed_sign": 0} and code == 1 and kurt is None


def test_shape_heavy_tail_by_kurtosis(diag):
    # fifteen 1s and one 17: mean 2, deviations -1 (x15) and 15; m2 = (15 + 225)/16 = 15,
    # m4 = (15 + 50625)/16 = 3165; excess = 3165 / 225 - 3 = 11.0667 > 6.
    flags, code, kurt = _shape(diag, [1.0] * 15 + [17.0])
    assert kurt == pytest.approx(3165 / 225 - 3)
    assert flags == {"all_zero": 0, "all_one": 0, "heavy_tail": 1, "mixed_sign": 0} and code == 3
    # 1..16 (discrete uniform): excess = -6 (n^2 + 1) / (5 (n^2 - 1)) = -1542 / 1275: light tails.
    flags, code, kurt = _shape(diag, np.arange(1.0, 17.0))
    assert kurt == pytest.approx(-1542 / 1275) and flags["heavy_tail"] == 0 and code == 0


def test_shape_mixed_sign(diag):
    flags, code, _ = _shape(diag, [1.0] * 8 + [-1.0, 0.0])  # positives 0.8, negatives 0.1 >= 0.1
    assert flags["mixed_sign"] == 1 and code == 4
    flags, _, _ = _shape(diag, [1.0] * 10 + [-1.0])  # negatives 1/11 < 0.1; 10/11 at max -> all_one
    assert flags["mixed_sign"] == 0 and flags["all_one"] == 1


def test_all_rewards_invalid_reports_counts_only(diag):
    m = diag(rewards=[math.nan, math.nan])
    assert m["reward/n_valid"] == 0 and m["reward/nonfinite_count"] == 2
    assert not any(k.startswith("reward/shape") for k in m) and "trend/reward_mean" not in m
