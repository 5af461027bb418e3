"""float64 numpy reference of every step metric, written from the metric definitions (not from the code), plus
the batch builders and the comparison used by test_stats_reference.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from stats_probes import probe_batch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.constants import DEFAULT_LAG_EDGES
from rl_guard.stats.sketch import ENTROPY, LOG_RATIO, QUANTILE_NAMES, QUANTILES
from rl_guard.stats.summarize import lag_bucket_names, summarize

FLOAT32_SLACK = 2e-3  # cells: fp32 rounding of the cell coordinate near an edge (see test_sketch.py)
# Keys of the float sums, and of the sequence ratio made of them, that the compiled engine or another device adds in
# another order than the eager engine on CPU (``assert_engines_agree``'s ``float_sums``).
FLOAT_SUMS = (".sum", ".sumsq", ".k1.", ".k2.", ".k3", "cells_k3", "seq_ratio.")


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
        out.update(
            {
                "adv/mean": a.mean(),
                "adv/std": a.std(ddof=1),
                "adv/min": a.min(),
                "adv/max": a.max(),
                "adv/zero_frac": (a == 0).mean(),
            }
        )
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
        out.update(
            {"reward/mean": rw.mean(), "reward/std": rw.std(ddof=1), "reward/min": rw.min(), "reward/max": rw.max()}
        )
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


def with_per_sequence_fields(seed: int) -> dict:
    """A padded batch (old and reference log-probs) whose advantages and versions are given per sequence, with the
    sequence lengths given too."""
    d = make_padded(seed, fields=("old", "ref"))
    g = torch.Generator().manual_seed(0)
    B = d["mask"].shape[0]
    d["advantages"] = torch.randn(B, generator=g)
    d["versions"] = torch.randint(0, 13, (B,), generator=g).float()
    d["lengths"] = torch.randint(1, 40, (B,), generator=g)
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


def step(batches, cv=12, engine="eager", **kw):
    acc = StepAccumulator()
    for b in batches:
        acc.add(probe_batch(TokenBatch(**b, current_version=cv if "versions" in b else None, **kw), engine=engine))
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
            bound = math.expm1(spec.width * (1 + FLOAT32_SLACK)) * (abs(exact) + spec.scale) + 1e-6 * abs(exact)
            assert abs(hat - exact) <= bound, (key, hat, exact, bound)


def np_dict(d):
    return {k: to_np(v) for k, v in d.items()}


def assert_engines_agree(got: dict, want: dict, float_sums: tuple, atol: float) -> None:
    """Two engines' finished statistics of one micro-batch: the same keys, the float sums (keys containing a part of
    ``float_sums``) to float32 accuracy, everything else (counts, histogram cells, extremes) bit for bit."""
    assert got.keys() == want.keys()
    for key in want:
        if any(part in key for part in float_sums):
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=atol, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
