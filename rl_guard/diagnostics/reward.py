"""reward/: what the reward is made of and what its histogram looks like (the table of shapes in
docs/sources.md#debugging-guide).

Statistics use valid rewards only: finite and not a system error (see ``samples``).

- ``reward/n_valid``; ``reward/nonfinite_count`` (NaN/inf rewards of non-system-error samples, up is trouble);
  ``reward/system_error_excluded`` (samples left out because the environment / verifier / infrastructure failed).
- ``reward/component/<name>/mean``: mean of component <name> over its finite values on non-system-error samples.
- ``reward/component/<name>/share`` = mean_c / sum over components of |mean_c'|, in [-1, 1]: which term the total
  moves with (a rising total carried by format or length terms is a hacking lead).
- Shape flags (0/1), over the n valid rewards:
  ``shape_all_zero``  share(r == 0) > 0.9 (too sparse: the gradient sees silence);
  ``shape_all_one``   share(r == max r) > 0.9 and max r > 0 (too lenient; for binary rewards: r == 1);
  ``shape_heavy_tail`` excess kurtosis m4 / m2^2 - 3 > 6 with n >= 12 (population moments). 6 is the exponential
  distribution's excess kurtosis, so the flag means tails heavier than exponential: a few samples dominate the
  gradient. Kurtosis, not a quantile ratio, because binary and sparse rewards have p01 = p50 and an
  inter-quartile range of 0, where quantile ratios divide by zero; a single large outlier pushes it toward n.
  ``reward/kurtosis`` is reported too (when n >= 12 and the spread exceeds float rounding) for custom thresholds;
  ``shape_mixed_sign`` min(share(r > 0), share(r < 0)) >= 0.1 (reward definition unclear: read samples).
- ``reward/shape``: 0 ordinary, 1 all_zero, 2 all_one, 3 heavy_tail, 4 mixed_sign; the first flag set, in that order.
"""

from __future__ import annotations

import numpy as np

from .names import Out, mean, share
from .samples import Prepared

SHAPES = ("all_zero", "all_one", "heavy_tail", "mixed_sign")
KURTOSIS_LIMIT = 6.0
KURTOSIS_MIN_N = 12  # n points cannot exceed excess kurtosis n - 5 + 1/(n-1): below 11, > 6 is unreachable

DOCS = {
    "reward/n_valid": "Rewards that entered the reward statistics (finite, not a system error).",
    "reward/nonfinite_count": "NaN / inf rewards among non-system-error samples; > 0 is trouble (excluded).",
    "reward/system_error_excluded": "Samples excluded from reward statistics because of a system-error termination.",
    "reward/component/<name>/mean": "Mean of reward component <name> (finite values, system errors excluded).",
    "reward/component/<name>/share": "mean_c / sum |mean_c'| over components; [-1, 1]. A rising total carried by "
    "format / length terms is a reward-hacking lead.",
    "reward/kurtosis": "Excess kurtosis m4/m2^2 - 3 of valid rewards (n >= 12); normal 0, exponential 6, up = "
    "heavier tail.",
    "reward/shape_all_zero": "1 if > 90% of valid rewards are exactly 0 (too sparse), else 0.",
    "reward/shape_all_one": "1 if > 90% of valid rewards sit at the batch maximum and it is > 0 (too lenient).",
    "reward/shape_heavy_tail": "1 if reward excess kurtosis > 6 (heavier than exponential, n >= 12): a few samples "
    "dominate the gradient; clip or normalise.",
    "reward/shape_mixed_sign": "1 if at least 10% of valid rewards are > 0 and at least 10% are < 0.",
    "reward/shape": "0 ordinary, 1 all_zero, 2 all_one, 3 heavy_tail, 4 mixed_sign (first flag set in this order).",
}


def excess_kurtosis(v: np.ndarray) -> float | None:
    if len(v) < KURTOSIS_MIN_N:
        return None
    d = v - mean(v)
    m2 = float(mean(d * d))
    # Spread at the level of float rounding (e.g. a constant 0.1) would give a meaningless ratio.
    if m2 <= (1e-12 * float(np.max(np.abs(v)))) ** 2 or m2 == 0.0:
        return None
    return float(mean(d**4)) / (m2 * m2) - 3.0


def shape_flags(v: np.ndarray, kurt: float | None = None) -> dict[str, int]:
    """``kurt``: ``excess_kurtosis(v)`` when the caller has it already."""
    top = float(v.max())
    kurt = excess_kurtosis(v) if kurt is None else kurt
    return {
        "all_zero": int(share(v == 0) > 0.9),
        "all_one": int(top > 0 and share(v == top) > 0.9),
        "heavy_tail": int(kurt is not None and kurt > KURTOSIS_LIMIT),
        "mixed_sign": int(min(share(v > 0), share(v < 0)) >= 0.1),
    }


def reward(p: Prepared, out: Out) -> None:
    if p.rewards is not None:
        v = p.rewards[p.reward_ok]
        out.put("reward/n_valid", len(v))
        out.put("reward/nonfinite_count", np.count_nonzero(p.ok & ~np.isfinite(p.rewards)))
        out.put("reward/system_error_excluded", np.count_nonzero(p.system_error))
        if len(v):
            kurt = excess_kurtosis(v)
            flags = shape_flags(v, kurt)
            for name in SHAPES:
                out.put(f"reward/shape_{name}", flags[name])
            out.put("reward/shape", next((i + 1 for i, s in enumerate(SHAPES) if flags[s]), 0))
            out.put("reward/kurtosis", kurt)
    means = {}
    for name, c in p.components.items():
        keep = p.ok & np.isfinite(c)
        if keep.any():
            means[name] = float(mean(c[keep]))
            out.put(f"reward/component/{name}/mean", means[name])
    scale = sum(abs(m) for m in means.values())
    for name, m in means.items():
        out.put(f"reward/component/{name}/share", m / scale if scale > 0 else None)
