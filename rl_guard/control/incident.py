"""The incident record, one per firing: what ``incidents.jsonl`` holds live and what ``rl-guard replay`` writes."""

from __future__ import annotations

CULPRIT_KEYS = ("prompt", "prompt_key", "reward", "family", "value", "nonfinite")


def incident_record(
    decision,
    firing,
    *,
    rank: int,
    checkpoint: str | None,
    time: float | None,
    restored_to: int | None = None,
    culprits: list[dict] | None = None,
    bundle: str | None = None,
    quarantined: list[dict] | None = None,
) -> dict:
    v = firing.verdict
    return {
        "step": decision.step,
        "rule": firing.rule.name,
        "metric": v.metric,
        "value": v.value,
        "op": v.op,
        "threshold": v.threshold,
        "action": firing.action,
        "severity": firing.rule.severity,
        "message": firing.message,
        "detail": v.detail,
        "rank": rank,
        "window": firing.window,
        "checkpoint": checkpoint,
        "time": time,
        "escalated_from": decision.escalated_from,
        "decision": decision.action,  # the step's action after precedence (``action`` is this rule's)
        "restored_to_step": restored_to,  # rollback: the state from before this guard step was restored
        "escalation_reason": decision.escalation_reason,
        "culprits": [{k: c[k] for k in CULPRIT_KEYS if k in c} for c in culprits or []],
        "bundle": bundle,  # run_dir/incidents/<step>/, where a rule acted
        "quarantined": [q["prompt"] for q in quarantined or []],
    }
