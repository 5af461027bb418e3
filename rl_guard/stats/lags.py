"""Policy-lag buckets: the slots ``families.chunk_stats`` counts tokens in, the table from slots to the configured
buckets (``lag_lut``), and the mapping once a micro-batch's chunks are done (``lag_finish``). Torch only: batches
with policy versions never take the numpy host path."""

from __future__ import annotations

import functools

import torch

from . import keys
from .chunks import ChunkStats
from .sketch import LOG_RATIO


@functools.lru_cache(maxsize=16)
def lag_lut(edges: tuple, device: torch.device) -> torch.Tensor:
    """Bucket (int32) of every integer lag in ``[edges[0], edges[-1]]`` plus a last entry ``len(edges)`` for
    masked-out tokens: bucket b holds ``edges[b] <= lag < edges[b+1]``; lags outside the range are clamped into it
    (below ``edges[0]`` -> bucket 0). Built once per edges and device; read only."""
    lags = torch.arange(edges[0], edges[-1] + 2, device=device)  # built on the device: no host->device copy
    lut = torch.zeros_like(lags, dtype=torch.int32)
    for e in edges[1:]:
        lut += lags >= e
    lut[-1:].fill_(len(edges))  # not ``lut[-1] = n``: on a GPU that copies n from the host and waits
    return lut


def lag_slots(edges) -> int:
    """Lag slots: one per integer lag in ``[edges[0], edges[-1]]`` plus one for invalid tokens (``lag_lut``)."""
    return edges[-1] - edges[0] + 2


def lag_slot_offset(edges, regions: bool) -> int:
    """The constant that turns ``families.chunk_stats``'s slot offsets into slot indices ``slot + slots * region``
    (>= 0)."""
    slots = lag_slots(edges)
    return slots - 1 + (2 * slots if regions else 0)


def by_bucket(counts: torch.Tensor, lut: torch.Tensor, nb: int, dim: int) -> torch.Tensor:
    """Per-slot counts summed into per-bucket ones along ``dim`` (``lut``: slot -> bucket, ``nb`` for invalid)."""
    shape = list(counts.shape)
    shape[dim] = nb + 1
    return torch.zeros(shape, dtype=counts.dtype, device=counts.device).index_add_(dim, lut, counts)


def lag_finish(acc: ChunkStats, lut: torch.Tensor, nb: int, ratio: bool, clipped: bool) -> None:
    """Per-bucket figures from the per-slot counts of ``families.chunk_stats`` (``lag_slots`` or ``lag_cells``):
    token counts and, with a log-ratio, clip counts (only when clipping was counted), ratio histograms and k3
    sums."""
    slots = lut.numel()
    if not ratio:
        acc.sum(keys.LAG.tokens, by_bucket(acc.pop_sum(keys.LAG.slots), lut, nb, 0)[:nb])
        return
    bins = LOG_RATIO.bins
    per_slot = acc.pop_sum(keys.LAG.cells).view(3, slots, bins)
    # every token with a finite ratio, whatever its version (the invalid-lag slot too)
    acc.sum(keys.RATIO.hist, (per_slot[0] + per_slot[1]).sum(0))
    cells = by_bucket(per_slot, lut, nb, 1)[:, :nb]
    k3 = by_bucket(acc.pop_sum(keys.LAG.cells_k3).view(3, slots), lut, nb, 1)[:, :nb]
    acc.sum(keys.LAG.tokens, cells.sum((0, 2)))
    if clipped:
        acc.sum(keys.LAG.clip, cells[1].sum(1))
    acc.sum(keys.LAG.hist, (cells[0] + cells[1]).reshape(-1))
    acc.sum(keys.LAG.k3, k3.sum(0))
