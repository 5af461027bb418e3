"""budget/: what this generation batch cost, per step and cumulative over the run.

Fixing only the optimizer step is not a fair unit: group size, filter rate, response length and epochs differ
between methods, so episodes, rollout tokens, train tokens, updates and wall-clock are reported together.

- ``budget/<x>`` this batch, ``budget/<x>_total`` summed over every update() since the start of the run (kept in
  ``state_dict``, so they continue across a resume; a rollback does not refund what was spent), for x in
  episodes (given, else one per sample), rollout_tokens (given, else the sum of ``lengths``), train_tokens
  (given, else funnel ``action_tokens``), optimizer_updates (``update(optimizer_updates=n)``, else funnel
  ``optimizer_updates``, else 1 per update() call).
- ``budget/seconds/<name>`` and ``budget/seconds_total/<name>``: seconds per phase from ``phase_seconds``.
Direction: none by itself; compare runs at equal budget, or bound a total (e.g. stop after N rollout tokens).
"""

from __future__ import annotations

import numpy as np

from .names import Out
from .samples import Prepared, SampleBatch, SampleError, label

COUNTERS = ("episodes", "rollout_tokens", "train_tokens", "optimizer_updates")

DOCS = {
    **{f"budget/{c}": f"{c.replace('_', ' ')} spent on this generation batch (>= 0)." for c in COUNTERS},
    **{
        f"budget/{c}_total": f"Cumulative {c.replace('_', ' ')} since the run started (survives resume)."
        for c in COUNTERS
    },
    "budget/seconds/<name>": "Wall-clock seconds spent in phase <name> for this batch (e.g. rollout, reward, train).",
    "budget/seconds_total/<name>": "Cumulative seconds in phase <name> since the run started (survives resume).",
}


def spent(s: SampleBatch, p: Prepared, optimizer_updates: int | None) -> dict[str, float]:
    """This batch's counters (absent ones left out); validated before any state changes."""
    funnel = s.funnel or {}
    given = {
        "episodes": s.episodes if s.episodes is not None else p.n,
        "rollout_tokens": s.rollout_tokens
        if s.rollout_tokens is not None
        else (p.lengths[np.isfinite(p.lengths)].sum() if p.lengths is not None else None),
        "train_tokens": s.train_tokens if s.train_tokens is not None else funnel.get("action_tokens"),
        "optimizer_updates": optimizer_updates if optimizer_updates is not None else funnel.get("optimizer_updates", 1),
    }
    this = {k: float(v) for k, v in given.items() if v is not None}
    seconds = {label(k): float(v) for k, v in (s.phase_seconds or {}).items()}
    for name, v in {**this, **seconds}.items():
        if not (v >= 0 and np.isfinite(v)):
            raise SampleError(f"budget {name} must be finite and >= 0, got {v}")
    return {**this, **{f"seconds/{k}": v for k, v in seconds.items()}}


class Budget:
    def __init__(self):
        self.totals: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def update(self, this: dict[str, float], out: Out) -> None:
        for name, v in this.items():
            out.put(f"budget/{name}", v)
            if name.startswith("seconds/"):
                key = name.removeprefix("seconds/")
                self.seconds[key] = self.seconds.get(key, 0.0) + v
            else:
                self.totals[name] = self.totals.get(name, 0.0) + v
        for name in COUNTERS:
            if name in self.totals:
                out.put(f"budget/{name}_total", self.totals[name])
        for key, total in self.seconds.items():
            out.put(f"budget/seconds_total/{key}", total)

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals), "seconds": dict(self.seconds)}

    def load_state_dict(self, state: dict) -> None:
        self.totals = {k: float(v) for k, v in state.get("totals", {}).items()}
        self.seconds = {k: float(v) for k, v in state.get("seconds", {}).items()}
