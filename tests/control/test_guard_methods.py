"""The ``Guard`` methods adapters use instead of the controller's and the actions' internals: ``take_restored``,
``start_at``, ``mark_reported_absent`` and the read-only ``skipped_steps`` / ``rollbacks``."""

import warnings

import pytest
import torch
from bitwise import assert_same
from guard_loop import full_state, setup, train_step

from rl_guard.control.controller import MISSING_PATIENCE

ROLLBACK = """
snapshots: {healthy_steps: 2, every: 2, keep: 2}
rollback: {max_rollbacks: 2}
rules:
  - {name: big_grad, metric: rl_guard/grad/norm, op: ">", threshold: 100, action: rollback}
"""


def test_take_restored_carries_out_a_deferred_rollback_once(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ROLLBACK)
    after = []  # the state after each step
    for _ in range(3):
        assert train_step(guard, model, opt, sched).action is None
        after.append(full_state(model, opt, sched))
    assert guard.take_restored() is None  # nothing pending
    assert guard.actions.snapshots.steps() == [0, 2]  # 0: the starting state
    snapshot = after[1]  # the snapshot of step 2: the state before it, after two steps
    loss = model(torch.randn(16, 6)).pow(2).mean() * 1e4
    guard.observe(loss=loss)
    loss.backward()
    decision = guard.check(defer_restore=True)
    assert decision.action == "rollback" and not decision.apply_step
    assert guard.take_restored() == 2  # the restored snapshot's step
    assert_same(snapshot["model"], model.state_dict(), "model")
    assert guard.take_restored() is None  # carried out once
    opt.zero_grad(set_to_none=True)
    guard.step_done()
    assert (guard.rollbacks, guard.skipped_steps) == (1, 1)  # its update was dropped as well
    guard.close()


def test_counters_are_read_only_views_of_the_guards_own(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ROLLBACK)
    train_step(guard, model, opt, sched)
    # the built-in non-finite rule skips it; big_grad sees the NaN norm too and rolls back to the starting state
    train_step(guard, model, opt, sched, poison=float("nan"))
    assert guard.skipped_steps == 1 and guard.rollbacks == 1
    for name in ("skipped_steps", "rollbacks"):
        with pytest.raises(AttributeError):
            setattr(guard, name, 0)
    guard.close()


def test_start_at_numbers_the_first_step_and_only_before_it(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ROLLBACK)
    guard.start_at(40)  # a trainer resuming at its own count
    assert guard.step == 40
    assert train_step(guard, model, opt, sched).step == 40
    assert guard.step == 41
    guard.start_at(7)  # the guard has stepped: its count stands
    assert guard.step == 41
    guard.close()


def test_mark_reported_absent_silences_the_missing_metric_warning(tmp_path):
    rule = "rules:\n  - {name: kl, metric: rl_guard/kl_ref/k3_mean, op: '>', threshold: 1.0, action: warn}\n"
    for marked in (False, True):
        guard, model, opt, sched = setup(tmp_path / str(marked), rule)
        if marked:  # an adapter's coverage report already said the run does not produce it
            guard.mark_reported_absent(["rl_guard/kl_ref/k3_mean"])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(MISSING_PATIENCE):
                train_step(guard, model, opt, sched)
        said = [w for w in record if "kl_ref/k3_mean" in str(w.message)]
        assert len(said) == (0 if marked else 1)
        guard.close()
