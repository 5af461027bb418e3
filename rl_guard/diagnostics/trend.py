"""length/ and trend/: response-length drift and the reward-hacking triad (docs/sources.md#debugging-guide).

- ``length/no_eos_frac`` = share of samples with ``truncated`` (no EOS) this batch; up is trouble.
- ``trend/<x>_mean`` this batch's mean of x, and ``trend/<x>_slope``: least-squares slope of that mean against the
  step number over the last ``window`` updates that reported x (units of x per training step; needs >= 3 points).
  x = reward (valid rewards), length (response tokens, all samples), outcome (independent outcome, valid samples).
  A resume or rollback to an earlier step drops the points at or after it, so a replayed stretch is not
  counted twice. The window survives ``state_dict``.

The triad "reward up, length up, independent outcome flat" (reward hacking, typically a length preference in the
reward; Singhal et al. 2023) as a composite rule; thresholds are per step, tune them to the run's scale::

  - name: reward_hacking_triad
    all:
      - {metric: rl_guard/trend/reward_slope, op: ">", threshold: 0.002}
      - {metric: rl_guard/trend/length_slope, op: ">", threshold: 1.0}
      - {metric: rl_guard/trend/outcome_slope, op: "<", threshold: 0.0005}
    patience: 3
    action: warn

Then read the audit files' top-reward samples and the ``quadrant`` hacking cell.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .names import Out, mean, share, slope
from .samples import Prepared

SERIES = ("reward", "length", "outcome")
MIN_POINTS = 3
_START, _END = "  - name: reward_hacking_triad", "    action: warn\n"
TRIAD_RULE = __doc__[__doc__.index(_START) : __doc__.index(_END) + len(_END)]  # the snippet above, for reuse

DOCS = {
    "length/no_eos_frac": "Share of samples that ended without EOS (truncated) this batch; up is trouble.",
    **{f"trend/{x}_mean": f"Batch mean of {x} (the point the trend is fitted on)." for x in SERIES},
    **{
        f"trend/{x}_slope": f"Least-squares slope of the batch mean {x} per training step over the last `window` "
        "updates (>= 3 points)."
        for x in SERIES
    },
}
DOCS["trend/length_slope"] += (
    " Up together with reward_slope while outcome_slope is flat: reward hacking (docs/sources.md#debugging-guide)."
)


class Trend:
    def __init__(self, window: int = 20):
        if window < MIN_POINTS:
            raise ValueError(f"window must be >= {MIN_POINTS}, got {window}")
        self.window = window
        self.points: dict[str, deque] = {x: deque(maxlen=window) for x in SERIES}

    def update(self, p: Prepared, step: int, out: Out) -> None:
        if p.truncated is not None and p.n:
            out.put("length/no_eos_frac", share(p.truncated))
        means = {}
        if p.rewards is not None and p.reward_ok.any():
            means["reward"] = mean(p.rewards[p.reward_ok])
        if p.lengths is not None:
            finite = p.lengths[np.isfinite(p.lengths)]
            if len(finite):
                means["length"] = mean(finite)
        if p.outcome is not None and p.outcome_ok.any():
            means["outcome"] = mean(p.outcome[p.outcome_ok])
        for x, pts in self.points.items():
            while pts and pts[-1][0] >= step:  # replay after resume / rollback
                pts.pop()
            if x in means:
                pts.append((int(step), float(means[x])))
                out.put(f"trend/{x}_mean", means[x])
            if len(pts) >= MIN_POINTS and x in means:
                xs, ys = np.array(pts, dtype=np.float64).T
                out.put(f"trend/{x}_slope", slope(xs, ys))

    def state_dict(self) -> dict:
        return {"window": self.window, "points": {x: [list(pt) for pt in pts] for x, pts in self.points.items()}}

    def load_state_dict(self, state: dict) -> None:
        for x in SERIES:
            self.points[x] = deque(((int(s), float(v)) for s, v in state["points"].get(x, [])), maxlen=self.window)
