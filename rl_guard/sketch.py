"""Mergeable histogram sketch for quantiles on the device.

Values are mapped through the odd, monotone transform ``u = sign(x) * log1p(|x| / c)`` and counted in ``bins``
uniform cells over ``u in [-U, U]`` with ``U = log1p(max_abs / c)`` (0 is a cell edge). Counting is one exact
integer count into a fixed-size tensor: no sort, no size limit, no host sync, and two sketches merge by adding
their counts (exact across micro-batches and ranks).

Error bound: for ``|x| <= max_abs`` the value reported for a rank lies in the same cell as the exact order
statistic of that rank, so ``|x_hat - x| <= eps * (|x| + c)`` with ``eps = exp(w / 2) - 1`` and ``w = 2U / bins``
(relative accuracy ``eps`` for ``|x| >> c``, absolute accuracy ``eps * c`` near 0). The cell coordinate is computed
in float32, so a value within ~1e-3 of a cell width from an edge may be counted in the neighbouring cell (the bound
then holds with ``w * (1/2 + 2e-3)`` in place of ``w / 2``). The reported value is clamped to the exact [min, max]
of the data. Values beyond ``max_abs`` land in the edge cells; a quantile that falls in an edge cell holding such
values is reported as the exact max (or min), a bound on the true quantile. Rank convention: the q-quantile is the
order statistic of rank ``ceil(q * n)`` (numpy ``method="inverted_cdf"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

QUANTILES = (0.01, 0.05, 0.25, 0.50, 0.75, 0.95, 0.99)
QUANTILE_NAMES = tuple(f"p{round(q * 100):02d}" for q in QUANTILES)


@dataclass(frozen=True)
class SketchSpec:
    """Resolution of one sketch: ``scale`` c (linear below it), ``max_abs`` range, ``bins`` cells (even)."""

    scale: float
    max_abs: float
    bins: int = 2048

    @property
    def half_range(self) -> float:
        return math.log1p(self.max_abs / self.scale)

    @property
    def width(self) -> float:
        return 2.0 * self.half_range / self.bins

    @property
    def eps(self) -> float:
        """Relative error bound: ``|x_hat - x| <= eps * (|x| + scale)``."""
        return math.expm1(self.width / 2.0)

    def edges(self) -> np.ndarray:
        """Cell edges in value space (float64), ``bins + 1`` of them."""
        u = np.linspace(-self.half_range, self.half_range, self.bins + 1)
        return np.sign(u) * np.expm1(np.abs(u)) * self.scale


# Log-ratios live near 0 (|log r| ~ 1e-3 matters); entropies in nats up to ~log(vocab).
LOG_RATIO = SketchSpec(scale=1e-4, max_abs=30.0, bins=2048)
ENTROPY = SketchSpec(scale=1e-3, max_abs=30.0, bins=4096)


def cell_index(x: torch.Tensor, spec: SketchSpec, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Cell index (int32) in ``[0, bins)`` of every element of a NaN-free tensor, plus a per-element ``offset``
    (integer-valued float: several sketches counted in one vector). Values beyond ``max_abs`` (and +-inf) land in
    the edge cells."""
    xf = x.float()
    u = xf.abs()
    u.mul_(1.0 / spec.scale).log1p_().mul_(1.0 / spec.width).copysign_(xf)
    u.add_(spec.bins // 2).clamp_(0, spec.bins - 1)
    if offset is not None:
        # floor first: integer-valued floats below 2^24 add exactly, so the offset never moves a value's cell
        u.floor_().add_(offset)
    return u.to(torch.int32)


def count_cells(index: torch.Tensor, size: int) -> torch.Tensor:
    """Exact counts (int64 ``[size]``) of an index tensor with values in ``[0, size)``.

    ``bincount`` is the fastest exact counter on CPU, but on CUDA it reads the index maximum on the host to size
    its output (a sync), so other devices use an ``index_add_`` of ones into a fixed-size vector.
    """
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=size)
    ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())
    return torch.zeros(size, dtype=torch.int64, device=index.device).index_add_(0, index, ones)


def sum_cells(index: torch.Tensor, weights: torch.Tensor, size: int) -> torch.Tensor:
    """Sums of ``weights`` per cell (``[size]``, the weights' dtype); same device split as ``count_cells``."""
    if index.device.type == "cpu":
        return torch.bincount(index, weights, minlength=size)
    return torch.zeros(size, dtype=weights.dtype, device=index.device).index_add_(0, index, weights)


def quantiles_from_counts(
    counts: np.ndarray, spec: SketchSpec, vmin: float, vmax: float, qs=QUANTILES
) -> list[float]:
    """Quantiles (rank ``ceil(q n)``) from a cell-count vector; NaN when empty."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    if n <= 0:
        return [math.nan] * len(qs)
    cum = np.cumsum(counts)
    edges_u = np.linspace(-spec.half_range, spec.half_range, spec.bins + 1)
    out = []
    for q in qs:
        # relative slack: q * n carries float noise (0.01 * 700 = 7.000000000000001) that must not bump the rank
        rank = max(1.0, math.ceil(q * n * (1.0 - 1e-12)))
        cell = int(np.searchsorted(cum, rank - 0.5))
        u = 0.5 * (edges_u[cell] + edges_u[cell + 1])
        value = math.copysign(math.expm1(abs(u)) * spec.scale, u)
        if cell == 0:
            value = min(value, vmin) if vmin < -spec.max_abs else value
        if cell == spec.bins - 1:
            value = max(value, vmax) if vmax > spec.max_abs else value
        out.append(float(min(max(value, vmin), vmax)))
    return out
