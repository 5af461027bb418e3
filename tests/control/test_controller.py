"""Controller: precedence, escalation, every rule every step, and state that survives a restart."""

import copy
import io
import math

import pytest
import torch

from rl_guard import Guard
from rl_guard.control.config import load_config
from rl_guard.control.controller import PRECEDENCE, Controller

M = "rl_guard/kl_ref/k3_mean"
NO_BUILTINS = "builtin_rules: {nonfinite_loss: false, nonfinite_grad: false, nonfinite_logprobs: false}\n"


def ladder(actions, extra: str = "") -> Controller:
    rules = "".join(f'  - {{name: r_{a}, metric: {M}, op: ">", threshold: 0, action: {a}}}\n' for a in actions)
    return Controller(load_config(NO_BUILTINS + extra + "rules:\n" + rules))


@pytest.mark.parametrize("k", range(len(PRECEDENCE)))
def test_precedence_strongest_action_wins_and_every_reason_is_kept(k):
    """rollback > checkpoint_and_halt > early_stop > skip_step > warn, whatever the rule order."""
    actions = list(reversed(PRECEDENCE[: k + 1]))  # strongest listed first, then again weakest first
    for order in (actions, actions[::-1]):
        d = ladder(order).decide({M: 1.0}, can_rollback=True)
        assert d.action == PRECEDENCE[k]
        assert sorted(f.rule.name for f in d.firings) == sorted(f"r_{a}" for a in order)  # all reasons logged
        assert all(m.endswith(f"-> {f.action}") for m, f in zip(d.messages, d.firings))
        assert d.apply_step == (PRECEDENCE[k] == "warn")
        assert d.stop == (PRECEDENCE[k] in ("early_stop", "checkpoint_and_halt"))


def test_rollback_without_snapshot_escalates_to_checkpoint_and_halt():
    d = ladder(["warn", "rollback"]).decide({M: 1.0}, can_rollback=False)
    assert d.action == "checkpoint_and_halt" and d.escalated_from == "rollback" and d.stop and d.save
    assert d.messages == [
        f"[rule r_warn] {M} = 1 > 0 at step 0 (rank 0) -> warn",
        f"[rule r_rollback] {M} = 1 > 0 at step 0 (rank 0) -> checkpoint_and_halt"
        " (no trusted healthy snapshot to restore yet)",
    ]


def test_rollback_budget_spent_escalates():
    ctl = ladder(["rollback"], extra="rollback: {max_rollbacks: 2}\n")
    actions = []
    for _ in range(3):
        d = ctl.decide({M: 1.0}, can_rollback=True)
        actions.append(d.action)
        ctl.step_done(d)
    assert actions == ["rollback", "rollback", "checkpoint_and_halt"]
    assert ctl.counters()["rl_guard/guard/rollbacks"] == 2.0


def test_every_rule_is_evaluated_every_step():
    """A rule's patience keeps counting while another rule fires (and after the decision is taken)."""
    ctl = Controller(
        load_config(
            NO_BUILTINS + "rules:\n"
            f'  - {{name: hard, metric: {M}, op: ">", threshold: 0.5, action: skip_step}}\n'
            f'  - {{name: slow, metric: {M}, op: ">", threshold: 0.1, patience: 2, action: warn}}\n'
        )
    )
    names = []
    for x in (0.9, 0.9, 0.05):
        d = ctl.decide({M: x})
        names.append([f.rule.name for f in d.firings])
        ctl.step_done(d)
    assert names == [["hard"], ["hard", "slow"], []]
    assert ctl.skipped_steps == 2


def test_missing_metric_warns_once():
    from rl_guard.control.controller import MISSING_PATIENCE

    ctl = ladder(["warn"])
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error")  # metrics that arrive only on generation steps are absent for a while: no noise
        for _ in range(MISSING_PATIENCE - 1):
            ctl.decide({"rl_guard/entropy/mean": 1.0})
    with pytest.warns(RuntimeWarning, match="r_warn.*not reported"):
        ctl.decide({"rl_guard/entropy/mean": 1.0})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctl.decide({"rl_guard/entropy/mean": 1.0})


# --- state round trip -------------------------------------------------------------------------------------------
ROUND_TRIP = (
    NO_BUILTINS
    + """
rollback: {max_rollbacks: 2}
rules:
  - {name: patient, metric: rl_guard/kl_ref/k3_mean, op: ">", threshold: 0.5, patience: 3, action: warn}
  - {name: cool, metric: rl_guard/kl_ref/k3_mean, op: ">", threshold: 0.8, cooldown_steps: 4, action: skip_step}
  - {name: robust, metric: rl_guard/grad/norm,
     spike: {method: mad, window: 16, threshold: 4, min_history: 6}, action: warn}
  - {name: ema, metric: rl_guard/entropy/mean,
     spike: {method: ema_z, window: 8, threshold: 3, direction: down, min_history: 4}, action: warn}
  - {name: early, metric: rl_guard/grad/norm, spike: {method: early_max, window: 5, factor: 4}, action: warn}
  - {name: far, metric: rl_guard/ratio/p99, op: ">", threshold: 2, action: rollback}
"""
)


def _metric_sequence(n=40):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        u = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        out.append(
            {
                M: u[0],
                "rl_guard/grad/norm": 1.0 + 0.2 * u[1] + (6.0 if i in (14, 30) else 0.0),
                "rl_guard/entropy/mean": 2.0 - 0.05 * u[2] - (1.5 if i == 25 else 0.0),
                "rl_guard/ratio/p99": 3.0 if i in (12, 22, 33) else 1.0 + 0.1 * u[3],
            }
        )
    out[18]["rl_guard/grad/norm"] = math.nan
    return out


def _trace(ctl: Controller, seq):
    out = []
    for m in seq:
        d = ctl.decide(m, can_rollback=True)
        out.append((d.action, d.escalated_from, tuple(d.messages), tuple(tuple(f.window.items()) for f in d.firings)))
        ctl.step_done(d)
    return out


def _through_disk(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("cut", [5, 13, 16, 24])
def test_resumed_controller_behaves_like_uninterrupted(cut):
    seq = _metric_sequence()
    cfg = load_config(ROUND_TRIP)
    whole = _trace(Controller(cfg), seq)
    first = Controller(cfg)
    head = _trace(first, seq[:cut])
    state = first.state_dict()
    frozen = copy.deepcopy(state)
    _trace(first, seq[cut:])  # going on must not change a state dict already taken
    assert state == frozen
    resumed = Controller(cfg)
    resumed.load_state_dict(_through_disk(state))
    assert head + _trace(resumed, seq[cut:]) == whole
    # The scenario exercises what must survive: patience, cooldown, spike history, rollback budget.
    actions = [a for a, *_ in whole]
    assert actions.count("rollback") == 2 and "checkpoint_and_halt" in actions and "skip_step" in actions


LOSS_RULES = """
builtin_rules: {nonfinite_logprobs: false}
snapshots: {healthy_steps: 2, every: 2, keep: 2, where: disk}
rollback: {max_rollbacks: 2}
rules:
  - {name: loss_high, metric: rl_guard/loss/value, op: ">", threshold: 5, action: rollback}
  - {name: loss_warm, metric: rl_guard/loss/value, op: ">", threshold: 1.5, patience: 2, action: warn}
  - {name: loss_spike, metric: rl_guard/loss/value,
     spike: {method: mad, window: 8, threshold: 5, min_history: 4}, action: warn}
"""
LOSSES = [1.0, 1.1, 0.9, 1.0, 9.0, 1.0, 1.2, 2.0, 2.0, 1.0, 1.1, 1.0, 9.0, 1.0, 2.0, 2.0, 1.0, 9.0, 1.0]


def _guard_trace(guard, model, opt, losses):
    out = []
    for value in losses:
        loss = (model.weight * 0).sum() + value  # the loss value is exactly ``value``
        guard.observe(loss=loss)
        loss.backward()
        d = guard.check()
        if d.apply_step:
            opt.step()
        opt.zero_grad()
        guard.step_done()
        out.append((d.action, tuple(d.messages), tuple(guard.actions.snapshots.steps()), guard.controller.rollbacks))
        if d.stop:
            break
    return out


def _guard(tmp_path, name):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Guard.from_yaml(LOSS_RULES, run_dir=tmp_path / name).attach(model, opt), model, opt


def test_resumed_guard_behaves_like_uninterrupted(tmp_path):
    """History, rule counters, rollback budget and the (disk) snapshot index all survive state_dict()."""
    cut = 10
    g, model, opt = _guard(tmp_path, "whole")
    whole = _guard_trace(g, model, opt, LOSSES)
    g.close()
    g1, model1, opt1 = _guard(tmp_path, "first")
    head = _guard_trace(g1, model1, opt1, LOSSES[:cut])
    state = _through_disk(g1.state_dict())
    g1.close()
    g2, model2, opt2 = _guard(tmp_path, "resumed")
    model2.load_state_dict(model1.state_dict())
    g2.load_state_dict(state)
    assert g2.step == cut and g2.actions.snapshots.steps() == g1.actions.snapshots.steps()
    tail = _guard_trace(g2, model2, opt2, LOSSES[cut:])
    g2.close()
    assert head + tail == whole
    assert [a for a, *_ in whole].count("rollback") == 2 and whole[-1][0] == "checkpoint_and_halt"
