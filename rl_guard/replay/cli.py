"""``rl-guard replay`` and ``rl-guard suggest``: argument wiring (lazy imports; see ``loop`` and ``suggest``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RUN_CONFIG = "config.yaml"  # the guard writes the config it ran with into every run directory (Guard.__init__)


def add_replay_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "history",
        metavar="HISTORY",
        help="metrics.jsonl (or its run dir), trainer_state.json, a TensorBoard event dir, or an offline wandb run dir",
    )
    ap.add_argument(
        "--config",
        metavar="FILE",
        help="guard YAML (a path or a preset name; default: the run's own HISTORY/config.yaml, which the "
        "guard writes into every run directory)",
    )
    ap.add_argument("--json", metavar="OUT", help="write the replayed incidents as incidents.jsonl records")
    ap.add_argument("--report", metavar="DIR", help="render rl-guard report's plots with the replayed incidents")


def replay_main(args: argparse.Namespace) -> int:
    """0 on success; 2 when the history or the config cannot be read (the reason on stderr)."""
    from ..control.config import load_config
    from ..errors import ConfigError
    from .history import HistoryFormatError
    from .load import load_history
    from .loop import replay
    from .output import lines, write_incidents, write_report

    config_name = args.config
    if config_name is None:
        config_name = run_config(args.history)
        if config_name is None:
            print(
                f"rl-guard replay: no --config given and {args.history} has no {RUN_CONFIG} next to it (the guard "
                "writes one into each run directory); pass --config FILE or a preset name (--config grpo)",
                file=sys.stderr,
            )
            return 2
        print(f"config: {config_name} (the run's own, as --config was not given)")
    try:
        config = load_config(config_name)
        history = load_history(args.history)
    except (ConfigError, HistoryFormatError) as exc:
        print(f"rl-guard replay: {exc}", file=sys.stderr)
        return 2
    result = replay(history, config)
    print("\n".join(lines(result, config_name)))
    print("\n".join(_live_records(args.history)))
    if args.json:
        print(f"\nreplayed incidents: {write_incidents(result, args.json)}")
    if args.report:
        try:
            res = write_report(result, args.report, config_name)
        except (ValueError, ImportError) as exc:
            print(f"rl-guard replay: {exc}", file=sys.stderr)
            return 2
        print(f"report: {res['markdown']}")
    return 0


def _live_records(history) -> list[str]:
    """What the live run left beside its metrics, which a replay of the metrics cannot recompute: the incident
    bundles (culprit sequences) and the quarantined prompts."""
    from ..report.bundles import bundles, quarantined

    path = Path(history)
    run_dir = path.parent if path.is_file() else path
    found, held = bundles(run_dir), quarantined(run_dir)
    out = []
    if found:
        out += ["", f"live incident bundles ({len(found)}, {run_dir / 'incidents'}):"]
        for _, b in found:
            culprits = [
                c.get("prompt", f"row {c.get('row')}") for r in b.get("rules", []) for c in r.get("culprits", [])
            ]
            shown = "; ".join(" ".join(str(c).split())[:60] for c in culprits[:3])
            out.append(f"  step {b.get('step')}: {b.get('decision')}" + (f"; culprits: {shown}" if shown else ""))
    if held:
        out += ["", f"quarantined prompts ({len(held)}, {run_dir / 'quarantine.jsonl'}):"]
        out += [
            f"  step {q.get('step')} ({q.get('rule')}): {' '.join(str(q.get('prompt')).split())[:80]}" for q in held
        ]
    return out


def run_config(history) -> str | None:
    """The config.yaml the guard wrote next to a history: in the run directory given, or beside the metrics.jsonl
    given (None when there is none, e.g. a trainer_state.json or a TensorBoard directory)."""
    path = Path(history)
    for folder in (path, path.parent) if path.suffix == ".jsonl" or path.is_file() else (path,):
        if (folder / RUN_CONFIG).is_file():
            return str(folder / RUN_CONFIG)
    return None


def add_suggest_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("histories", nargs="+", metavar="HISTORY", help="one or more healthy histories (formats as replay)")
    from .history import MIN_STEPS

    ap.add_argument(
        "--rules",
        default="grpo",
        metavar="FILE",
        help="guard YAML whose rules get thresholds (a path or a preset name)",
    )
    ap.add_argument("--quantile", type=float, default=0.99, help="healthy quantile the threshold starts from")
    ap.add_argument("--margin", type=float, default=1.5, help="factor applied beyond the healthy quantile")
    ap.add_argument(
        "--min-steps",
        type=int,
        default=MIN_STEPS,
        metavar="N",
        help="healthy values a condition needs before it is calibrated; with fewer it keeps its setting and says so",
    )


def suggest_main(args: argparse.Namespace) -> int:
    from ..control.config import load_config
    from ..errors import ConfigError
    from .history import MIN_STEPS, HistoryFormatError
    from .load import load_history
    from .suggest import TOO_SHORT, suggest, to_yaml

    min_steps = getattr(args, "min_steps", None)
    if not 0 < args.quantile <= 1 or args.margin < 1 or (min_steps is not None and min_steps < 1):
        print("rl-guard suggest: --quantile must be in (0, 1], --margin >= 1 and --min-steps >= 1", file=sys.stderr)
        return 2
    try:
        config = load_config(args.rules)
        histories = [load_history(h) for h in args.histories]
    except (ConfigError, HistoryFormatError) as exc:
        print(f"rl-guard suggest: {exc}", file=sys.stderr)
        return 2
    for h in histories:
        acted = _acted(h)
        if acted:
            print(
                f"rl-guard suggest: warning: {h.path} is not a healthy run: its guard acted {acted} time(s) "
                "(incidents.jsonl); thresholds from it will tolerate that fault",
                file=sys.stderr,
            )
    kw = {} if min_steps is None else {"min_steps": min_steps}
    suggestions = suggest(config, histories, quantile=args.quantile, margin=args.margin, **kw)
    short = [e for s in suggestions for e in s.evidence if TOO_SHORT in e]
    if short:
        steps = sum(len(h.records) for h in histories)
        print(
            f"rl-guard suggest: warning: too short to calibrate from: {len(short)} condition(s) have fewer healthy "
            f"values than --min-steps {kw.get('min_steps', MIN_STEPS)} ({steps} steps in "
            f"{len(histories)} histor{'y' if len(histories) == 1 else 'ies'}); they keep the settings of "
            f"{args.rules} (see the comments)",
            file=sys.stderr,
        )
    print(to_yaml(suggestions, histories, args))
    return 0


def _acted(history) -> int:
    """Non-warn incidents the guard logged next to a metrics.jsonl (0 for other formats)."""
    from ..sinks.jsonl import INCIDENTS_FILE, read_jsonl

    path = history.path.parent / INCIDENTS_FILE
    if history.kind != "rl_guard metrics.jsonl" or not path.is_file():
        return 0
    return sum((r.get("would") or r.get("action")) not in (None, "warn") for r in read_jsonl(path))
