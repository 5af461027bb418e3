"""``Rule.fires`` (the controller's per-step test, which builds no verdict) is exactly ``Rule.evaluate(...).fired``
for every kind of condition, on values with NaN, inf, spikes and absent metrics."""

import math

import numpy as np

from rl_guard.control.config import load_config
from rl_guard.control.controller import MISSING_PATIENCE, Controller
from rl_guard.control.rules import History

A, B = "rl_guard/kl_ref/k3_mean", "rl_guard/grad/norm"
RULES = f"""
builtin_rules: {{nonfinite_loss: false, nonfinite_grad: false, nonfinite_logprobs: false}}
rules:
  - {{name: gt, metric: {A}, op: ">", threshold: 1.2, action: warn}}
  - {{name: ge, metric: {A}, op: ">=", threshold: 1.0, action: warn}}
  - {{name: lt, metric: {B}, op: "<", threshold: 0.5, action: warn}}
  - {{name: le, metric: {B}, op: "<=", threshold: 0.5, action: warn}}
  - {{name: band, metric: {A}, op: outside, band: [0.8, 1.3], action: warn}}
  - {{name: nf, metric: {B}, op: nonfinite, action: warn}}
  - {{name: mad_up, metric: {A}, spike: {{method: mad, window: 16, threshold: 2, min_history: 5}}, action: warn}}
  - {{name: mad_both, metric: {B},
      spike: {{method: mad, window: 9, threshold: 1.5, direction: both, min_history: 3}}, action: warn}}
  - {{name: ema_down, metric: {B},
      spike: {{method: ema_z, window: 6, threshold: 1, direction: down, min_history: 2}}, action: warn}}
  - {{name: early, metric: {A}, spike: {{method: early_max, window: 4, factor: 1.3}}, action: warn}}
  - {{name: all2, all: [{{metric: {A}, op: ">", threshold: 1.0}}, {{metric: {B}, op: "<", threshold: 1.0}}],
      action: warn}}
  - {{name: any2, any: [{{metric: {A}, op: "<", threshold: 0.9}},
                        {{metric: {B}, spike: {{method: mad, window: 8, threshold: 1, min_history: 3}}}}],
      action: warn}}
"""


def test_fires_is_evaluate_fired():
    rules = Controller(load_config(RULES)).rules
    rng = np.random.default_rng(0)
    history, fired, checked = History(maxlen=16, early=4), set(), 0
    for step in range(400):
        metrics = {}
        for name in (A, B):
            r = rng.random()
            if r < 0.1:
                continue  # absent this step
            v = float(rng.normal(1.0, 0.2))
            metrics[name] = math.nan if r > 0.98 else (math.inf if r > 0.96 else (-v if r > 0.9 else v))
        for rule in rules:
            want = rule.evaluate(metrics, history).fired
            assert rule.fires(metrics, history) == want, (step, rule.name, metrics)
            fired |= {rule.name} if want else set()
            checked += 1
        history.push(metrics)
    assert fired == {r.name for r in rules}  # every kind of condition was seen firing
    assert checked == 400 * len(rules)


def test_a_metric_watched_by_several_rules_waits_the_full_patience():
    ctl = Controller(load_config(RULES))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(MISSING_PATIENCE - 1):  # B is watched by six rules: still one count per step
            ctl.step_done(ctl.decide({A: 1.0}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctl.decide({A: 1.0})
    assert [str(w.message).split(",")[0] for w in caught] == [f"rl_guard: rule 'lt' watches {B}"]
