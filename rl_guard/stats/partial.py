"""``Partial``: the sufficient statistics of one micro-batch (or one rank's step), the unit every probe produces
and every accumulator merges. Entries reduce by sum or by max (minima are stored negated), so merging over
micro-batches and ranks is exact."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
