"""quadrant/: training reward against an independent outcome (the four quadrants of
docs/sources.md#experiments-and-diagnostics).

Samples: finite reward, finite outcome, not a system error. success = outcome >= 0.5.
high reward = r >= t with t = the configured ``quadrant_threshold``; without one, t is the batch median and
high = r >= median if median > min(r) else r > median. The second case keeps binary rewards right when most
of the batch is 0 (median 0 would otherwise call every 0 "high"); a constant batch has no high/low split and
reports nothing.

- ``quadrant/hacking_frac`` = count(high reward and outcome fail) / n: reward-hacking candidates. Up is trouble.
- ``quadrant/false_negative_frac`` = count(low reward and outcome success) / n: the reward misses real successes.
- ``quadrant/threshold`` (t), ``quadrant/n``.
The sample indices of both cells go to the audit file: these two cells, not average samples, are worth reading.
"""

from __future__ import annotations

import numpy as np

from .names import Out
from .samples import Prepared

DOCS = {
    "quadrant/hacking_frac": "Share of samples with high training reward but a failed independent outcome "
    "(reward-hacking candidates); [0, 1], up is trouble.",
    "quadrant/false_negative_frac": "Share with low training reward but a successful independent outcome "
    "(reward false negatives); [0, 1], up is trouble.",
    "quadrant/threshold": "Reward threshold splitting high from low (configured, else the batch median rule).",
    "quadrant/n": "Samples in the quadrant (finite reward and outcome, no system error).",
}


def high_mask(r: np.ndarray, threshold: float | None) -> tuple[np.ndarray, float] | None:
    if threshold is not None:
        return r >= threshold, float(threshold)
    med, lo = float(np.median(r)), float(r.min())
    if lo == float(r.max()):
        return None
    return (r >= med if med > lo else r > med), med


def quadrant(p: Prepared, threshold: float | None, out: Out) -> dict[str, list[int]]:
    """Returns {'hacking': [sample index...], 'false_negative': [...]} for the audit (empty when undefined)."""
    if p.rewards is None or p.outcome is None:
        return {}
    idx = np.flatnonzero(p.reward_ok & p.outcome_ok)
    if len(idx) == 0:
        return {}
    split = high_mask(p.rewards[idx], threshold)
    if split is None:
        return {}
    high, t = split
    ok = p.success[idx]
    hacking, false_neg = idx[high & ~ok], idx[~high & ok]
    out.put("quadrant/hacking_frac", len(hacking) / len(idx))
    out.put("quadrant/false_negative_frac", len(false_neg) / len(idx))
    out.put("quadrant/threshold", t)
    out.put("quadrant/n", len(idx))
    return {"hacking": hacking.tolist(), "false_negative": false_neg.tolist()}
