"""The report's view of incident bundles (``run_dir/incidents/<step>/``) and quarantined prompts
(``run_dir/quarantine.jsonl``): what a person opens first when a rule acted."""

from __future__ import annotations

import json
import pathlib

MAX_BUNDLES = 20
TEXT = 80  # characters of a prompt shown in a table cell


def _short(text) -> str:
    text = " ".join(str(text).split())
    return (text[:TEXT] + "...") if len(text) > TEXT else text


def _cell(text) -> str:
    return _short(text).replace("|", "\\|")


def bundles(run_dir: pathlib.Path) -> list[tuple[pathlib.Path, dict]]:
    out = []
    for folder in sorted((run_dir / "incidents").glob("*/")):
        path = folder / "bundle.json"
        if path.is_file():
            try:
                out.append((folder, json.loads(path.read_text(encoding="utf-8"))))
            except ValueError:
                continue  # a bundle cut short by a crash: the incident record still names the step
    return out


def quarantined(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "quarantine.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def bundle_lines(run_dir: pathlib.Path) -> list[str]:
    """Markdown: one row per bundle (its culprits), then the quarantined prompts."""
    found, held = bundles(run_dir), quarantined(run_dir)
    lines: list[str] = []
    if found:
        lines += [
            "",
            "## Incident bundles",
            "",
            "One folder per step a rule acted on: `bundle.json` (the rules and their windows, the culprit "
            "sequences with their prompts, completions and rewards, the learning rates, the counters) and "
            "`rng.pt`.",
            "",
            "| step | decision | rules | culprits | folder |",
            "|---:|---|---|---|---|",
        ]
        for folder, b in found[:MAX_BUNDLES]:
            culprits = [c for r in b.get("rules", []) for c in r.get("culprits", [])]
            named = "; ".join(_cell(c.get("prompt", f"row {c.get('row')}")) for c in culprits[:3]) or "-"
            rules = ", ".join(r["rule"] for r in b.get("rules", []) if r.get("action") != "warn")
            lines.append(
                f"| {b.get('step')} | {b.get('decision')} | {rules} | {named} | `{folder.relative_to(run_dir)}` |"
            )
        if len(found) > MAX_BUNDLES:
            lines.append(f"\n{len(found) - MAX_BUNDLES} more bundles under `incidents/`")
    if held:
        lines += [
            "",
            "## Quarantined prompts",
            "",
            f"{len(held)} prompts kept out of further sampling (`quarantine.jsonl`).",
            "",
            "| step | rule | prompt |",
            "|---:|---|---|",
        ]
        lines += [f"| {q.get('step')} | {q.get('rule')} | {_cell(q.get('prompt'))} |" for q in held]
    return lines
