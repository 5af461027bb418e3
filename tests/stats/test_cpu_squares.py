"""``cpu_squares.square_sums``: float64 accuracy from float32 rows, torch's float64 norm wherever range is lost."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_guard.stats import cpu_squares
from rl_guard.stats.cpu_squares import REL_ERROR, ROWS_MIN, square_sums
from rl_guard.stats.grads import squares

SIZES = [ROWS_MIN, ROWS_MIN + 7, 3 * ROWS_MIN + 31, 1 << 17]  # multiples of the row length and not


def _reference(t: torch.Tensor) -> float:
    return float(np.sum(t.detach().double().numpy() ** 2))


def _close(got: float, want: float, rel: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=rel, abs=0.0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(SIZES), min_size=1, max_size=4),
    st.floats(-30, 30),
    st.integers(0, 2**16),
    st.sampled_from([None, "nan", "inf", "huge", "zeros", "tiny"]),
)
def test_square_sums_match_float64_within_the_bound(sizes, log_scale, seed, special):
    # Heavy-tailed values at any scale; one tensor may hold NaN / inf / a value whose float32 square overflows, or be
    # all zero or all below float32's squared range: those are taken in float64, so they match exactly.
    rng = np.random.default_rng(seed)
    tensors = []
    for n in sizes:
        x = rng.standard_normal(n) * 10.0 ** (log_scale / 3) * np.where(rng.random(n) < 0.01, 1e3, 1.0)
        tensors.append(torch.from_numpy(x.astype(np.float32)))
    exact = -1
    if special is not None:
        exact = int(rng.integers(len(tensors)))
        t = tensors[exact]
        if special in ("zeros", "tiny"):
            t.fill_(0.0 if special == "zeros" else 1e-25)
        else:
            t[int(rng.integers(t.numel()))] = {"nan": math.nan, "inf": -math.inf, "huge": 3e30}[special]
    got = square_sums(tensors).numpy()
    for i, (t, g) in enumerate(zip(tensors, got)):
        assert _close(float(g), _reference(t), 1e-12 if i == exact else REL_ERROR), (i, special)


def test_the_bound_holds_where_float32_norms_drift():
    # 4M equal values: a float32 running sum of squares loses ~1e-4 here; rows of 32 lose nothing.
    t = torch.full((1 << 22,), 0.1)
    want = _reference(t)
    assert _close(float(square_sums([t])[0]), want, REL_ERROR)
    assert abs(float(torch.linalg.vector_norm(t)) ** 2 / want - 1) > 10 * REL_ERROR  # what it improves on


def test_small_and_other_tensors_keep_torch_float64_norm_and_order():
    rng = np.random.default_rng(0)
    big = torch.from_numpy(rng.standard_normal(ROWS_MIN).astype(np.float32))
    small = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    bf16 = torch.from_numpy(rng.standard_normal(ROWS_MIN).astype(np.float32)).bfloat16()
    strided = torch.from_numpy(rng.standard_normal((2 * ROWS_MIN, 2)).astype(np.float32))[:, 0]
    assert square_sums([small, small]) is None  # nothing fits: the caller's multi-tensor norm
    # parameters (which require grad) read outside no_grad too, whichever way each is taken
    got = squares([small, big, bf16, strided, torch.nn.Parameter(big.clone()), torch.nn.Parameter(small.clone())])
    want = [_reference(t) for t in (small, big, bf16, strided, big, small)]
    for i, (g, w) in enumerate(zip(got.numpy(), want)):
        assert _close(float(g), w, REL_ERROR if i in (1, 4) else 1e-12), i


def test_above_the_threshold_only(monkeypatch):
    t = torch.randn(ROWS_MIN - 1)
    assert square_sums([t]) is None
    monkeypatch.setattr(cpu_squares, "ROWS_MIN", ROWS_MIN - 1)
    assert _close(float(square_sums([t])[0]), _reference(t), REL_ERROR)
