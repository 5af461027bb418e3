"""The histogram sketch's documented error bound on adversarial data.

Bound (sketch.py): for an exact order statistic x (rank ceil(q n)) with |x| <= max_abs, the reported x_hat (read
inside the cell of that rank, interpolated by the rank's place among the cell's values) obeys
|x_hat - x| <= eps * (|x| + scale), eps = expm1(w) = 2^-mantissa_bits, w = log1p(2^-mantissa_bits) the largest cell
width in u = log1p(|x| / scale) (cells are read off the float32 bits of |x| + scale).

Float32 slack: the device rounds |x| + scale to float32 (relative error 2^-24, at most 2^(mantissa_bits - 24) of a
cell), so a value that close to a cell edge may be counted in the neighbouring cell. The reported value may then be
slightly more than a cell away in u, so the tests use expm1(w * (1 + FLOAT32_SLACK)) with FLOAT32_SLACK = 2e-3 cells
(far more than the rounding needs).

Continuity (item of the sketch's design, not of its bound): on smooth data a quantile follows a shift of the data
smaller than a cell, and its error is a small fraction of the bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_guard.stats import sketch
from rl_guard.stats.sketch import (
    ENTROPY,
    LOG_RATIO,
    QUANTILES,
    SketchSpec,
    cell_index,
    count_cells,
    quantiles_from_counts,
)

FLOAT32_SLACK = 2e-3
QS = (*QUANTILES, 0.001, 0.1, 0.333, 0.9, 0.999, 1.0)
SPECS = (LOG_RATIO, ENTROPY, SketchSpec(scale=1.0, max_abs=10.0, mantissa_bits=3))


def exact_rank_stat(x: np.ndarray, q: float) -> float:
    n = x.size
    rank = max(1, math.ceil(round(q * n, 9)))  # q n without float noise (q has at most 3 decimals here)
    return float(np.sort(x)[rank - 1])


def sketch_quantiles(x32: np.ndarray, spec: SketchSpec, qs=QS) -> list[float]:
    t = torch.from_numpy(x32)
    counts = count_cells(cell_index(t, spec), spec.bins).numpy()
    assert counts.sum() == x32.size
    return quantiles_from_counts(counts, spec, float(x32.min()), float(x32.max()), qs=qs)


def check_bound(x: np.ndarray, spec: SketchSpec, qs=QS) -> int:
    """Asserts the documented guarantee for every q; returns how many quantiles were checked against the bound."""
    x32 = x.astype(np.float32)
    x64 = x32.astype(np.float64)  # the data the device sees
    eps = math.expm1(spec.width * (1 + FLOAT32_SLACK))
    edges = spec.edges
    outside_hi, outside_lo = x64.max() > spec.max_abs, x64.min() < -spec.max_abs
    checked = 0
    for q, hat in zip(qs, sketch_quantiles(x32, spec, qs)):
        exact = exact_rank_stat(x64, q)
        assert x64.min() <= hat <= x64.max(), (q, hat)
        if exact > spec.max_abs or (outside_hi and exact >= edges[-2]):
            assert hat == x64.max(), (q, hat, exact)  # beyond the range: the exact max, an upper bound
        elif exact < -spec.max_abs or (outside_lo and exact <= edges[1]):
            assert hat == x64.min(), (q, hat, exact)
        else:
            assert abs(hat - exact) <= eps * (abs(exact) + spec.scale), (q, hat, exact, eps)
            checked += 1
    return checked


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("spec", SPECS, ids=["log_ratio", "entropy", "coarse"])
@pytest.mark.parametrize(
    "name,make",
    [
        ("normal_small", lambda r: r.normal(0, 1e-3, 20_000)),
        ("normal_wide", lambda r: r.normal(0, 2.0, 20_000)),
        ("cauchy", lambda r: r.standard_cauchy(20_000) * 0.01),
        ("pareto", lambda r: r.pareto(1.1, 20_000) * 0.01),
        ("mixed_signs_many_scales", lambda r: r.choice([-1, 1], 20_000) * 10 ** r.uniform(-9, 1.4, 20_000)),
        ("tiny_near_zero", lambda r: r.normal(0, 1e-8, 5_000)),
        ("uniform_positive", lambda r: r.uniform(0, 12, 9_999)),
    ],
)
def test_error_bound_on_distributions(spec, name, make):
    assert check_bound(make(rng()), spec) > 0


@pytest.mark.parametrize("spec", SPECS, ids=["log_ratio", "entropy", "coarse"])
def test_point_masses(spec):
    for v in (0.0, 1e-7, -0.37, 2.5, 29.0):
        x = np.full(1000, v)
        assert sketch_quantiles(x.astype(np.float32), spec) == [np.float32(v)] * len(QS)  # exact: clamped to [min, max]
    r = rng(1)
    x = np.where(r.random(50_000) < 0.99, 0.125, r.normal(0, 3, 50_000))  # 99% at one value
    check_bound(x, spec)
    x = np.concatenate([np.zeros(990), r.normal(5, 1, 10)])  # the p99 sits exactly at the boundary of the mass
    check_bound(x, spec)


@pytest.mark.parametrize("spec", SPECS, ids=["log_ratio", "entropy", "coarse"])
def test_values_beyond_the_range_report_the_exact_extreme(spec):
    r = rng(2)
    big = spec.max_abs * 1e3
    x = np.concatenate([r.normal(0, spec.scale, 900), np.full(60, big), np.linspace(-big, -2 * spec.max_abs, 40)])
    qs = (0.001, 0.02, 0.5, 0.95, 0.99, 1.0)
    hats = sketch_quantiles(x.astype(np.float32), spec, qs)
    assert hats[0] == np.float32(-big) and hats[-1] == hats[-2] == hats[-3] == np.float32(big)
    check_bound(x, spec, qs)
    inf = np.array([np.inf, -np.inf, 1.0, 2.0])  # +-inf land in the edge cells; never out of bounds
    counts = count_cells(cell_index(torch.from_numpy(inf.astype(np.float32)), spec), spec.bins)
    assert counts[0] == 1 and counts[-1] == 1 and counts.sum() == 4


def test_tiny_samples_and_every_rank():
    for n in (1, 2, 3, 7, 100, 101):
        x = rng(n).normal(0, 0.1, n)
        check_bound(x, LOG_RATIO, qs=tuple(k / 1000 for k in range(1, 1001, 37)) + (1.0,))


def test_empty_sketch_gives_nan():
    assert all(math.isnan(v) for v in quantiles_from_counts(np.zeros(LOG_RATIO.bins), LOG_RATIO, math.inf, -math.inf))


def test_rank_convention_is_numpy_inverted_cdf():
    """rank ceil(q n) is numpy's method="inverted_cdf" (checked where numpy's own q * n has no float noise)."""
    x = rng(3).normal(0, 1, 1000)
    for q in QUANTILES:
        assert exact_rank_stat(x, q) == np.quantile(x, q, method="inverted_cdf")
    # q * n noise: 0.01 * 700 = 7.000000000000001 in float; rank must stay 7, as for the exact product
    y = np.arange(1.0, 701.0)
    spec = SketchSpec(1.0, 1000.0, 10)
    counts = count_cells(cell_index(torch.from_numpy(y.astype(np.float32)), spec), spec.bins)
    (p01,) = quantiles_from_counts(counts.numpy(), spec, 1.0, 700.0, qs=(0.01,))
    assert abs(p01 - 7.0) < 0.01


def test_merging_sketches_adds_counts_exactly():
    r = rng(4)
    parts = [r.standard_cauchy(n).astype(np.float32) for n in (10, 1000, 5555)]
    whole = count_cells(cell_index(torch.from_numpy(np.concatenate(parts)), LOG_RATIO), LOG_RATIO.bins)
    merged = sum(count_cells(cell_index(torch.from_numpy(p), LOG_RATIO), LOG_RATIO.bins) for p in parts)
    assert torch.equal(whole, merged)


def test_extra_places_several_sketches_in_one_vector_and_numpy_gives_the_same_cells():
    x = torch.tensor([-1.0, 0.0, 0.5, 3.0, -math.inf, math.inf, 1e-30, -2e-4])
    base = cell_index(x, LOG_RATIO)
    assert torch.equal(cell_index(x, LOG_RATIO, 2 * LOG_RATIO.bins), base + 2 * LOG_RATIO.bins)
    assert np.array_equal(cell_index(x.numpy(), LOG_RATIO), base.numpy())  # the host path's namespace
    assert np.array_equal(count_cells(base.numpy(), LOG_RATIO.bins), count_cells(base, LOG_RATIO.bins).numpy())


@pytest.mark.parametrize("spec", SPECS, ids=["log_ratio", "entropy", "coarse"])
def test_every_value_lies_in_its_cell_and_cells_are_at_most_w_wide(spec):
    """The cell of each value (read off the float32 bits) contains it, and no cell is wider than w in u: together
    they give the documented bound for every single value, not only for the quantiles sampled above."""
    edges = spec.edges
    assert edges.size == spec.bins + 1 and edges[spec.bins // 2] == 0.0 and np.all(np.diff(edges) > 0)
    u = np.sign(edges) * np.log1p(np.abs(edges) / spec.scale)
    assert np.diff(u).max() <= spec.width * (1 + 1e-12)
    assert np.diff(u).max() >= spec.width * 0.99  # the bound is tight: cells at the start of an octave are w wide
    r = rng(5)
    x = (r.choice([-1, 1], 200_000) * 10 ** r.uniform(-9, math.log10(spec.max_abs), 200_000)).astype(np.float32)
    x = np.concatenate([x, edges.astype(np.float32), np.float32([0.0, spec.max_abs, -spec.max_abs])])
    x = x[np.abs(x.astype(np.float64)) <= spec.max_abs]
    cells = cell_index(torch.from_numpy(x), spec).numpy()
    x64 = x.astype(np.float64)
    slack = (np.abs(x64) + spec.scale) * 2.0**-23  # float32 rounding of |x| + scale
    assert np.all(edges[cells] <= x64 + slack) and np.all(x64 - slack <= edges[cells + 1])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), size=st.integers(1, 700), weighted=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_atomic_counting_spread_over_copies_equals_bincount(n, size, weighted, seed):
    """The GPU's counter (``index_add_``, spread over private copies of the cells for large inputs), run here on
    CPU tensors with the spreading threshold lowered: integer counts exact, weighted sums to float64 rounding."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, size, (n,), generator=g)
    weights = torch.randn(n, generator=g, dtype=torch.float32) if weighted else None
    want = np.bincount(index.numpy(), weights=None if weights is None else weights.double().numpy(), minlength=size)
    for threshold in (sketch.SPREAD_MIN_VALUES, 1):  # as shipped (no spreading at these sizes), and spread
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sketch, "SPREAD_MIN_VALUES", threshold)
            got = sketch.count_cells_atomic(index, size, weights)
            copies = sketch._copies(n, size)
        if threshold > n:
            assert copies == 1
        else:  # a power of two (the lane is a bit mask), within both budgets, and the largest such
            assert copies & (copies - 1) == 0 and copies <= sketch.SPREAD_MAX_COPIES
            assert copies * size <= sketch.SPREAD_MAX_CELLS or copies == 1
            assert 2 * copies > sketch.SPREAD_MAX_COPIES or 2 * copies * size > sketch.SPREAD_MAX_CELLS
        assert got.shape == (size,) and got.dtype == (torch.float64 if weighted else torch.int64)
        if weighted:
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-9)
        else:
            np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("spec", SPECS, ids=["log_ratio", "entropy", "coarse"])
def test_values_inside_a_cell_are_interpolated_by_rank(spec):
    """The j-th of a cell's c values reads at fraction (j - 1/2) / c of its width in u: the midpoint for one value,
    and increasing through the cell."""
    lo, hi = spec.edges[spec.bins // 2 + 5], spec.edges[spec.bins // 2 + 6]
    x = np.full(4, 0.5 * (lo + hi))
    counts = count_cells(cell_index(torch.from_numpy(x.astype(np.float32)), spec), spec.bins).numpy()
    hats = quantiles_from_counts(counts, spec, -math.inf, math.inf, qs=(0.25, 0.5, 0.75, 1.0))
    u = np.log1p(np.array(hats) / spec.scale)
    u_lo, u_hi = np.log1p(lo / spec.scale), np.log1p(hi / spec.scale)
    np.testing.assert_allclose((u - u_lo) / (u_hi - u_lo), [0.125, 0.375, 0.625, 0.875], rtol=1e-9)


@pytest.mark.parametrize("center,scale,step", [(2.6, 0.4, 2e-3), (0.05, 0.02, 1e-4)])
def test_entropy_quantiles_read_continuously(center, scale, step):
    """An entropy distribution drifting by a fifth of a cell per step (a cell is 0.010 nats wide at 2.6): every
    quantile stays well inside the bound, p25 < p50 < p75, and those three follow each step with an error well below
    the step's movement (the sparse tails carry sampling noise of about one step)."""
    base = rng(6).normal(0, 1, 40_000)
    previous = None
    for k in range(8):
        x = np.abs(center + k * step + scale * base).astype(np.float32)
        hats = sketch_quantiles(x, ENTROPY, QUANTILES)
        exact = [exact_rank_stat(x.astype(np.float64), q) for q in QUANTILES]
        assert all(a < b for a, b in zip(hats, hats[1:])), hats  # distinct and ordered, never stuck on one edge
        for hat, want in zip(hats, exact):
            assert abs(hat - want) <= 0.5 * ENTROPY.eps * (want + ENTROPY.scale), (hat, want)
        middle = slice(QUANTILES.index(0.25), QUANTILES.index(0.75) + 1)
        np.testing.assert_allclose(hats[middle], exact[middle], rtol=0, atol=0.25 * step)
        if previous is not None:
            moves = np.subtract(hats, previous)[middle]
            assert np.all(moves > 0.5 * step) and np.all(moves < 1.5 * step), moves
        previous = hats
