"""Rules are pure: ``(step metrics, history) -> Verdict(fired, reason)``.

A condition is a threshold (``>``, ``>=``, ``<``, ``<=``, ``outside`` a band, ``nonfinite``) or a spike detector
relative to the run's own history: rolling median + MAD (robust z = (x - median) / (1.4826 MAD)), EMA z-score
(EMA mean and variance over the window, alpha = 2 / (window + 1)), or ``early_max`` (x >= factor * the max of the
first ``window`` values, as Megatron flags grad-norm spikes at 10x the early max). A non-finite value fires every
condition: a NaN can never be "within" a threshold. Composite rules combine conditions with ``all`` / ``any``.
Warmup, patience, cooldown and actions are applied by the controller.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    fired: bool
    reason: str = ""
    metric: str = ""
    value: float = math.nan
    op: str = ""
    threshold: float | str = ""
    missing: bool = False


class History:
    """Past values per metric (most recent last) and the first values seen (for ``early_max``)."""

    def __init__(self, maxlen: int = 1024, early: int = 1024):
        self.maxlen, self.early = maxlen, early
        self.recent: dict[str, deque] = {}
        self.first: dict[str, list] = {}

    def values(self, metric: str) -> list[float]:
        return list(self.recent.get(metric, ()))

    def push(self, metrics: dict[str, float]) -> None:
        for name, v in metrics.items():
            self.recent.setdefault(name, deque(maxlen=self.maxlen)).append(v)
            first = self.first.setdefault(name, [])
            if len(first) < self.early and math.isfinite(v):
                first.append(v)

    def state_dict(self) -> dict:
        return {"recent": {k: list(v) for k, v in self.recent.items()}, "first": dict(self.first)}

    def load_state_dict(self, state: dict) -> None:
        self.recent = {k: deque(v, maxlen=self.maxlen) for k, v in state["recent"].items()}
        self.first = {k: list(v) for k, v in state["first"].items()}


def _fmt(x: float) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


class Condition:
    """One metric test, built from a validated YAML mapping."""

    def __init__(self, spec: dict):
        self.metric = spec["metric"] if spec["metric"].startswith("rl_guard/") else "rl_guard/" + spec["metric"]
        self.op = spec.get("op")
        self.threshold = spec.get("threshold")
        self.band = spec.get("band")
        self.spike = spec.get("spike")

    def evaluate(self, metrics: dict[str, float], history: History) -> Verdict:
        if self.metric not in metrics:
            return Verdict(False, f"{self.metric} not reported this step", self.metric, missing=True)
        x = float(metrics[self.metric])
        if not math.isfinite(x):
            return Verdict(True, f"{self.metric} = {x} is non-finite", self.metric, x, "nonfinite", "finite")
        if self.op == "nonfinite":
            return Verdict(False, "", self.metric, x)
        if self.spike is not None:
            return self._spike(x, history)
        return self._threshold(x)

    def _threshold(self, x: float) -> Verdict:
        if self.op == "outside":
            lo, hi = self.band
            fired = x < lo or x > hi
            return Verdict(fired, f"{self.metric} = {_fmt(x)} outside [{lo}, {hi}]", self.metric, x, "outside", f"[{lo}, {hi}]")
        t = float(self.threshold)
        fired = {">": x > t, ">=": x >= t, "<": x < t, "<=": x <= t}[self.op]
        return Verdict(fired, f"{self.metric} = {_fmt(x)} {self.op} {_fmt(t)}", self.metric, x, self.op, t)

    def _spike(self, x: float, history: History) -> Verdict:
        s = self.spike
        method, window = s["method"], s.get("window", 100)
        direction, min_history = s.get("direction", "up"), s.get("min_history", 8)
        past = [v for v in history.values(self.metric)[-window:] if math.isfinite(v)]
        if method == "early_max":
            early = history.first.get(self.metric, [])[:window]
            if len(early) < min(window, min_history) or len(history.values(self.metric)) < window:
                return Verdict(False, "", self.metric, x)
            limit = s.get("factor", 10.0) * max(early)
            return Verdict(x >= limit, f"{self.metric} = {_fmt(x)} >= {s.get('factor', 10.0)} x early max "
                           f"{_fmt(max(early))}", self.metric, x, ">=", limit)
        if len(past) < min_history:
            return Verdict(False, "", self.metric, x)
        arr = np.asarray(past, dtype=np.float64)
        if method == "mad":
            center = float(np.median(arr))
            scale = 1.4826 * float(np.median(np.abs(arr - center)))
            label = "robust z (median/MAD)"
        else:
            alpha = 2.0 / (window + 1.0)
            center, var = arr[0], 0.0
            for v in arr[1:]:
                d = v - center
                center += alpha * d
                var = (1 - alpha) * (var + alpha * d * d)
            scale = math.sqrt(var)
            label = "EMA z"
        scale = max(scale, 1e-12 * max(abs(center), 1.0))
        z = (x - center) / scale
        k = float(s.get("threshold", 6.0))
        fired = z > k if direction == "up" else (z < -k if direction == "down" else abs(z) > k)
        return Verdict(fired, f"{self.metric} = {_fmt(x)}, {label} = {z:.3g} vs {k:g} over {len(past)} steps "
                       f"({direction})", self.metric, x, f"{label} {direction}", k)


class Rule:
    """A named condition (or ``all``/``any`` of several) with an action and modifiers."""

    def __init__(self, spec: dict, builtin: bool = False):
        self.name = spec["name"]
        self.action = spec["action"]
        self.severity = spec.get("severity") or {"warn": "warning", "rollback": "error", "skip_step": "error"}.get(
            self.action, "critical")
        self.warmup_steps = spec.get("warmup_steps", 0)
        self.patience = spec.get("patience", 1)
        self.cooldown_steps = spec.get("cooldown_steps", 0)
        self.builtin = builtin
        self.mode = "all" if "all" in spec else ("any" if "any" in spec else "single")
        subs = spec.get(self.mode, [spec]) if self.mode != "single" else [spec]
        self.conditions = [Condition(c) for c in subs]

    @property
    def metrics(self) -> list[str]:
        return [c.metric for c in self.conditions]

    def evaluate(self, metrics: dict[str, float], history: History) -> Verdict:
        verdicts = [c.evaluate(metrics, history) for c in self.conditions]
        if self.mode == "single":
            return verdicts[0]
        fired = [v for v in verdicts if v.fired]
        ok = all(v.fired for v in verdicts) if self.mode == "all" else bool(fired)
        lead = fired[0] if fired else verdicts[0]
        reason = f" {'and' if self.mode == 'all' else 'or'} ".join(v.reason for v in (verdicts if self.mode == "all" else fired) if v.reason)
        return Verdict(ok, reason, lead.metric, lead.value, lead.op, lead.threshold,
                       missing=all(v.missing for v in verdicts))

    def bypasses_modifiers(self, verdict: Verdict) -> bool:
        """Built-in non-finite rules, and any non-finite value, skip warmup and patience (the ladder's first rung)."""
        return self.builtin or (verdict.fired and not math.isfinite(verdict.value))


def builtin_rules(config_builtins: dict[str, dict | None]) -> list[Rule]:
    """The always-on non-finite checks (unless disabled in YAML)."""
    metric = {"nonfinite_loss": "rl_guard/loss/nonfinite", "nonfinite_grad": "rl_guard/grad/nonfinite",
              "nonfinite_logprobs": "rl_guard/input/logprobs/nonfinite"}
    rules = []
    for name, spec in config_builtins.items():
        if spec is not None:
            rules.append(Rule({"name": name, "metric": metric[name], "op": ">", "threshold": 0,
                               "action": spec["action"], "severity": "critical"}, builtin=True))
    return rules
