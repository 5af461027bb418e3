"""Offline report for a run directory: PNG plots of the health metrics with rule markers, plus report.md.

Needs the optional extra ``rl-guard[report]`` (matplotlib), imported only when a report is rendered. The names
below are imported on first use, so ``rl-guard report --help`` loads neither numpy nor matplotlib.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"render_report": ".render", "ReportDependencyError": ".render", "add_arguments": ".cli", "main": ".cli"}
__all__ = ["render_report", "add_arguments", "main", "ReportDependencyError"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
