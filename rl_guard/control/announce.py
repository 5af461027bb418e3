"""What the guard did, said where the user looks: one console line per action, and a summary at the end.

Every action (skip_step, rollback, early_stop, checkpoint_and_halt) and the first firing of each warn rule print one
line through the ``rl_guard`` logger, whatever sinks the YAML lists: the rule, the metric, its value against the
threshold, the action, and what it did. Later firings of a warn rule go to the incident records only. The logger
writes to stderr unless the application configured handlers for it; while a tqdm progress bar is on screen the line
goes through ``tqdm.write``, so it is never glued to the bar.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter

logger = logging.getLogger("rl_guard")

DROPPED = "the update was dropped (weights and optimizer state unchanged)"


def write_lines(text: str, stream) -> None:
    """``text`` on ``stream`` as whole lines: through ``tqdm.write`` while a tqdm bar is shown (the trainers'
    progress bars), which clears the bar, writes, and draws it again, so nothing is glued to it."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None and getattr(getattr(tqdm, "tqdm", None), "_instances", None):
        try:
            tqdm.tqdm.write(text, file=stream)
            return
        except Exception:  # noqa: BLE001 - fall back to a plain line
            pass
    stream.write(text + "\n")
    stream.flush()


class _ConsoleHandler(logging.StreamHandler):
    """stderr (the current one: a test or a notebook may have replaced it), around any active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_lines(self.format(record), sys.stderr)
        except Exception:  # noqa: BLE001 - logging reports its own failures
            self.handleError(record)


def console_logger() -> logging.Logger:
    """The ``rl_guard`` logger; given a stderr handler at INFO unless the application configured one."""
    if not logger.handlers:
        handler = _ConsoleHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def outcome(record: dict, lr_scale: float | None = None) -> str:
    """What the step's decision did, in words (with what was quarantined and why it escalated)."""
    said = _outcome(record, lr_scale)
    quarantined = record.get("quarantined") or []
    if quarantined:
        shown = ", ".join(repr(str(p)[:60]) for p in quarantined[:3]) + (" ..." if len(quarantined) > 3 else "")
        said += f"; quarantined {len(quarantined)} prompt(s): {shown}"
    if record.get("escalation_reason"):
        said += f" ({record['escalation_reason']})"
    if record.get("bundle"):
        said += f"; details in {record['bundle']}"
    return said


def _outcome(record: dict, lr_scale: float | None) -> str:
    if record.get("mode") == "shadow":
        would = record.get("would")
        restore = record.get("would_restore_to_step")
        where = f" to the state from before step {restore}" if would == "rollback" and restore is not None else ""
        return f"shadow mode: would {would}{where}; nothing was changed"
    decision = record.get("decision") or record.get("action")
    escalated = record.get("escalated_from")
    said = f" (escalated from {escalated})" if escalated and decision != escalated else ""
    if decision == "rollback":
        step = record.get("restored_to_step")
        scale = f", learning rate x{lr_scale:g}" if lr_scale is not None else ""
        return f"the update was dropped; the healthy state from before step {step} is restored{scale}"
    if decision == "skip_step":
        return DROPPED
    if decision == "early_stop":
        return f"{DROPPED}; training stops after this step{said}"
    if decision == "checkpoint_and_halt":
        where = f"checkpoint {record['checkpoint']}" if record.get("checkpoint") else "no state attached to save"
        return f"{DROPPED}; {where}; training halts{said}"
    return "training continues"


def _g(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


class Announcer:
    """Prints action lines (rank 0 only) and keeps what the end-of-run summary needs."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()  # (rule, action) -> firings
        self.warned: set[str] = set()
        self.stop_record: dict | None = None  # the incident that stopped or halted the run

    def incident(self, record: dict, lr_scale: float | None = None) -> None:
        rule = record.get("rule", "?")
        shadow = record.get("mode") == "shadow"
        action = record.get("would") if shadow else record.get("action")
        self.counts[(rule, action)] += 1
        decision = record.get("decision") or action
        if not shadow and decision in ("early_stop", "checkpoint_and_halt") and self.stop_record is None:
            self.stop_record = record
        said = outcome(record, lr_scale)
        if action == "warn":
            if rule in self.warned:
                return
            self.warned.add(rule)
            said += " (first firing of this warning; later ones go to incidents.jsonl only)"
        console_logger().warning(f"rl_guard: {record.get('message')}: {said}")

    def state_dict(self) -> dict:
        return {"counts": [[r, a, n] for (r, a), n in self.counts.items()], "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter({(r, a): n for r, a, n in state.get("counts", [])})
        self.warned = set(state.get("warned", []))

    def summary(self, first_step: int, last_step: int, run_dir) -> list[str]:
        """Steps guarded, actions per rule, and for a stop or halt the reason (adapters add how to resume)."""
        counted = sorted(self.counts.items(), key=str)  # str: a shadow record may lack an action
        actions = ", ".join(f"{rule} {action} x{n}" for (rule, action), n in counted if action != "warn") or "none"
        warnings = ", ".join(f"{rule} x{n}" for (rule, action), n in counted if action == "warn") or "none"
        lines = [
            f"rl_guard summary: steps {first_step}-{last_step} guarded in this process; since the run began: "
            f"actions {actions}; warnings {warnings}",
            f"  records: {run_dir} (render them: rl-guard report {run_dir})",
        ]
        stop = self.stop_record
        if stop is not None:
            lines.insert(
                1,
                f"  stopped at step {stop['step']} by rule {stop['rule']}: {stop['metric']} = "
                f"{_g(stop['value'])} {stop['op']} {_g(stop['threshold'])} -> {stop.get('decision')}"
                + (f"; guard checkpoint {stop['checkpoint']}" if stop.get("checkpoint") else ""),
            )
        return lines
