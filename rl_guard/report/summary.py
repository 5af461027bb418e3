"""`report.md`: a short incident summary a person can read in a minute, linking the PNG plots."""

from __future__ import annotations

import pathlib
from collections import Counter, defaultdict

from . import incidents as describe
from .bundles import bundle_lines
from .data import RunData
from .panels import BY_DESIGN, CAVEAT
from .style import action_rank

PLOT_TITLES = {
    "overview": "Overview",
    "ratio": "Importance ratio quantiles",
    "entropy": "Entropy quantiles",
    "kl": "KL to rollout and reference policy",
    "clip": "Clip fractions",
    "grad": "Gradient norm and spikes",
    "optim": "Learning rate and update size",
    "lag": "Policy-lag shares",
    "rollout": "Reward, length, truncation",
}


def step_ranges(steps) -> str:
    """[2, 3, 4, 7, 9, 10] -> "2-4, 7, 9-10" (long incident streaks stay one line)."""
    steps = sorted(set(int(s) for s in steps))
    if not steps:
        return "-"
    parts, start, prev = [], steps[0], steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(parts)


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _step(rec: dict):
    s = rec.get("step")
    return int(s) if isinstance(s, (int, float)) and s == s and abs(s) != float("inf") else None


MAX_ROWS = 500  # incident table rows; a run warning every step for days would make report.md unreadable


def summary_lines(run: RunData, plots: dict[str, str], panels: dict[str, tuple] | None = None) -> list[str]:
    name = run.run_dir.name or str(run.run_dir)
    inc = run.incidents
    steps = [s for s in (_step(r) for r in inc) if s is not None]
    lines = [f"# rl_guard report: {name}", "", f"- run directory: `{run.run_dir}`"]
    if len(run.steps):
        lines.append(f"- steps logged: {len(run.steps)} (step {run.steps[0]} to {run.steps[-1]})")
    else:
        lines.append("- steps logged: 0 (no metrics.jsonl records)")
    if inc:
        lines.append(
            f"- incidents: {len(inc)}" + (f" (first at step {min(steps)}, last at step {max(steps)})" if steps else "")
        )
    else:
        lines.append("- incidents: 0 (no rule fired)")
    kinds = Counter(describe.kind(r) for r in inc)
    if kinds["replayed"]:
        sources = sorted({str(r["source"]) for r in inc if r.get("replayed") and r.get("source")})
        lines.append(
            f"- replayed incidents: {kinds['replayed']} (`rl-guard replay`"
            + (" of " + ", ".join(f"`{s}`" for s in sources) if sources else "")
            + ": what the rules would have done on that history; none of it happened live)"
        )
    if kinds["shadow"]:
        lines.append(
            f"- shadow-mode incidents: {kinds['shadow']} (`mode: shadow`: the guard only warned; the "
            "action column says what it would have done)"
        )
    bad = run.nonfinite()
    if bad:
        lines.append(
            "- non-finite values: "
            + "; ".join(f"`{m}` at step{'s' if len(s) > 1 else ''} {step_ranges(s)}" for m, s in bad.items())
        )
    if "overview" in plots:
        lines += ["", f"![overview]({pathlib.Path(plots['overview']).name})"]
    if inc:
        lines += _incident_rows(inc)
        lines += _incident_tables(inc)
        lines += _checkpoints(run)
    lines += bundle_lines(run.run_dir)
    if panels:
        lines += _panel_lines(panels)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"- [{PLOT_TITLES.get(k, k)}]({pathlib.Path(p).name})" for k, p in plots.items()]
    return lines + [""]


def _incident_rows(inc: list[dict]) -> list[str]:
    """One row per incident: what fired, on which value, what the guard did, and where it went back to."""
    lines = [
        "",
        "## Incidents",
        "",
        "One row per incident, by step. *restored to / checkpoint*: the step whose state a rollback restored "
        "(the run went on from the weights it had before that step), or the checkpoint written.",
        "",
        "| step | rule | metric | value | condition | action | restored to / checkpoint |",
        "|---:|---|---|---:|---|---|---|",
    ]
    for r in inc[:MAX_ROWS]:
        step = _step(r)
        lines.append(
            f"| {'-' if step is None else step} | {_cell(r.get('rule'))} | `{_cell(r.get('metric'))}` | "
            f"{_cell(describe.number(r.get('value')))} | {_cell(describe.condition(r))} | "
            f"{_cell(describe.action(r))} | {_cell(describe.outcome(r))} |"
        )
    if len(inc) > MAX_ROWS:
        lines.append(
            f"\n{len(inc) - MAX_ROWS} more incidents after step {_step(inc[MAX_ROWS - 1])}: see "
            "incidents.jsonl (the per-rule tables below count them all)"
        )
    return lines


def _panel_lines(panels: dict[str, tuple]) -> list[str]:
    """Which panels are drawn, which are constant (and where they went), which had no data."""
    by = defaultdict(list)
    for name, (status, value) in panels.items():
        by[status].append((name, value))
    lines = ["", "## Panels", ""]
    if by["drawn"]:
        lines.append("- drawn: " + ", ".join(f"`{n}`" for n, _ in by["drawn"]))
    if by["constant by design"]:
        lines.append(
            "- constant by design in this run: left out of overview.png, drawn in their own figure "
            'labelled "constant by design in this run (value X)":'
        )
        lines += [f"  - `{n}` = {v:g}: {BY_DESIGN[n]}" for n, v in by["constant by design"]]
        lines.append(f"  {CAVEAT}")
    if by["constant"]:
        lines.append(
            "- constant in this run (drawn everywhere, labelled with the value): "
            + ", ".join(f"`{n}` = {v:g}" for n, v in by["constant"])
        )
    if by["no data"]:
        lines.append("- no data in this run (left out): " + ", ".join(f"`{n}`" for n, _ in by["no data"]))
    return lines


def _incident_tables(inc: list[dict]) -> list[str]:
    by_rule: dict[tuple, list[dict]] = defaultdict(list)
    for r in inc:
        by_rule[(str(r.get("rule")), str(r.get("action")), str(r.get("metric")))].append(r)
    lines = [
        "",
        "## Incidents per rule",
        "",
        "| rule | action | metric | count | first step | last step |",
        "|---|---|---|---:|---:|---:|",
    ]
    for (rule, action, metric), recs in sorted(by_rule.items(), key=lambda kv: (-action_rank(kv[0][1]), kv[0])):
        st = [s for s in (_step(r) for r in recs) if s is not None]
        first, last = (min(st), max(st)) if st else ("-", "-")
        lines.append(f"| {_cell(rule)} | {_cell(action)} | `{_cell(metric)}` | {len(recs)} | {first} | {last} |")
    counts = Counter(str(r.get("action")) for r in inc)
    lines += ["", "## Incidents per action", "", "| action | count | steps |", "|---|---:|---|"]
    for action in sorted(counts, key=lambda a: (-action_rank(a), a)):
        st = [_step(r) for r in inc if str(r.get("action")) == action]
        lines.append(f"| {_cell(action)} | {counts[action]} | {step_ranges(s for s in st if s is not None)} |")
    first = inc[0]
    lines += ["", "## First incident", "", f"> {_cell(first.get('message') or first)}"]
    # The first incident is often a mild warning; the one that changed the run matters more.
    worst = max(inc, key=lambda r: action_rank(str(r.get("action"))))
    if worst is not first and action_rank(str(worst.get("action"))) > action_rank(str(first.get("action"))):
        lines += [
            "",
            f"## First `{_cell(worst.get('action'))}` (most severe action taken)",
            "",
            f"> {_cell(worst.get('message') or worst)}",
        ]
    return lines


def _checkpoints(run: RunData) -> list[str]:
    lines = ["", "## Checkpoints", ""]
    seen = set()
    for r in run.incidents:
        path = r.get("checkpoint")
        if path and path not in seen:
            seen.add(path)
            lines.append(f"- `{path}` (step {_step(r)}, rule {r.get('rule')}, action {r.get('action')})")
    ckdir = run.run_dir / "checkpoints"
    if ckdir.is_dir():
        refs = [pathlib.Path(p) for p in seen]
        for p in sorted(ckdir.iterdir()):
            # An incident usually names a file inside the step directory (step_00000015/rank0.pt).
            if not any(_same_or_parent(p, r) for r in refs):
                lines.append(f"- `{p}` (in checkpoints/, not referenced by an incident)")
                seen.add(str(p))
    if not seen:
        lines.append("No checkpoint was written by an incident.")
    return lines


def _same_or_parent(entry: pathlib.Path, ref: pathlib.Path) -> bool:
    try:
        entry, ref = entry.resolve(), ref.resolve()
    except OSError:
        pass
    return entry == ref or entry in ref.parents


def write_markdown(
    run: RunData, path: pathlib.Path, plots: dict[str, str], panels: dict[str, tuple] | None = None
) -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text("\n".join(summary_lines(run, plots, panels)), encoding="utf-8")
    return path
