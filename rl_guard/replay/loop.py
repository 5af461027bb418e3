"""Replay: a recorded history through the live ``Controller``, step by step, as the guard would have seen it.

Everything the controller does live happens here too: built-in and YAML rules, warm-up, patience, cooldown, spike
histories, composites, precedence and the rollback -> checkpoint_and_halt escalation, whose snapshot availability
is computed by ``SnapshotPlan`` from the same schedule the live guard follows. The controller's step is set to each
record's step, so warm-up and cooldown count the history's own steps; patience counts records (equal when every
step was logged, the guard's default ``log_every: 1``). The recorded run went on after whatever the guard would have
done, so evaluation does too: incidents after a would-be halt carry ``"after_halt": true``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from ..control.config import GuardConfig
from ..control.controller import Controller
from ..control.incident import incident_record
from ..control.shadow import SnapshotPlan
from .history import History


@dataclass
class RuleInput:
    """How much of a rule's input the history holds."""

    rule: str
    action: str
    metrics: dict[str, int]  # metric -> records holding it
    sources: dict[str, str]  # metric -> where its values came from ("rl_guard", a trainer key, or "")
    mode: str  # single / all / any

    @property
    def has_input(self) -> bool:
        present = [n > 0 for n in self.metrics.values()]
        return any(present) if self.mode == "any" else all(present)


@dataclass
class Replay:
    history: History
    config: GuardConfig
    incidents: list[dict] = field(default_factory=list)
    inputs: list[RuleInput] = field(default_factory=list)
    halted_at: int | None = None  # first step whose decision would have stopped the run

    def steps_by_rule(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {i.rule: [] for i in self.inputs}
        for rec in self.incidents:
            out.setdefault(rec["rule"], []).append(rec["step"])
        return out


def incident(decision, firing, restored_to, source: str, after_halt: bool) -> dict:
    """The live ``incidents.jsonl`` record (``control/actions.py``), marked as replayed."""
    # the sequences behind a firing are not in a metrics history: the live record and its bundle name them
    record = incident_record(decision, firing, rank=0, checkpoint=None, time=None, restored_to=restored_to)
    record.update(replayed=True, would=firing.action, source=source, after_halt=after_halt)
    return record


def rule_inputs(controller: Controller, history: History) -> list[RuleInput]:
    out = []
    for rule in controller.rules:
        out.append(
            RuleInput(
                rule.name,
                rule.action,
                {m: history.count(m) for m in rule.metrics},
                {m: history.origin.get(m, "") for m in rule.metrics},
                rule.mode,
            )
        )
    return out


def replay(history: History, config: GuardConfig) -> Replay:
    """Feed every record of ``history`` through a fresh controller built from ``config`` (shadow or not, the replay
    reports the actions of ``mode: enforce``)."""
    config = dataclasses.replace(config, mode="enforce")
    controller = Controller(config)
    plan = SnapshotPlan(config, controller.rules)
    result = Replay(history, config, inputs=rule_inputs(controller, history))
    with warnings.catch_warnings():
        # The live guard warns once per watched metric that never arrives; here the input table says it.
        warnings.filterwarnings("ignore", message="rl_guard: rule .* watches", category=RuntimeWarning)
        for rec in history.records:
            step = rec["step"]
            controller.step = step
            decision = controller.decide(
                {k: v for k, v in rec.items() if k != "step"}, can_rollback=plan.can_rollback(step)
            )
            restored = plan.rollback(step) if decision.rollback else None
            for firing in decision.firings:
                result.incidents.append(
                    incident(decision, firing, restored, str(history.path), result.halted_at is not None)
                )
            if decision.stop and result.halted_at is None:
                result.halted_at = step
            plan.after_step(decision.action, step)
            controller.step_done(decision)
    return result
