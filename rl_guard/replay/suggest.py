"""``rl-guard suggest``: thresholds from healthy histories, with the evidence next to each number.

For each condition of each YAML rule, the metric's values across the healthy histories give:

- ``>`` / ``>=``: the ``quantile`` of the healthy values times ``margin`` (``<`` / ``<=``: the low quantile
  ``1 - quantile`` divided by ``margin``); ``outside``: the band between the two quantiles, widened on each side
  by ``margin - 1`` times its width;
- spike rules (``mad``, ``ema_z``): the largest z-score the detector reached on the healthy steps, in its
  direction, computed exactly as the live detector does (same window, min_history, center and scale), times
  ``margin``; ``early_max``: the largest multiple of the early max, times ``margin``.

Counts of non-finite values keep threshold 0 (any is a fault). Numbers are rounded to 3 significant digits away
from the healthy values. A condition whose metric is absent, whose detector never armed, or that has fewer than
``min_steps`` healthy values to go on (``history.MIN_STEPS``: why 50) keeps its setting and says why: a threshold
from a short history is far tighter than the preset's and fires on the next healthy run.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import yaml

from ..control.rules import Condition, _center_scale
from .history import MIN_STEPS

TOO_SHORT = "too short to calibrate from"  # in the evidence of every condition kept for want of healthy values


@dataclass
class Suggestion:
    rule: dict
    evidence: list[str] = field(default_factory=list)


def round_away(x: float, up: bool, digits: int = 3) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(abs(x))))
    return (math.ceil if up else math.floor)(x * scale) / scale


def _beyond(x: float, margin: float, up: bool) -> float:
    """``margin`` x further from zero in the direction of trouble (additive for values of the other sign)."""
    if up:
        return x * margin if x > 0 else x + (margin - 1) * abs(x)
    return x / margin if x > 0 else x - (margin - 1) * abs(x)


def _series(histories, metric: str) -> list[np.ndarray]:
    out = []
    for h in histories:
        vals = np.array([r[metric] for r in h.records if metric in r], dtype=np.float64)
        out.append(vals[np.isfinite(vals)])
    return out


def _healthy(values: np.ndarray) -> str:
    return f"{len(values)} healthy steps, range [{values.min():.4g}, {values.max():.4g}]"


def _short(metric: str, n: int, what: str, min_steps: int) -> str:
    return f"{metric}: {TOO_SHORT} ({n} {what}, fewer than --min-steps {min_steps}): kept"


def _threshold(spec: dict, cond: Condition, series, q: float, margin: float, min_steps: int = MIN_STEPS) -> str:
    values = np.concatenate(series)
    op = spec["op"]
    if op == "nonfinite" or "nonfinite" in cond.metric:
        return f"{cond.metric}: a count of non-finite values, any is a fault: kept"
    if len(values) < min_steps:
        return _short(cond.metric, len(values), "healthy steps", min_steps)
    if op == "outside":
        lo, hi = float(np.quantile(values, 1 - q)), float(np.quantile(values, q))
        pad = (margin - 1) * ((hi - lo) or abs(hi) or 1e-6)
        band = [round_away(lo - pad, False), round_away(hi + pad, True)]
        inside = int(np.sum((values < band[0]) | (values > band[1])))
        old, spec["band"] = spec["band"], band
        return (
            f"{cond.metric}: {_healthy(values)}, p{100 * (1 - q):g}-p{100 * q:g} [{lo:.4g}, {hi:.4g}] widened by "
            f"{margin:g}x its width -> {band} (was {old}); healthy steps outside: {inside}"
        )
    up = op in (">", ">=")
    base = float(np.quantile(values, q if up else 1 - q))
    label = f"p{100 * (q if up else 1 - q):g}"
    if base == 0:  # e.g. a count that stays 0 when healthy: a margin on 0 has no scale, 0 itself would always fire
        return f"{cond.metric}: {_healthy(values)}, {label} 0 gives no scale for a margin: kept"
    new = round_away(_beyond(base, margin, up), up)
    fires = {">": np.greater, ">=": np.greater_equal, "<": np.less, "<=": np.less_equal}[op]
    beyond = int(np.sum(fires(values, new)))
    old, spec["threshold"] = spec["threshold"], new
    how = f"x {margin:g}" if up else f"/ {margin:g}"
    return (
        f"{cond.metric}: {_healthy(values)}, {label} {base:.4g} {how} -> {new} (was {old}); "
        f"healthy steps beyond: {beyond}"
    )


def _z_scores(values: np.ndarray, s: dict) -> list[float]:
    """The live detector's z at every armed step (``rules.Condition._spike``), signed toward trouble."""
    window, direction = s["window"], s["direction"]
    past: deque = deque(maxlen=window)
    out = []
    for x in values:
        if len(past) >= s["min_history"]:
            center, scale, _ = _center_scale(s["method"], np.asarray(past, dtype=np.float64), window)
            scale = max(scale, 1e-12 * max(abs(center), 1.0))
            z = (x - center) / scale
            out.append(z if direction == "up" else (-z if direction == "down" else abs(z)))
        past.append(float(x))
    return out


def _spike(spec: dict, cond: Condition, series, margin: float, min_steps: int = MIN_STEPS) -> str:
    # The detector's own settings, defaults filled in as the live rule fills them.
    assert cond.spike is not None  # called for spike conditions
    s = {"window": 100, "min_history": 8, "threshold": 6.0, "factor": 10.0, "direction": "up", **cond.spike}
    n = sum(len(v) for v in series)
    if s["method"] == "early_max":
        ratios = [
            float(v[s["window"] :].max() / v[: s["window"]].max())
            for v in series
            if len(v) > s["window"] and v[: s["window"]].max() > 0
        ]
        if not ratios:
            return (
                f"{cond.metric}: early_max never armed ({n} healthy steps, needs more than window={s['window']}): kept"
            )
        after = sum(max(0, len(v) - s["window"]) for v in series)  # the steps compared with the early max
        if after < min_steps:
            return _short(cond.metric, after, f"healthy steps after the early window of {s['window']}", min_steps)
        new = max(1.0, round_away(max(ratios) * margin, True))
        old, spec["spike"]["factor"] = s["factor"], new
        return (
            f"{cond.metric}: {n} healthy steps, largest multiple of the early max {max(ratios):.3g} x {margin:g} "
            f"-> factor {new} (was {old:g})"
        )
    z = [x for v in series for x in _z_scores(v, s)]
    if not z:
        return (
            f"{cond.metric}: {s['method']} never armed ({n} healthy steps; needs min_history={s['min_history']} "
            "per history): kept"
        )
    if len(z) < min_steps:
        return _short(
            cond.metric, len(z), f"scored healthy steps of {n}, after min_history={s['min_history']}", min_steps
        )
    worst = max(z)
    new = max(0.1, round_away(worst * margin, True))
    old, spec["spike"]["threshold"] = s["threshold"], new
    return (
        f"{cond.metric}: {s['method']} z ({s['direction']}) on {len(z)} scored healthy steps, max {worst:.3g} "
        f"x {margin:g} -> threshold {new} (was {old:g}; it fired on {sum(x > old for x in z)} healthy steps)"
    )


def suggest(
    config, histories, quantile: float = 0.99, margin: float = 1.5, min_steps: int = MIN_STEPS
) -> list[Suggestion]:
    out = []
    for given in config.rules:
        rule = copy.deepcopy(given)
        mode = "all" if "all" in rule else ("any" if "any" in rule else None)
        specs = rule[mode] if mode else [rule]
        evidence = []
        for spec in specs:
            cond = Condition(spec)
            series = _series(histories, cond.metric)
            if not sum(len(v) for v in series):
                evidence.append(f"{cond.metric}: not in these histories: kept")
            elif "spike" in spec:
                evidence.append(_spike(spec, cond, series, margin, min_steps))
            else:
                evidence.append(_threshold(spec, cond, series, quantile, margin, min_steps))
        out.append(Suggestion(rule, evidence))
    return out


def to_yaml(suggestions: list[Suggestion], histories, args) -> str:
    plural = "y" if len(histories) == 1 else "ies"
    lines = [
        f"# rl-guard suggest: thresholds from {len(histories)} healthy histor{plural}"
        f" (quantile {args.quantile:g}, margin {args.margin:g}; rules from {args.rules})"
    ]
    lines += [f"#   {h.path}: {h.kind}, {len(h.records)} steps" for h in histories]
    short = sum(TOO_SHORT in e for s in suggestions for e in s.evidence)
    if short:
        lines.append(
            f"# {short} condition(s) {TOO_SHORT}: fewer than {getattr(args, 'min_steps', MIN_STEPS)} healthy "
            "values; they keep their settings (record a longer healthy run, or lower --min-steps knowingly)"
        )
    lines.append("rules:")
    for s in suggestions:
        lines += [f"  # {e}" for e in s.evidence]
        body = yaml.safe_dump([s.rule], sort_keys=False, default_flow_style=None, width=120)
        lines += ["  " + line for line in body.rstrip("\n").split("\n")]
    return "\n".join(lines)
