"""Mergeable histogram sketch for quantiles on the device.

Cells are relative-accuracy (DDSketch-style) buckets of ``a = |x| + c``, read straight off its float32 bits: the
exponent and the top ``mantissa_bits`` bits of ``a`` (an integer shift of the IEEE representation, monotone in
``a``) give the cell of ``|x|``, and the sign bit of ``x`` mirrors it below 0 (cells ``bins / 2 - 1 - k`` for
negative values, ``bins / 2 + k`` for positive ones; 0 is a cell edge). Every cell spans a ratio of at most
``1 + 2^-mantissa_bits`` in ``a``, i.e. a width of at most ``w = log1p(2^-mantissa_bits)`` in
``u = log((|x| + c) / c)``; ``a`` ranges over ``[c, max_abs + c]``. Counting is one exact integer count into a
fixed-size tensor: no sort, no size limit, no host sync, and two sketches merge by adding their counts (exact
across micro-batches and ranks). Cheap: a handful of integer operations per value, no logarithm.

Reading a quantile: the cell holding the order statistic of rank ``ceil(q * n)`` (numpy
``method="inverted_cdf"``) is found from the running count, and within it the value is interpolated linearly in
``u``: the ``j``-th of the cell's ``c`` values is read at fraction ``(j - 1/2) / c`` of the cell's width (the
midpoint for a cell of one value). A quantile then moves continuously with the data rather than jumping between
cell midpoints, and on smooth data its error is a small fraction of a cell.

Error bound (derived in ``docs/statistics.md``, "Quantiles"): the value reported for a rank lies in the cell of the
exact order statistic of that rank, so ``|x_hat - x| <= eps * (|x| + c)`` with ``eps = 2^-mantissa_bits``.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from . import xp

QUANTILES = (0.01, 0.05, 0.25, 0.50, 0.75, 0.95, 0.99)
QUANTILE_NAMES = tuple(f"p{round(q * 100):02d}" for q in QUANTILES)


def _bits(v: float) -> int:
    """The float32 representation of ``v`` as an integer."""
    return int(np.array(v, dtype=np.float32).view(np.int32))


@dataclass(frozen=True)
class SketchSpec:
    """Resolution of one sketch: ``scale`` c (absolute accuracy below it), ``max_abs`` range, ``mantissa_bits``
    (relative accuracy ~2^-(mantissa_bits + 1)); the number of cells ``bins`` follows from them (even)."""

    scale: float
    max_abs: float
    mantissa_bits: int = 7

    @functools.cached_property  # read per step and per kernel: computed once
    def shift(self) -> int:
        return 23 - self.mantissa_bits

    @functools.cached_property
    def top(self) -> float:
        """Largest ``a = |x| + c`` kept apart (float32): larger values are clamped into the edge cells."""
        return float(np.float32(self.max_abs + self.scale))

    @functools.cached_property
    def base(self) -> int:
        return _bits(self.scale) >> self.shift

    @functools.cached_property
    def bins(self) -> int:
        return 2 * ((_bits(self.top) >> self.shift) - self.base + 1)

    @property
    def width(self) -> float:
        """Largest cell width in ``u = log((|x| + c) / c)``."""
        return math.log1p(2.0**-self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Relative error bound: ``|x_hat - x| <= eps * (|x| + scale)`` (one cell: ``2^-mantissa_bits``)."""
        return math.expm1(self.width)

    @functools.cached_property
    def edges(self) -> np.ndarray:
        """Cell edges in value space (float64), ``bins + 1`` of them; computed once, shared read-only."""
        half = self.bins // 2
        k = (np.arange(half + 1, dtype=np.int64) + self.base) << self.shift
        a = k.astype(np.int32).view(np.float32).astype(np.float64)
        a[0] = self.scale  # a = |x| + c >= c: the first cell starts at x = 0
        pos = a - self.scale
        edges = np.concatenate([-pos[::-1], pos[1:]])
        edges.flags.writeable = False
        return edges

    @functools.cached_property
    def edges_u(self) -> np.ndarray:
        """Cell edges in ``u`` (quantiles are interpolated there)."""
        return np.sign(self.edges) * np.log1p(np.abs(self.edges) / self.scale)


# Log-ratios live near 0 (|log r| ~ 1e-3 matters); entropies in nats up to log(vocab) (12.5 for a 256K vocabulary;
# 20 nats is log of a 485M-token vocabulary), and a healthy run's entropy quantiles move by ~0.01 nats a step.
def warmed(obj):
    """``obj`` with every ``functools.cached_property`` computed: compiled code reads them, and before Python 3.12 a
    first read takes a lock that ``torch.compile`` cannot trace."""
    for name, attr in vars(type(obj)).items():
        if isinstance(attr, functools.cached_property):
            getattr(obj, name)
    return obj


LOG_RATIO = warmed(SketchSpec(scale=1e-4, max_abs=30.0, mantissa_bits=6))  # 2338 cells, eps 1.6%: a small payload
ENTROPY = warmed(SketchSpec(scale=1e-3, max_abs=20.0, mantissa_bits=8))  # 7286 cells, eps 0.39%


def cell_index(x, spec: SketchSpec, extra: int = 0):
    """Cell index (int32) in ``[0, bins)`` of every element of a NaN-free tensor or numpy array, plus a constant
    ``extra`` (several sketches counted in one vector). Values beyond ``max_abs`` (and +-inf) land in the edge
    cells."""
    ops = xp.of(x)
    return cell_index_with(
        ops, ops.cast(x, ops.f32), spec.scale, spec.top, spec.shift, spec.base, spec.bins // 2 + extra
    )


def cell_index_with(ops, xf, scale: float, top: float, shift: int, base: int, middle: int):
    """``cell_index`` of a float32 ``xf`` from a spec's constants, in the array namespace ``ops``."""
    k = ops.bits(ops.clamp(ops.abs(xf) + scale, None, top)) >> shift
    # sign >> 31 is -1 for negative x (0 otherwise) and k ^ -1 = -k - 1: the mirrored cell below 0
    return ((k - base) ^ (ops.bits(xf) >> 31)) + middle


def count_cells(index, size: int, weights=None):
    """Exact counts (int64 ``[size]``) of an index tensor (or numpy array) with values in ``[0, size)``; with
    ``weights``, the sum of the weights that land in each cell instead (float64).

    ``bincount`` is the fastest exact counter on CPU, but on CUDA it reads the index maximum on the host to size
    its output (a sync), so other devices use an ``index_add_`` into a fixed-size vector.
    """
    if not isinstance(index, torch.Tensor):
        return np.bincount(index, weights=weights, minlength=size)
    if index.device.type == "cpu":
        counts = torch.bincount(index, weights=weights, minlength=size)
        return counts if weights is None else counts.to(torch.float64)
    return count_cells_atomic(index, size, weights)


SPREAD_MIN_VALUES = 1 << 17  # below, not worth three more kernels: a 64K-token step counts in 63 us of GPU time
SPREAD_MAX_CELLS = 1 << 20  # cells of all the copies together (8 MiB of int64 or float64)
SPREAD_MAX_COPIES = 1024


def count_cells_atomic(index: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``count_cells`` by atomic adds (``index_add_``), as on a GPU. Millions of values landing in a few thousand
    cells (or a few dozen: the lag buckets' k3 sums) make the atomics on one cell wait on each other, so a large
    input is spread over ``copies`` private copies of the cells (value ``i`` goes to copy ``i % copies``),
    which are summed after: integer counts exactly, float sums in another order."""
    dtype = torch.int64 if weights is None else torch.float64
    n = index.numel()
    copies = _copies(n, size)
    if copies > 1:
        lane = torch.arange(n, device=index.device).bitwise_and_(copies - 1)
        index = index.add(lane, alpha=size)
    out = torch.zeros(copies * size, dtype=dtype, device=index.device)
    values = torch.ones((), dtype=dtype, device=index.device).expand(n) if weights is None else weights.to(dtype)
    out.index_add_(0, index, values)
    return out if copies == 1 else out.view(copies, size).sum(0)


def _copies(n: int, size: int) -> int:
    """A power of two (``lane`` is a bit mask): 1 for small inputs, else as many as the cell budget allows."""
    if n < SPREAD_MIN_VALUES:
        return 1
    most = max(1, min(SPREAD_MAX_COPIES, SPREAD_MAX_CELLS // max(size, 1)))
    return 1 << (most.bit_length() - 1)


@functools.cache
def _edges_u_list(spec: SketchSpec) -> list[float]:
    return spec.edges_u.tolist()


def quantiles_from_counts(counts: np.ndarray, spec: SketchSpec, vmin: float, vmax: float, qs=QUANTILES) -> list[float]:
    """Quantiles (rank ``ceil(q n)``, interpolated within its cell: module docstring) from a cell-count vector; NaN
    when empty.

    One numpy call (the running count), then plain Python: right after a training step numpy's code is out of the
    CPU caches and each distinct numpy call costs tens of microseconds. The counts are whole numbers, so the running
    count's last entry is their exact total; ``bisect_left`` on it is ``np.searchsorted``'s default side."""
    cum = np.asarray(counts, dtype=np.float64).cumsum().data  # a memoryview
    n = float(cum[-1]) if len(cum) else 0.0
    if n <= 0:
        return [math.nan] * len(qs)
    edges_u, out = _edges_u_list(spec), []
    scale, max_abs, last = spec.scale, spec.max_abs, spec.bins - 1
    for q in qs:
        # relative slack: q * n carries float noise (0.01 * 700 = 7.000000000000001) that must not bump the rank
        rank = max(1.0, math.ceil(q * n * (1.0 - 1e-12)))
        cell = bisect.bisect_left(cum, rank - 0.5)
        before = cum[cell - 1] if cell else 0.0
        frac = (rank - before - 0.5) / (cum[cell] - before)  # the rank's place among the cell's values
        u = edges_u[cell] + frac * (edges_u[cell + 1] - edges_u[cell])
        value = math.copysign(math.expm1(abs(u)) * scale, u)
        if cell == 0:
            value = min(value, vmin) if vmin < -max_abs else value
        if cell == last:
            value = max(value, vmax) if vmax > max_abs else value
        out.append(float(min(max(value, vmin), vmax)))
    return out
