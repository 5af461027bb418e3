"""budget/ and funnel/: hand-computed counts, totals across calls, keep fractions, validation."""

import pytest

from rl_guard.diagnostics import RunDiagnostics, SampleBatch


def test_budget_per_step_and_cumulative(diag):
    d = RunDiagnostics()
    m1 = diag(1, d, lengths=[10, 20, 30], train_tokens=45, phase_seconds={"rollout": 2.0, "reward": 0.5})
    # episodes default to one per sample (3); rollout tokens = 10 + 20 + 30 = 60; one update per call.
    assert m1["budget/episodes"] == 3 and m1["budget/episodes_total"] == 3
    assert m1["budget/rollout_tokens"] == 60 and m1["budget/train_tokens"] == 45
    assert m1["budget/optimizer_updates"] == 1 and m1["budget/optimizer_updates_total"] == 1
    assert m1["budget/seconds/rollout"] == 2.0 and m1["budget/seconds_total/reward"] == 0.5

    m2 = diag(2, d, episodes=2, rollout_tokens=100, lengths=[1, 2], phase_seconds={"rollout": 1.0}, optimizer_updates=4)
    # Given values win over the defaults: 2 episodes (not 2 samples by chance: see 3 + 2), 100 tokens (not 1 + 2).
    assert m2["budget/episodes"] == 2 and m2["budget/episodes_total"] == 5
    assert m2["budget/rollout_tokens"] == 100 and m2["budget/rollout_tokens_total"] == 160
    assert "budget/train_tokens" not in m2 and m2["budget/train_tokens_total"] == 45  # nothing new, total kept
    assert m2["budget/optimizer_updates"] == 4 and m2["budget/optimizer_updates_total"] == 5
    assert m2["budget/seconds_total/rollout"] == 3.0 and m2["budget/seconds_total/reward"] == 0.5
    assert "budget/seconds/reward" not in m2


def test_budget_falls_back_to_funnel_counts(diag):
    m = diag(funnel={"action_tokens": 700, "optimizer_updates": 2})
    assert m["budget/train_tokens"] == 700 and m["budget/optimizer_updates"] == 2
    assert m["budget/episodes"] == 0  # empty batch: no samples, no episodes


def test_invalid_budget_raises_and_leaves_state_untouched():
    d = RunDiagnostics()
    d.update(SampleBatch(episodes=4), 0)
    with pytest.raises(ValueError, match="episodes"):
        d.update(SampleBatch(episodes=-1), 1)
    with pytest.raises(ValueError, match="unknown funnel layer"):
        d.update(SampleBatch(episodes=5, funnel={"acepted": 3}), 1)
    m = d.update(SampleBatch(episodes=1), 1)
    assert m["rl_guard/budget/episodes_total"] == 5  # 4 + 1: the two failed calls added nothing


def test_funnel_counts_and_keep_fractions(diag):
    counts = {
        "sampled": 100,
        "started": 96,
        "completed": 80,
        "truncated": 12,
        "failed": 4,
        "reward_available": 90,
        "valid": 88,
        "accepted": 66,
        "action_tokens": 30000,
        "optimizer_updates": 2,
    }
    m = diag(funnel=counts, rollout_tokens=40000, drop_reasons={"stale": 20, "ratio gate": 2})
    for layer, c in counts.items():
        assert m[f"funnel/{layer}/count"] == c
    assert m["funnel/started/keep_frac"] == pytest.approx(96 / 100)
    # completed / truncated / failed are siblings, each a share of started.
    assert m["funnel/completed/keep_frac"] == pytest.approx(80 / 96)
    assert m["funnel/truncated/keep_frac"] == pytest.approx(0.125)  # 12 / 96
    assert m["funnel/failed/keep_frac"] == pytest.approx(4 / 96)
    assert m["funnel/reward_available/keep_frac"] == pytest.approx(0.9375)  # 90 / 96
    assert m["funnel/valid/keep_frac"] == pytest.approx(88 / 90)
    assert m["funnel/accepted/keep_frac"] == pytest.approx(0.75)  # 66 / 88
    assert m["funnel/action_tokens/keep_frac"] == pytest.approx(0.75)  # 30000 / 40000 rollout tokens
    assert "funnel/optimizer_updates/keep_frac" not in m  # different unit: no parent
    assert m["funnel/drop/stale"] == 20 and m["funnel/drop/ratio_gate"] == 2  # label made name-safe


def test_funnel_nearest_present_parent_and_zero_parent(diag):
    m = diag(funnel={"sampled": 10, "accepted": 5})
    assert m["funnel/accepted/keep_frac"] == 0.5  # started / valid absent: compared with sampled
    assert "funnel/accepted/keep_frac" not in diag(funnel={"accepted": 5})
    m = diag(funnel={"sampled": 0, "started": 0})
    assert m["funnel/started/count"] == 0 and "funnel/started/keep_frac" not in m


@pytest.mark.filterwarnings("ignore:rl_guard. rule")  # built-in rules watch token metrics absent here
def test_funnel_keep_frac_rule_fires_through_the_controller(diag):
    from rl_guard.control.config import load_config
    from rl_guard.control.controller import Controller

    cfg = load_config(
        "rules:\n  - {name: gate_drops, metric: rl_guard/funnel/accepted/keep_frac, op: '<', "
        "threshold: 0.8, action: warn}\n"
    )
    c = Controller(cfg)
    healthy = {"rl_guard/" + k: v for k, v in diag(funnel={"valid": 100, "accepted": 90}).items()}
    dropped = {"rl_guard/" + k: v for k, v in diag(funnel={"valid": 100, "accepted": 70}).items()}
    first = c.decide(healthy)
    c.step_done(first)
    second = c.decide(dropped)
    assert not first.firings and [f.rule.name for f in second.firings] == ["gate_drops"]
