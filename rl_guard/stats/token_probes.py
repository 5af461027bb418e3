"""Clipping and policy-lag probes of one chunk on reused chunk buffers (``scratch.py``): they read the stacked
rows of ``token_rows.py`` (zero-filled log-ratio, validity, k3) and append their chunk contribution to a
``ChunkStats`` (see ``kernels.py`` for the conventions: sums, maxima, minima stored negated, histogram counts).
"""

from __future__ import annotations

import math

import torch

from . import keys
from .chunks import ChunkStats
from .scratch import Scratch, finite_max, valid_of, zero_filled
from .sketch import LOG_RATIO, count_cells

F64 = torch.float64


def clip_into(acc: ChunkStats, ws: Scratch, z, v, sign, adv_valid, eps_low: float, eps_high: float):
    """PPO clip fractions of the zero-filled log-ratio ``z`` (validity ``v``) against the advantage
    ``sign`` (0 where invalid; ``adv_valid`` its validity). With s = sign(A) both regions are one comparison,
    s * (lr - b) > a, where a -+ b are the two log thresholds (a > |b|, so a zero-filled lr or A = 0 never clips);
    the low/high split follows from sum(s * clipped) = high - low. Returns the clipped tokens as 0/1 floats."""
    lo, hi = math.log1p(-eps_low), math.log1p(eps_high)
    a, b = (hi - lo) / 2, (hi + lo) / 2
    clipped = torch.sub(z, b, out=ws("clipped")).mul_(sign)
    torch.gt(clipped, a, out=clipped)
    n_clipped = clipped.sum()
    n_low = (n_clipped - torch.dot(clipped, sign)) * 0.5
    acc.sum(keys.CLIP.count, torch.dot(v, adv_valid))
    acc.sum(keys.CLIP.low, n_low)
    acc.sum(keys.CLIP.high, n_clipped - n_low)
    return clipped


def lag_slots(edges) -> int:
    """Lag slots: one per integer lag in ``[edges[0], edges[-1]]`` plus one for invalid tokens (``lag_lut``)."""
    return edges[-1] - edges[0] + 2


def lag_into(acc: ChunkStats, ws: Scratch, versions, current_version: int, gate, edges, ratio_valid=None,
             clipped=None) -> torch.Tensor:
    """Policy lag ``current_version - round(versions)`` of the valid tokens: sum and max. Returns each token's
    slot offset (int32) ``slot - (slots - 1) + slots * (2 - 2 * ratio_valid + clipped)``, where ``slot`` is
    ``lag - edges[0]`` clamped into the edges, or the last slot where the token or its version is invalid (the
    region term only with ``ratio_valid``; ``lag_slot_offset`` is the constant that makes it non-negative).
    The slot is mapped to its bucket on the reduced counts (``lag_lut``), not per token. Exact in fp32 below
    2^24."""
    lag = torch.sub(gate, torch.round(versions, out=ws("t0")), out=ws("t1")).add_(float(current_version))
    z = zero_filled(ws, "z", lag)
    v = valid_of(ws, "t2", lag, z)
    acc.sum(keys.LAG.sum, z.sum())  # fp32 per chunk: relative error ~1e-7 even for huge lags
    acc.max(keys.LAG.max, finite_max(ws, lag))
    lo, hi = edges[0], edges[-1]
    slots = lag_slots(edges)
    # valid: clamp(lag) - lo - (slots - 1) <= -1; invalid (z = 0, v = 0): 0, i.e. the last slot
    slot = torch.clamp(z, lo, hi, out=ws("t3")).sub_(lo + slots - 1).mul_(v)
    if ratio_valid is not None:
        slot.add_(ratio_valid, alpha=-2.0 * slots)
        if clipped is not None:
            slot.add_(clipped, alpha=float(slots))
    return ws("idx", torch.int32).copy_(slot)


def lag_slot_offset(edges, regions: bool) -> int:
    """The constant that turns ``lag_into``'s offsets into slot indices ``slot + slots * region`` >= 0."""
    slots = lag_slots(edges)
    return slots - 1 + (2 * slots if regions else 0)


def lag_counts_into(acc: ChunkStats, offset, edges) -> None:
    """Tokens per lag slot (no log-ratio: no cells), mapped to buckets by ``lag_finish``."""
    offset.add_(lag_slot_offset(edges, regions=False))
    acc.sum(keys.LAG.slots, count_cells(offset, lag_slots(edges)))


def lag_cells_into(acc: ChunkStats, offset, edges, cells: torch.Tensor, start: int, k3) -> None:
    """One count for every per-bucket figure: token ``t`` lands in cell ``cell(log r) + bins * (slot + slots *
    region)`` (``lag_into``), where region is 0 for a valid ratio, 1 for a valid and clipped one, 2 for an invalid
    one. ``cells`` are the log-ratio's sketch cells plus ``start`` (``token_rows``: the histogram's own cell
    index, reused in place). ``lag_finish`` maps slots to buckets and splits the counts into the per-bucket ratio
    histograms, token counts and clip counts, and the k3 sums (per region and slot, weighted by float64 ``k3``)."""
    bins, slots = LOG_RATIO.bins, lag_slots(edges)
    base = lag_slot_offset(edges, regions=True)
    idx = cells.add_(bins * base - start).add_(offset, alpha=bins)
    acc.sum(keys.LAG.cells, count_cells(idx, 3 * slots * bins))
    # k3 is only wanted per bucket: summed per (region, slot), not per cell, into a vector small enough to stay in
    # the L1 cache
    acc.sum(keys.LAG.cells_k3, count_cells(offset.add_(base), 3 * slots, weights=k3))


def _by_bucket(counts: torch.Tensor, lut: torch.Tensor, nb: int, dim: int) -> torch.Tensor:
    """Per-slot counts summed into per-bucket ones along ``dim`` (``lut``: slot -> bucket, ``nb`` for invalid)."""
    shape = list(counts.shape)
    shape[dim] = nb + 1
    return torch.zeros(shape, dtype=counts.dtype, device=counts.device).index_add_(dim, lut, counts)


def lag_finish(acc: ChunkStats, lut: torch.Tensor, nb: int, ratio: bool, clipped: bool) -> None:
    """Per-bucket figures from the per-slot counts of ``lag_counts_into`` or ``lag_cells_into``: token counts and,
    with a log-ratio, clip counts (only when clipping was counted), ratio histograms and k3 sums."""
    slots = lut.numel()
    if not ratio:
        acc.sum(keys.LAG.tokens, _by_bucket(acc.pop_sum(keys.LAG.slots), lut, nb, 0)[:nb])
        return
    bins = LOG_RATIO.bins
    per_slot = acc.pop_sum(keys.LAG.cells).view(3, slots, bins)
    # every token with a finite ratio, whatever its version (the invalid-lag slot too)
    acc.sum(keys.RATIO.hist, (per_slot[0] + per_slot[1]).sum(0))
    cells = _by_bucket(per_slot, lut, nb, 1)[:, :nb]
    k3 = _by_bucket(acc.pop_sum(keys.LAG.cells_k3).view(3, slots), lut, nb, 1)[:, :nb]
    acc.sum(keys.LAG.tokens, cells.sum((0, 2)))
    if clipped:
        acc.sum(keys.LAG.clip, cells[1].sum(1))
    acc.sum(keys.LAG.hist, (cells[0] + cells[1]).reshape(-1))
    acc.sum(keys.LAG.k3, k3.sum(0))
