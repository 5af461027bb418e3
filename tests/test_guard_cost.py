"""``rl_guard/guard/host_ms`` and ``host_frac``: the guard's own host time per step cycle, as a user sees it in their
logs, is the time spent inside its calls, within what the calls took measured from outside; rules cannot watch
it."""

import math
import time

import pytest
import torch
from guard_loop import BUILTINS_NO_LOGPROBS

from rl_guard import Guard
from rl_guard.control.controller import MISSING_PATIENCE
from rl_guard.errors import ConfigError
from rl_guard.sinks.base import Sink

SINK_S, WORK_S = 0.03, 0.01


class SlowSink(Sink):
    """A real sink whose every log takes SINK_S (a slow disk or network): the guard's time, inside step_done."""

    def log(self, values, step, histograms=None):
        time.sleep(SINK_S)


def test_host_time_is_the_time_inside_the_guards_calls(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard.from_yaml(BUILTINS_NO_LOGPROBS, run_dir=tmp_path / "run", sinks=[SlowSink()]).attach(model, opt)
    took = []  # per step, each call's time measured from outside
    cycle, reported = [], []  # when each check started; the guard's own figures at each check

    def timed(name, call, *args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        took[-1][name] = time.perf_counter() - start
        return out

    for _ in range(6):
        took.append({})
        loss = model(torch.randn(16, 6)).pow(2).mean()
        time.sleep(WORK_S)  # the loop's own work, outside the guard
        timed("observe", guard.observe, loss=loss)
        loss.backward()
        cycle.append(time.perf_counter())
        timed("check", guard.check)
        reported.append({k: guard.last_metrics.get("rl_guard/guard/" + k) for k in ("host_ms", "host_frac")})
        opt.step()
        opt.zero_grad(set_to_none=True)
        timed("step_done", guard.step_done)
    assert reported[0] == {"host_ms": None, "host_frac": None}  # no cycle before the first check
    # Only what the clocks' nesting guarantees, however loaded the machine: how close the guard's figure comes to the
    # outside timer is a timing claim, made by benchmarks/guard_step.py (host_ms_over_outside).
    for t in range(1, 6):
        # the cycle that ends at this check: the previous check and step_done, this step's observe
        outside_ms = 1e3 * (took[t - 1]["check"] + took[t - 1]["step_done"] + took[t]["observe"])
        host_ms, frac = reported[t]["host_ms"], reported[t]["host_frac"]
        assert math.isfinite(host_ms) and math.isfinite(frac) and frac > 0
        # the sink's log (a sleep of at least SINK_S) runs inside step_done; the guard's clock runs inside each call
        assert 1e3 * SINK_S - 1e-6 <= host_ms <= outside_ms + 1e-6
        # the cycle host_frac divides by runs from inside one check to inside the next: between the outside marks
        # taken just before each check and the ends of those checks, and it holds both sleeps
        lap_ms = host_ms / frac
        cycle_ms = 1e3 * (cycle[t] - cycle[t - 1])
        assert cycle_ms - 1e3 * took[t - 1]["check"] - 1e-6 <= lap_ms <= cycle_ms + 1e3 * took[t]["check"] + 1e-6
        assert lap_ms >= 1e3 * (SINK_S + WORK_S) - 1e-6


def test_a_rule_on_host_time_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as err:
        Guard.from_yaml(
            BUILTINS_NO_LOGPROBS + "rules:\n  - name: slow\n    metric: rl_guard/guard/host_frac\n"
            "    op: '>'\n    threshold: 0.2\n    action: warn\n"
        )
    text = str(err.value)
    assert "rules[0].metric" in text and "line 4" in text and "differs between ranks" in text


def test_timing_adds_no_frame_warnings_still_point_at_the_caller(tmp_path):
    """The clock is a context manager inside each call, not a wrapper around it: a warning the guard raises for the
    caller (a rule whose metric is never reported) names the caller's line."""
    guard = Guard.from_yaml(
        BUILTINS_NO_LOGPROBS + "rules:\n  - {name: kl, metric: rl_guard/kl_ref/k3_mean, op: '>', "
        "threshold: 1.0, action: warn}\n",
        run_dir=tmp_path / "run",
    )
    with pytest.warns(RuntimeWarning, match="kl_ref/k3_mean") as record:
        for _ in range(MISSING_PATIENCE):  # the warning waits that many steps (some metrics come only now and then)
            guard.observe(loss=torch.tensor(0.5))
            guard.check()
            guard.step_done()
    assert [w.filename for w in record if "kl_ref/k3_mean" in str(w.message)] == [__file__]
