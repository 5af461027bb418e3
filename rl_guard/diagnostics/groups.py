"""group/: group-relative methods (GRPO, RLOO) - which prompts can give a gradient at all.

A group is all samples sharing a ``group_ids`` value (one prompt). Reward and outcome statistics use valid
samples only (no system error; finite reward or outcome), so a group can be empty of valid samples.

- ``group/count``; ``group/size_mean``, ``size_min``, ``size_max``: realised samples per group (every sample).
- correct: ``outcome >= 0.5`` when an outcome is given, else ``r > 0.5 * max r`` over the batch's valid rewards
  (nothing is correct when that max is <= 0). Half the best reward rather than ``== max`` so continuous rewards
  near the top count, and relative to the batch so any reward scale works.
  ``group/all_correct_frac``, ``all_wrong_frac``, ``mixed_frac``: shares of non-empty groups (sum to 1); only
  mixed groups carry a group-relative signal, so mixed down is trouble. ``group/empty_frac``: groups with no
  valid sample for the correctness signal, over all groups.
- ``group/zero_std_frac``: groups whose valid rewards are all equal (max == min; a single-sample group counts:
  its group-relative advantage is 0) over groups with >= 1 valid reward. Up is trouble.
- ``group/no_signal_token_frac`` = response tokens of samples in zero-std or reward-empty groups / all response
  tokens: generation spent without gradient signal (needs ``lengths``).
- ``group/len_adv_corr``: Pearson correlation of response length and advantage over valid samples (given
  ``advantages``, else r - group mean of valid r). Strongly positive: the update rewards being long.
- ``group/unique_frac``: mean over groups of distinct texts / texts, every sample with a text (1 = all different;
  down = mode collapse).
- With an outcome, per group with m valid outcomes of which c succeed (k = m, the group's own size):
  ``group/pass_at_k`` = share of groups with c >= 1; ``group/pass_pow_k`` (pass^k) = share with c == m;
  ``group/pass_at_1`` = mean of c / m, the unbiased pass@1 estimator 1 - C(m-c, 1) / C(m, 1).
"""

from __future__ import annotations

import numpy as np

from .names import Out, frac, mean, pearson, share
from .samples import Prepared

DOCS = {
    "group/count": "Groups (distinct group_ids) in the batch.",
    "group/size_mean": "Mean realised samples per group.",
    "group/size_min": "Smallest realised group; 1 means no group-relative signal for that prompt.",
    "group/size_max": "Largest realised group.",
    "group/all_correct_frac": "Share of non-empty groups where every valid sample is correct (no signal).",
    "group/all_wrong_frac": "Share of non-empty groups where no valid sample is correct (no signal).",
    "group/mixed_frac": "Share of non-empty groups with both correct and wrong samples; down is trouble.",
    "group/empty_frac": "Share of groups with no valid sample (all system errors / non-finite).",
    "group/zero_std_frac": "Share of groups (>= 1 valid reward) whose rewards are all equal; up is trouble.",
    "group/no_signal_token_frac": "Response tokens in zero-std or empty groups / all response tokens; [0, 1].",
    "group/len_adv_corr": "Pearson(response length, advantage) over valid samples; [-1, 1], strongly > 0 is a "
    "length-bias lead.",
    "group/unique_frac": "Mean over groups of distinct texts / texts; (0, 1], down is mode collapse.",
    "group/pass_at_k": "Share of groups with at least one outcome success (k = group size).",
    "group/pass_pow_k": "pass^k: share of groups whose every valid sample succeeds.",
    "group/pass_at_1": "Mean over groups of successes / samples (unbiased pass@1).",
}


def _per_group(codes: np.ndarray, mask: np.ndarray, values: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(count, sum) of values[mask] per group."""
    return (
        np.bincount(codes[mask], minlength=g).astype(np.float64),
        np.bincount(codes[mask], weights=values[mask], minlength=g),
    )


def groups(p: Prepared, out: Out) -> None:
    if p.group is None or p.n == 0:
        return
    codes, g = p.group, int(p.group.max()) + 1
    sizes = np.bincount(codes, minlength=g)
    out.put("group/count", g)
    out.put("group/size_mean", sizes.sum() / g)
    out.put("group/size_min", sizes.min())
    out.put("group/size_max", sizes.max())
    _correctness(p, codes, g, out)
    if p.rewards is not None:
        _reward_spread(p, codes, g, out)
    if p.lengths is not None and (p.advantages is not None or p.rewards is not None):
        out.put("group/len_adv_corr", _len_adv_corr(p, codes, g))
    if p.texts is not None:
        by_group: dict[int, list] = {}  # one pass over the samples (not one mask per group)
        for k, text in zip(codes.tolist(), p.texts):
            if text is not None:
                by_group.setdefault(k, []).append(text)
        shares = [len(set(texts)) / len(texts) for texts in (by_group.get(k) for k in range(g)) if texts]
        out.put("group/unique_frac", float(np.mean(shares)) if shares else None)
    if p.outcome is not None:
        m, c = _per_group(codes, p.outcome_ok, p.success.astype(np.float64), g)
        has = m > 0
        if has.any():
            out.put("group/pass_at_k", share(c[has] > 0))
            out.put("group/pass_pow_k", share(c[has] == m[has]))
            out.put("group/pass_at_1", mean(c[has] / m[has]))


def _correctness(p: Prepared, codes: np.ndarray, g: int, out: Out) -> None:
    if p.outcome is not None:
        valid, correct = p.outcome_ok, p.success
    elif p.rewards is not None:
        valid = p.reward_ok
        top = float(p.rewards[valid].max()) if valid.any() else 0.0
        correct = p.rewards > 0.5 * top if top > 0 else np.zeros(p.n, dtype=bool)
    else:
        return
    m, c = _per_group(codes, valid, correct.astype(np.float64), g)
    has = m > 0
    out.put("group/empty_frac", share(~has))
    if has.any():
        c, m = c[has], m[has]
        out.put("group/all_correct_frac", share(c == m))
        out.put("group/all_wrong_frac", share(c == 0))
        out.put("group/mixed_frac", share((c > 0) & (c < m)))


def _reward_spread(p: Prepared, codes: np.ndarray, g: int, out: Out) -> None:
    ok, r = p.reward_ok, p.rewards
    assert r is not None  # the caller checked
    m, _ = _per_group(codes, ok, r, g)
    hi = np.full(g, -np.inf)
    lo = np.full(g, np.inf)
    np.maximum.at(hi, codes[ok], r[ok])
    np.minimum.at(lo, codes[ok], r[ok])
    has = m > 0
    zero_std = has & (hi == lo)
    out.put("group/zero_std_frac", frac(zero_std.sum(), has.sum()))
    if p.lengths is not None:
        finite_len = np.isfinite(p.lengths)
        no_signal = (zero_std | ~has)[codes]
        all_tokens = p.lengths[finite_len].sum()
        out.put("group/no_signal_token_frac", frac(p.lengths[finite_len & no_signal].sum(), all_tokens))


def _len_adv_corr(p: Prepared, codes: np.ndarray, g: int) -> float | None:
    assert p.lengths is not None and (p.advantages is not None or p.rewards is not None)  # the caller checked
    if p.advantages is not None:
        adv, keep = p.advantages, p.ok & np.isfinite(p.advantages)
    else:  # group-mean baseline, the common core of GRPO and RLOO advantages
        assert p.rewards is not None
        m, total = _per_group(codes, p.reward_ok, p.rewards, g)
        adv = p.rewards - np.divide(total, m, out=np.zeros(g), where=m > 0)[codes]
        keep = p.reward_ok.copy()
    keep &= np.isfinite(p.lengths)
    return pearson(p.lengths[keep], adv[keep])
