"""Gradient probe: how the merge across ranks is chosen (detected, or ``sharded_grads``) and gradients held outside
``p.grad`` (a ``GradientSource``, as the DeepSpeed adapter hands over ZeRO partitions). Multi-process DTensor and
ZeRO runs are in ``tests/engines/``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_probes import entries

from rl_guard.stats import keys
from rl_guard.stats.grads import (
    GradientSource,
    abs_max,
    drop_grads,
    param_groups_of,
    probe_grads,
)


def _params(*grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


class Partitions:
    """Gradient buffers owned by an engine: this rank's pieces, loss-scaled by 1 / scale."""

    sharded = True

    def __init__(self, groups, scale=1.0):
        self.groups, self.scale, self.dropped = groups, scale, False

    def grad_groups(self):
        return self.groups

    def drop_grads(self):
        self.dropped = True


def test_plain_gradients_merge_by_max_unless_declared_sharded():
    groups = param_groups_of(_params(torch.tensor([3.0, 4.0])))
    detected = probe_grads(groups)
    assert (
        keys.GRAD.sq in entries(detected)[1] and keys.GRAD.sq not in entries(detected)[0]
    )  # replicas: identical on every rank
    forced = probe_grads(groups, sharded=True)  # the YAML override: each rank's p.grad is a distinct shard
    assert keys.GRAD.sq in entries(forced)[0] and float(entries(forced)[0][keys.GRAD.sq]) == 25.0


def test_gradient_source_partitions_merge_by_sum_and_unscale():
    rng = np.random.default_rng(0)
    pieces = [rng.normal(size=5), rng.normal(size=3), rng.normal(size=4)]
    scale = 2.0**-10  # fp16: the buffers hold loss-scaled gradients
    src = Partitions(
        [
            [
                torch.tensor(pieces[0] / scale, dtype=torch.float32),
                torch.tensor(pieces[1] / scale, dtype=torch.float32),
            ],
            [torch.tensor(pieces[2] / scale, dtype=torch.float32), torch.empty(0)],
        ],
        scale=scale,
    )
    assert isinstance(src, GradientSource) and param_groups_of(src) is src
    p = probe_grads(src)
    want = sum(float(np.sum(x.astype(np.float32).astype(np.float64) ** 2)) for x in pieces)
    assert math.isclose(float(entries(p)[0][keys.GRAD.sq]), want, rel_tol=1e-6)
    assert math.isclose(float(entries(p)[1][keys.GRAD.max_abs]), max(np.abs(x).max() for x in pieces), rel_tol=1e-6)
    assert float(entries(p)[0][keys.GRAD.nonfinite]) == 0 and keys.grad_group(1) in entries(p)[0]
    src.groups[1][0][2] = math.inf
    assert float(entries(probe_grads(src))[0][keys.GRAD.nonfinite]) == 1
    drop_grads(src)  # a skip leaves the buffers to their owner
    assert src.dropped


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(
                st.floats(width=32, allow_nan=False, allow_infinity=False),
                st.sampled_from([math.nan, math.inf, -math.inf]),
            ),
            max_size=40,
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_abs_max_matches_float64_reference_with_nonfinite_values(values, dtype):
    tensors = [torch.tensor(v, dtype=torch.float32).to(dtype) for v in values]
    got = abs_max(tensors).double().numpy()
    for t, g in zip(tensors, got):
        x = t.double().numpy()
        want = 0.0 if x.size == 0 else (math.nan if np.isnan(x).any() else np.abs(x).max())
        assert (math.isnan(g) and math.isnan(want)) or g == want
    # the same figures as torch's inf-norm (the CUDA path; it refuses empty tensors, which never reach it)
    full = [t for t in tensors if t.numel()]
    if full:
        np.testing.assert_array_equal(
            abs_max(full).double().numpy(), torch.stack(torch._foreach_norm(full, math.inf)).double().numpy()
        )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from([(64,), (32, 3), (5, 7), (1,), (8192,), (8193,), (4, 2049), (3,)]), min_size=1, max_size=7
    ),
    st.lists(st.sampled_from([math.nan, math.inf, -math.inf, 1e30]), max_size=3),
    st.integers(0, 2**16),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_grad_figures_match_float64_reference_on_every_layout(shapes, specials, seed, dtype):
    # Tensors small and large, sizes multiple of 32 or not, in two groups (one may be empty), with NaN / +-inf /
    # huge values planted: norms, max |g| and the count of non-finite tensors as float64 numpy computes them.
    rng = np.random.default_rng(seed)
    grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dtype) for s in shapes]
    for value in specials:
        t = grads[int(rng.integers(len(grads)))].view(-1)
        t[int(rng.integers(t.numel()))] = value
    params = _params(*grads)
    cut = int(rng.integers(len(params) + 1))
    p = probe_grads([params[:cut], params[cut:]])
    x = [g.double().numpy().ravel() for g in grads]

    def same(got, want):
        return (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12)

    for i, group in enumerate((x[:cut], x[cut:])):
        assert same(float(entries(p)[1][keys.grad_group(i)]), sum(float((v**2).sum()) for v in group))
    assert same(float(entries(p)[1][keys.GRAD.sq]), sum(float((v**2).sum()) for v in x))
    want_max = max((math.nan if np.isnan(v).any() else float(np.abs(v).max())) for v in x)
    want_max = math.nan if any(np.isnan(v).any() for v in x) else want_max
    assert same(float(entries(p)[1][keys.GRAD.max_abs]), want_max)
    assert float(entries(p)[1][keys.GRAD.nonfinite]) == sum(not np.isfinite(v).all() for v in x)
