"""Every step metric against a float64 numpy reference written from the metric definitions.

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

from rl_guard.accumulate import StepAccumulator
from rl_guard.batch import TokenBatch
from rl_guard.grads import param_groups_of, probe_grads
from rl_guard.probe_batch import probe_batch
from rl_guard.probes import DEFAULT_LAG_EDGES, Partial, loss_stats
from rl_guard.sketch import ENTROPY, LOG_RATIO, QUANTILE_NAMES, QUANTILES
from rl_guard.summarize import lag_bucket_names, summarize

FLOAT32_SLACK = 2e-3  # cells: fp32 rounding of the cell coordinate near an edge (see test_sketch.py)


# ----------------------------------------------------------------------------------------------- reference
def order_stat(x: np.ndarray, q: float) -> float:
    """Order statistic of rank ceil(q n), q = k/100 taken exactly (integer arithmetic, no float noise)."""
    k, n = round(q * 100), x.size
    return float(np.sort(x)[max(1, -(-k * n // 100)) - 1])


def reference(d: dict, cv=None, eps_low=0.2, eps_high=0.2, level="token", edges=DEFAULT_LAG_EDGES):
    """float64 metrics of one step from padded numpy arrays; also the samples behind each quantile family."""
    out, samples = {}, {}
    m = d["mask"].astype(bool)
    lp = d["logprobs"]
    ok = m & np.isfinite(lp)
    out["tokens/count"] = m.sum()
    out["input/logprobs/nonfinite"] = m.sum() - ok.sum()

    def ratio_family(name, lr, valid, spec=LOG_RATIO):
        x = lr[valid]
        if x.size:
            out[f"{name}/mean"] = np.exp(x).mean()
            out[f"{name}/min"], out[f"{name}/max"] = np.exp(x.min()), np.exp(x.max())
            samples[name] = (x, spec, True)

    def kl(name, lr, valid):
        lr = np.where(valid, lr, 0.0)
        seq_ok = valid.sum(1) > 0
        for k, f in (("k1", -lr), ("k2", 0.5 * lr * lr), ("k3", np.expm1(lr) - lr)):
            out[f"{name}/{k}_mean"] = f[valid].mean()
            per_seq = f.sum(1)[seq_ok]
            out[f"{name}/{k}_seq_mean"], out[f"{name}/{k}_seq_max"] = per_seq.mean(), per_seq.max()

    lr = rv = clip_lr = clip_ok = None
    if "old_logprobs" in d:
        old = d["old_logprobs"]
        rv = ok & np.isfinite(old)
        out["input/old_logprobs/nonfinite"] = ok.sum() - rv.sum()
        lr = np.where(rv, lp - old, 0.0)
        ratio_family("ratio", lr, rv)
        kl("kl_old", lr, rv)
        n_seq = rv.sum(1)
        s_lr = lr.sum(1) / np.maximum(n_seq, 1)
        ratio_family("seq_ratio", s_lr, n_seq > 0)
        clip_lr, clip_ok = (np.repeat(s_lr[:, None], lr.shape[1], 1) if level == "sequence" else lr), rv
    if "prox_logprobs" in d:
        prox = d["prox_logprobs"]
        iv = ok & np.isfinite(prox)
        out["input/prox_logprobs/nonfinite"] = ok.sum() - iv.sum()
        iw = np.where(iv, lp - prox, 0.0)
        ratio_family("importance_weight", iw, iv)
        if rv is not None:
            ratio_family("behave_imp_weight", np.where(iv & rv, prox - d["old_logprobs"], 0.0), iv & rv)
        clip_lr, clip_ok = iw, iv
    if "ref_logprobs" in d:
        rr = ok & np.isfinite(d["ref_logprobs"])
        out["input/ref_logprobs/nonfinite"] = ok.sum() - rr.sum()
        kl("kl_ref", np.where(rr, d["ref_logprobs"] - lp, 0.0), rr)
    if "entropy" in d:
        ev = m & np.isfinite(d["entropy"])
        out["input/entropy/nonfinite"] = m.sum() - ev.sum()
        e = d["entropy"][ev]
        out["entropy/mean"], out["entropy/min"], out["entropy/max"] = e.mean(), e.min(), e.max()
        samples["entropy"] = (e, ENTROPY, False)
    clipped = None
    if "advantages" in d:
        adv = d["advantages"] if d["advantages"].ndim == 2 else np.repeat(d["advantages"][:, None], m.shape[1], 1)
        av = m & np.isfinite(adv)
        out["input/advantages/nonfinite"] = m.sum() - av.sum()
        a = adv[av]
        out.update({"adv/mean": a.mean(), "adv/std": a.std(ddof=1), "adv/min": a.min(), "adv/max": a.max(),
                    "adv/zero_frac": (a == 0).mean()})
        if clip_lr is not None:
            cv_ = clip_ok & av
            low = cv_ & (clip_lr < math.log1p(-eps_low)) & (adv < 0)
            high = cv_ & (clip_lr > math.log1p(eps_high)) & (adv > 0)
            out["clip/low_frac"], out["clip/high_frac"] = low.sum() / cv_.sum(), high.sum() / cv_.sum()
            out["clip/region_frac"] = (low | high).sum() / cv_.sum()
            clipped = low | high
    lengths = d["lengths"].astype(np.float64) if "lengths" in d else m.sum(1).astype(np.float64)
    out["length/mean"], out["length/min"], out["length/max"] = lengths.mean(), lengths.min(), lengths.max()
    if "truncated" in d:
        out["length/truncated_frac"] = d["truncated"].mean()
    if "rewards" in d:
        rw = d["rewards"][np.isfinite(d["rewards"])]
        out["input/rewards/nonfinite"] = d["rewards"].size - rw.size
        out.update({"reward/mean": rw.mean(), "reward/std": rw.std(ddof=1), "reward/min": rw.min(), "reward/max": rw.max()})
    if "versions" in d:
        ver = d["versions"] if d["versions"].ndim == 2 else np.repeat(d["versions"][:, None], m.shape[1], 1)
        lag = cv - np.round(ver)
        out["lag/mean"], out["lag/max"] = lag[m].mean(), lag[m].max()
        bucket = np.searchsorted(np.asarray(edges[1:]), lag, side="right")
        for i, name in enumerate(lag_bucket_names(edges)):
            inb = m & (bucket == i)
            out[f"lag/{name}/token_frac"] = inb.sum() / m.sum()
            if rv is not None and (rv & inb).any():
                sel = rv & inb
                samples[f"lag/{name}"] = (lr[sel], LOG_RATIO, True)
                out[f"lag/{name}/k3_mean"] = (np.expm1(lr) - lr)[sel].mean()
                if clipped is not None:
                    out[f"lag/{name}/clip_frac"] = (clipped & inb).sum() / sel.sum()
    return out, samples


# ------------------------------------------------------------------------------------------------ helpers
def to_np(t):
    return t.double().numpy() if t.dtype.is_floating_point else t.numpy()


def make_padded(seed, B=6, T=40, fields=("old", "ref", "entropy", "adv", "versions"), dtype=torch.float32, spread=0.3):
    """Padded batch with random response lengths (padding holds garbage, even NaN), prompt tokens masked out."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.1
    lp = -torch.rand(B, T, generator=g) * 3
    d = {"logprobs": lp, "mask": mask}
    noise = lambda: spread * torch.randn(B, T, generator=g)  # noqa: E731
    if "old" in fields:
        d["old_logprobs"] = lp + noise()
    if "prox" in fields:
        d["prox_logprobs"] = lp + 0.5 * noise()
    if "ref" in fields:
        d["ref_logprobs"] = lp + noise()
    if "entropy" in fields:
        d["entropy"] = torch.rand(B, T, generator=g) * 4
    if "adv" in fields:
        adv = torch.randn(B, T, generator=g)
        adv[torch.rand(B, T, generator=g) < 0.1] = 0.0
        d["advantages"] = adv
    if "versions" in fields:
        d["versions"] = torch.randint(0, 13, (B, T), generator=g).float()
    for k in ("logprobs", "old_logprobs", "ref_logprobs", "entropy", "prox_logprobs"):
        if k in d:
            d[k] = d[k].to(dtype)
            d[k][~mask] = float("nan")  # padding garbage must never leak into a statistic
    d["rewards"] = torch.randn(B, generator=g, dtype=torch.float64)
    d["truncated"] = torch.rand(B, generator=g) < 0.3
    return d


def packed_from(d: dict) -> dict:
    """Same sequences, padding dropped: [N] tensors plus cu_seqlens (each row keeps up to its last mask token)."""
    m = d["mask"]
    keep = [int(torch.nonzero(m[i]).max()) + 1 if m[i].any() else 1 for i in range(m.shape[0])]
    cu = torch.tensor([0, *np.cumsum(keep)])
    out = {"cu_seqlens": cu}
    for k, v in d.items():
        out[k] = torch.cat([v[i, : keep[i]] for i in range(len(keep))]) if v.dim() == 2 else v
    return out


def step(batches, cv=12, **kw):
    acc = StepAccumulator()
    for b in batches:
        acc.add(probe_batch(TokenBatch(**b, current_version=cv if "versions" in b else None, **kw)))
    return summarize(acc.finish())[0]


def check(got: dict, ref: tuple, rtol=2e-5, atol=1e-6):
    out, samples = ref
    for key, want in out.items():
        name = "rl_guard/" + key
        assert name in got, f"missing {name}"
        assert got[name] == pytest.approx(float(want), rel=rtol, abs=atol), name
    for fam, (x, spec, log) in samples.items():
        qs = dict(zip(QUANTILE_NAMES, QUANTILES)) if not fam.startswith("lag/") else {"p50": 0.5, "p99": 0.99}
        for qn, q in qs.items():
            key = f"rl_guard/{fam}/{qn}" if not fam.startswith("lag/") else f"rl_guard/{fam}/ratio_{qn}"
            exact = order_stat(x, q)
            hat = math.log(got[key]) if log else got[key]
            bound = math.expm1(spec.width * (0.5 + FLOAT32_SLACK)) * (abs(exact) + spec.scale) + 1e-6 * abs(exact)
            assert abs(hat - exact) <= bound, (key, hat, exact, bound)


def np_dict(d):
    return {k: to_np(v) for k, v in d.items()}


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fields", [("old", "ref", "entropy", "adv", "versions"), ("old", "adv"), ("old", "prox", "adv", "entropy"), ("ref", "entropy")])
def test_all_metrics_match_reference(seed, fields):
    d = make_padded(seed, fields=fields)
    got = step([d])
    check(got, reference(np_dict(d), cv=12))
    assert got["rl_guard/tokens/microbatches"] == 1


def test_gspo_sequence_level_clip_and_lag():
    d = make_padded(7, B=8, T=30, spread=0.6)
    got = step([d], importance_sampling_level="sequence")
    check(got, reference(np_dict(d), cv=12, level="sequence"))
    assert 0 < got["rl_guard/clip/region_frac"] < 1  # the case really exercises clipping


def test_per_sequence_advantages_versions_and_given_lengths():
    d = make_padded(3, fields=("old", "ref"))
    g = torch.Generator().manual_seed(0)
    d["advantages"] = torch.randn(6, generator=g)
    d["versions"] = torch.randint(0, 13, (6,), generator=g).float()
    d["lengths"] = torch.randint(1, 40, (6,), generator=g)
    check(step([d]), reference(np_dict(d), cv=12))


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
    column_blocks = StepAccumulator()  # rows longer than a chunk: column blocks of one row
    column_blocks.add(probe_batch(TokenBatch(**d, current_version=12), chunk_tokens=10))
    for other in (packed, summarize(tiny_chunks.finish())[0], summarize(column_blocks.finish())[0]):
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
        elif key.endswith((".count", ".seqs", ".hist", ".tokens", ".clip", ".nonfinite", ".max", ".min", ".logmax",
                           ".logmin", ".seqmax", ".low", ".high", ".zero", "truncated")):
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
    b = {"logprobs": torch.full((1, n), -1.0, dtype=dtype), "mask": torch.ones(1, n, dtype=torch.bool),
         "entropy": torch.ones(1, n, dtype=dtype)}
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


def test_grads_and_loss_against_reference():
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(s)) for s in ((5, 3), (7,), (4, 4)))
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1)
    acc = StepAccumulator()
    acc.add(probe_grads(param_groups_of(opt), pre_clip_norm=3.0))
    for loss in (torch.tensor(0.5), torch.tensor(0.25)):
        p = Partial()
        loss_stats(p, loss)
        acc.add(p)
    got = summarize(acc.finish())[0]
    g = [p.grad.double().numpy().ravel() for p in (a, b, c)]
    assert got["rl_guard/grad/norm"] == pytest.approx(np.sqrt(sum((x**2).sum() for x in g)), rel=1e-12)
    assert got["rl_guard/grad/max_abs"] == pytest.approx(max(np.abs(x).max() for x in g), rel=1e-7)
    assert got["rl_guard/grad/group0/norm"] == pytest.approx(np.sqrt((g[0] ** 2).sum() + (g[1] ** 2).sum()), rel=1e-12)
    assert got["rl_guard/grad/group1/norm"] == pytest.approx(np.sqrt((g[2] ** 2).sum()), rel=1e-12)
    assert got["rl_guard/grad/nonfinite"] == 0 and got["rl_guard/grad/norm_preclip"] == 3.0
    assert got["rl_guard/loss/value"] == 0.75 and got["rl_guard/loss/nonfinite"] == 0
    b.grad[2] = float("nan")
    acc.add(probe_grads(param_groups_of(opt)))
    bad = summarize(acc.finish())[0]
    assert bad["rl_guard/grad/nonfinite"] == 1 and math.isnan(bad["rl_guard/grad/norm"])
