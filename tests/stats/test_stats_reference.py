"""Every step metric against a float64 numpy reference written from the metric definitions (reference_stats.py).

Exact statistics (counts, sums, means, extremes) must agree to float32 accumulation accuracy; quantiles must lie
within the sketch's documented bound of the exact order statistic of rank ceil(q n). Also: padded == packed,
several micro-batches == one batch, bf16/fp16 inputs accumulate in fp32, non-finite inputs are counted and excluded.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_stats import check, make_padded, np_dict, packed_from, reference, step, with_per_sequence_fields
from stats_probes import probe_batch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.eager import eager_loss
from rl_guard.stats.engines import Engine
from rl_guard.stats.grads import param_groups_of, probe_grads
from rl_guard.stats.sketch import QUANTILE_NAMES
from rl_guard.stats.summarize import summarize

# The reference against every engine explicitly: the eager engine with its host path (small CPU batches without
# versions take it), the eager engine's torch path alone, and the compiled engine (``slow``: it compiles).
ENGINES = [
    pytest.param(lambda: Engine("eager"), id="eager-host"),
    pytest.param(lambda: Engine("eager", host_max_tokens=0), id="eager"),
    pytest.param(
        lambda: Engine("compiled", host_max_tokens=0, cpu_min_tokens=1), id="compiled", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("make_engine", ENGINES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "fields",
    [
        ("old", "ref", "entropy", "adv", "versions"),
        ("old", "adv"),
        ("old", "prox", "adv", "entropy"),
        ("ref", "entropy"),
    ],
)
def test_all_metrics_match_reference(seed, fields, make_engine):
    d = make_padded(seed, fields=fields)
    engine = make_engine()
    got = step([d], engine=engine)
    assert getattr(engine, "failure", None) is None and engine.host_failure is None
    check(got, reference(np_dict(d), cv=12))
    assert got["rl_guard/tokens/microbatches"] == 1


@pytest.mark.parametrize("make_engine", ENGINES)
def test_gspo_sequence_level_clip_and_lag(make_engine):
    d = make_padded(7, B=8, T=30, spread=0.6)
    got = step([d], engine=make_engine(), importance_sampling_level="sequence")
    check(got, reference(np_dict(d), cv=12, level="sequence"))
    assert 0 < got["rl_guard/clip/region_frac"] < 1  # the case really exercises clipping


@pytest.mark.parametrize("make_engine", ENGINES)
def test_per_sequence_advantages_versions_and_given_lengths(make_engine):
    d = with_per_sequence_fields(3)
    check(step([d], engine=make_engine()), reference(np_dict(d), cv=12))


def test_extremes_of_one_signed_data_ignore_masked_tokens():
    """All valid values negative (or all positive): a masked-out token filled with 0 must not become the max/min."""
    d = make_padded(6, fields=("old", "adv", "entropy"))
    d["old_logprobs"] = d["logprobs"] + 0.05 + torch.rand(d["mask"].shape)  # every log-ratio < 0
    d["advantages"] = -1.0 - torch.rand(d["mask"].shape)
    d["entropy"] = 2.0 + torch.rand(d["mask"].shape)
    got = step([d])
    check(got, reference(np_dict(d)))
    assert got["rl_guard/ratio/max"] < 1 and got["rl_guard/adv/max"] < -1 and got["rl_guard/entropy/min"] > 2


def test_clip_fractions_asymmetric_range():
    d = make_padded(11, B=8, T=50, spread=0.5)
    got = step([d], eps_low=0.1, eps_high=0.28)
    check(got, reference(np_dict(d), cv=12, eps_low=0.1, eps_high=0.28))
    assert got["rl_guard/clip/low_frac"] > 0 and got["rl_guard/clip/high_frac"] > 0


def test_padded_equals_packed_and_chunking_is_invisible():
    d = make_padded(5, B=7, T=64)
    padded = step([d])
    packed = step([packed_from(d)])
    tiny_chunks = StepAccumulator()
    tiny_chunks.add(probe_batch(TokenBatch(**packed_from(d), current_version=12), chunk_tokens=17))
    one_row = StepAccumulator()  # rows longer than a chunk: one row per chunk
    one_row.add(probe_batch(TokenBatch(**d, current_version=12), chunk_tokens=10))
    for other in (packed, summarize(tiny_chunks.finish())[0], summarize(one_row.finish())[0]):
        assert other.keys() == padded.keys()
        for k in padded:
            assert other[k] == pytest.approx(padded[k], rel=1e-5, abs=1e-7), k


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 6), T=st.integers(1, 48), chunk=st.integers(1, 200))
def test_property_padded_equals_packed(seed, B, T, chunk):
    d = make_padded(seed, B=B, T=T)
    d["mask"][0, 0] = True  # at least one loss token
    for k in ("logprobs", "old_logprobs", "ref_logprobs", "entropy"):
        d[k][0, 0] = -0.5
    a = StepAccumulator()
    a.add(probe_batch(TokenBatch(**d, current_version=12)))
    b = StepAccumulator()
    b.add(probe_batch(TokenBatch(**packed_from(d), current_version=12), chunk_tokens=chunk))
    ma, mb = summarize(a.finish())[0], summarize(b.finish())[0]
    assert ma.keys() == mb.keys()
    for k in ma:
        assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-6) or (math.isnan(ma[k]) and math.isnan(mb[k])), k


def _micro_batches(d, splits):
    rows = [0, *splits, d["mask"].shape[0]]
    return [{k: v[a:b] for k, v in d.items()} for a, b in zip(rows[:-1], rows[1:])]


def test_micro_batches_merge_like_one_batch():
    d = make_padded(9, B=8, T=50)
    one = StepAccumulator()
    one.add(probe_batch(TokenBatch(**d, current_version=12)))
    raw_one = one.finish()
    many = StepAccumulator()
    for part in _micro_batches(d, [1, 4, 5]):
        many.add(probe_batch(TokenBatch(**part, current_version=12)))
    raw_many = many.finish()
    for key, v in raw_one.items():
        w = raw_many[key]
        if key == "tokens.microbatches":
            assert w[0] == 4
        elif key.endswith(
            (
                ".count",
                ".seqs",
                ".hist",
                ".tokens",
                ".clip",
                ".nonfinite",
                ".max",
                ".min",
                ".logmax",
                ".logmin",
                ".seqmax",
                ".low",
                ".high",
                ".zero",
                "truncated",
            )
        ):
            np.testing.assert_array_equal(w, v, err_msg=key)  # counts, histogram cells and extremes: exact
        else:
            np.testing.assert_allclose(w, v, rtol=1e-6, atol=1e-9, err_msg=key)  # sums: fp32 chunk order
    m1, m4 = summarize(raw_one)[0], summarize(raw_many)[0]
    for k in m1:
        if k.endswith(QUANTILE_NAMES):  # same cells -> the same quantiles (so within any bound)
            assert m4[k] == m1[k], k


@settings(max_examples=15, deadline=None)
@given(order=st.permutations(range(4)), seed=st.integers(0, 1000))
def test_property_merge_order_invariant(order, seed):
    d = make_padded(seed, B=8, T=20)
    parts = _micro_batches(d, [2, 3, 6])
    results = []
    for perm in (range(4), order):
        acc = StepAccumulator()
        for i in perm:
            acc.add(probe_batch(TokenBatch(**parts[i], current_version=12)))
        results.append(acc.finish())
    for key, v in results[0].items():
        np.testing.assert_allclose(results[1][key], v, rtol=1e-12, atol=0, err_msg=key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_fp32(dtype):
    d = make_padded(4, dtype=dtype)
    got = step([d])
    check(got, reference(np_dict(d), cv=12))  # reference on the exact half values, in float64
    # 60K tokens of entropy 1.0: a bf16/fp16 running sum would stall at 256 / 2048 (or overflow); fp32 does not.
    n = 60_000
    b = {
        "logprobs": torch.full((1, n), -1.0, dtype=dtype),
        "mask": torch.ones(1, n, dtype=torch.bool),
        "entropy": torch.ones(1, n, dtype=dtype),
    }
    m = step([b])
    assert m["rl_guard/entropy/mean"] == 1.0 and m["rl_guard/tokens/count"] == n


def test_nonfinite_inputs_are_counted_and_excluded():
    d = make_padded(2, B=6, T=40)
    m = d["mask"]
    pos = torch.nonzero(m)[:12]
    d["logprobs"][tuple(pos[0])] = float("inf")
    d["old_logprobs"][tuple(pos[1])] = float("nan")
    d["old_logprobs"][tuple(pos[2])] = -float("inf")
    d["ref_logprobs"][tuple(pos[3])] = float("nan")
    d["entropy"][tuple(pos[4])] = float("inf")
    d["entropy"][tuple(pos[5])] = float("nan")
    d["advantages"][tuple(pos[6])] = float("nan")
    d["rewards"][1] = float("inf")
    got = step([d])
    want = {"logprobs": 1, "old_logprobs": 2, "ref_logprobs": 1, "entropy": 2, "advantages": 1, "rewards": 1}
    for field, n in want.items():
        assert got[f"rl_guard/input/{field}/nonfinite"] == n, field
    assert all(math.isfinite(v) for k, v in got.items()), [k for k, v in got.items() if not math.isfinite(v)]
    check(got, reference(np_dict(d), cv=12))  # every other statistic: over the finite values only


@pytest.mark.parametrize("edges", [(2, 4, 7), (0, 1, 2, 3, 5, 9), (0,)])
@pytest.mark.parametrize("chunk", [None, 23])
def test_lag_buckets_custom_edges_negative_and_nonfinite_versions(edges, chunk):
    """Lags below the first edge fall in the first bucket, lags past the last edge in the last one; a token whose
    version is NaN or inf is in no bucket (and not in the lag mean/max) but keeps every other statistic."""
    d = make_padded(4, B=6, T=40)
    g = torch.Generator().manual_seed(1)
    d["versions"] = torch.randint(-4, 15, d["mask"].shape, generator=g).float()  # lags -6 .. 12 at cv = 8
    pos = torch.nonzero(d["mask"])[:3]
    for p, v in zip(pos, (float("nan"), float("inf"), -float("inf"))):
        d["versions"][tuple(p)] = v
    acc = StepAccumulator()
    acc.add(probe_batch(TokenBatch(**d, current_version=8), lag_edges=edges, chunk_tokens=chunk))
    got = summarize(acc.finish(), lag_edges=edges)[0]
    lag_ok = d["mask"] & torch.isfinite(d["versions"])
    out, samples = reference(np_dict({**d, "mask": lag_ok}), cv=8, edges=edges)
    check(
        got,
        (
            {k: v for k, v in out.items() if k.startswith("lag/")},
            {k: v for k, v in samples.items() if k.startswith("lag/")},
        ),
    )
    check(got, reference(np_dict({k: v for k, v in d.items() if k != "versions"})))  # the rest: unaffected
    assert got["rl_guard/lag/max"] == 12


def test_grads_and_loss_against_reference():
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(s)) for s in ((5, 3), (7,), (4, 4)))
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1)
    acc = StepAccumulator()
    acc.add(probe_grads(param_groups_of(opt), pre_clip_norm=3.0))
    for loss in (torch.tensor(0.5), torch.tensor(0.25)):
        acc.add(eager_loss(loss))
    got = summarize(acc.finish())[0]
    g = [p.grad.double().numpy().ravel() for p in (a, b, c)]
    # Gradients seen after clipping: grad/norm is the pre-clip norm given, the measured one is grad/norm_postclip.
    assert got["rl_guard/grad/norm_postclip"] == pytest.approx(np.sqrt(sum((x**2).sum() for x in g)), rel=1e-12)
    assert got["rl_guard/grad/max_abs"] == pytest.approx(max(np.abs(x).max() for x in g), rel=1e-7)
    assert got["rl_guard/grad/group0/norm"] == pytest.approx(np.sqrt((g[0] ** 2).sum() + (g[1] ** 2).sum()), rel=1e-12)
    assert got["rl_guard/grad/group1/norm"] == pytest.approx(np.sqrt((g[2] ** 2).sum()), rel=1e-12)
    assert got["rl_guard/grad/nonfinite"] == 0 and got["rl_guard/grad/norm"] == 3.0
    assert got["rl_guard/loss/value"] == 0.75 and got["rl_guard/loss/nonfinite"] == 0
    b.grad[2] = float("nan")
    acc.add(probe_grads(param_groups_of(opt)))
    bad = summarize(acc.finish())[0]
    assert bad["rl_guard/grad/nonfinite"] == 1 and math.isnan(bad["rl_guard/grad/norm"])
