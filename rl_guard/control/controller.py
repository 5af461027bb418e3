"""The controller evaluates every rule every step and returns a ``Decision`` (flags); adapters act on it.

Ladder (as Lightning's EarlyStopping): non-finite checks first (built-ins and any non-finite value bypass warmup
and patience), then thresholds, patience / consecutive-step rules, spike detectors and composites. Every rule is
evaluated each step so all reasons are logged even after one fires.

Precedence when several rules fire: rollback > checkpoint_and_halt > early_stop > skip_step > warn. Every action
but ``warn`` drops the current update (the numbers that fired came from it). ``rollback`` escalates to
``checkpoint_and_halt`` when no healthy snapshot exists or ``max_rollbacks`` is spent.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from .action_names import Action
from .config import ACTIONS as PRECEDENCE  # listed in precedence order
from .config import GuardConfig
from .rules import History, Rule, Verdict, builtin_rules

MISSING_PATIENCE = 20  # steps a watched metric may be absent before the guard says so


@dataclass
class Firing:
    rule: Rule
    verdict: Verdict
    action: Action
    message: str
    window: dict = field(default_factory=dict)  # metric -> values of the steps before the trigger


@dataclass
class Decision:
    """Flags for the adapter. ``apply_step`` is False whenever the update must not reach the weights."""

    step: int
    action: Action | None = None
    firings: list[Firing] = field(default_factory=list)
    escalated_from: Action | None = None
    would: Action | None = None  # mode shadow: the action it would have taken (``action`` stays None: run untouched)
    escalation_reason: str | None = None  # set where the escalation's cause is not in the rule's message

    @property
    def skip_step(self) -> bool:
        return self.action in ("skip_step", "early_stop", "checkpoint_and_halt", "rollback")

    @property
    def apply_step(self) -> bool:
        return not self.skip_step

    @property
    def stop(self) -> bool:
        return self.action in ("early_stop", "checkpoint_and_halt")

    @property
    def save(self) -> bool:
        return self.stop

    @property
    def rollback(self) -> bool:
        return self.action == "rollback"

    @property
    def messages(self) -> list[str]:
        return [f.message for f in self.firings]


def message(rule: Rule, v: Verdict, step: int, rank: int, action: str) -> str:
    """The one template ``[rule <name>] <metric> = <value> <op> <threshold> at step <n> (rank <r>) -> <action>``,
    e.g. ``[rule kl_spike] rl_guard/kl_ref/k3_mean = 0.31 > 0.2 at step 812 (rank 3) -> checkpoint_and_halt``
    (composites join their conditions with ``and`` / ``or``; a non-finite value reads ``= nan is non-finite``)."""
    return f"[rule {rule.name}] {v.reason} at step {step} (rank {rank}) -> {action}"


class Controller:
    def __init__(self, config: GuardConfig, rank: int = 0):
        self.config, self.rank = config, rank
        self.rules = builtin_rules(config.builtin_rules) + [Rule(r) for r in config.rules]
        windows = [c.spike["window"] for r in self.rules for c in r.conditions if c.spike]
        self.history = History(maxlen=max(windows + [64]), early=max(windows + [1]))
        self.step = 0
        self.consecutive = {r.name: 0 for r in self.rules}
        self.last_fired = {r.name: -(10**9) for r in self.rules}
        self.rollbacks = 0
        self.would_rollbacks = 0  # mode shadow: the rollbacks the enforced run would have made (its budget)
        self.skipped_steps = 0
        self.dropped_streak = 0  # consecutive steps whose update was dropped (skip, rollback), any cause
        self.missing_warned: set[str] = set()
        self.absent_for: dict[str, int] = {}
        # Only metrics some rule watches need a history (spike windows, incident windows).
        self.watched = tuple(dict.fromkeys(m for r in self.rules for m in r.metrics))

    def decide(self, metrics: dict[str, float], can_rollback: bool = True) -> Decision:
        """Evaluate all rules on this step's metrics; update history and counters; return the decision."""
        decision = Decision(step=self.step)
        self._count_missing(metrics)
        history, consecutive = self.history, self.consecutive
        for rule in self.rules:
            # The cheap test first: a verdict (and its reason) is only built for a rule that fires.
            if not rule.fires(metrics, history):
                consecutive[rule.name] = 0
                continue
            v = rule.evaluate(metrics, history)
            consecutive[rule.name] += 1
            if not self._armed(rule, v):
                continue
            self.last_fired[rule.name] = self.step
            window = {m: history.recent(m, 32) for m in rule.metrics}
            decision.firings.append(Firing(rule, v, rule.action, "", window))
        decision.action = max((f.action for f in decision.firings), key=PRECEDENCE.index, default=None)
        if decision.action == "rollback" and (
            not can_rollback or self.rollbacks >= self.config.rollback["max_rollbacks"]
        ):
            decision.escalated_from, decision.action = "rollback", "checkpoint_and_halt"
            limit, spent = self.config.rollback["max_rollbacks"], max(self.rollbacks, self.would_rollbacks)
            why = (
                f" (rollback budget spent: {spent} of max_rollbacks={limit})"
                if spent >= limit
                else " (no trusted healthy snapshot to restore yet)"
            )
        else:
            why = ""
        persistent = self._persistent_fault(decision)
        shadow = self.config.mode == "shadow"
        for f in decision.firings:
            if decision.action is not None and decision.escalated_from and f.action == decision.escalated_from:
                f.action = decision.action
            said = f"would {f.action} (shadow mode)" if shadow else f.action
            f.message = message(f.rule, f.verdict, self.step, self.rank, said) + persistent
            if why and f.rule.action == "rollback":  # the rollback rules say why they halt instead
                f.message += why
        if shadow:  # only say what it would do; every flag the loop reads stays neutral
            decision.would, decision.action = decision.action, None
        # Finite values only (History drops the rest). A value that fired still enters the history: a genuine
        # regime change must become the new normal for the spike detectors, or it would be refused forever.
        self.history.push({m: metrics[m] for m in self.watched if m in metrics})
        return decision

    def _persistent_fault(self, decision: Decision) -> str:
        """``max_consecutive_skips`` = N: the N-th consecutive dropped update (any cause) checkpoints and halts, so a
        fault that never clears ends the run with a checkpoint instead of skipping every step to max_steps."""
        limit = self.config.max_consecutive_skips
        if not limit or decision.action not in ("skip_step", "rollback") or self.dropped_streak + 1 < limit:
            return ""
        decision.escalated_from, decision.action = decision.action, "checkpoint_and_halt"
        return f" ({self.dropped_streak + 1} consecutive dropped updates, max_consecutive_skips={limit})"

    def _count_missing(self, metrics: dict) -> None:
        """Once per metric: a rule whose metric is never reported can never fire, which must not stay silent.
        Some metrics arrive only on generation steps, so the warning waits for ``MISSING_PATIENCE`` steps."""
        absent_for = self.absent_for
        for m in self.watched:
            if m in metrics:
                absent_for[m] = 0
                continue
            n = absent_for[m] = absent_for.get(m, 0) + 1
            if n >= MISSING_PATIENCE and m not in self.missing_warned:
                self.missing_warned.add(m)
                rule = next(r for r in self.rules if m in r.metrics)
                warnings.warn(
                    f"rl_guard: rule {rule.name!r} watches {m}, which was not reported at step {self.step}; "
                    "it cannot fire while the metric is absent (is the input that produces it passed?)",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def _armed(self, rule: Rule, v: Verdict) -> bool:
        if rule.bypasses_modifiers(v):
            return True
        if self.step < rule.warmup_steps or self.consecutive[rule.name] < rule.patience:
            return False
        return self.step - self.last_fired[rule.name] > rule.cooldown_steps

    def step_done(self, decision: Decision) -> None:
        """Count the step (applied, skipped or rolled back) and advance the guard's step counter."""
        if decision.skip_step:
            self.skipped_steps += 1
        would_drop = decision.would not in (None, "warn")  # shadow: the streak the enforced run would have had
        self.dropped_streak = self.dropped_streak + 1 if decision.skip_step or would_drop else 0
        if decision.rollback:
            self.rollbacks += 1
        if decision.would == "rollback":
            self.would_rollbacks += 1
        self.step += 1

    def counters(self, decision: Decision | None = None) -> dict[str, float]:
        """Cumulative counters, including ``decision`` (this step's, not yet counted by ``step_done``)."""
        skipped = self.skipped_steps + int(decision is not None and decision.skip_step)
        rollbacks = self.rollbacks + int(decision is not None and decision.rollback)
        return {"rl_guard/guard/skipped_steps": float(skipped), "rl_guard/guard/rollbacks": float(rollbacks)}

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "consecutive": dict(self.consecutive),
            "last_fired": dict(self.last_fired),
            "rollbacks": self.rollbacks,
            "skipped_steps": self.skipped_steps,
            "dropped_streak": self.dropped_streak,
            "history": self.history.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.rollbacks, self.skipped_steps = state["step"], state["rollbacks"], state["skipped_steps"]
        self.dropped_streak = state.get("dropped_streak", 0)
        self.consecutive.update(state["consecutive"])
        self.last_fired.update(state["last_fired"])
        self.history.load_state_dict(state["history"])
