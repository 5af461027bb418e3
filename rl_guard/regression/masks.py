"""Check 6: an empty (all-zero) action mask must raise a clear error, not produce numbers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ._base import CheckResult, RegressionCheckFailed


def _describe(value: Any) -> str:
    """Short description of what the stats function returned instead of raising."""
    items = value.values() if isinstance(value, dict) else [value]
    flat = []
    for v in items:
        try:
            flat.extend(torch.as_tensor(v, dtype=torch.float64).flatten().tolist())
        except (TypeError, ValueError, RuntimeError):
            return repr(value)[:200]
    nan = any(math.isnan(x) for x in flat)
    zero = bool(flat) and all(x == 0 for x in flat)
    tag = (
        " (NaN: masked mean divided by a zero token count)"
        if nan
        else (" (silent zero: the empty batch masquerades as a real statistic)" if zero else "")
    )
    return f"{repr(value)[:200]}{tag}"


def check_empty_mask_raises(
    stats_fn: Callable[[torch.Tensor], Any],
    *,
    shape: tuple[int, ...] = (2, 5),
    dtype: torch.dtype = torch.bool,
) -> CheckResult:
    """Assert ``stats_fn(mask)`` raises ``ValueError`` (or a subclass) mentioning "mask" on an empty mask.

    Contract: ``stats_fn(mask)`` consumes a Tensor[``shape``] of ``dtype`` (nonzero = token counted)
    and returns anything; wrap a function that needs more inputs, e.g.
    ``lambda m: masked_mean(values, m)``. The check feeds an all-zero mask. It fails when the
    function returns (NaN and 0 are called out), or raises something that looks accidental:
    a non-``ValueError`` (``ZeroDivisionError``, a torch ``RuntimeError``...) or a message
    without the word "mask". Measured figure: 1.0 (the error was raised).
    """
    mask = torch.zeros(shape, dtype=dtype)
    try:
        value = stats_fn(mask)
    except ValueError as exc:
        if "mask" not in str(exc).lower():
            raise RegressionCheckFailed(
                f"[empty_mask_raises] raised ValueError without mentioning the mask: {exc!r}; "
                f"say what is wrong, e.g. 'empty action mask: no tokens to average'"
            ) from exc
        return CheckResult(
            name="empty_mask_raises", metric="raised", value=1.0, tolerance=0.0, detail=f"{type(exc).__name__}: {exc}"
        )
    except Exception as exc:  # any other error type is the failure being reported
        raise RegressionCheckFailed(
            f"[empty_mask_raises] empty mask raised {type(exc).__name__}: {exc!r}, which looks accidental; "
            f"raise ValueError mentioning the mask instead"
        ) from exc
    raise RegressionCheckFailed(
        f"[empty_mask_raises] empty mask of shape {tuple(shape)} returned {_describe(value)} instead of raising "
        f"ValueError"
    )
