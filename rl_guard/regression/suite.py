"""Run every seed regression check whose inputs were supplied and collect a report."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ._base import RegressionCheckFailed
from .baseline import check_advantage_fn_baseline_invariance
from .bootstrap import check_bootstrap_contract
from .gradient import check_zero_advantage_zero_grad
from .groups import check_group_advantage_zero_on_ties
from .masks import check_empty_mask_raises
from .ratio import check_ratio_is_one


def run_all(
    *,
    logprob_fn: Callable | None = None,
    ratio_batch: Any = None,
    ratio_mask: Any = None,
    loss_fn: Callable | None = None,
    params: Any = None,
    loss_batch: Any = None,
    baseline_advantage_fn: Callable | None = None,
    returns_fn: Callable | None = None,
    group_advantage_fn: Callable | None = None,
    stats_fn: Callable | None = None,
    raise_on_failure: bool = False,
) -> dict[str, Any]:
    """Run the checks whose callables are given; the rest are reported as ``"skipped"``.

    Arguments map onto the individual checks (see their docstrings for the contracts):
    ``logprob_fn, ratio_batch[, ratio_mask]`` -> check_ratio_is_one;
    ``loss_fn, params, loss_batch`` -> check_zero_advantage_zero_grad;
    ``baseline_advantage_fn`` -> check_advantage_fn_baseline_invariance (built-in 3x3 policy);
    ``returns_fn`` -> check_bootstrap_contract; ``group_advantage_fn`` ->
    check_group_advantage_zero_on_ties; ``stats_fn`` -> check_empty_mask_raises.

    Returns ``{"passed": bool, "failed": [names], "checks": {name: {"status", "metric", "value",
    "tolerance", "message"}}}`` with status "passed" / "failed" (contract violated) / "error" (the
    check could not run, e.g. the user's code raised) / "skipped". ``passed`` is True when nothing
    failed or errored. With ``raise_on_failure`` a failing report raises RegressionCheckFailed.
    """
    # name -> the check bound to its inputs, None (skipped) when they are not all given
    plan: list[tuple[str, Callable[[], Any] | None]] = [
        (
            "ratio_is_one",
            None
            if logprob_fn is None or ratio_batch is None
            else functools.partial(check_ratio_is_one, logprob_fn, ratio_batch, mask=ratio_mask),
        ),
        (
            "zero_adv_zero_grad",
            None
            if loss_fn is None or params is None or loss_batch is None
            else functools.partial(check_zero_advantage_zero_grad, loss_fn, params, loss_batch),
        ),
        (
            "advantage_fn_baseline_invariance",
            None
            if baseline_advantage_fn is None
            else functools.partial(check_advantage_fn_baseline_invariance, baseline_advantage_fn),
        ),
        ("bootstrap_contract", None if returns_fn is None else functools.partial(check_bootstrap_contract, returns_fn)),
        (
            "group_adv_zero_on_ties",
            None
            if group_advantage_fn is None
            else functools.partial(check_group_advantage_zero_on_ties, group_advantage_fn),
        ),
        ("empty_mask_raises", None if stats_fn is None else functools.partial(check_empty_mask_raises, stats_fn)),
    ]
    checks: dict[str, dict[str, Any]] = {}
    for name, run in plan:
        entry = {"status": "skipped", "metric": None, "value": None, "tolerance": None, "message": ""}
        if run is not None:
            try:
                res = run()
                entry.update(
                    status="passed", metric=res.metric, value=res.value, tolerance=res.tolerance, message=res.detail
                )
            except RegressionCheckFailed as exc:
                entry.update(status="failed", message=str(exc))
            except Exception as exc:  # noqa: BLE001 - one broken input must not hide the other checks
                entry.update(status="error", message=f"{type(exc).__name__}: {exc}")
        checks[name] = entry
    failed = [n for n, e in checks.items() if e["status"] in ("failed", "error")]
    report = {"passed": not failed, "failed": failed, "checks": checks}
    if raise_on_failure and failed:
        raise RegressionCheckFailed(
            "seed regression checks failed: " + "; ".join(f"{n}: {checks[n]['message']}" for n in failed)
        )
    return report
