"""Token probes of one chunk on reused chunk buffers (``scratch.py``): the per-chunk path of ``probe_batch``.

Each probe reads values that are non-finite exactly where a token is invalid (masked out, or an input is NaN/inf),
writes its temporaries into the chunk's ``Scratch`` and appends its chunk contribution to a ``ChunkStats`` (see
``kernels.py`` for the conventions: sums, maxima, minima stored negated, histogram counts).
"""

from __future__ import annotations

import math

import torch

from . import keys
from .chunks import ChunkStats
from .constants import EXP_CLAMP
from .scratch import Scratch, cell_index_into, finite_max, finite_min, invalid, valid, zero_filled
from .sketch import ENTROPY, LOG_RATIO, count_cells

F64 = torch.float64


def values_into(acc: ChunkStats, ws: Scratch, name: str, y, n, squares: bool = False) -> torch.Tensor:
    """count ``n``, sum, (sum of squares), min, max of the finite entries of ``y``; returns ``y`` zero-filled."""
    key = keys.of(name)
    z = zero_filled(ws, "z", y)  # a chunk temporary: read by the caller before the next family
    acc.sum(key.count, n)
    if squares:
        # std = sqrt(E[x^2] - mean^2) cancels when |mean| >> std: both sums in float64 keep it accurate
        zd = ws("f64", F64).copy_(z)
        acc.sum(key.sum, zd.sum())
        acc.sum(key.sumsq, torch.dot(zd, zd))
    else:
        acc.sum(key.sum, z.sum())
    acc.max(key.max, finite_max(ws, y))
    acc.min(key.min, finite_min(ws, y))
    return z


def ratio_into(acc: ChunkStats, ws: Scratch, name: str, lr, hist: bool = True):
    """Ratio r = exp(lr) of a log-ratio ``lr`` (non-finite where invalid): count, sum r, min/max log r and (with
    ``hist``) the log-ratio histogram. Returns (zero-filled lr, validity, r - 1, count)."""
    key = keys.of(name)
    v = valid(ws, f"{name}.v", lr)
    n = v.sum()
    z = zero_filled(ws, f"{name}.z", lr)
    # expm1 keeps r - 1 and k3 = (r - 1) - log r accurate for |log r| ~ 1e-4 where exp(x) - 1 cancels in fp32
    e = torch.clamp(z, max=EXP_CLAMP, out=ws("e")).expm1_()
    acc.sum(key.count, n)
    acc.sum(key.sum, e.sum() + n)  # sum r = sum (r - 1) + count: no cancellation for r ~ 1
    acc.max(key.logmax, finite_max(ws, lr))
    acc.min(key.logmin, finite_min(ws, lr))
    if hist:
        acc.hist(key.hist, count_cells(cell_index_into(ws, z, LOG_RATIO), LOG_RATIO.bins), LOG_RATIO.bins // 2,
                 z.numel() - n)
    return z, v, e, n


def entropy_into(acc: ChunkStats, ws: Scratch, y, n) -> None:
    """Entropy (non-finite where invalid, ``n`` valid): value statistics and histogram."""
    z = values_into(acc, ws, "entropy", y, n)
    acc.hist(keys.ENTROPY.hist, count_cells(cell_index_into(ws, z, ENTROPY), ENTROPY.bins), ENTROPY.bins // 2,
             z.numel() - n)


def clip_into(acc: ChunkStats, ws: Scratch, z, v, n, sign, adv_invalid, eps_low: float, eps_high: float):
    """PPO clip fractions of the zero-filled log-ratio ``z`` (validity ``v``, ``n`` valid) against the advantage
    ``sign`` (0 where invalid). With s = sign(A) both regions are one comparison, s * (lr - b) > a, where a -+ b
    are the two log thresholds (a > |b|, so a zero-filled lr or A = 0 never clips); the low/high split follows
    from sum(s * clipped) = high - low. Returns the clipped tokens as 0/1 floats."""
    lo, hi = math.log1p(-eps_low), math.log1p(eps_high)
    a, b = (hi - lo) / 2, (hi + lo) / 2
    clipped = torch.sub(z, b, out=ws("clipped")).mul_(sign).sub_(a).sign_().clamp_(min=0.0)
    n_clipped = clipped.sum()
    n_low = (n_clipped - torch.dot(clipped, sign)) * 0.5
    acc.sum(keys.CLIP.count, n - torch.dot(v, adv_invalid))
    acc.sum(keys.CLIP.low, n_low)
    acc.sum(keys.CLIP.high, n_clipped - n_low)
    return clipped


def lag_into(acc: ChunkStats, ws: Scratch, versions, current_version: int, gate, edges, lut,
             region=None) -> torch.Tensor:
    """Policy lag ``current_version - round(versions)`` of the valid tokens: sum and max; returns ``lut`` at each
    token's lag slot (int32): slot ``lag - edges[0]`` clamped into the edges, the last slot where the token or its
    version is invalid, plus ``len(slots) * region`` when a per-token ``region`` is given (``lag_cell_lut``).
    Exact in fp32 below 2^24."""
    lag = torch.sub(gate, torch.round(versions, out=ws("t0")), out=ws("t1")).add_(float(current_version))
    bad = invalid(ws, "t2", lag)
    z = zero_filled(ws, "z", lag)
    acc.sum(keys.LAG.sum, z.sum())  # fp32 per chunk: relative error ~1e-7 even for huge lags
    acc.max(keys.LAG.max, finite_max(ws, lag))
    lo, hi = edges[0], edges[-1]
    slot = torch.clamp(z, lo, hi, out=ws("t3")).add_(bad, alpha=hi + 1 - lo).clamp_(max=hi + 1)
    if lo:
        slot.sub_(lo)
    if region is not None:
        slot.add_(region, alpha=hi + 2 - lo)
    idx = ws("idx", torch.int32).copy_(slot)
    return torch.index_select(lut, 0, idx, out=ws("lag.bucket", torch.int32))  # several times faster than lut[idx]


def lag_cell_lut(lut: torch.Tensor, nb: int) -> torch.Tensor:
    """``lut`` (lag slot -> bucket) extended to (region, slot) -> offset of the bucket's block of log-ratio cells
    in ``lag_cells_into``: ``bins * (bucket + (nb + 1) * region)`` for regions 0, 1, 2."""
    return torch.cat([(lut + (nb + 1) * r) * LOG_RATIO.bins for r in range(3)])


def lag_region(ws: Scratch, v, clipped) -> torch.Tensor:
    """Region of each token's lag cells: 0 valid ratio, 1 valid ratio and clipped, 2 invalid ratio."""
    region = torch.add(v, -1.0, out=ws("lag.region")).mul_(-2.0)
    return region if clipped is None else region.add_(clipped)


def lag_cells_into(acc: ChunkStats, ws: Scratch, offset, nb: int, z, k3) -> None:
    """One count for every per-bucket figure: token ``t`` lands in cell ``cell(log r) + offset``, where the
    offset (``lag_into`` with ``lag_cell_lut``) is ``bins * (bucket + (nb + 1) * region)`` (bucket ``nb``: masked
    out, dropped). ``lag_finish`` splits the counts into the per-bucket ratio histograms, token counts and clip
    counts, and the k3 sums (the same index weighted by k3)."""
    idx = cell_index_into(ws, z, LOG_RATIO).add_(offset)
    size = 3 * (nb + 1) * LOG_RATIO.bins
    acc.sum("lag.cells", count_cells(idx, size))
    acc.sum("lag.cells_k3", count_cells(idx, size, weights=ws("f64", F64).copy_(k3)))  # float64 sums per cell


def lag_finish(acc: ChunkStats, nb: int, clipped: bool) -> None:
    """Per-bucket figures from the counts of ``lag_cells_into``: token counts, clip counts (only when clipping was
    counted), ratio histograms and k3 sums."""
    bins = LOG_RATIO.bins
    cells = acc.pop_sum("lag.cells").view(3, nb + 1, bins)[:, :nb]
    k3 = acc.pop_sum("lag.cells_k3").view(3, nb + 1, bins)[:, :nb]
    acc.sum(keys.LAG.tokens, cells.sum((0, 2)))
    if clipped:
        acc.sum(keys.LAG.clip, cells[1].sum(1))
    acc.sum(keys.LAG.hist, (cells[0] + cells[1]).reshape(-1))
    acc.sum(keys.LAG.k3, k3.sum((0, 2)))
