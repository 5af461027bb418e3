"""funnel/: the denominator at every layer from sampled task to gradient, and why samples were dropped.

Layers (``SampleBatch.funnel`` counts; unknown layer names are rejected so a typo cannot hide a layer)::

    sampled -> started -> completed / truncated / failed -> reward_available -> valid
            -> accepted (freshness / ratio gates) -> action_tokens -> optimizer_updates

- ``funnel/<layer>/count``: the count given for the layer.
- ``funnel/<layer>/keep_frac`` = count / count of the nearest *present* parent layer, in [0, 1] (> 1 means the
  accounting is broken). completed, truncated and failed are siblings: each is a share of ``started``.
  ``action_tokens`` is in tokens, so its parent is the batch's rollout tokens (``budget/rollout_tokens``);
  ``optimizer_updates`` has no parent. Left out when the parent is absent or 0.
  Direction: down is trouble; a rising reward while a layer keeps less may only mean harder or longer
  trajectories were dropped. Example rule: ``funnel/accepted/keep_frac < 0.8``.
- ``funnel/drop/<name>``: samples dropped for reason <name> (``SampleBatch.drop_reasons``).
"""

from __future__ import annotations

from .names import Out, frac
from .samples import SampleBatch, SampleError, label

LAYERS = (
    "sampled",
    "started",
    "completed",
    "truncated",
    "failed",
    "reward_available",
    "valid",
    "accepted",
    "action_tokens",
    "optimizer_updates",
)
# Nearest present ancestor wins, so a pipeline that does not count one layer still gets a ratio.
PARENTS = {
    "started": ("sampled",),
    "completed": ("started", "sampled"),
    "truncated": ("started", "sampled"),
    "failed": ("started", "sampled"),
    "reward_available": ("started", "sampled"),
    "valid": ("reward_available", "started", "sampled"),
    "accepted": ("valid", "reward_available", "started", "sampled"),
}

DOCS = {
    **{f"funnel/{layer}/count": f"Funnel layer '{layer}': count this batch." for layer in LAYERS},
    **{
        f"funnel/{layer}/keep_frac": f"count({layer}) / count(nearest present parent: {' > '.join(PARENTS[layer])}); "
        "[0, 1], down is trouble."
        for layer in PARENTS
    },
    "funnel/action_tokens/keep_frac": "Effective action tokens / rollout tokens generated this batch; [0, 1], down "
    "is trouble (tokens generated but never trained on).",
    "funnel/drop/<name>": "Samples dropped this batch for reason <name> (count, >= 0).",
}


def funnel(s: SampleBatch, rollout_tokens: float | None, out: Out) -> None:
    counts = dict(s.funnel or {})
    bad = sorted(set(counts) - set(LAYERS))
    if bad:
        raise SampleError(f"unknown funnel layer(s) {bad}; allowed: {', '.join(LAYERS)}")
    for layer in LAYERS:
        if layer not in counts:
            continue
        c = float(counts[layer])
        if c < 0:
            raise SampleError(f"funnel count for {layer!r} must be >= 0, got {c}")
        out.put(f"funnel/{layer}/count", c)
        if layer == "action_tokens":
            out.put("funnel/action_tokens/keep_frac", frac(c, rollout_tokens) if rollout_tokens else None)
        parent = next((p for p in PARENTS.get(layer, ()) if p in counts), None)
        if parent is not None:
            out.put(f"funnel/{layer}/keep_frac", frac(c, counts[parent]))
    for reason, c in (s.drop_reasons or {}).items():
        out.put(f"funnel/drop/{label(reason)}", c)
