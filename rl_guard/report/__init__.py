"""Offline report for a run directory: PNG plots of the health metrics with rule markers, plus report.md.

Needs the optional extra ``rl-guard[report]`` (matplotlib), imported only when a report is rendered.
"""

from .cli import add_arguments, main
from .render import ReportDependencyError, render_report

__all__ = ["render_report", "add_arguments", "main", "ReportDependencyError"]
