"""term/: how episodes ended, by taxonomy class, with system failures kept apart from policy failures.

- ``term/<class>_rate`` = count(termination == class) / n for every class in the taxonomy (0 when absent):
  success, task_failure, invalid_action, timeout, truncated_budget, environment_error, verifier_error,
  infrastructure_error. Rates sum to 1.
- ``term/system_error_rate`` = (environment_error + verifier_error + infrastructure_error) / n. A service level of
  the environment and verifier, not something the model should learn to avoid: system-error samples are left
  out of every reward, outcome, group and critic statistic (never folded into reward 0). Up is trouble.
"""

from __future__ import annotations

from .names import Out
from .samples import SYSTEM_ERRORS, TERMINATIONS, Prepared

DOCS = {
    **{f"term/{t}_rate": f"Share of samples that ended as '{t}' (count / n, [0, 1])." for t in TERMINATIONS},
    "term/system_error_rate": "(environment_error + verifier_error + infrastructure_error) / n; [0, 1], up is "
    "trouble. These samples are excluded from reward statistics, never scored as reward 0.",
}


def termination(p: Prepared, out: Out) -> None:
    if p.termination is None or p.n == 0:
        return
    for t in TERMINATIONS:
        out.put(f"term/{t}_rate", sum(x == t for x in p.termination) / p.n)
    out.put("term/system_error_rate", sum(x in SYSTEM_ERRORS for x in p.termination) / p.n)
