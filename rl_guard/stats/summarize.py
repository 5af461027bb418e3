"""Host-side formulas: merged sufficient statistics (float64 numpy) -> named step metrics.

Every metric is documented once in ``rl_guard/glossary.py``; this module only computes them. Means divide by
the number of finite, unmasked entries; an empty denominator gives NaN and the metric is left out.

This runs once per optimizer step on the host, between the step's transfer and the rules: metric names are
formatted once (module constants, and per key layout for the keys that vary), scalars are read as Python floats
and each sketch's quantiles take one numpy call.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import keys
from .constants import DEFAULT_LAG_EDGES, EXP_ARG_MAX
from .sketch import ENTROPY, LOG_RATIO, QUANTILE_NAMES, quantiles_from_counts

PREFIX = "rl_guard/"
_NAN = math.nan


def _exp(x: float) -> float:
    return math.exp(min(x, EXP_ARG_MAX))


def lag_bucket_names(edges=DEFAULT_LAG_EDGES) -> list[str]:
    names = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else None
        names.append(f"{lo}+" if hi is None else (str(lo) if hi == lo else f"{lo}-{hi}"))
    return names


# -- metric names, formatted once ----------------------------------------------------------------------------------
def _names(family: str, *stats: str) -> tuple[str, ...]:
    return tuple(f"{PREFIX}{family}/{s}" for s in stats)


def _mean_min_max(family: str) -> tuple[str, str, str]:
    mean, vmin, vmax = _names(family, "mean", "min", "max")
    return mean, vmin, vmax


# family -> (family keys, mean, min, max, quantile names)
_RATIO = {name: (keys.of(name), *_mean_min_max(name), _names(name, *QUANTILE_NAMES)) for name in keys.RATIO_FAMILIES}
# family -> (count key, seqs key, [(sum key, seqsum key, seqmax key, mean, seq_mean, seq_max) per estimator])
_KL = {
    name: (
        keys.of(name).count,
        keys.of(name).seqs,
        [
            (
                keys.of(name).estimator(k, "sum"),
                keys.of(name).estimator(k, "seqsum"),
                keys.of(name).estimator(k, "seqmax"),
                *_names(name, f"{k}_mean", f"{k}_seq_mean", f"{k}_seq_max"),
            )
            for k in keys.KL_ESTIMATORS
        ],
    )
    for name in keys.KL_FAMILIES
}
# family -> (family keys, mean, min, max, std)
_VALUES = {
    name: (keys.of(name), *_mean_min_max(name), _names(name, "std")[0])
    for name in ("entropy", "adv", "length", "reward", "logp")
}
_ENTROPY_Q = _names("entropy", *QUANTILE_NAMES)
_HIST_RATIO, _HIST_ENTROPY = PREFIX + "log_ratio", PREFIX + "entropy"


@functools.cache
def _lag_names(edges: tuple) -> list[tuple[str, ...]]:
    """Per bucket: token_frac, ratio_p50, ratio_p99, clip_frac, k3_mean."""
    return [
        _names(f"lag/{b}", "token_frac", "ratio_p50", "ratio_p99", "clip_frac", "k3_mean")
        for b in lag_bucket_names(edges)
    ]


class _Layout:
    """What varies with the set of keys a step carries (input fields, optimizer groups), worked out once per set."""

    __slots__ = ("inputs", "grad_groups", "update_groups")

    def __init__(self, raw_keys: tuple[str, ...]):
        self.inputs = [
            (k, PREFIX + k.replace(".", "/"))
            for k in raw_keys
            if k.startswith(keys.INPUT_PREFIX) and k.endswith(keys.NONFINITE_SUFFIX)
        ]
        groups = sorted(k for k in raw_keys if k.startswith(keys.GRAD_GROUP_PREFIX))
        self.grad_groups = [(k, f"{PREFIX}grad/{k.split('.')[1]}/norm") for k in groups] if len(groups) > 1 else []
        prefix = keys.UPDATE_GROUP_PREFIX
        ids = sorted({int(k[len(prefix) :].split(".")[0]) for k in raw_keys if k.startswith(prefix)})
        # per group: its keys lr, param_sq, sq, base_sq and its metrics param_norm, rel (these with several groups)
        self.update_groups = [
            tuple(keys.update_group(g, f) for f in ("lr", "param_sq", "sq", "base_sq"))
            + _names(f"update/group{g}", "param_norm", "rel")
            for g in ids
        ]


# Layouts are few (one per kind of step); the cache never grows without bound.
_layout_of = functools.lru_cache(maxsize=64)(_Layout)


# -- the step's metrics -----------------------------------------------------------------------------------------------
def summarize(raw: dict[str, np.ndarray], lag_edges=DEFAULT_LAG_EDGES) -> tuple[dict[str, float], dict]:
    """Metrics ``{rl_guard/<family>/<stat>: float}`` and histograms ``{name: (edges, counts)}`` of one step."""
    layout = _layout_of(tuple(raw))
    get = raw.get

    def f(key, default=_NAN) -> float:
        v = get(key)
        return float(v[0]) if v is not None else default

    out: dict[str, float] = {}
    if keys.TOKENS.count in raw:  # absent when no token batch was fed (e.g. a plain supervised Trainer)
        out[PREFIX + "tokens/count"] = f(keys.TOKENS.count)
        out[PREFIX + "tokens/microbatches"] = f(keys.TOKENS.microbatches)
    for key, name in layout.inputs:
        out[name] = float(raw[key][0])
    if keys.LAG.tokens in raw:
        _lag(out, raw, f, tuple(lag_edges))
    for name in keys.RATIO_FAMILIES:
        _ratio(out, raw, f, name)
    for name in keys.KL_FAMILIES:
        _kl(out, raw, f, name)
    if _values(out, f, "entropy"):
        ent = _VALUES["entropy"][0]
        for name, v in zip(_ENTROPY_Q, quantiles_from_counts(raw[ent.hist], ENTROPY, f(ent.min), f(ent.max))):
            out[name] = v
    n_clip = f(keys.CLIP.count, 0.0)
    if n_clip > 0:
        low, high = f(keys.CLIP.low), f(keys.CLIP.high)
        out[PREFIX + "clip/low_frac"] = low / n_clip
        out[PREFIX + "clip/high_frac"] = high / n_clip
        out[PREFIX + "clip/region_frac"] = (low + high) / n_clip
    n_adv = _values(out, f, "adv", std=True)
    if n_adv:
        out[PREFIX + "adv/zero_frac"] = f(keys.ADV.zero) / n_adv
    n_seq = _values(out, f, "length")
    if n_seq and keys.LENGTH.truncated in raw:
        out[PREFIX + "length/truncated_frac"] = f(keys.LENGTH.truncated) / n_seq
    _values(out, f, "reward", std=True)
    _values(out, f, "logp")
    _update(out, f, layout.update_groups)
    _grad(out, raw, f, layout)
    _loss(out, raw, f)
    hists = {}
    if keys.RATIO.hist in raw:
        hists[_HIST_RATIO] = (LOG_RATIO.edges, raw[keys.RATIO.hist])
    if keys.ENTROPY.hist in raw:
        hists[_HIST_ENTROPY] = (ENTROPY.edges, raw[keys.ENTROPY.hist])
    return out, hists


def _ratio(out: dict, raw, f, name: str) -> None:
    key, mean, vmin, vmax, qnames = _RATIO[name]
    n = f(key.count, 0.0)
    if n <= 0:
        return
    lo, hi = f(key.logmin), f(key.logmax)
    out[mean] = f(key.sum) / n
    out[vmin] = _exp(lo)
    out[vmax] = _exp(hi)
    hist = raw.get(key.hist)
    if hist is not None:
        for q, v in zip(qnames, quantiles_from_counts(hist, LOG_RATIO, lo, hi)):
            out[q] = _exp(v)


def _values(out: dict, f, name: str, std: bool = False) -> float:
    key, mean_name, min_name, max_name, std_name = _VALUES[name]
    n = f(key.count, 0.0)
    if n <= 0:
        return 0.0
    mean = f(key.sum) / n
    out[mean_name] = mean
    out[min_name] = f(key.min)
    out[max_name] = f(key.max)
    if std:
        var = max(f(key.sumsq) / n - mean * mean, 0.0)
        out[std_name] = math.sqrt(var * n / (n - 1)) if n > 1 else 0.0
    return n


def _kl(out: dict, raw, f, name: str) -> None:
    count, seqs_key, estimators = _KL[name]
    if count not in raw:
        return
    n, seqs = f(count, 0.0), f(seqs_key, 0.0)
    for sum_key, seqsum_key, seqmax_key, mean, seq_mean, seq_max in estimators:
        if n > 0:
            out[mean] = f(sum_key) / n
        if seqs > 0:
            out[seq_mean] = f(seqsum_key) / seqs
            out[seq_max] = f(seqmax_key)


def _lag(out: dict, raw, f, edges: tuple) -> None:
    tokens = raw[keys.LAG.tokens]
    total = float(tokens.sum())
    if total > 0:
        out[PREFIX + "lag/mean"] = f(keys.LAG.sum) / total
        out[PREFIX + "lag/max"] = f(keys.LAG.max)
    hist = raw.get(keys.LAG.hist)
    nb = len(edges)
    bins = LOG_RATIO.bins
    token_counts = tokens.tolist()
    clip = raw.get(keys.LAG.clip)  # absent without advantages (nothing is clipped)
    lo, hi = f(keys.RATIO.logmin), f(keys.RATIO.logmax)
    for i, (frac, p50_name, p99_name, clip_name, k3_name) in enumerate(_lag_names(edges)):
        if total > 0:
            out[frac] = token_counts[i] / total
        if hist is None:
            continue
        cells = hist[i * bins : (i + 1) * bins]
        count = float(cells.sum())  # tokens of the bucket with a finite ratio
        if count <= 0:
            continue
        p50, p99 = quantiles_from_counts(cells, LOG_RATIO, lo, hi, qs=(0.5, 0.99))
        out[p50_name] = _exp(p50)
        out[p99_name] = _exp(p99)
        if clip is not None:
            out[clip_name] = float(clip[i]) / count
        out[k3_name] = float(raw[keys.LAG.k3][i]) / count
    if hist is not None and nb:
        raw.setdefault(keys.RATIO.hist, hist.reshape(nb, bins).sum(0))


def _update(out: dict, f, groups: list[tuple]) -> None:
    """The update probe's figures (``stats/update.py``); ``groups``: ``_Layout.update_groups``."""
    param_sq = f(keys.UPDATE.param_sq, None)
    if param_sq is not None:
        out[PREFIX + "update/param_norm"] = math.sqrt(param_sq)
        drift = f(keys.UPDATE.drift_sq, None)
        if drift is not None and param_sq > 0:
            out[PREFIX + "update/external_rel"] = math.sqrt(drift / param_sq)
        changed = f(keys.UPDATE.changed, None)
        if changed is not None:
            out[PREFIX + "update/external_changed"] = changed
        prev = f(keys.UPDATE.prev_param_sq, None)
        if prev is not None and prev > 0:
            out[PREFIX + "update/param_norm_change"] = abs(math.sqrt(param_sq) - math.sqrt(prev)) / math.sqrt(prev)
    several = groups if len(groups) > 1 else []
    for _lr, param_sq_key, _sq, _base, param_norm, _rel in several:
        sq = f(param_sq_key, None)
        if sq is not None:
            out[param_norm] = math.sqrt(sq)
    sq, base = f(keys.UPDATE.sq, None), f(keys.UPDATE.base_sq, None)
    if sq is None or base is None:
        return
    out[PREFIX + "update/norm"] = math.sqrt(sq)
    if base > 0:
        out[PREFIX + "update/rel"] = math.sqrt(sq / base)
    lr = max((x for x in (f(lr_key) for lr_key, *_ in groups) if math.isfinite(x)), default=None)
    if lr and base > 0:
        out[PREFIX + "update/rel_per_lr"] = math.sqrt(sq / base) / lr
    count = f(keys.UPDATE.count, None)
    if lr and count:
        out[PREFIX + "update/rms_per_lr"] = math.sqrt(sq / count) / lr
    for _lr, _param_sq, sq_key, base_key, _param_norm, rel in several:
        g_sq, g_base = f(sq_key, None), f(base_key, None)
        if g_sq is not None and g_base:
            out[rel] = math.sqrt(g_sq / g_base)


def _grad(out: dict, raw, f, layout: _Layout) -> None:
    # One meaning for grad/norm: the pre-clip total norm. Where the gradients are seen after the trainer clipped
    # them, the trainer's own pre-clip norm is grad/norm and the norm seen here is grad/norm_postclip.
    if keys.GRAD.sq in raw:
        measured = math.sqrt(f(keys.GRAD.sq))
        if keys.GRAD.preclip_sq in raw:
            # Clipping cannot make a finite norm non-finite: non-finite gradients here were corrupted after the
            # trainer measured them, and the pre-clip figure no longer describes what the optimizer receives.
            preclip = math.sqrt(f(keys.GRAD.preclip_sq))
            out[PREFIX + "grad/norm"] = preclip if math.isfinite(measured) else measured
            out[PREFIX + "grad/norm_postclip"] = measured
        else:
            out[PREFIX + "grad/norm"] = measured
        out[PREFIX + "grad/max_abs"] = f(keys.GRAD.max_abs)
        out[PREFIX + "grad/nonfinite"] = f(keys.GRAD.nonfinite)
        for key, name in layout.grad_groups:
            out[name] = math.sqrt(f(key))
    elif keys.GRAD.preclip_sq in raw:
        out[PREFIX + "grad/norm"] = math.sqrt(f(keys.GRAD.preclip_sq))


def _loss(out: dict, raw, f) -> None:
    if keys.LOSS.count in raw:
        ranks = max(f(keys.LOSS.ranks, 1.0), 1.0)  # data-parallel ranks each add their own step loss
        out[PREFIX + "loss/value"] = f(keys.LOSS.sum) / ranks if f(keys.LOSS.nonfinite) == 0 else _NAN
        out[PREFIX + "loss/nonfinite"] = f(keys.LOSS.nonfinite)
