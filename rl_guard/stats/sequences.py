"""The per-sequence families, defined once in an array namespace (``xp.py``): the KL estimators per sequence, the
sequence ratio, lengths, truncation, rewards; and the micro-batch loss and the rank count. Like the token families
(``families.py``) they append sufficient statistics to a ``ChunkStats`` so that micro-batches and ranks merge
exactly, and nothing here reads a device value on the host. Statistics use finite values only; non-finite inputs
are counted under ``input/<field>/nonfinite``.

A per-sequence vector marks its invalid entries NaN, next to a 0/1 validity ``v``; NaN never reaches a sum, extreme
or histogram (sums use the zero-filled copy, extremes fill NaN with -inf/+inf, histograms take the invalid entries
back out of the zero cell: ``ChunkStats.hist``).
"""

from __future__ import annotations

import functools

import torch

from . import keys
from .chunks import ChunkStats
from .families import INF, k3
from .partial import Partial
from .sketch import LOG_RATIO, cell_index, count_cells
from .token_rows import RowPlan


def gated(ops, x):
    """``(y, v)``: ``x`` NaN where it is non-finite, and its validity (1.0 where finite, 0.0 elsewhere)."""
    f = ops.finite(x)
    return ops.where(f, x, float("nan")), ops.cast(f, x.dtype)


def nan_max(ops, y):  # max of the non-NaN entries (-inf if none)
    return ops.max_where(y, y == y) if ops.size(y) else ops.full((), -INF, y.dtype, y.device)


def nan_min(ops, y):  # min of the non-NaN entries (+inf if none)
    return ops.min_where(y, y == y) if ops.size(y) else ops.full((), INF, y.dtype, y.device)


def value_stats(acc: ChunkStats, ops, name: str, y, v, squares: bool = False):
    """count, sum, (sum of squares in float64: std = sqrt(E[x^2] - mean^2) cancels when |mean| >> std), min, max of
    the valid entries of ``y`` (NaN elsewhere, validity ``v``); returns the count."""
    key = keys.of(name)
    z = ops.where(y == y, y, 0.0)
    n = v.sum()
    acc.sum(key.count, n)
    acc.sum(key.sum, z.sum())
    if squares:
        acc.sum(key.sumsq, (z * z).sum())
    acc.max(key.max, nan_max(ops, y))
    acc.min(key.min, nan_min(ops, y))
    return n


def ratio_stats(acc: ChunkStats, ops, name: str, lr, v, zero: bool = False) -> None:
    """Ratio r = exp(lr) over the valid entries of a float64 per-sequence log-ratio (the sequence ratio; the token
    rows' are ``families.chunk_stats``'s, with the same formulas): count, sum r = sum (log r + k3) + count, min/max
    log r, log-ratio histogram (quantiles of r). ``zero``: every valid ``lr`` is known to be +0 (``families.same_old``),
    so its k3 is too."""
    key = keys.of(name)
    z = ops.where(v > 0, lr, 0.0)
    n = v.sum()
    acc.sum(key.count, n)
    acc.sum(key.sum, (z if zero else z + k3(ops, z)).sum() + n)
    acc.max(key.logmax, nan_max(ops, lr))
    acc.min(key.logmin, nan_min(ops, lr))
    acc.hist(key.hist, count_cells(cell_index(z, LOG_RATIO), LOG_RATIO.bins), LOG_RATIO.bins // 2, ops.size(z) - n)


def kl_finish(acc: ChunkStats, ops, plan: RowPlan, scales) -> None:
    """Per KL family: token sums of k1, k2, k3 (equal to the sums over sequences), the sequence count, and the max
    over sequences of the per-sequence sums (float64: each sequence's sum was added chunk by chunk)."""
    nk = len(plan.kl_families)
    if not nk:
        return
    seq = acc.seq("kl", 4 * nk).reshape(4, nk, -1)
    valid = seq[0] > 0
    names = plan.names
    acc.sum(names["seqs"], valid.sum(1))
    est = seq[1:] * scales  # k1, k2, k3 (``token_rows.Constants.kl_scales``): [3, families, S]
    total = est.sum(2).reshape(-1)
    acc.sum(names["kl_sum"], total)
    acc.sum(names["kl_seqsum"], ops.copy(total))
    top = (
        ops.amax(ops.where(valid, est, -INF), 2).reshape(-1)
        if seq.shape[2]
        else ops.full((3 * nk,), -INF, ops.f64, seq.device)
    )
    acc.max(names["kl_seqmax"], top)


def seq_log_ratio(acc: ChunkStats, ops, plan: RowPlan):
    """GSPO's sequence log-ratio: the mean token log-ratio per sequence, NaN for sequences without a valid token;
    returns (values [S], validity [S] as 0/1). The ratio row is the first KL row."""
    seq = acc.seq("kl", 4 * len(plan.kl_families)).reshape(4, len(plan.kl_families), -1)
    tokens = seq[0, 0]
    return seq[1, 0] / tokens, ops.cast(tokens > 0, ops.f64)  # 0 / 0 = NaN marks the empty sequences


def sequence_stats(acc: ChunkStats, ops, lengths, truncated, rewards) -> None:
    """Lengths (every value counted), the truncated count, rewards (finite values only)."""
    if lengths is not None:
        lengths = ops.cast(lengths.reshape(-1), ops.f64)
        value_stats(acc, ops, "length", lengths, ops.full(lengths.shape, 1.0, ops.f64, lengths.device))
    if truncated is not None:
        acc.sum(keys.LENGTH.truncated, ops.cast(truncated, ops.bool_).sum())
    if rewards is not None:
        rewards, v = gated(ops, ops.cast(rewards.reshape(-1), ops.f64))
        n = value_stats(acc, ops, "reward", rewards, v, squares=True)
        acc.sum(keys.input_nonfinite("rewards"), ops.size(rewards) - n)


def loss_stats(acc: ChunkStats, ops, loss) -> None:
    """Sum of the finite micro-batch losses and the count of non-finite ones (the step loss when summed)."""
    loss = ops.cast(loss.reshape(-1), ops.f32)
    ok = ops.finite(loss)
    acc.sum(keys.LOSS.count, ops.full((), ops.size(loss), ops.f32, loss.device))
    acc.sum(keys.LOSS.sum, ops.where(ok, loss, 0.0).sum())
    acc.sum(keys.LOSS.nonfinite, (~ok).sum())


def rank_count(name: str, device) -> Partial:
    """A count of 1 per rank per step (summed across ranks: the number of ranks that contributed): a packed
    ``Partial`` of constant vectors made once per device (the accumulator copies what it adds, never writes it)."""
    ones, empty = _constant_count(torch.device(device if device is not None else "cpu"))
    return Partial((((name, 1),), ()), ones, empty)


@functools.lru_cache(maxsize=8)
def _constant_count(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(1, dtype=torch.float64, device=device), torch.zeros(0, dtype=torch.float64, device=device)
