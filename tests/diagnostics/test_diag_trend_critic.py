"""length/, trend/ (and the reward-hacking triad rule) and critic/."""

import math

import numpy as np
import pytest

from rl_guard.control.config import load_config
from rl_guard.control.controller import Controller
from rl_guard.diagnostics import TRIAD_RULE, RunDiagnostics, SampleBatch
from rl_guard.diagnostics import trend as trend_module


def _batch(reward_mean, length, outcome_mean=0.5):
    # Four samples with the requested means: rewards m +/- 0.1, lengths constant, outcomes half successes.
    return dict(
        rewards=[reward_mean - 0.1, reward_mean + 0.1] * 2,
        lengths=[length] * 4,
        outcome=[1, 0, 1, 0] if outcome_mean == 0.5 else [outcome_mean] * 4,
    )


def test_no_eos_frac(diag):
    assert diag(truncated=[True, False, False, False])["length/no_eos_frac"] == 0.25


def test_trend_slopes_over_window(diag):
    d = RunDiagnostics(window=3)
    out = [diag(s, d, **_batch(r, n)) for s, (r, n) in enumerate([(0.1, 100), (0.2, 110), (0.4, 130), (0.5, 160)])]
    assert "trend/reward_slope" not in out[1]  # two points: below the 3-point minimum
    assert out[1]["trend/reward_mean"] == pytest.approx(0.2)
    # three equally spaced points: slope = (y2 - y0) / 2.
    assert out[2]["trend/reward_slope"] == pytest.approx((0.4 - 0.1) / 2)
    assert out[2]["trend/length_slope"] == pytest.approx((130 - 100) / 2)
    # window 3 drops step 0: points 1..3.
    assert out[3]["trend/reward_slope"] == pytest.approx((0.5 - 0.2) / 2)
    assert out[3]["trend/length_slope"] == pytest.approx((160 - 110) / 2)
    assert out[3]["trend/outcome_slope"] == 0.0 and out[3]["trend/outcome_mean"] == 0.5


def test_trend_slope_is_per_training_step_and_replay_drops_points(diag):
    d = RunDiagnostics(window=5)
    for step, y in ((0, 0.0), (10, 1.0), (20, 2.0)):
        m = diag(step, d, lengths=[y])
    assert m["trend/length_slope"] == pytest.approx(0.1)  # 1 token per 10 steps
    # Resume from step 10: the points at steps 10 and 20 are replaced, leaving (0, 0) and (10, 5): 2 points.
    m = diag(10, d, lengths=[5.0])
    assert "trend/length_slope" not in m
    m = diag(20, d, lengths=[10.0])
    assert m["trend/length_slope"] == pytest.approx(0.5)  # (0,0) (10,5) (20,10)


def test_triad_snippet_is_in_the_docstring_and_valid_yaml():
    assert TRIAD_RULE in trend_module.__doc__
    cfg = load_config("rules:\n" + TRIAD_RULE)
    assert [r["name"] for r in cfg.rules] == ["reward_hacking_triad"]


@pytest.mark.filterwarnings("ignore:rl_guard. rule")  # slopes are absent for the first two steps
@pytest.mark.parametrize("outcome_rises, expect", [(False, True), (True, False)])
def test_triad_fires_only_when_outcome_stays_flat(outcome_rises, expect):
    cfg = load_config("rules:\n" + TRIAD_RULE)
    c, d = Controller(cfg), RunDiagnostics(window=5)
    fired = []
    for step in range(8):
        # reward +0.01 / step, length +5 tokens / step; outcome either flat at 0.5 or +0.05 / step.
        outcome = [min(1.0, 0.3 + 0.05 * step)] * 4 if outcome_rises else [1, 0, 1, 0]
        m = d.update(SampleBatch(rewards=[0.2 + 0.01 * step] * 4, lengths=[100 + 5 * step] * 4, outcome=outcome), step)
        decision = c.decide(m)
        fired.append(bool(decision.firings))
        c.step_done(decision)
    # Slopes exist from step 2; patience 3 -> first firing at step 4 when the outcome is flat.
    assert fired == ([False] * 4 + [True] * 4 if expect else [False] * 8)


def test_critic_explained_variance_and_buckets(diag):
    g = np.arange(1.0, 9.0)
    e = np.array([0, 0, 0, 0, 1, 1, 1, 1.0])
    m = diag(
        returns=g,
        values=g - e,
        lengths=[10, 20, 30, 40, 50, 60, 70, 80],
        rewards=[0, 0, 0, 0, 1, 1, 1, 1],
        termination=["success"] * 4 + ["timeout"] * 4,
        versions=[5] * 7 + [6],
    )
    # Var(G) of 1..8 = (8^2 - 1) / 12 = 5.25; Var(G - V) = Var(e) = 0.25; EV = 1 - 0.25 / 5.25 = 20/21.
    assert m["critic/var_return"] == pytest.approx(5.25) and m["critic/n"] == 8
    assert m["critic/ev"] == pytest.approx(20 / 21) and m["critic/ev_unreliable"] == 0
    assert m["critic/residual/mean"] == pytest.approx(0.5)
    # length quartile edges (linear): 27.5, 45, 62.5 -> q1 {10,20} q2 {30,40} q3 {50,60} q4 {70,80}.
    assert [m[f"critic/residual/length/q{q}"] for q in (1, 2, 3, 4)] == [0, 0, 1, 1]
    # reward edges 0, 0.5, 1: r = 0 -> q1 (not > 0), r = 1 -> q3 (> 0, > 0.5, not > 1); q2, q4 empty.
    assert m["critic/residual/reward/q1"] == 0 and m["critic/residual/reward/q3"] == 1
    assert "critic/residual/reward/q2" not in m and "critic/residual/reward/q4" not in m
    assert m["critic/residual/term/success"] == 0 and m["critic/residual/term/timeout"] == 1
    assert m["critic/residual/version/5"] == pytest.approx(3 / 7) and m["critic/residual/version/6"] == 1


def test_critic_constant_return_small_n_and_system_errors(diag):
    m = diag(returns=[2.0] * 9, values=np.arange(9.0))
    assert m["critic/var_return"] == 0 and "critic/ev" not in m and m["critic/ev_unreliable"] == 1
    assert m["critic/residual/mean"] == pytest.approx(2.0 - 4.0)  # mean V = 36 / 9 = 4
    tiny = 1.0 + 1e-5 * np.arange(10.0)  # Var = 1e-10 * 8.25 < 1e-8: reported, but flagged unreliable
    m = diag(returns=tiny, values=np.ones(10))
    assert m["critic/var_return"] == pytest.approx(8.25e-10) and m["critic/ev_unreliable"] == 1
    assert math.isfinite(m["critic/ev"])
    m = diag(returns=[1.0, 2.0, 3.0], values=[1.0, 2.0, 3.0])
    assert m["critic/ev"] == 1.0 and m["critic/ev_unreliable"] == 1  # n = 3 < 8
    # A system error with a bogus return changes nothing.
    m = diag(
        returns=[1.0, 2.0, 3.0, 100.0], values=[1.0, 2.0, 3.0, 0.0], termination=["success"] * 3 + ["environment_error"]
    )
    assert m["critic/n"] == 3 and m["critic/ev"] == 1.0 and m["critic/residual/mean"] == 0.0
    m = diag(returns=[math.nan, math.nan], values=[0.0, 0.0])
    assert m["critic/n"] == 0 and m["critic/ev_unreliable"] == 1 and "critic/var_return" not in m
