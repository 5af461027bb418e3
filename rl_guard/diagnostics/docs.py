"""The metric documentation of every diagnostic family, collected for ``rl_guard.glossary``."""

from __future__ import annotations

from . import budget, critic, funnel, groups, quadrant, reward, termination, trend

DOCS: dict[str, str] = {}
for _family in (budget, critic, funnel, groups, quadrant, reward, termination, trend):
    DOCS.update(_family.DOCS)
