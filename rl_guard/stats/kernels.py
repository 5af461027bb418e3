"""The per-sequence probes (lengths, rewards, the GSPO sequence ratio), the loss, and the rank count: sufficient
statistics of small vectors, appended to a ``ChunkStats`` (sums, maxima, minima stored negated, histogram counts)
so that micro-batches and ranks merge exactly. Nothing here reads a device value on the host. Statistics use finite
values only; non-finite inputs are counted under ``input/<field>/nonfinite``. The per-token families are
``families.py``'s; the host formulas that turn all of them into metrics are ``summarize.py``'s.

Validity travels inside the values: a vector is NaN wherever an entry is invalid (``validate_``), next to a 0/1
float validity ``v``; NaN never survives into a sum, extreme or histogram (sums use the zero-filled copy, extremes
fill NaN with -inf/+inf, histograms take the invalid entries back out of the zero cell: ``ChunkStats.hist``).
"""

from __future__ import annotations

import functools
import math

import torch

from . import keys
from .chunks import ChunkStats
from .constants import EXP_CLAMP
from .partial import Partial
from .sketch import LOG_RATIO, SketchSpec, cell_index, count_cells

F64 = torch.float64


def validate_(y: torch.Tensor) -> torch.Tensor:
    """In place: non-finite entries of ``y`` become NaN (``y * 0`` is NaN exactly there); returns the validity
    ``v`` (1.0 where ``y`` is finite, 0.0 elsewhere) in the same dtype."""
    t = y * 0.0
    y.add_(t)
    return t.add_(1.0).nan_to_num_(0.0)


def gated(x: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, v)``: a fresh copy of ``x``, NaN where ``gate`` is non-finite (masked out) or ``x`` is non-finite."""
    y = x + gate if gate is not None else x.clone()
    return y, validate_(y)


def nonfinite(acc: ChunkStats, name: str, n_before, n_after) -> None:
    """``input/<name>/nonfinite``: tokens valid before this field was taken into account and not after it (a
    token whose logprobs is already non-finite is counted under logprobs only)."""
    acc.sum(keys.input_nonfinite(name), n_before - n_after)


def value_stats(acc: ChunkStats, name: str, y, v, squares: bool = False):
    """count, sum, (sum of squares), min, max of the valid entries of ``y`` (NaN elsewhere, validity ``v``);
    returns (zero-filled ``y``, count)."""
    key = keys.of(name)
    z = torch.nan_to_num(y, nan=0.0)
    n = v.sum()
    acc.sum(key.count, n)
    if squares:
        # std = sqrt(E[x^2] - mean^2) cancels when |mean| >> std: both sums in float64 keep it accurate
        zd = z.to(F64)
        acc.sum(key.sum, zd.sum())
        acc.sum(key.sumsq, torch.dot(zd, zd))
    else:
        acc.sum(key.sum, z.sum())
    acc.max(key.max, nan_max(y))
    acc.min(key.min, nan_min(y))
    return z, n


def nan_max(y: torch.Tensor) -> torch.Tensor:  # max of the non-NaN entries (-inf if none)
    return torch.nan_to_num(y, nan=-math.inf).amax() if y.numel() else y.new_full((), -math.inf)


def nan_min(y: torch.Tensor) -> torch.Tensor:  # min of the non-NaN entries (+inf if none)
    return torch.nan_to_num(y, nan=math.inf).amin() if y.numel() else y.new_full((), math.inf)


def log_ratio_terms(lr: torch.Tensor):
    """``(z, e)`` of a NaN-marked log-ratio: ``z`` zero-filled and ``e = expm1(min(z, EXP_CLAMP)) = r - 1``.

    ``expm1`` keeps r - 1 and k3 = (r - 1) - log r accurate for |log r| ~ 1e-4 where exp(x) - 1 cancels in fp32.
    """
    z = torch.nan_to_num(lr, nan=0.0)
    return z, z.clamp(max=EXP_CLAMP).expm1_()


def ratio_stats(acc: ChunkStats, name: str, lr, v, z=None, e=None, hist: bool = True) -> None:
    """Ratio r = exp(lr) over the valid entries of an allocated vector (the per-sequence ratio; token chunks use
    ``families.chunk_stats``): count, sum r, min/max log r, log-ratio histogram (quantiles of r)."""
    key = keys.of(name)
    if z is None:
        z, e = log_ratio_terms(lr)
    n = v.sum()
    acc.sum(key.count, n)
    acc.sum(key.sum, e.sum() + n)  # sum r = sum (r - 1) + count: no cancellation for r ~ 1
    acc.max(key.logmax, nan_max(lr))
    acc.min(key.logmin, nan_min(lr))
    if hist:
        zero_filled_hist(acc, key.hist, z, LOG_RATIO, z.numel() - n)
    return n


def zero_filled_hist(acc: ChunkStats, name: str, z, spec: SketchSpec, n_invalid) -> None:  # see ChunkStats.hist
    acc.hist(name, count_cells(cell_index(z, spec), spec.bins), spec.bins // 2, n_invalid)


def lag_lut(edges, device) -> torch.Tensor:
    """Bucket (int32) of every integer lag in ``[edges[0], edges[-1]]`` plus a last entry ``len(edges)`` for
    masked-out tokens: bucket b holds ``edges[b] <= lag < edges[b+1]``; lags outside the range are clamped into it
    (below ``edges[0]`` -> bucket 0). Built once per edges and device; read only."""
    return _lag_lut(tuple(edges), torch.device(device))


@functools.lru_cache(maxsize=16)
def _lag_lut(edges: tuple, device: torch.device) -> torch.Tensor:
    lags = torch.arange(edges[0], edges[-1] + 2, device=device)  # built on the device: no host->device copy
    lut = torch.zeros_like(lags, dtype=torch.int32)
    for e in edges[1:]:
        lut += lags >= e
    lut[-1:].fill_(len(edges))  # not ``lut[-1] = n``: on a GPU that copies n from the host and waits
    return lut


def loss_stats(p: Partial, loss: torch.Tensor) -> Partial:
    """Sum of the finite micro-batch losses and the count of non-finite ones (the step loss when summed)."""
    loss = loss.detach().float().reshape(-1)
    ok = torch.isfinite(loss)
    p.add_sum(keys.LOSS.count, torch.ones((), device=loss.device) * loss.numel())
    p.add_sum(keys.LOSS.sum, torch.where(ok, loss, 0.0).sum())
    p.add_sum(keys.LOSS.nonfinite, (~ok).sum())
    return p


def rank_count(name: str, device) -> Partial:
    """A count of 1 per rank per step (summed across ranks: the number of ranks that contributed): a packed
    ``Partial`` of constant vectors made once per device (the accumulator copies what it adds, never writes it)."""
    ones, empty = _constant_count(torch.device(device if device is not None else "cpu"))
    return Partial.of_packed((((name, 1),), ()), ones, empty)


@functools.lru_cache(maxsize=8)
def _constant_count(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(1, dtype=torch.float64, device=device), torch.zeros(0, dtype=torch.float64, device=device)
