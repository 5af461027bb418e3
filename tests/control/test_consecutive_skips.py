"""max_consecutive_skips: a fault that never clears ends in checkpoint_and_halt instead of skipping to max_steps."""

import pytest

from rl_guard.control.config import load_config
from rl_guard.control.controller import Controller
from rl_guard.errors import ConfigError

M = "rl_guard/kl_ref/k3_mean"
NO_BUILTINS = "builtin_rules: {nonfinite_loss: false, nonfinite_grad: false, nonfinite_logprobs: false}\n"


def controller(limit: int, action: str = "skip_step") -> Controller:
    return Controller(
        load_config(
            NO_BUILTINS + f"max_consecutive_skips: {limit}\nrules:\n"
            f'  - {{name: bad, metric: {M}, op: ">", threshold: 0, action: {action}}}\n'
        )
    )


def run(c: Controller, values) -> list[str | None]:
    actions = []
    for v in values:
        d = c.decide({M: v}, can_rollback=True)
        actions.append(d.action)
        c.step_done(d)
    return actions


@pytest.mark.parametrize("action", ["skip_step", "rollback"])
def test_the_nth_consecutive_dropped_update_halts(action):
    c = controller(3, action)
    assert run(c, [1, 1, 1]) == [action, action, "checkpoint_and_halt"]
    c2 = controller(3, action)
    d = None
    for v in (1, 1, 1):
        d = c2.decide({M: v}, can_rollback=True)
        c2.step_done(d)
    assert d.escalated_from == action and d.firings[0].action == "checkpoint_and_halt"
    assert d.messages[0].endswith("-> checkpoint_and_halt (3 consecutive dropped updates, max_consecutive_skips=3)")


def test_an_applied_update_resets_the_count_and_zero_turns_it_off():
    assert run(controller(3), [1, 1, 0, 1, 1, 0]) == ["skip_step", "skip_step", None, "skip_step", "skip_step", None]
    assert run(controller(0), [1] * 10) == ["skip_step"] * 10
    c = controller(2)
    run(c, [1])
    restored = controller(2)
    restored.load_state_dict(c.state_dict())
    assert run(restored, [1]) == ["checkpoint_and_halt"]  # the count survives a restart


def test_a_negative_limit_is_a_located_config_error():
    with pytest.raises(ConfigError, match="max_consecutive_skips"):
        load_config("version: 1\nmax_consecutive_skips: -1\n")
