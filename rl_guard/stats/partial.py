"""``Partial``: the sufficient statistics of one micro-batch (or one rank's step), the unit every probe produces
and every accumulator merges. Entries reduce by sum or by max (minima are stored negated), so merging over
micro-batches and ranks is exact.

A probe that produced everything at once hands over a *packed* ``Partial`` (``pack``): one float64 vector per
reduction plus its layout, which the accumulator adds as it is. The named entries are views of those vectors,
built only when someone reads ``sum`` / ``max`` (after which the ``Partial`` is an ordinary, mutable one)."""

from __future__ import annotations

import torch

F64 = torch.float64

Layout = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]


class Partial:
    """Sufficient statistics of one micro-batch, keyed by name; all tensors 1-D float64."""

    def __init__(self, sum: dict | None = None, max: dict | None = None) -> None:  # noqa: A002 - the reductions
        self._sum = {} if sum is None else sum
        self._max = {} if max is None else max
        self._packed: tuple[Layout, torch.Tensor, torch.Tensor] | None = None

    @property
    def sum(self) -> dict:
        self._unpack()
        return self._sum

    @property
    def max(self) -> dict:
        self._unpack()
        return self._max

    @property
    def packed(self) -> tuple[Layout, torch.Tensor, torch.Tensor] | None:
        """``(layout, sums, maxes)`` while nobody has unpacked the named entries, else None."""
        return self._packed

    def _unpack(self) -> None:
        if self._packed is None:
            return
        (sum_layout, max_layout), s, m = self._packed
        self._packed = None
        for layout, vec, out in ((sum_layout, s, self._sum), (max_layout, m, self._max)):
            if layout:
                out.update(zip((n for n, _ in layout), vec.split([k for _, k in layout])))

    def add_sum(self, name: str, t: torch.Tensor) -> None:
        self.sum[name] = t.reshape(-1).to(F64)

    def add_max(self, name: str, t: torch.Tensor) -> None:
        self.max[name] = t.reshape(-1).to(F64)

    def add_min(self, name: str, t: torch.Tensor) -> None:
        self.max["-" + name] = -t.reshape(-1).to(F64)


def _joined(parts: list, device) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=F64, device=device)
    out = torch.cat([t if t.dim() == 1 else t.reshape(-1) for _, t in parts])  # mixed dtypes promote (int64 counts + float64 -> float64)
    return out if out.dtype == F64 else out.to(F64)


def pack(sums: list, maxes: list, mins: list, device) -> Partial:
    """A packed ``Partial`` from ``[(layout, tensor)]`` pieces (``layout``: ``((name, size), ...)`` covering the
    tensor's elements in order); minima are negated into the max vector under ``-name``."""
    p = Partial()
    s = _joined(sums, device)
    m = _joined(maxes + mins, device)
    n_max = sum(t.numel() for _, t in maxes)
    if mins:
        m[n_max:].neg_()
    layout = (tuple(e for lay, _ in sums for e in lay),
              tuple(e for lay, _ in maxes for e in lay) + tuple(("-" + n, k) for lay, _ in mins for n, k in lay))
    p._packed = (layout, s, m)
    return p
