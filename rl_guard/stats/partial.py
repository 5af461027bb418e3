"""``Partial``: the sufficient statistics of one micro-batch (or one rank's step), the unit every probe produces
and every accumulator merges. Entries reduce by sum or by max (minima are stored negated), so merging over
micro-batches and ranks is exact.

A probe that produced everything at once hands over a *packed* ``Partial`` (``pack``): one float64 vector per
reduction plus its layout, which the accumulator adds as it is. The named entries are views of those vectors,
built only when someone reads ``sum`` / ``max`` (after which the ``Partial`` is an ordinary, mutable one)."""

from __future__ import annotations

import torch

from .on_device import host_to_device

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

    @classmethod
    def of_packed(cls, layout: Layout, sums: torch.Tensor, maxes: torch.Tensor) -> Partial:
        """A packed ``Partial`` from its layout and its float64 sum and max vectors (minima negated in the latter)."""
        p = cls()
        p._packed = (layout, sums, maxes)
        return p

    def add_max(self, name: str, t: torch.Tensor) -> None:
        self.max[name] = t.reshape(-1).to(F64)


class Scalars:
    """Scalar figures by reduction, ``(name, 0-d tensor)`` in the order they were measured; packed into one
    ``Partial`` at the end (one vector per reduction, no dict of tensors)."""

    def __init__(self) -> None:
        self.sum: list[tuple[str, torch.Tensor]] = []
        self.max: list[tuple[str, torch.Tensor]] = []

    def partial(self, device) -> Partial:
        layout = (tuple((name, 1) for name, _ in self.sum), tuple((name, 1) for name, _ in self.max))
        return Partial.of_packed(layout, _scalar_vector(self.sum, device), _scalar_vector(self.max, device))


def _scalar_vector(entries: list, device) -> torch.Tensor:
    if not entries:
        return torch.zeros(0, dtype=F64, device=device)
    return host_to_device(torch.stack([value for _, value in entries]), device, F64)
