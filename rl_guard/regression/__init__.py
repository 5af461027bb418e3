"""Minimal regression checks for user-supplied RL loss / advantage / returns code (the minimal regression tests of
docs/sources.md#experiments-and-diagnostics).

Each ``check_*`` runs the user's callable(s) on small, exactly-known inputs, raises
``RegressionCheckFailed`` (an ``AssertionError``) with a precise message on a contract violation,
and returns a ``CheckResult`` holding the measured figure on success. ``run_all`` runs the checks
whose inputs are given and returns a report dict.
"""

from ._base import CheckResult, RegressionCheckFailed
from .baseline import (
    check_advantage_fn_baseline_invariance,
    check_baseline_invariance,
    expected_policy_gradient,
)
from .bootstrap import check_bootstrap_contract, reference_returns
from .gradient import check_zero_advantage_zero_grad
from .groups import check_group_advantage_zero_on_ties
from .masks import check_empty_mask_raises
from .ratio import check_ratio_is_one
from .suite import run_all

__all__ = [
    "CheckResult",
    "RegressionCheckFailed",
    "check_advantage_fn_baseline_invariance",
    "check_baseline_invariance",
    "check_bootstrap_contract",
    "check_empty_mask_raises",
    "check_group_advantage_zero_on_ties",
    "check_ratio_is_one",
    "check_zero_advantage_zero_grad",
    "expected_policy_gradient",
    "reference_returns",
    "run_all",
]
