"""What one incident record says, in words: shared by the plot labels and report.md's incident table.

Three kinds of record reach a report:

- live: the guard acted (``action``); a rollback carries ``restored_to_step``, a checkpoint ``checkpoint``;
- shadow (``"mode": "shadow"``): the run was left alone; ``action`` is ``warn`` and ``would`` /
  ``would_restore_to_step`` say what the guard would have done;
- replayed (``"replayed": true``, written by ``rl-guard replay``): what the rules would have done on a recorded
  history; ``after_halt`` marks the ones after a step that would have stopped the run.
"""

from __future__ import annotations

import math

from .data import PREFIX


def kind(rec: dict) -> str:
    """ "replayed", "shadow" or "live"."""
    if rec.get("replayed"):
        return "replayed"
    if rec.get("mode") == "shadow":
        return "shadow"
    return "live"


def step_of(rec: dict) -> int | None:
    s = rec.get("step")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        return None
    return int(s)


def short_metric(metric) -> str:
    metric = str(metric or "")
    return metric[len(PREFIX) :] if metric.startswith(PREFIX) else metric


def number(v) -> str:
    """94.73684 -> "94.74", 1e-06 -> "1e-06", "nan" stays "nan", None -> "-"."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(number(x) for x in v) + "]"
    return str(v)


def condition(rec: dict) -> str:
    """The rule's test as the record states it: "> 10", ">= 0.0123" (a spike limit), "is non-finite"."""
    op, threshold = rec.get("op"), rec.get("threshold")
    if not op and threshold in (None, ""):
        return "-"
    return f"{op or ''} {number(threshold) if threshold not in (None, '') else ''}".strip()


def action(rec: dict) -> str:
    """The action in words: "rollback", "rollback (replayed)", "would rollback (shadow: warned only)",
    "checkpoint_and_halt (escalated from rollback)"."""
    act = str(rec.get("action"))
    if kind(rec) == "shadow":
        would = rec.get("would") or act
        return "warn (shadow)" if would == "warn" else f"would {would} (shadow: warned only)"
    notes = []
    if rec.get("escalated_from") and rec["escalated_from"] != act:
        notes.append(f"escalated from {rec['escalated_from']}")
    if kind(rec) == "replayed":
        notes.append("replayed")
        if rec.get("after_halt"):
            notes.append("after the would-be halt")
    return f"{act} ({'; '.join(notes)})" if notes else act


def effective_action(rec: dict) -> str:
    """The action the record stands for: the one taken, or in shadow mode the one the guard would have taken."""
    if kind(rec) == "shadow" and rec.get("would"):
        return str(rec["would"])
    return str(rec.get("action"))


def short_action(rec: dict) -> str:
    """For plot labels: "rollback", "would rollback"."""
    act = effective_action(rec)
    return f"would {act}" if kind(rec) == "shadow" and act != "warn" else act


def restored(rec: dict) -> str | None:
    """ "restored to step 9" for a rollback; "would restore to step 9" for a shadow-mode or replayed one; else None.
    The step is the one whose state was restored: the run went on from the weights it had before that step."""
    if rec.get("restored_to_step") is not None:
        verb = "would restore" if kind(rec) == "replayed" else "restored"
        return f"{verb} to step {rec['restored_to_step']}"
    if rec.get("would_restore_to_step") is not None:
        return f"would restore to step {rec['would_restore_to_step']}"
    return None


def outcome(rec: dict) -> str:
    """report.md's last column: the restored step and/or the checkpoint written, "-" if neither."""
    parts = [p for p in (restored(rec),) if p]
    if rec.get("checkpoint"):
        parts.append(f"checkpoint `{rec['checkpoint']}`")
    return "; ".join(parts) or "-"
