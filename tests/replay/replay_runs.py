"""Helpers shared by the replay tests (a module of its own: a bare ``import conftest`` finds whichever folder's
conftest pytest loaded last)."""

from __future__ import annotations


def quiet_demo_yaml(**sections) -> str:
    """The demo's rollback config with the console sink off."""
    from rl_guard.demo.run import demo_config

    return demo_config("rollback", console_every=None, **sections)


def incidents_key(records):
    """What must match between a live run's incidents and a replay's: step, rule, action and rollback target."""
    return [(r["step"], r["rule"], r["action"], r.get("restored_to_step")) for r in records]
