"""``Partial``: the sufficient statistics of one micro-batch (or one rank's step), the unit every probe produces
and every accumulator merges. Entries reduce by sum or by max (minima are stored negated), so merging over
micro-batches and ranks is exact. A probe hands over one float64 vector per reduction and the layout that names
their elements, which the accumulator adds as it is."""

from __future__ import annotations

from typing import NamedTuple

import torch

F64 = torch.float64

Layout = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]


class Partial(NamedTuple):
    """``layout``: ``(name, size)`` of the elements of ``sums`` and of ``maxes`` in order (a minimum's name is
    prefixed ``-``: it travels negated among the maxima); ``sums``, ``maxes``: 1-D float64 tensors. Read-only:
    the accumulator keeps a micro-batch's vectors without copying them."""

    layout: Layout = ((), ())
    sums: torch.Tensor = torch.zeros(0, dtype=F64)
    maxes: torch.Tensor = torch.zeros(0, dtype=F64)
