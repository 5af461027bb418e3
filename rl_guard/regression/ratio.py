"""Check 1: with identical parameters the PPO importance ratio is exactly 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._base import CheckResult, RegressionCheckFailed, as_f64

LogprobFn = Callable[[Any], torch.Tensor]
RatioFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _default_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(logp - old_logp)


def check_ratio_is_one(
    logprob_fn: LogprobFn,
    batch: Any,
    *,
    old_logprob_fn: LogprobFn | None = None,
    ratio_fn: RatioFn | None = None,
    mask: torch.Tensor | None = None,
    atol: float = 0.0,
) -> CheckResult:
    """Assert r = exp(logp - old_logp) == 1 on every unmasked token when old and current policy coincide.

    Contracts:
      * ``logprob_fn(batch) -> Tensor[B, T]``: per-token log pi(a_t | s_t) of the batch's actions,
        computed exactly as the training step computes it.
      * ``old_logprob_fn(batch) -> Tensor[B, T]``: the path that produces ``old_logp`` (rollout /
        reference pass). Defaults to ``logprob_fn`` itself, i.e. the same function called twice.
      * ``ratio_fn(logp, old_logp) -> Tensor[B, T]``: the user's ratio; default ``exp(logp - old_logp)``.
      * ``mask``: Tensor[B, T], nonzero = token counted; default every token.

    ``old_logp`` is computed first, then ``logp``, mirroring a training step. The ratio is compared
    in float64. Identical deterministic computation gives exactly 0 log-ratio, hence ``atol=0.0``.
    Measured figure: max |r - 1| over unmasked tokens. Typical culprits: dropout left on
    (``model.train()``), a temperature / dtype / padding difference between the two paths.
    """
    old_fn = logprob_fn if old_logprob_fn is None else old_logprob_fn
    old_logp = old_fn(batch).detach()
    logp = logprob_fn(batch).detach()
    if logp.shape != old_logp.shape:
        raise RegressionCheckFailed(
            f"[ratio_is_one] logp shape {tuple(logp.shape)} != old_logp shape {tuple(old_logp.shape)}"
        )
    ratio = as_f64((ratio_fn or _default_ratio)(logp, old_logp))
    if ratio.shape != logp.shape:
        raise RegressionCheckFailed(
            f"[ratio_is_one] ratio_fn returned shape {tuple(ratio.shape)}, expected {tuple(logp.shape)}"
        )
    keep = torch.ones_like(ratio, dtype=torch.bool) if mask is None else mask.detach().to(torch.bool)
    if keep.shape != ratio.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} != logp shape {tuple(ratio.shape)}")
    n = int(keep.sum())
    if n == 0:
        raise ValueError("mask selects no tokens; the ratio check would be vacuous")

    # NaN must count as a deviation, so map it to +inf before taking the max.
    dev = torch.nan_to_num((ratio - 1.0).abs(), nan=float("inf"))
    dev = torch.where(keep, dev, torch.zeros_like(dev))
    worst = float(dev.max())
    n_bad = int((dev > atol).sum())
    if n_bad:
        idx = tuple(int(i) for i in torch.nonzero(dev == dev.max())[0])
        raise RegressionCheckFailed(
            f"[ratio_is_one] importance ratio != 1 with identical parameters: max |r - 1| = {worst:.6g} "
            f"> atol {atol:g} at token index {idx}; {n_bad}/{n} unmasked tokens off "
            f"(r there = {float(ratio[idx]):.6g}). Likely dropout active or old/new log-prob paths differ "
            f"(temperature, dtype, padding)."
        )
    return CheckResult(
        name="ratio_is_one",
        metric="max_abs_ratio_minus_one",
        value=worst,
        tolerance=atol,
        detail=f"max |r - 1| = {worst:.3g} over {n} unmasked tokens",
    )
