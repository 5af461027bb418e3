"""What ``import rl_guard`` offers: every name in ``__all__`` resolves (imported on first use), the exceptions a user
meets among them, and the actions as one type whose values are the YAML's own strings."""

from __future__ import annotations

from typing import get_args

import pytest

import rl_guard


@pytest.mark.parametrize("name", rl_guard.__all__)
def test_every_name_in_all_resolves(name):
    assert getattr(rl_guard, name) is not None


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Guardd'"):
        rl_guard.Guardd  # noqa: B018


def test_the_exceptions_a_user_meets_are_exported_where_they_are_raised_from():
    from rl_guard.diagnostics.samples import SampleError
    from rl_guard.errors import ConfigError, GuardHalted, InputError
    from rl_guard.stats.ranks import RankMismatch

    assert (
        rl_guard.InputError,
        rl_guard.ConfigError,
        rl_guard.SampleError,
        rl_guard.RankMismatch,
        rl_guard.GuardHalted,
    ) == (InputError, ConfigError, SampleError, RankMismatch, GuardHalted)
    # one ``except rl_guard.InputError`` catches every wrong input, the configuration's and the samples' included
    assert issubclass(rl_guard.ConfigError, rl_guard.InputError) and issubclass(
        rl_guard.SampleError, rl_guard.InputError
    )


def test_action_values_are_the_yaml_strings_in_precedence_order():
    from rl_guard.control.config import ACTIONS
    from rl_guard.control.rules import Rule

    assert (
        get_args(rl_guard.Action) == ACTIONS == ("warn", "skip_step", "early_stop", "checkpoint_and_halt", "rollback")
    )
    config = rl_guard.load_config(
        "rules:\n  - {name: big, metric: rl_guard/grad/norm, op: '>', threshold: 1, action: rollback}\n"
    )
    rule = Rule(config.rules[0])
    assert rule.action == "rollback" and rule.action in get_args(rl_guard.Action)
    decision = rl_guard.Decision(step=0, action="rollback")
    assert decision.rollback and decision.skip_step and not decision.stop
