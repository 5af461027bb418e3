"""Rules are pure: ``(step metrics, history) -> Verdict(fired, reason)``.

A condition is a threshold (``>``, ``>=``, ``<``, ``<=``, ``outside`` a band, ``nonfinite``) or a spike detector
relative to the run's own history (the last ``window`` finite values, the current one excluded):

- ``mad``: robust z = (x - median) / (1.4826 MAD); when MAD = 0 (over half the window identical) the scale falls
  back to 1.2533 x mean absolute deviation from the median (Iglewicz & Hoaglin's modified z-score).
- ``ema_z``: z = (x - m) / s with the exponentially weighted mean m and variance s^2 over the window,
  alpha = 2 / (window + 1), seeded with the oldest value (m += alpha d; s^2 = (1 - alpha)(s^2 + alpha d^2)).
- ``early_max``: x >= factor x the max of the first ``window`` values of the run (Megatron flags grad-norm spikes
  at 10x the early max); armed once ``window`` values are known.

``direction`` up fires on z > k, down on z < -k, both on |z| > k. Every reason reads
``<metric> = <value> <op> <threshold>`` with the threshold in the metric's own units (a spike reports the limit
center +- k scale; the z-score and window go to ``detail``). A non-finite value fires every condition ("nan can
never be within a threshold") and reads ``<metric> = nan is non-finite``. Composite rules combine conditions with
``all`` / ``any``. Warmup, patience, cooldown and actions are applied by the controller.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .action_names import Action
from .config import RULE_DEFAULTS, SEVERITY_BY_ACTION, SPIKE_DEFAULTS
from .rule_history import History


@dataclass(frozen=True, eq=False, repr=False)
class Verdict:
    """One condition's (or rule's) outcome. ``reason`` reads ``<metric> = <value> <op> <threshold>`` and ``detail``
    says how a spike limit was found; both are built only when read (every rule is evaluated every step, and a
    verdict that does not fire is rarely read)."""

    fired: bool
    metric: str = ""
    value: float = math.nan
    op: str = ""
    threshold: float | str = ""
    missing: bool = False
    nonfinite: bool = False  # fired because a value was NaN/inf (bypasses warmup and patience)
    # -> (reason, or None for the template; detail)
    text: Callable[[], tuple[str | None, str]] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (
            f"Verdict(fired={self.fired}, reason={self.reason!r}, metric={self.metric!r}, value={self.value!r}, "
            f"op={self.op!r}, threshold={self.threshold!r}, missing={self.missing}, detail={self.detail!r}, "
            f"nonfinite={self.nonfinite})"
        )

    @property
    def reason(self) -> str:
        custom = self.text()[0] if self.text is not None else None
        if custom is not None:
            return custom
        if self.missing:
            return f"{self.metric} not reported this step"
        return f"{self.metric} = {_fmt(self.value)} {self.op} {_fmt(self.threshold)}" if self.op else ""

    @property
    def detail(self) -> str:
        return self.text()[1] if self.text is not None else ""

    def _key(self) -> tuple:
        return (
            self.fired,
            self.metric,
            self.value,
            self.op,
            self.threshold,
            self.missing,
            self.nonfinite,
            self.reason,
            self.detail,
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, Verdict) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def verdict(fired: bool, metric: str, x: float, op: str, threshold, detail: Callable[[], str] | None = None) -> Verdict:
    """A verdict whose reason follows the one template ``<metric> = <value> <op> <threshold>``; ``detail`` is
    called only if the detail is read."""
    return Verdict(fired, metric, x, op, threshold, text=None if detail is None else (lambda: (None, detail())))


_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


class Condition:
    """One metric test, built from a validated YAML mapping."""

    def __init__(self, spec: dict):
        self.metric = spec["metric"] if spec["metric"].startswith("rl_guard/") else "rl_guard/" + spec["metric"]
        # Validated YAML (config.py): a comparison op comes with a threshold, "outside" with a band [lo, hi]; a spike
        # condition has no op ("").
        self.op: str = spec.get("op") or ""
        self.threshold: Any = spec.get("threshold")
        self.band: Any = spec.get("band")
        self._band_text = f"[{self.band[0]}, {self.band[1]}]" if self.band else ""
        self._compare: Any = _COMPARE.get(self.op)
        spike = spec.get("spike")
        self.spike: dict[str, Any] | None = {**SPIKE_DEFAULTS, **spike} if spike is not None else None
        # ``fires`` runs every step for every condition: its test is chosen once here.
        if self.spike is not None:
            self._fires = self._spike_fires
        elif self.op == "nonfinite":
            self._fires = _never
        elif self.op == "outside":
            lo, hi = spec["band"]
            self._fires = lambda x, history: x < lo or x > hi
        else:
            compare, t = _COMPARE[self.op], float(spec["threshold"])
            self._fires = lambda x, history: compare(x, t)

    def fires(self, metrics: dict[str, float], history: History) -> bool:
        """``evaluate(metrics, history).fired``, without building the verdict (few conditions fire in a step)."""
        x = metrics.get(self.metric, _ABSENT)
        if x is _ABSENT:
            return False
        x = float(x)
        return not math.isfinite(x) or self._fires(x, history)

    def evaluate(self, metrics: dict[str, float], history: History) -> Verdict:
        if self.metric not in metrics:
            return Verdict(False, self.metric, missing=True)
        x = float(metrics[self.metric])
        if not math.isfinite(x):
            return Verdict(True, self.metric, x, "is", "non-finite", nonfinite=True)
        if self.op == "nonfinite":
            return verdict(False, self.metric, x, "is", "non-finite")
        if self.spike is not None:
            return self._spike(x, history)
        if self.op == "outside":
            lo, hi = self.band
            return verdict(x < lo or x > hi, self.metric, x, "outside", self._band_text)
        t = float(self.threshold)
        return verdict(self._compare(x, t), self.metric, x, self.op, t)

    def _early_max(self, history: History) -> float | None:
        """The max of the run's first ``window`` values; None until they are known or when it is not positive
        (a multiple of a non-positive max means nothing)."""
        assert self.spike is not None  # spike conditions only, as for the methods below
        window = self.spike["window"]
        first = history.first.get(self.metric)
        if first is None or len(first) < window:
            return None
        top = max(first[:window])
        return top if top > 0 else None

    def _window_stats(self, history: History) -> tuple[float, float, str, int] | None:
        """(center, scale, label, values) of the spike window; None while it holds fewer than ``min_history``."""
        s = self.spike
        assert s is not None
        mad = s["method"] == "mad"  # the median and MAD read the window sorted, kept so by the history
        past = (history.sorted_recent if mad else history.recent)(self.metric, s["window"])
        if len(past) < s["min_history"]:
            return None
        if mad:
            center, scale, label = _mad(past, lambda: history.recent(self.metric, s["window"]))
        else:
            center, scale, label = _center_scale(s["method"], past, s["window"])
        scale = max(scale, 1e-12 * max(abs(center), 1.0))  # a constant history: any change is a spike
        return center, scale, label, len(past)

    def _spike_fires(self, x: float, history: History) -> bool:
        s = self.spike
        assert s is not None
        if s["method"] == "early_max":
            top = self._early_max(history)
            return top is not None and x >= float(s["factor"]) * top
        stats = self._window_stats(history)
        if stats is None:
            return False
        z = (x - stats[0]) / stats[1]
        k = float(s["threshold"])
        direction = s["direction"]
        return z > k if direction == "up" else (z < -k if direction == "down" else abs(z) > k)

    def _spike(self, x: float, history: History) -> Verdict:
        s = self.spike
        assert s is not None
        method, window = s["method"], s["window"]
        if method == "early_max":
            top = self._early_max(history)
            if top is None:
                return Verdict(False, self.metric, x)
            factor = float(s["factor"])
            limit = factor * top
            return verdict(
                x >= limit,
                self.metric,
                x,
                ">=",
                limit,
                lambda: f"{factor:g} x early max {_fmt(top)} (first {window} steps)",
            )
        stats = self._window_stats(history)
        if stats is None:
            return Verdict(False, self.metric, x)
        center, scale, label, n = stats
        z = (x - center) / scale
        k = float(s["threshold"])
        lo, hi = center - k * scale, center + k * scale

        def detail() -> str:
            return f"{label} = {z:.3g} vs {k:g} (center {_fmt(center)}, scale {_fmt(scale)}, {n} steps)"

        direction = s["direction"]
        if direction == "up":
            return verdict(z > k, self.metric, x, ">", hi, detail)
        if direction == "down":
            return verdict(z < -k, self.metric, x, "<", lo, detail)
        return verdict(abs(z) > k, self.metric, x, "outside", f"[{_fmt(lo)}, {_fmt(hi)}]", detail)


_ABSENT: Any = object()  # Any: it stands for a missing value in ``metrics.get``


def _never(x: float, history: History) -> bool:
    return False


def _mad(s: list[float], in_order) -> tuple[float, float, str]:
    """Median and scaled MAD of the window from its values sorted (``s``); ``in_order()`` gives them oldest first
    for the fallback when the MAD is 0. The deviations from the median grow outward from it on either side of the
    sorted values: two sorted runs, whose middle one(s) a binary search finds without listing them."""
    n = len(s)
    m = n // 2
    center = s[m] if n % 2 else (s[m - 1] + s[m]) / 2.0
    before, mad = _middle_deviations(s, center, m)
    if n % 2 == 0:
        mad = (before + mad) / 2.0
    if mad > 0:
        return center, 1.4826 * mad, "robust z"
    # np.mean for the fallback: its pairwise summation rounds differently from a Python sum, and depends on the order
    return center, 1.2533 * float(np.mean([abs(v - center) for v in in_order()])), "robust z"


def _middle_deviations(s: list[float], center: float, k: int) -> tuple[float, float]:
    """The ``k-1``-th and ``k``-th smallest (from 0) of ``abs(v - center)`` over sorted ``s``. Below ``mid`` the
    deviations grow leftward (run a: ``a[i] = center - s[mid - 1 - i]``), from ``mid`` rightward (run b): the
    ``k + 1`` smallest are the first ``i`` of a and ``k + 1 - i`` of b for the split where neither run's last taken
    value exceeds the other's next one (a binary search over ``i``; out of range reads -inf before a run, +inf
    after it)."""
    mid = bisect.bisect_left(s, center)
    n_a, n_b = mid, len(s) - mid
    lo, hi = max(0, k + 1 - n_b), min(k + 1, n_a)
    while True:
        i = (lo + hi) // 2
        j = k + 1 - i
        a_last = abs(s[mid - i] - center) if i > 0 else -math.inf
        b_last = abs(s[mid + j - 1] - center) if j > 0 else -math.inf
        if i < n_a and b_last > abs(s[mid - 1 - i] - center):
            lo = i + 1
        elif j < n_b and a_last > abs(s[mid + j] - center):
            hi = i - 1
        elif a_last >= b_last:  # the k-th is a's last taken value; the one before it ends either run
            return max(abs(s[mid - i + 1] - center) if i > 1 else -math.inf, b_last), a_last
        else:
            return max(a_last, abs(s[mid + j - 2] - center) if j > 1 else -math.inf), b_last


def _center_scale(method: str, values, window: int) -> tuple[float, float, str]:
    """``values``: the window, oldest first (a list of floats, or an array). Python floats throughout: on a window of
    a few dozen values numpy's per-call cost outweighs its speed; each operation is the one numpy did, in the same
    IEEE double arithmetic, so the results are the same."""
    values = values.tolist() if isinstance(values, np.ndarray) else values
    if method == "mad":
        return _mad(sorted(values), lambda: values)
    alpha = 2.0 / (window + 1.0)
    center, var = float(values[0]), 0.0
    for v in values[1:]:
        d = v - center
        center += alpha * d
        var = (1 - alpha) * (var + alpha * d * d)
    return center, math.sqrt(var), "EMA z"


class Rule:
    """A named condition (or ``all``/``any`` of several) with an action and modifiers."""

    def __init__(self, spec: dict, builtin: bool = False):
        spec = {**RULE_DEFAULTS, **spec}
        self.name = spec["name"]
        self.action: Action = spec["action"]
        self.severity = spec["severity"] or SEVERITY_BY_ACTION[self.action]
        self.warmup_steps = spec["warmup_steps"]
        self.patience = spec["patience"]
        self.cooldown_steps = spec["cooldown_steps"]
        self.builtin = builtin
        self.mode = "all" if "all" in spec else ("any" if "any" in spec else "single")
        subs = spec[self.mode] if self.mode != "single" else [spec]
        self.conditions = [Condition(c) for c in subs]
        self.metrics: list[str] = [c.metric for c in self.conditions]

    def fires(self, metrics: dict[str, float], history: History) -> bool:
        """``evaluate(metrics, history).fired`` without building verdicts."""
        if self.mode == "single":
            return self.conditions[0].fires(metrics, history)
        if self.mode == "all":
            return all(c.fires(metrics, history) for c in self.conditions)
        return any(c.fires(metrics, history) for c in self.conditions)

    def evaluate(self, metrics: dict[str, float], history: History) -> Verdict:
        if self.mode == "single":
            return self.conditions[0].evaluate(metrics, history)
        verdicts = [c.evaluate(metrics, history) for c in self.conditions]
        fired = [v for v in verdicts if v.fired]
        ok = len(fired) == len(verdicts) if self.mode == "all" else bool(fired)
        lead = fired[0] if fired else verdicts[0]
        shown = verdicts if self.mode == "all" else fired
        joiner = " and " if self.mode == "all" else " or "

        def text() -> tuple[str, str]:
            reasons = [v.reason for v in shown]
            details = [v.detail for v in shown]
            return joiner.join(r for r in reasons if r), "; ".join(d for d in details if d)

        return Verdict(
            ok,
            lead.metric,
            lead.value,
            lead.op,
            lead.threshold,
            missing=all(v.missing for v in verdicts),
            nonfinite=ok and any(v.nonfinite for v in fired),
            text=text,
        )

    def bypasses_modifiers(self, verdict: Verdict) -> bool:
        """Built-in non-finite rules, and any non-finite value, skip warmup and patience (the ladder's first rung)."""
        return self.builtin or (verdict.fired and verdict.nonfinite)


def builtin_rules(config_builtins: dict[str, dict | None]) -> list[Rule]:
    """The always-on non-finite checks (unless disabled in YAML)."""
    metric = {
        "nonfinite_loss": "rl_guard/loss/nonfinite",
        "nonfinite_grad": "rl_guard/grad/nonfinite",
        "nonfinite_logprobs": "rl_guard/input/logprobs/nonfinite",
    }
    rules = []
    for name, spec in config_builtins.items():
        if spec is not None:
            rules.append(
                Rule(
                    {
                        "name": name,
                        "metric": metric[name],
                        "op": ">",
                        "threshold": 0,
                        "action": spec["action"],
                        "severity": "critical",
                    },
                    builtin=True,
                )
            )
    return rules
