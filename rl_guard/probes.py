"""Pure device-side probes: token batch -> sufficient statistics (sums, maxima, histogram counts).

Every probe writes into a ``Partial``: entries reduced by sum (counts, sums, sums of squares, histogram cells)
and entries reduced by max (maxima, and minima stored negated), so micro-batches and ranks merge exactly.
Nothing here reads a device value on the host. Statistics use finite values only; non-finite inputs are counted
under ``input/<field>/nonfinite``. The host-side formulas that turn these into metrics live in ``summarize.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .batch import TokenBatch
from .sketch import ENTROPY, LOG_RATIO, cell_index, count_cells

DEFAULT_LAG_EDGES = (0, 1, 2, 3, 5, 9)  # buckets 0, 1, 2, 3-4, 5-8, 9+
EXP_CLAMP = 80.0  # exp() argument clamp so a finite but huge log-ratio gives a huge finite ratio, not inf


@dataclass
class Partial:
    """Sufficient statistics of one micro-batch, keyed by name; all tensors 1-D."""

    sum: dict = field(default_factory=dict)
    max: dict = field(default_factory=dict)

    def add_sum(self, name: str, t: torch.Tensor) -> None:
        self.sum[name] = t.reshape(-1).to(torch.float64)

    def add_max(self, name: str, t: torch.Tensor) -> None:
        self.max[name] = t.reshape(-1).to(torch.float64)

    def add_min(self, name: str, t: torch.Tensor) -> None:
        self.max["-" + name] = -t.reshape(-1).to(torch.float64)


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, -math.inf).amax() if x.numel() else x.new_full((), -math.inf)


def _masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, math.inf).amin() if x.numel() else x.new_full((), math.inf)


def value_stats(p: Partial, name: str, x: torch.Tensor, valid: torch.Tensor, squares: bool = False) -> None:
    """count, sum, (sum of squares), min, max of ``x`` over ``valid``."""
    xv = torch.where(valid, x, 0.0)
    p.add_sum(f"{name}.count", valid.sum())
    p.add_sum(f"{name}.sum", xv.sum())
    if squares:
        p.add_sum(f"{name}.sumsq", (xv * xv).sum())
    p.add_max(f"{name}.max", _masked_max(x, valid))
    p.add_min(f"{name}.min", _masked_min(x, valid))


def ratio_stats(p: Partial, name: str, log_ratio: torch.Tensor, valid: torch.Tensor, hist: bool = True) -> None:
    """Ratio r = exp(log_ratio): count, sum r, min/max log r, log-ratio histogram (quantiles of r)."""
    r = torch.exp(log_ratio.clamp(max=EXP_CLAMP))
    p.add_sum(f"{name}.count", valid.sum())
    p.add_sum(f"{name}.sum", torch.where(valid, r, 0.0).sum())
    p.add_max(f"{name}.logmax", _masked_max(log_ratio, valid))
    p.add_min(f"{name}.logmin", _masked_min(log_ratio, valid))
    if hist:
        p.add_sum(f"{name}.hist", count_cells(cell_index(log_ratio, LOG_RATIO), valid, LOG_RATIO.bins))


def kl_stats(p: Partial, b: TokenBatch, name: str, log_r: torch.Tensor, valid: torch.Tensor) -> None:
    """k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r: token sums, per-sequence sums and their max."""
    lr = torch.where(valid, log_r, 0.0)
    vf = valid.float()
    seq_tokens = b.seq_sum(vf)
    seq_valid = seq_tokens > 0
    p.add_sum(f"{name}.count", valid.sum())
    p.add_sum(f"{name}.seqs", seq_valid.sum())
    estimators = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.expm1(lr.clamp(max=EXP_CLAMP)) - lr}
    for k, per_token in estimators.items():
        per_seq = b.seq_sum(per_token)
        p.add_sum(f"{name}.{k}.sum", per_token.sum())
        p.add_sum(f"{name}.{k}.seqsum", per_seq.sum())
        p.add_max(f"{name}.{k}.seqmax", _masked_max(per_seq, seq_valid))


def seq_log_ratio(b: TokenBatch, log_ratio: torch.Tensor, valid: torch.Tensor):
    """GSPO sequence log-ratio: mean token log-ratio per sequence; returns (values [S], valid [S])."""
    tokens = b.seq_sum(valid.float())
    total = b.seq_sum(torch.where(valid, log_ratio, 0.0))
    return total / tokens.clamp(min=1.0), tokens > 0


def nonfinite(p: Partial, name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Counts masked non-finite entries under ``input/<name>/nonfinite``; returns the finite mask."""
    finite = torch.isfinite(x)
    p.add_sum(f"input.{name}.nonfinite", (mask & ~finite).sum())
    return finite


def clip_stats(p: Partial, clip_log_ratio, adv, valid, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO clip fractions: low (r < 1 - eps_low and A < 0), high (r > 1 + eps_high and A > 0); returns region."""
    low = valid & (clip_log_ratio < math.log1p(-eps_low)) & (adv < 0)
    high = valid & (clip_log_ratio > math.log1p(eps_high)) & (adv > 0)
    p.add_sum("clip.count", valid.sum())
    p.add_sum("clip.low", low.sum())
    p.add_sum("clip.high", high.sum())
    return low | high


def lag_stats(p: Partial, lag, valid_tokens, edges, log_ratio, ratio_valid, clipped, k3) -> None:
    """Per-bucket token counts, ratio histograms, clip counts and k3 sums; bucket b holds edges[b] <= lag < edges[b+1]."""
    nb = len(edges)
    bounds = torch.tensor(edges[1:], device=lag.device, dtype=lag.dtype)
    bucket = torch.bucketize(lag, bounds, right=True)
    vf = valid_tokens.float()
    p.add_sum("lag.tokens", torch.zeros(nb, dtype=torch.float64, device=lag.device).index_add_(0, bucket, vf.double()))
    p.add_sum("lag.sum", torch.where(valid_tokens, lag, 0).sum())
    p.add_max("lag.max", _masked_max(lag, valid_tokens))
    if log_ratio is None:
        return
    rv = ratio_valid.float()
    p.add_sum("lag.ratio_count", torch.zeros(nb, dtype=torch.float64, device=lag.device).index_add_(0, bucket, rv.double()))
    cells = cell_index(log_ratio, LOG_RATIO) + bucket * LOG_RATIO.bins
    p.add_sum("lag.hist", count_cells(cells, rv, nb * LOG_RATIO.bins))
    p.add_sum("lag.clip", torch.zeros(nb, dtype=torch.float64, device=lag.device).index_add_(0, bucket, clipped.double()))
    k3v = torch.where(ratio_valid, k3, 0.0)
    p.add_sum("lag.k3", torch.zeros(nb, dtype=torch.float64, device=lag.device).index_add_(0, bucket, k3v.double()))


def entropy_stats(p: Partial, ent: torch.Tensor, valid: torch.Tensor) -> None:
    value_stats(p, "entropy", ent, valid)
    p.add_sum("entropy.hist", count_cells(cell_index(ent, ENTROPY), valid, ENTROPY.bins))


def loss_stats(p: Partial, loss: torch.Tensor) -> None:
    """Sum of the finite micro-batch losses and the count of non-finite ones (the step loss when summed)."""
    loss = loss.detach().float().reshape(-1)
    finite = torch.isfinite(loss)
    p.add_sum("loss.count", torch.ones((), device=loss.device) * loss.numel())
    p.add_sum("loss.sum", torch.where(finite, loss, 0.0).sum())
    p.add_sum("loss.nonfinite", (~finite).sum())
