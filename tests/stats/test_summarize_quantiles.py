"""``sketch.quantiles_from_counts`` (one cumsum, then a bisection per quantile) gives exactly the values of the plain
numpy formulation below (``np.searchsorted`` over the running count), whose error bound tests/stats/test_sketch.py
checks: same cells, same interpolation, same clamping, on data inside and beyond the sketch's range."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from rl_guard.stats.sketch import ENTROPY, LOG_RATIO, QUANTILES, SketchSpec, cell_index, count_cells
from rl_guard.stats.sketch import quantiles_from_counts as quantiles

SPECS = (LOG_RATIO, ENTROPY, SketchSpec(scale=1.0, max_abs=10.0, mantissa_bits=3))
QS = (*QUANTILES, 0.001, 0.1, 0.333, 0.9, 0.999, 1.0)


def quantiles_reference(counts, spec, vmin, vmax, qs=QUANTILES) -> list[float]:
    n = counts.sum()
    if n <= 0:
        return [math.nan] * len(qs)
    ranks = [max(1.0, math.ceil(q * n * (1.0 - 1e-12))) for q in qs]
    cum = np.cumsum(counts)
    cells = np.searchsorted(cum, np.asarray(ranks) - 0.5).tolist()
    out = []
    for rank, cell in zip(ranks, cells):
        before = cum[cell - 1] if cell else 0.0
        frac = (rank - before - 0.5) / counts[cell]  # interpolated by the rank's place among the cell's values
        u = spec.edges_u[cell] + frac * (spec.edges_u[cell + 1] - spec.edges_u[cell])
        value = math.copysign(math.expm1(abs(u)) * spec.scale, u)
        if cell == 0 and vmin < -spec.max_abs:
            value = min(value, vmin)
        if cell == spec.bins - 1 and vmax > spec.max_abs:
            value = max(value, vmax)
        out.append(float(min(max(value, vmin), vmax)))
    return out


def _data(kind: str, rng: np.random.Generator) -> np.ndarray:
    n = int(rng.integers(1, 3000))
    if kind == "normal":
        return rng.normal(0, 10 ** rng.uniform(-5, 1), n)
    if kind == "heavy":
        return rng.standard_cauchy(n) * 10 ** rng.uniform(-3, 1)  # values beyond max_abs land in the edge cells
    if kind == "ties":
        return rng.choice([-2.0, 0.0, 1e-4, 3.0], n)
    if kind == "one":
        return np.full(1, rng.normal())
    return np.concatenate([rng.normal(size=n), [np.inf, -np.inf, 1e6]])  # "infinite"


@pytest.mark.parametrize("spec", SPECS, ids=["log_ratio", "entropy", "coarse"])
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "one", "infinite"])
def test_quantiles_equal_the_sketch_reference(spec, kind):
    rng = np.random.default_rng(zlib.crc32(repr((spec.bins, kind)).encode()))  # the same data in every process
    for _ in range(20):
        x = _data(kind, rng).astype(np.float32)
        counts = count_cells(cell_index(torch.from_numpy(x), spec), spec.bins).numpy().astype(np.float64)
        lo, hi = float(x.min()), float(x.max())
        for qs in (QS, (0.5, 0.99)):
            got, want = quantiles(counts, spec, lo, hi, qs), quantiles_reference(counts, spec, lo, hi, qs)
            assert got == want, (kind, qs)
            assert all(type(v) is float for v in got)


def test_empty_counts_give_nan_as_the_reference():
    counts = np.zeros(LOG_RATIO.bins)
    got = quantiles(counts, LOG_RATIO, math.inf, -math.inf)
    assert len(got) == len(QUANTILES) and all(math.isnan(v) for v in got)
    assert len(quantiles(counts, LOG_RATIO, 0.0, 1.0, qs=(0.5, 0.99))) == 2
