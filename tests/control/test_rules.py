"""Rules are pure functions (metrics, history) -> verdict; warmup/patience/cooldown via the controller.

Every expectation below is computed by hand (or in float64 numpy) from the formulas in rl_guard/control/rules.py.
"""

import math

import numpy as np
import pytest

from rl_guard.control.config import load_config
from rl_guard.control.controller import Controller
from rl_guard.control.rules import Condition, History, Rule

NAN, INF = float("nan"), float("inf")
M = "rl_guard/kl_ref/k3_mean"
NO_BUILTINS = "builtin_rules: {nonfinite_loss: false, nonfinite_grad: false, nonfinite_logprobs: false}\n"


def controller(*rules: str, extra: str = "") -> Controller:
    text = NO_BUILTINS + extra + "rules:\n" + "".join(f"  - {r}\n" for r in rules)
    return Controller(load_config(text))


def fired_steps(rule: str, seq, metric: str = M) -> list[int]:
    """Feed ``seq`` one value per step; return the steps at which the rule acted."""
    ctl, out = controller(rule), []
    for x in seq:
        d = ctl.decide({metric: x})
        if d.firings:
            out.append(ctl.step)
        ctl.step_done(d)
    return out


def rule(op_part: str, mods: str = "") -> str:
    return "{name: r, metric: " + M + ", " + op_part + ", action: warn" + (", " + mods if mods else "") + "}"


@pytest.mark.parametrize(
    "spec, seq, expected",
    [
        (rule('op: ">", threshold: 0.2'), [0.1, 0.2, 0.3, 0.1], [2]),
        (rule('op: ">=", threshold: 0.2'), [0.1, 0.2, 0.3, 0.1], [1, 2]),
        (rule('op: "<", threshold: 0.02'), [0.5, 0.02, 0.01], [2]),
        (rule('op: "<=", threshold: 0.02'), [0.5, 0.02, 0.01], [1, 2]),
        (rule("op: outside, band: [0.95, 1.05]"), [1.0, 0.95, 1.05, 1.06, 0.94], [3, 4]),
        (rule("op: nonfinite"), [1.0, 1e30, NAN, INF, -INF, 2.0], [2, 3, 4]),
        # A non-finite value fires every condition, whatever its direction: NaN is never "within" a threshold.
        (rule('op: ">", threshold: 0.2'), [0.1, NAN, 0.1], [1]),
        (rule('op: "<", threshold: 0.02'), [0.5, INF], [1]),
        (rule("op: outside, band: [0.95, 1.05]"), [1.0, -INF], [1]),
        # warmup_steps: nothing acts before step 3; a NaN bypasses warmup.
        (rule('op: ">", threshold: 0.2', "warmup_steps: 3"), [0.3, 0.3, 0.3, 0.3, 0.1], [3]),
        (rule('op: ">", threshold: 0.2', "warmup_steps: 3"), [NAN, 0.1, 0.1, 0.3], [0, 3]),
        # patience: 3 consecutive firing steps; a break resets the count; inf bypasses patience.
        (rule('op: ">", threshold: 0.2', "patience: 3"), [0.3, 0.3, 0.1, 0.3, 0.3, 0.3, 0.3], [5, 6]),
        (rule('op: ">", threshold: 0.2', "patience: 3"), [0.1, INF, 0.1], [1]),
        # cooldown_steps: after acting at s, silent until s + cooldown + 1.
        (rule('op: ">", threshold: 0.2', "cooldown_steps: 2"), [0.3] * 6, [0, 3]),
        (rule('op: ">", threshold: 0.2', "patience: 2, cooldown_steps: 1"), [0.3] * 5, [1, 3]),
        (rule('op: ">", threshold: 0.2', "warmup_steps: 2, patience: 2"), [0.3, 0.3, 0.3, 0.1], [2]),
    ],
)
def test_threshold_rules_trigger_at_expected_step(spec, seq, expected):
    assert fired_steps(spec, seq) == expected


# --- spike detectors, hand computed -------------------------------------------------------------------------------
# MAD over [1..8]: median 4.5, |dev| = [3.5 2.5 1.5 .5 .5 1.5 2.5 3.5] -> MAD 2.0 -> scale 1.4826*2 = 2.9652;
# threshold 3 -> limit 4.5 + 3 * 2.9652 = 13.3956.
MAD_RULE = "{name: r, metric: " + M + ", spike: {method: mad, window: 8, threshold: 3, min_history: 8}, action: warn}"
# MAD = 0 over [1]*7 + [2]: fallback scale 1.2533 * mean|dev| = 1.2533 * 0.125 = 0.1566625; limit 1 + 6 * that.
MAD0_RULE = "{name: r, metric: " + M + ", spike: {method: mad, window: 8, threshold: 6, min_history: 8}, action: warn}"
# EMA, window 3 (alpha 0.5) over [1, 2, 3]: m 1 -> 1.5 -> 2.25; s^2 0 -> 0.25 -> 0.6875; threshold 2:
# limits 2.25 +- 2 * sqrt(0.6875) = 2.25 +- 1.6583124 -> (0.5916876, 3.9083124).
EMA = (
    "{name: r, metric: "
    + M
    + ", spike: {method: ema_z, window: 3, threshold: 2, min_history: 3, direction: %s}, action: warn}"
)
# early_max, window 3, factor 10 over first values [0.1, 0.25, 0.2]: limit 10 * 0.25 = 2.5 (x >= limit fires).
EARLY = "{name: r, metric: " + M + ", spike: {method: early_max, window: 3, factor: 10}, action: warn}"


@pytest.mark.parametrize(
    "spec, seq, expected",
    [
        (MAD_RULE, [1, 2, 3, 4, 5, 6, 7, 8, 13.39], []),
        (MAD_RULE, [1, 2, 3, 4, 5, 6, 7, 8, 13.40], [8]),
        (MAD_RULE, [1, 2, 3, 4, 5, 6, 7, 100], []),  # min_history 8: only 7 values known at step 7
        (MAD_RULE, [1, 2, 3, 4, 5, 6, 7, NAN], [7]),  # ...but a NaN needs no history
        (MAD0_RULE, [1, 1, 1, 1, 1, 1, 1, 2, 1.93], []),
        (MAD0_RULE, [1, 1, 1, 1, 1, 1, 1, 2, 1.95], [8]),
        (EMA % "up", [1, 2, 3, 3.90], []),
        (EMA % "up", [1, 2, 3, 3.92], [3]),
        (EMA % "up", [1, 2, 3, 0.5], []),
        (EMA % "down", [1, 2, 3, 0.5], [3]),
        (EMA % "down", [1, 2, 3, 0.6], []),
        (EMA % "down", [1, 2, 3, 3.92], []),
        (EMA % "both", [1, 2, 3, 0.5], [3]),
        (EMA % "both", [1, 2, 3, 3.92], [3]),
        (EMA % "both", [1, 2, 3, 2.0], []),
        (EARLY, [0.1, 0.25, 0.2, 2.4, 2.5, 0.2], [4]),
        (EARLY, [0.1, 5.0, 0.2, 2.9], []),  # not armed before 3 values; the early spike then raises the bar
    ],
)
def test_spike_detectors_trigger_at_hand_computed_step(spec, seq, expected):
    assert fired_steps(spec, seq) == expected


def _hist(values, metric=M) -> History:
    h = History()
    for v in values:
        h.push({metric: v})
    return h


def test_spike_verdicts_report_limits_in_metric_units():
    cond = Condition({"metric": M, "spike": {"method": "mad", "window": 8, "threshold": 3, "min_history": 8}})
    v = cond.evaluate({M: 14.0}, _hist(range(1, 9)))
    arr = np.arange(1, 9, dtype=np.float64)
    limit = np.median(arr) + 3 * 1.4826 * np.median(np.abs(arr - np.median(arr)))
    assert v.fired and v.op == ">" and v.threshold == pytest.approx(limit, rel=1e-12)
    assert v.reason == f"{M} = 14 > 13.4" and "robust z" in v.detail

    ema = Condition(
        {"metric": M, "spike": {"method": "ema_z", "window": 3, "threshold": 2, "min_history": 3, "direction": "down"}}
    )
    v = ema.evaluate({M: 0.5}, _hist([1, 2, 3]))
    assert v.fired and v.op == "<" and v.threshold == pytest.approx(2.25 - 2 * math.sqrt(0.6875), rel=1e-12)

    early = Condition({"metric": M, "spike": {"method": "early_max", "window": 3, "factor": 10}})
    v = early.evaluate({M: 2.5}, _hist([0.1, 0.25, 0.2, 0.3]))  # only the first 3 values count
    assert v.fired and v.op == ">=" and v.threshold == 2.5 and v.reason == f"{M} = 2.5 >= 2.5"


def test_rules_are_pure():
    """Same inputs, same verdict; evaluation never mutates the history or the metrics."""
    r = Rule({"name": "r", "metric": M, "spike": {"method": "mad", "window": 8, "threshold": 3}, "action": "warn"})
    h = _hist(range(1, 9))
    before = h.state_dict()
    metrics = {M: 20.0}
    v1, v2 = r.evaluate(metrics, h), r.evaluate(metrics, h)
    assert v1 == v2 and v1.fired
    assert h.state_dict() == before and metrics == {M: 20.0}


E = "rl_guard/entropy/mean"
COMPOSITE = (
    "{name: c, %s: [{metric: "
    + M
    + ', op: ">", threshold: 0.2}, {metric: '
    + E
    + ', op: "<", threshold: 0.1}], action: warn}'
)


@pytest.mark.parametrize("mode, expected", [("all", [2]), ("any", [0, 1, 2])])
def test_composite_all_any(mode, expected):
    ctl, out, messages = controller(COMPOSITE % mode), [], []
    for m in ({M: 0.3, E: 0.5}, {M: 0.1, E: 0.05}, {M: 0.3, E: 0.05}, {M: 0.1, E: 0.5}):
        d = ctl.decide(m)
        if d.firings:
            out.append(ctl.step)
            messages.append(d.firings[0].message)
        ctl.step_done(d)
    assert out == expected
    joined = f"{M} = 0.3 > 0.2 and {E} = 0.05 < 0.1" if mode == "all" else f"{M} = 0.3 > 0.2 or {E} = 0.05 < 0.1"
    assert messages[-1] == f"[rule c] {joined} at step 2 (rank 0) -> warn"


def test_composite_nonfinite_bypasses_warmup_only_when_the_composite_fires():
    spec = COMPOSITE.replace("action: warn", "action: warn, warmup_steps: 5")
    for mode, expected in (("any", [0]), ("all", [])):
        ctl = controller(spec % mode)
        d = ctl.decide({M: NAN, E: 0.5})
        assert [f.rule.name for f in d.firings] == (["c"] if expected else [])


def test_message_template_exact():
    ctl = Controller(
        load_config(
            NO_BUILTINS
            + "rules:\n  - {name: kl_spike, metric: "
            + M
            + ', op: ">", threshold: 0.2, action: checkpoint_and_halt}\n'
        ),
        rank=3,
    )
    ctl.step = 812
    d = ctl.decide({M: 0.31})
    assert d.messages == [f"[rule kl_spike] {M} = 0.31 > 0.2 at step 812 (rank 3) -> checkpoint_and_halt"]
    d = ctl.decide({M: NAN})
    assert d.messages == [f"[rule kl_spike] {M} = nan is non-finite at step 812 (rank 3) -> checkpoint_and_halt"]
    band = Controller(
        load_config(
            NO_BUILTINS + "rules:\n  - {name: mid, metric: rl_guard/ratio/p50, op: outside, "
            "band: [0.952, 1.05], action: warn}\n"
        )
    )
    assert band.decide({"rl_guard/ratio/p50": 0.8446}).messages == [
        "[rule mid] rl_guard/ratio/p50 = 0.8446 outside [0.952, 1.05] at step 0 (rank 0) -> warn"
    ]


def test_builtin_nonfinite_rule_ignores_warmup_and_reports_count():
    ctl = Controller(load_config("rules: []\n"))
    d = ctl.decide(
        {"rl_guard/grad/nonfinite": 2.0, "rl_guard/loss/nonfinite": 0.0, "rl_guard/input/logprobs/nonfinite": 0.0}
    )
    assert d.action == "skip_step"
    assert d.messages == ["[rule nonfinite_grad] rl_guard/grad/nonfinite = 2 > 0 at step 0 (rank 0) -> skip_step"]
