"""Host-side formulas: merged sufficient statistics (float64 numpy) -> named step metrics.

Every metric is documented once in ``rl_guard/glossary.py``; this module only computes them. Means divide by
the number of finite, unmasked entries; an empty denominator gives NaN and the metric is left out.
"""

from __future__ import annotations

import math

import numpy as np

from .probes import DEFAULT_LAG_EDGES
from .sketch import ENTROPY, LOG_RATIO, QUANTILE_NAMES, quantiles_from_counts

PREFIX = "rl_guard/"


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
    n = _f(raw, f"{name}.count", 0.0)
    if n <= 0:
        return
    lo, hi = _f(raw, f"{name}.logmin"), _f(raw, f"{name}.logmax")
    out.put(f"{name}/mean", _f(raw, f"{name}.sum") / n)
    out.put(f"{name}/min", math.exp(min(lo, 709.0)))
    out.put(f"{name}/max", math.exp(min(hi, 709.0)))
    hist = raw.get(f"{name}.hist") if hist is None else hist
    if hist is not None:
        for q, v in zip(QUANTILE_NAMES, quantiles_from_counts(hist, LOG_RATIO, lo, hi)):
            out.put(f"{name}/{q}", math.exp(min(v, 709.0)))


def _values(out: _Out, raw, name: str, std: bool = False) -> float:
    n = _f(raw, f"{name}.count", 0.0)
    if n <= 0:
        return 0.0
    mean = _f(raw, f"{name}.sum") / n
    out.put(f"{name}/mean", mean)
    out.put(f"{name}/min", _f(raw, f"{name}.min"))
    out.put(f"{name}/max", _f(raw, f"{name}.max"))
    if std:
        var = max(_f(raw, f"{name}.sumsq") / n - mean * mean, 0.0)
        out.put(f"{name}/std", math.sqrt(var * n / (n - 1)) if n > 1 else 0.0)
    return n


def _kl(out: _Out, raw, name: str) -> None:
    n, seqs = _f(raw, f"{name}.count", 0.0), _f(raw, f"{name}.seqs", 0.0)
    for k in ("k1", "k2", "k3"):
        out.put(f"{name}/{k}_mean", _div(_f(raw, f"{name}.{k}.sum"), n))
        out.put(f"{name}/{k}_seq_mean", _div(_f(raw, f"{name}.{k}.seqsum"), seqs))
        if seqs > 0:
            out.put(f"{name}/{k}_seq_max", _f(raw, f"{name}.{k}.seqmax"))


def _lag(out: _Out, raw, edges) -> None:
    tokens = raw["lag.tokens"]
    total = tokens.sum()
    out.put("lag/mean", _div(_f(raw, "lag.sum"), total))
    if total > 0:
        out.put("lag/max", _f(raw, "lag.max"))
    hist = raw.get("lag.hist")
    nb = len(edges)
    for i, bucket in enumerate(lag_bucket_names(edges)):
        out.put(f"lag/{bucket}/token_frac", _div(tokens[i], total))
        if hist is None:
            continue
        cells = hist[i * LOG_RATIO.bins : (i + 1) * LOG_RATIO.bins]
        count = cells.sum()  # tokens of the bucket with a finite ratio
        if count <= 0:
            continue
        lo, hi = _f(raw, "ratio.logmin"), _f(raw, "ratio.logmax")
        p50, p99 = quantiles_from_counts(cells, LOG_RATIO, lo, hi, qs=(0.5, 0.99))
        out.put(f"lag/{bucket}/ratio_p50", math.exp(min(p50, 709.0)))
        out.put(f"lag/{bucket}/ratio_p99", math.exp(min(p99, 709.0)))
        if "lag.clip" in raw:  # absent without advantages (nothing is clipped)
            out.put(f"lag/{bucket}/clip_frac", raw["lag.clip"][i] / count)
        out.put(f"lag/{bucket}/k3_mean", raw["lag.k3"][i] / count)
    if hist is not None and nb:
        raw.setdefault("ratio.hist", hist.reshape(nb, LOG_RATIO.bins).sum(0))


def summarize(raw: dict[str, np.ndarray], lag_edges=DEFAULT_LAG_EDGES) -> tuple[dict[str, float], dict]:
    """Metrics ``{rl_guard/<family>/<stat>: float}`` and histograms ``{name: (edges, counts)}`` of one step."""
    out = _Out()
    if "tokens.count" in raw:  # absent when no token batch was fed (e.g. a plain supervised Trainer)
        out.put("tokens/count", _f(raw, "tokens.count"))
        out.put("tokens/microbatches", _f(raw, "tokens.microbatches"))
    for key, v in raw.items():
        if key.startswith("input.") and key.endswith(".nonfinite"):
            out.put(key.replace(".", "/"), float(v[0]))
    if "lag.tokens" in raw:
        _lag(out, raw, lag_edges)
    for name in ("ratio", "seq_ratio", "importance_weight", "behave_imp_weight"):
        _ratio(out, raw, name)
    for name in ("kl_old", "kl_ref"):
        if f"{name}.count" in raw:
            _kl(out, raw, name)
    if _values(out, raw, "entropy"):
        lo, hi = _f(raw, "entropy.min"), _f(raw, "entropy.max")
        for q, v in zip(QUANTILE_NAMES, quantiles_from_counts(raw["entropy.hist"], ENTROPY, lo, hi)):
            out.put(f"entropy/{q}", v)
    n_clip = _f(raw, "clip.count", 0.0)
    if n_clip > 0:
        low, high = _f(raw, "clip.low"), _f(raw, "clip.high")
        out.put("clip/low_frac", low / n_clip)
        out.put("clip/high_frac", high / n_clip)
        out.put("clip/region_frac", (low + high) / n_clip)
    n_adv = _values(out, raw, "adv", std=True)
    if n_adv:
        out.put("adv/zero_frac", _f(raw, "adv.zero") / n_adv)
    n_seq = _values(out, raw, "length")
    if n_seq and "length.truncated" in raw:
        out.put("length/truncated_frac", _f(raw, "length.truncated") / n_seq)
    _values(out, raw, "reward", std=True)
    _grad(out, raw)
    _loss(out, raw)
    hists = {}
    if "ratio.hist" in raw:
        hists[PREFIX + "log_ratio"] = (LOG_RATIO.edges(), raw["ratio.hist"])
    if "entropy.hist" in raw:
        hists[PREFIX + "entropy"] = (ENTROPY.edges(), raw["entropy.hist"])
    return dict(out), hists


def _grad(out: _Out, raw) -> None:
    if "grad.sq" in raw:
        out.put("grad/norm", math.sqrt(_f(raw, "grad.sq")))
        out.put("grad/max_abs", _f(raw, "grad.max_abs"))
        out.put("grad/nonfinite", _f(raw, "grad.nonfinite"))
        groups = sorted(k for k in raw if k.startswith("grad.group"))
        if len(groups) > 1:
            for key in groups:
                out.put(f"grad/{key.split('.')[1]}/norm", math.sqrt(_f(raw, key)))
    if "grad.preclip_sq" in raw:
        out.put("grad/norm_preclip", math.sqrt(_f(raw, "grad.preclip_sq")))


def _loss(out: _Out, raw) -> None:
    if "loss.count" in raw:
        ranks = max(_f(raw, "loss.ranks", 1.0), 1.0)  # data-parallel ranks each add their own step loss
        out.put("loss/value", _f(raw, "loss.sum") / ranks if _f(raw, "loss.nonfinite") == 0 else math.nan)
        out.put("loss/nonfinite", _f(raw, "loss.nonfinite"))
