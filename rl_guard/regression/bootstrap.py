"""Check 4: terminal steps do not bootstrap, truncated (time-limit) steps do.

Contract for the user's function::

    returns_fn(rewards[T], values[T+1], terminated[T], truncated[T], gamma) -> returns[T]

``values[t]`` is V(s_t) and ``values[t+1]`` the value of the state reached after step t; at a
truncation inside the segment it is the value of the final (cut-off) observation, never of the
next episode's reset state. Returns are lambda = 1 (Monte-Carlo / n-step up to the segment end;
GAE(lambda=1) advantages + values give the same numbers):

    G_t = r_t                               if terminated[t]
    G_t = r_t + gamma * values[t+1]         if truncated[t] (and not terminated) or t == T - 1
    G_t = r_t + gamma * G_{t+1}             otherwise
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._base import CheckResult, RegressionCheckFailed, as_f64

ReturnsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def reference_returns(rewards, values, terminated, truncated, gamma: float) -> torch.Tensor:
    """Correct lambda = 1 returns (see module docstring), float64 Tensor[T]."""
    r, v = as_f64(rewards), as_f64(values)
    term = torch.as_tensor(terminated, dtype=torch.bool)
    trunc = torch.as_tensor(truncated, dtype=torch.bool)
    t_len = r.shape[0]
    if v.shape[0] != t_len + 1 or term.shape[0] != t_len or trunc.shape[0] != t_len:
        raise ValueError("expected rewards[T], values[T+1], terminated[T], truncated[T]")
    out = torch.empty(t_len, dtype=torch.float64)
    for t in reversed(range(t_len)):
        if term[t]:
            # The episode really ended: there is no future, whatever values[t+1] says.
            out[t] = r[t]
        elif trunc[t] or t == t_len - 1:
            # Cut by a time limit or by the segment end: the future exists, estimate it with V.
            out[t] = r[t] + gamma * v[t + 1]
        else:
            out[t] = r[t] + gamma * out[t + 1]
    return out


# Hand-computed cases with gamma = 0.5, rewards [1, 2, 4], values [10, 20, 40, 80].
# The values are large next to the rewards so that any wrong (non-)bootstrap is glaring.
_GAMMA = 0.5
_REWARDS = (1.0, 2.0, 4.0)
_VALUES = (10.0, 20.0, 40.0, 80.0)
_F, _T = False, True
_CASES: list[tuple[str, tuple, tuple, tuple]] = [
    # (clause, terminated, truncated, expected returns)
    (
        "segment end without a flag bootstraps values[T]",
        (_F, _F, _F),
        (_F, _F, _F),
        (1 + 0.5 * 24, 2 + 0.5 * 44, 4 + 0.5 * 80),
    ),
    ("terminal last step must not bootstrap", (_F, _F, _T), (_F, _F, _F), (1 + 0.5 * 4, 2 + 0.5 * 4, 4.0)),
    (
        "truncated last step must bootstrap values[T]",
        (_F, _F, _F),
        (_F, _F, _T),
        (1 + 0.5 * 24, 2 + 0.5 * 44, 4 + 0.5 * 80),
    ),
    (
        "terminal mid-segment: no bootstrap, no flow from the next episode",
        (_F, _T, _F),
        (_F, _F, _F),
        (1 + 0.5 * 2, 2.0, 4 + 0.5 * 80),
    ),
    (
        "truncated mid-segment: bootstrap values[t+1], no flow from the next episode",
        (_F, _F, _F),
        (_F, _T, _F),
        (1 + 0.5 * 22, 2 + 0.5 * 40, 4 + 0.5 * 80),
    ),
    (
        "terminated and truncated together: terminal wins, no bootstrap",
        (_F, _F, _T),
        (_F, _F, _T),
        (1 + 0.5 * 4, 2 + 0.5 * 4, 4.0),
    ),
]


def check_bootstrap_contract(returns_fn: ReturnsFn, *, atol: float = 1e-12) -> CheckResult:
    """Run ``returns_fn`` on hand-computed cases and compare in float64 (see module docstring).

    Inputs are float64 tensors for rewards/values and bool tensors for the flags. Measured figure:
    max |returns - expected| over all cases. The failure names the violated clause.
    """
    worst = 0.0
    for clause, term, trunc, expected in _CASES:
        got = as_f64(
            returns_fn(
                torch.tensor(_REWARDS, dtype=torch.float64),
                torch.tensor(_VALUES, dtype=torch.float64),
                torch.tensor(term),
                torch.tensor(trunc),
                _GAMMA,
            )
        )
        want = torch.tensor(expected, dtype=torch.float64)
        if got.shape != want.shape:
            raise RegressionCheckFailed(
                f"[bootstrap_contract] {clause}: returns shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            )
        err = float(torch.nan_to_num((got - want).abs(), nan=float("inf")).max())
        if not (err <= atol):
            raise RegressionCheckFailed(
                f"[bootstrap_contract] {clause}: got {got.tolist()}, expected {want.tolist()} "
                f"(max err {err:.6g} > atol {atol:g}; gamma={_GAMMA}, rewards={list(_REWARDS)}, "
                f"values={list(_VALUES)}, terminated={list(term)}, truncated={list(trunc)})"
            )
        worst = max(worst, err)
    return CheckResult(
        name="bootstrap_contract",
        metric="max_abs_return_err",
        value=worst,
        tolerance=atol,
        detail=f"{len(_CASES)} hand-computed cases match",
    )
