"""Pure device-side probes: chunks of token tensors -> sufficient statistics (sums, maxima, histogram counts).

A micro-batch is probed chunk by chunk (``chunks.py``); every probe appends its chunk's contribution to a
``ChunkStats``, which reduces them once into a ``Partial``: entries reduced by sum (counts, sums, sums of squares,
histogram cells) and entries reduced by max (maxima, and minima stored negated), so micro-batches and ranks merge
exactly. Nothing here reads a device value on the host. Statistics use finite values only; non-finite inputs are
counted under ``input/<field>/nonfinite``. The host formulas that turn these into metrics live in ``summarize.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .sketch import ENTROPY, LOG_RATIO, cell_index, count_cells

DEFAULT_LAG_EDGES = (0, 1, 2, 3, 5, 9)  # buckets 0, 1, 2, 3-4, 5-8, 9+
EXP_CLAMP = 80.0  # exp() argument clamp so a finite but huge log-ratio gives a huge finite ratio, not inf
F64 = torch.float64


@dataclass
class Partial:
    """Sufficient statistics of one micro-batch, keyed by name; all tensors 1-D."""

    sum: dict = field(default_factory=dict)
    max: dict = field(default_factory=dict)

    def add_sum(self, name: str, t: torch.Tensor) -> None:
        self.sum[name] = t.reshape(-1).to(F64)

    def add_max(self, name: str, t: torch.Tensor) -> None:
        self.max[name] = t.reshape(-1).to(F64)

    def add_min(self, name: str, t: torch.Tensor) -> None:
        self.max["-" + name] = -t.reshape(-1).to(F64)


class ChunkStats:
    """Chunk contributions of one micro-batch. Scalars are kept in lists and reduced once at the end (one stack
    per statistic instead of one add per chunk); vectors (histograms) are added in place (the caller hands over a
    fresh tensor). ``seq(name)`` is a float64 ``[S]`` accumulator of per-sequence sums."""

    def __init__(self, num_seqs: int, device: torch.device) -> None:
        self.num_seqs, self.device = num_seqs, device
        self._sum: dict = {}
        self._max: dict = {}
        self._min: dict = {}
        self._seq: dict = {}

    def sum(self, name: str, t: torch.Tensor) -> None:
        if t.numel() == 1 and t.dim() == 0:
            self._sum.setdefault(name, []).append(t)
        elif name in self._sum:
            self._sum[name].add_(t)
        else:
            self._sum[name] = t

    def max(self, name: str, t: torch.Tensor) -> None:
        self._max.setdefault(name, []).append(t)

    def min(self, name: str, t: torch.Tensor) -> None:
        self._min.setdefault(name, []).append(t)

    def seq(self, name: str) -> torch.Tensor:
        if name not in self._seq:
            self._seq[name] = torch.zeros(self.num_seqs, dtype=F64, device=self.device)
        return self._seq[name]

    def has_seq(self, name: str) -> bool:
        return name in self._seq

    def partial(self) -> Partial:
        p = Partial()
        for k, v in self._sum.items():
            p.add_sum(k, torch.stack(v).sum(0, dtype=F64) if isinstance(v, list) else v)
        for k, v in self._max.items():
            p.add_max(k, torch.stack(v).amax(0))
        for k, v in self._min.items():
            p.add_min(k, torch.stack(v).amin(0))
        return p


def masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, -math.inf).amax() if x.numel() else x.new_full((), -math.inf)


def masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, math.inf).amin() if x.numel() else x.new_full((), math.inf)


def count(mask: torch.Tensor) -> torch.Tensor:
    """Number of true entries (``count_nonzero`` is ~2x faster than ``sum`` on bool tensors)."""
    return mask.count_nonzero()


def finite(x: torch.Tensor) -> torch.Tensor:
    """Finite-value mask; ``|x| < inf`` is false for NaN and +-inf and is cheaper than ``isfinite`` on CPU."""
    return x.abs() < math.inf


def nonfinite(acc: ChunkStats, name: str, x: torch.Tensor, mask: torch.Tensor, mask_count) -> torch.Tensor:
    """Counts masked non-finite entries under ``input/<name>/nonfinite``; returns ``mask & finite(x)``."""
    ok = finite(x).logical_and_(mask)
    acc.sum(f"input.{name}.nonfinite", mask_count - count(ok))
    return ok


def value_stats(acc: ChunkStats, name: str, x, valid, squares: bool = False):
    """count, sum, (sum of squares), min, max of ``x`` over ``valid``; returns (``x`` with invalid entries 0, count)."""
    xv = torch.where(valid, x, 0.0)
    n = count(valid)
    acc.sum(f"{name}.count", n)
    acc.sum(f"{name}.sum", xv.sum())
    if squares:
        acc.sum(f"{name}.sumsq", torch.dot(xv, xv) if xv.dim() == 1 else (xv * xv).sum())
    acc.max(f"{name}.max", masked_max(x, valid))
    acc.min(f"{name}.min", masked_min(x, valid))
    return xv, n


def log_ratio_terms(log_ratio: torch.Tensor, valid: torch.Tensor):
    """``(lr, e)``: the log-ratio with invalid entries 0 and ``e = expm1(min(lr, EXP_CLAMP)) = r - 1`` (0 there).

    ``expm1`` keeps r - 1 and k3 = (r - 1) - log r accurate for |log r| ~ 1e-4 where exp(x) - 1 cancels in fp32.
    """
    lr = torch.where(valid, log_ratio, 0.0)
    return lr, lr.clamp(max=EXP_CLAMP).expm1_()


def ratio_stats(acc: ChunkStats, name: str, log_ratio, valid, lr=None, e=None, hist: bool = True) -> None:
    """Ratio r = exp(log_ratio): count, sum r, min/max log r, log-ratio histogram (quantiles of r)."""
    if lr is None:
        lr, e = log_ratio_terms(log_ratio, valid)
    n = count(valid)
    acc.sum(f"{name}.count", n)
    acc.sum(f"{name}.sum", e.sum() + n)  # sum r = sum (r - 1) + count, exact for r ~ 1
    acc.max(f"{name}.logmax", masked_max(log_ratio, valid))
    acc.min(f"{name}.logmin", masked_min(log_ratio, valid))
    if hist:
        acc.sum(f"{name}.hist", count_cells(cell_index(log_ratio, LOG_RATIO, valid), LOG_RATIO.bins + 1)[:-1])


def kl_stats(acc: ChunkStats, chunk, name: str, lr, e, valid) -> torch.Tensor:
    """k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r: token sums here, per-sequence sums into ``[S]``
    accumulators (``kl_finish`` takes their mean and max). Returns the per-token k3 (0 where invalid)."""
    k3 = e - lr
    acc.sum(f"{name}.count", count(valid))
    acc.sum(f"{name}.k1.sum", -lr.sum())
    acc.sum(f"{name}.k2.sum", 0.5 * torch.dot(lr, lr))
    acc.sum(f"{name}.k3.sum", k3.sum())
    chunk.seq_add(acc.seq(f"{name}.tokens"), valid)
    chunk.seq_add(acc.seq(f"{name}.lr"), lr)
    chunk.seq_add(acc.seq(f"{name}.lr2"), lr * lr)
    chunk.seq_add(acc.seq(f"{name}.k3"), k3)
    return k3


def kl_finish(acc: ChunkStats, name: str) -> None:
    """Mean (as a sum plus a sequence count) and max over sequences of the per-sequence estimator sums."""
    seq_valid = acc.seq(f"{name}.tokens") > 0
    acc.sum(f"{name}.seqs", count(seq_valid))
    lr = acc.seq(f"{name}.lr")
    for k, per_seq in (("k1", -lr), ("k2", 0.5 * acc.seq(f"{name}.lr2")), ("k3", acc.seq(f"{name}.k3"))):
        acc.sum(f"{name}.{k}.seqsum", per_seq.sum())
        acc.max(f"{name}.{k}.seqmax", masked_max(per_seq, seq_valid))


def seq_log_ratio(acc: ChunkStats, name: str = "kl_old"):
    """GSPO sequence log-ratio: mean token log-ratio per sequence; returns (values [S], valid [S])."""
    tokens = acc.seq(f"{name}.tokens")
    return acc.seq(f"{name}.lr") / tokens.clamp(min=1.0), tokens > 0


def clip_stats(acc: ChunkStats, clip_lr, valid, adv, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO clip fractions: low (r < 1 - eps_low and A < 0), high (r > 1 + eps_high and A > 0); returns region.

    ``clip_lr`` and ``adv`` must be 0 where not ``valid`` (so they never count as clipped)."""
    low = (clip_lr < math.log1p(-eps_low)).logical_and_(adv < 0)
    high = (clip_lr > math.log1p(eps_high)).logical_and_(adv > 0)
    acc.sum("clip.count", count(valid))
    acc.sum("clip.low", count(low))
    acc.sum("clip.high", count(high))
    return low.logical_or_(high)


def lag_lut(edges, device) -> torch.Tensor:
    """Bucket (int32) of every integer lag in ``[edges[0], edges[-1]]``: bucket b holds ``edges[b] <= lag <
    edges[b+1]``; lags outside the range are clamped into it (below ``edges[0]`` -> bucket 0)."""
    lags = torch.arange(edges[0], edges[-1] + 1, device=device)
    return torch.bucketize(lags, torch.tensor(edges[1:], device=device), right=True).to(torch.int32)


def lag_buckets(versions: torch.Tensor, current_version: int, edges, lut) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy lag ``current_version - round(versions)`` (fp32: exact for versions below 2^24) and its bucket."""
    lag = versions.round().neg_().add_(current_version)
    idx = lag.clamp(edges[0], edges[-1]).sub_(edges[0]).to(torch.int64)
    return lag, lut.index_select(0, idx)  # index_select: several times faster than lut[idx] on CPU


def lag_stats(acc: ChunkStats, lag, bucket, mask, nb: int, log_ratio=None, ratio_valid=None, k3=None) -> None:
    """Per-bucket token counts, ratio histograms and k3 sums (``clip_by_lag`` adds the clip counts)."""
    acc.sum("lag.tokens", count_cells(torch.where(mask, bucket, nb), nb + 1)[:-1])
    acc.sum("lag.sum", torch.where(mask, lag, 0.0).sum(dtype=F64))
    acc.max("lag.max", masked_max(lag, mask))
    if log_ratio is None:
        return
    cells = nb * LOG_RATIO.bins
    acc.sum("lag.hist", count_cells(cell_index(log_ratio, LOG_RATIO, ratio_valid, bucket, nb), cells + 1)[:-1])
    acc.sum("lag.k3", torch.zeros(nb, dtype=F64, device=lag.device).index_add_(0, bucket, k3.to(F64)))


def clip_by_lag(acc: ChunkStats, bucket, clipped, nb: int) -> None:
    acc.sum("lag.clip", count_cells(torch.where(clipped, bucket, nb), nb + 1)[:-1])


def entropy_stats(acc: ChunkStats, ent: torch.Tensor, valid: torch.Tensor) -> None:
    value_stats(acc, "entropy", ent, valid)
    acc.sum("entropy.hist", count_cells(cell_index(ent, ENTROPY, valid), ENTROPY.bins + 1)[:-1])


def loss_stats(p: Partial, loss: torch.Tensor) -> None:
    """Sum of the finite micro-batch losses and the count of non-finite ones (the step loss when summed)."""
    loss = loss.detach().float().reshape(-1)
    ok = torch.isfinite(loss)
    p.add_sum("loss.count", torch.ones((), device=loss.device) * loss.numel())
    p.add_sum("loss.sum", torch.where(ok, loss, 0.0).sum())
    p.add_sum("loss.nonfinite", (~ok).sum())
