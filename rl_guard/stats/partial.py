"""``Partial``: the sufficient statistics of one micro-batch (or one rank's step), the unit every probe produces
and every accumulator merges. Entries reduce by sum or by max (minima are stored negated), so merging over
micro-batches and ranks is exact. A probe hands over one float64 vector per reduction and the layout that names
their elements, which the accumulator adds as it is."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .on_device import host_to_device

F64 = torch.float64

Layout = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]


class Partial(NamedTuple):
    """``layout``: ``(name, size)`` of the elements of ``sums`` and of ``maxes`` in order (a minimum's name is
    prefixed ``-``: it travels negated among the maxima); ``sums``, ``maxes``: 1-D float64 tensors. Read-only:
    the accumulator keeps a micro-batch's vectors without copying them."""

    layout: Layout = ((), ())
    sums: torch.Tensor = torch.zeros(0, dtype=F64)
    maxes: torch.Tensor = torch.zeros(0, dtype=F64)

    def entries(self) -> tuple[dict, dict]:
        """``(sums, maxima)`` by name, views of the vectors (minima un-negated, under their own names)."""
        out: tuple[dict, dict] = ({}, {})
        for layout, vec, named in zip(self.layout, (self.sums, self.maxes), out):
            for (name, _), part in zip(layout, vec.split([k for _, k in layout])):
                if name.startswith("-"):
                    name, part = name[1:], -part
                named[name] = part
        return out


class Scalars:
    """Scalar figures by reduction, ``(name, tensor of one element)`` in the order they were measured; packed into
    one ``Partial`` at the end (one vector per reduction)."""

    def __init__(self) -> None:
        self.sum: list[tuple[str, torch.Tensor]] = []
        self.max: list[tuple[str, torch.Tensor]] = []

    def partial(self, device) -> Partial:
        layout = (tuple((name, 1) for name, _ in self.sum), tuple((name, 1) for name, _ in self.max))
        return Partial(layout, _scalar_vector(self.sum, device), _scalar_vector(self.max, device))


def _scalar_vector(entries: list, device) -> torch.Tensor:
    if not entries:
        return torch.zeros(0, dtype=F64, device=device)
    return host_to_device(torch.stack([value.reshape(()) for _, value in entries]), device, F64)
