"""Output helpers shared by the diagnostic families: prefixed names, least squares."""

from __future__ import annotations

import math

import numpy as np

PREFIX = "rl_guard/"


class Out(dict):
    """Flat {name: float}. Undefined statistics are left out, never NaN: a non-finite value fires every rule
    that names the metric, and "no data" must not look like an incident."""

    def put(self, name: str, value) -> None:
        if value is None:
            return
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} = {value}: diagnostics must leave undefined statistics out instead")
        self[PREFIX + name] = value


def mean(x: np.ndarray):
    """``x.mean()`` of a 1-D float array, bit for bit (numpy's mean is this sum over the count), without the
    dispatch through ``np.mean`` that costs more than the sum on the small arrays of one batch."""
    return x.sum() / len(x)


def share(mask: np.ndarray) -> float:
    """``np.mean(mask)`` of a non-empty boolean array, bit for bit: count / n."""
    return np.count_nonzero(mask) / mask.size


def frac(count, total) -> float | None:
    return float(count) / float(total) if total > 0 else None


def slope(x: np.ndarray, y: np.ndarray) -> float | None:
    """Least-squares slope of y on x: sum((x - x̄)(y - ȳ)) / sum((x - x̄)^2); None if x is constant."""
    dx = x - mean(x)
    sxx = float(dx @ dx)
    return float(dx @ (y - mean(y))) / sxx if sxx > 0 else None


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson correlation; None with fewer than 2 points or a constant input."""
    if len(x) < 2:
        return None
    dx, dy = x - mean(x), y - mean(y)
    den = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / den if den > 0 else None
