"""Host-side formulas: merged sufficient statistics (float64 numpy) -> named step metrics.

Every metric is documented once in ``rl_guard/glossary.py``; this module only computes them. Means divide by
the number of finite, unmasked entries; an empty denominator gives NaN and the metric is left out.
"""

from __future__ import annotations

import math

import numpy as np

from . import keys
from .constants import DEFAULT_LAG_EDGES, EXP_ARG_MAX
from .sketch import ENTROPY, LOG_RATIO, QUANTILE_NAMES, quantiles_from_counts
from .update import summarize_update

PREFIX = "rl_guard/"


def _exp(x: float) -> float:
    return math.exp(min(x, EXP_ARG_MAX))


def lag_bucket_names(edges=DEFAULT_LAG_EDGES) -> list[str]:
    names = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else None
        names.append(f"{lo}+" if hi is None else (str(lo) if hi == lo else f"{lo}-{hi}"))
    return names


def _f(raw, key, default=math.nan) -> float:
    v = raw.get(key)
    return float(v[0]) if v is not None else default


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


class _Out(dict):
    def put(self, name: str, value: float | None) -> None:
        """Non-finite values are kept (they are the point); ``None`` means 'no data this step'."""
        if value is not None:
            self[PREFIX + name] = float(value)


def _ratio(out: _Out, raw, name: str, hist=None) -> None:
    key = keys.of(name)
    n = _f(raw, key.count, 0.0)
    if n <= 0:
        return
    lo, hi = _f(raw, key.logmin), _f(raw, key.logmax)
    out.put(f"{name}/mean", _f(raw, key.sum) / n)
    out.put(f"{name}/min", _exp(lo))
    out.put(f"{name}/max", _exp(hi))
    hist = raw.get(key.hist) if hist is None else hist
    if hist is not None:
        for q, v in zip(QUANTILE_NAMES, quantiles_from_counts(hist, LOG_RATIO, lo, hi)):
            out.put(f"{name}/{q}", _exp(v))


def _values(out: _Out, raw, name: str, std: bool = False) -> float:
    key = keys.of(name)
    n = _f(raw, key.count, 0.0)
    if n <= 0:
        return 0.0
    mean = _f(raw, key.sum) / n
    out.put(f"{name}/mean", mean)
    out.put(f"{name}/min", _f(raw, key.min))
    out.put(f"{name}/max", _f(raw, key.max))
    if std:
        var = max(_f(raw, key.sumsq) / n - mean * mean, 0.0)
        out.put(f"{name}/std", math.sqrt(var * n / (n - 1)) if n > 1 else 0.0)
    return n


def _kl(out: _Out, raw, name: str) -> None:
    key = keys.of(name)
    n, seqs = _f(raw, key.count, 0.0), _f(raw, key.seqs, 0.0)
    for k in keys.KL_ESTIMATORS:
        out.put(f"{name}/{k}_mean", _div(_f(raw, key.estimator(k, "sum")), n))
        out.put(f"{name}/{k}_seq_mean", _div(_f(raw, key.estimator(k, "seqsum")), seqs))
        if seqs > 0:
            out.put(f"{name}/{k}_seq_max", _f(raw, key.estimator(k, "seqmax")))


def _lag(out: _Out, raw, edges) -> None:
    tokens = raw[keys.LAG.tokens]
    total = tokens.sum()
    out.put("lag/mean", _div(_f(raw, keys.LAG.sum), total))
    if total > 0:
        out.put("lag/max", _f(raw, keys.LAG.max))
    hist = raw.get(keys.LAG.hist)
    nb = len(edges)
    for i, bucket in enumerate(lag_bucket_names(edges)):
        out.put(f"lag/{bucket}/token_frac", _div(tokens[i], total))
        if hist is None:
            continue
        cells = hist[i * LOG_RATIO.bins : (i + 1) * LOG_RATIO.bins]
        count = cells.sum()  # tokens of the bucket with a finite ratio
        if count <= 0:
            continue
        lo, hi = _f(raw, keys.RATIO.logmin), _f(raw, keys.RATIO.logmax)
        p50, p99 = quantiles_from_counts(cells, LOG_RATIO, lo, hi, qs=(0.5, 0.99))
        out.put(f"lag/{bucket}/ratio_p50", _exp(p50))
        out.put(f"lag/{bucket}/ratio_p99", _exp(p99))
        if keys.LAG.clip in raw:  # absent without advantages (nothing is clipped)
            out.put(f"lag/{bucket}/clip_frac", raw[keys.LAG.clip][i] / count)
        out.put(f"lag/{bucket}/k3_mean", raw[keys.LAG.k3][i] / count)
    if hist is not None and nb:
        raw.setdefault(keys.RATIO.hist, hist.reshape(nb, LOG_RATIO.bins).sum(0))


def summarize(raw: dict[str, np.ndarray], lag_edges=DEFAULT_LAG_EDGES) -> tuple[dict[str, float], dict]:
    """Metrics ``{rl_guard/<family>/<stat>: float}`` and histograms ``{name: (edges, counts)}`` of one step."""
    out = _Out()
    if keys.TOKENS.count in raw:  # absent when no token batch was fed (e.g. a plain supervised Trainer)
        out.put("tokens/count", _f(raw, keys.TOKENS.count))
        out.put("tokens/microbatches", _f(raw, keys.TOKENS.microbatches))
    for key, v in raw.items():
        if key.startswith(keys.INPUT_PREFIX) and key.endswith(keys.NONFINITE_SUFFIX):
            out.put(key.replace(".", "/"), float(v[0]))
    if keys.LAG.tokens in raw:
        _lag(out, raw, lag_edges)
    for name in ("ratio", "seq_ratio", "importance_weight", "behave_imp_weight"):
        _ratio(out, raw, name)
    for name in ("kl_old", "kl_ref"):
        if keys.of(name).count in raw:
            _kl(out, raw, name)
    if _values(out, raw, "entropy"):
        lo, hi = _f(raw, keys.ENTROPY.min), _f(raw, keys.ENTROPY.max)
        for q, v in zip(QUANTILE_NAMES, quantiles_from_counts(raw[keys.ENTROPY.hist], ENTROPY, lo, hi)):
            out.put(f"entropy/{q}", v)
    n_clip = _f(raw, keys.CLIP.count, 0.0)
    if n_clip > 0:
        low, high = _f(raw, keys.CLIP.low), _f(raw, keys.CLIP.high)
        out.put("clip/low_frac", low / n_clip)
        out.put("clip/high_frac", high / n_clip)
        out.put("clip/region_frac", (low + high) / n_clip)
    n_adv = _values(out, raw, "adv", std=True)
    if n_adv:
        out.put("adv/zero_frac", _f(raw, keys.ADV.zero) / n_adv)
    n_seq = _values(out, raw, "length")
    if n_seq and keys.LENGTH.truncated in raw:
        out.put("length/truncated_frac", _f(raw, keys.LENGTH.truncated) / n_seq)
    _values(out, raw, "reward", std=True)
    _values(out, raw, "logp")
    for name, value in summarize_update(raw).items():
        out.put(name, value)
    _grad(out, raw)
    _loss(out, raw)
    hists = {}
    if keys.RATIO.hist in raw:
        hists[PREFIX + "log_ratio"] = (LOG_RATIO.edges, raw[keys.RATIO.hist])
    if keys.ENTROPY.hist in raw:
        hists[PREFIX + "entropy"] = (ENTROPY.edges, raw[keys.ENTROPY.hist])
    return dict(out), hists


def _grad(out: _Out, raw) -> None:
    # One meaning for grad/norm: the pre-clip total norm. Where the gradients are seen after the trainer clipped
    # them, the trainer's own pre-clip norm is grad/norm and the norm seen here is grad/norm_postclip.
    if keys.GRAD.sq in raw:
        measured = math.sqrt(_f(raw, keys.GRAD.sq))
        if keys.GRAD.preclip_sq in raw:
            # Clipping cannot make a finite norm non-finite: non-finite gradients here were corrupted after the
            # trainer measured them, and the pre-clip figure no longer describes what the optimizer receives.
            preclip = math.sqrt(_f(raw, keys.GRAD.preclip_sq))
            out.put("grad/norm", preclip if math.isfinite(measured) else measured)
            out.put("grad/norm_postclip", measured)
        else:
            out.put("grad/norm", measured)
        out.put("grad/max_abs", _f(raw, keys.GRAD.max_abs))
        out.put("grad/nonfinite", _f(raw, keys.GRAD.nonfinite))
        groups = sorted(k for k in raw if k.startswith(keys.GRAD_GROUP_PREFIX))
        if len(groups) > 1:
            for key in groups:
                out.put(f"grad/{key.split('.')[1]}/norm", math.sqrt(_f(raw, key)))
    elif keys.GRAD.preclip_sq in raw:
        out.put("grad/norm", math.sqrt(_f(raw, keys.GRAD.preclip_sq)))


def _loss(out: _Out, raw) -> None:
    if keys.LOSS.count in raw:
        ranks = max(_f(raw, keys.LOSS.ranks, 1.0), 1.0)  # data-parallel ranks each add their own step loss
        out.put("loss/value", _f(raw, keys.LOSS.sum) / ranks if _f(raw, keys.LOSS.nonfinite) == 0 else math.nan)
        out.put("loss/nonfinite", _f(raw, keys.LOSS.nonfinite))
