"""Shared pieces of the seed regression checks: the failure type and the result record."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


class RegressionCheckFailed(AssertionError):
    """A seed regression check found the user's code violating its contract.

    Subclasses ``AssertionError`` so the checks read naturally inside pytest suites.
    """


@dataclass(frozen=True)
class CheckResult:
    """Outcome of a passing check.

    ``metric`` names the measured figure and ``value`` holds it (e.g. max |r - 1|);
    ``tolerance`` is the bound it was held to; ``detail`` is a one-line human summary.
    """

    name: str
    metric: str
    value: float
    tolerance: float
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def as_f64(x) -> torch.Tensor:
    """Detached float64 copy of a tensor / array / number (references are computed in float64)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def max_abs(x: torch.Tensor) -> float:
    """max |x| as a Python float; NaN if any entry is NaN, 0.0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    x = as_f64(x)
    if torch.isnan(x).any():
        return float("nan")
    return float(x.abs().max())
