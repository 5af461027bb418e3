"""What ``rl-guard replay`` prints and writes: the per-rule table, the incident records, the report directory."""

from __future__ import annotations

from pathlib import Path

from ..report.summary import step_ranges
from ..sinks.jsonl import INCIDENTS_FILE, METRICS_FILE, dumps
from .loop import Replay

SHOWN = 5  # messages printed per rule


def lines(result: Replay, config_name: str) -> list[str]:
    h = result.history
    steps = h.steps
    out = [
        f"replay of {h.path} ({h.kind}, {len(steps)} steps, {steps[0]}-{steps[-1]}) with {config_name}",
        "",
        "per rule: the steps it would have fired at, its input (records holding the metric / all records) and the "
        f"messages it would have given (the first {SHOWN}; all of them with --json)",
    ]
    fired = result.steps_by_rule()
    for inp in result.inputs:
        steps_fired = fired.get(inp.rule, [])
        mine = [r for r in result.incidents if r["rule"] == inp.rule]
        escalated = [r["step"] for r in mine if r["action"] != inp.action]  # this rule's own action was escalated
        if not inp.has_input:
            status = "NO INPUT in this history (it cannot fire)"
        elif steps_fired:
            plural = "s" if len(steps_fired) > 1 else ""
            status = f"fired {len(steps_fired)}x at step{plural} {step_ranges(steps_fired)}"
            if escalated:  # no trusted snapshot yet, max_rollbacks or max_consecutive_skips spent
                status += f" (escalated to checkpoint_and_halt at {step_ranges(escalated)})"
        else:
            status = "silent"
        out.append(f"  {inp.rule} -> {inp.action}: {status}")
        for metric, n in inp.metrics.items():
            source = inp.sources.get(metric, "")
            note = "" if source in ("", "rl_guard") else f"  (from {source})"
            out.append(f"      {metric}: {n}/{len(steps)}{note}" + ("  not in this history" if n == 0 else ""))
        out += [f"      > {r['message']}" + ("  [after the halt]" if r["after_halt"] else "") for r in mine[:SHOWN]]
        if len(mine) > SHOWN:
            out.append(f"      > ... and {len(mine) - SHOWN} more")
    if result.halted_at is not None:
        out += [
            "",
            f"the run would have stopped at step {result.halted_at}; later incidents are what the rules say "
            "on the recorded continuation",
        ]
    return out


def write_incidents(result: Replay, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(dumps(r) + "\n" for r in result.incidents), encoding="utf-8")
    return path


def write_report(result: Replay, out_dir, config_name: str, dpi: int = 110) -> dict:
    """``rl-guard report``'s plots and report.md for the history, with the replayed incidents marked: the directory
    gets its own metrics.jsonl (the history in rl_guard names) and incidents.jsonl (the replayed ones)."""
    from ..report import render_report

    out = Path(out_dir)
    source = result.history.path
    if out.resolve() in (source.resolve(), source.parent.resolve()):
        raise ValueError(f"--report {out_dir}: pick a new directory; this one holds the history being replayed")
    out.mkdir(parents=True, exist_ok=True)
    (out / METRICS_FILE).write_text("".join(dumps(r) + "\n" for r in result.history.records), encoding="utf-8")
    write_incidents(result, out / INCIDENTS_FILE)
    res = render_report(out, out, dpi=dpi)
    md = Path(res["markdown"])
    text = md.read_text(encoding="utf-8").split("\n")
    text.insert(2, f"- rules replayed: `{config_name}` (the incidents below are marked replayed)")
    md.write_text("\n".join(text), encoding="utf-8")
    return res
