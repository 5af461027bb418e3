"""``rl-guard replay`` and ``rl-guard suggest``: argument wiring (lazy imports; see ``loop`` and ``suggest``)."""

from __future__ import annotations

import argparse
import sys


def add_replay_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("history", metavar="HISTORY", help="metrics.jsonl (or its run dir), trainer_state.json, a "
                    "TensorBoard event dir, or an offline wandb run dir")
    ap.add_argument("--config", required=True, metavar="FILE", help="guard YAML (a path or a preset name)")
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

    try:
        config = load_config(args.config)
        history = load_history(args.history)
    except (ConfigError, HistoryFormatError) as exc:
        print(f"rl-guard replay: {exc}", file=sys.stderr)
        return 2
    result = replay(history, config)
    print("\n".join(lines(result, args.config)))
    if args.json:
        print(f"\nreplayed incidents: {write_incidents(result, args.json)}")
    if args.report:
        try:
            res = write_report(result, args.report, args.config)
        except (ValueError, ImportError) as exc:
            print(f"rl-guard replay: {exc}", file=sys.stderr)
            return 2
        print(f"report: {res['markdown']}")
    return 0


def add_suggest_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("histories", nargs="+", metavar="HISTORY", help="one or more healthy histories (formats as replay)")
    ap.add_argument("--rules", default="grpo", metavar="FILE",
                    help="guard YAML whose rules get thresholds (a path or a preset name; default grpo)")
    ap.add_argument("--quantile", type=float, default=0.99, help="healthy quantile the threshold starts from")
    ap.add_argument("--margin", type=float, default=1.5, help="factor applied beyond the healthy quantile")


def suggest_main(args: argparse.Namespace) -> int:
    from ..control.config import load_config
    from ..errors import ConfigError
    from .history import HistoryFormatError
    from .load import load_history
    from .suggest import suggest, to_yaml

    if not 0 < args.quantile <= 1 or args.margin < 1:
        print("rl-guard suggest: --quantile must be in (0, 1] and --margin >= 1", file=sys.stderr)
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
            print(f"rl-guard suggest: warning: {h.path} is not a healthy run: its guard acted {acted} time(s) "
                  "(incidents.jsonl); thresholds from it will tolerate that fault", file=sys.stderr)
    print(to_yaml(suggest(config, histories, quantile=args.quantile, margin=args.margin), histories, args))
    return 0


def _acted(history) -> int:
    """Non-warn incidents the guard logged next to a metrics.jsonl (0 for other formats)."""
    from ..sinks.jsonl import INCIDENTS_FILE, read_jsonl

    path = history.path.parent / INCIDENTS_FILE
    if history.kind != "rl_guard metrics.jsonl" or not path.is_file():
        return 0
    return sum((r.get("would") or r.get("action")) not in (None, "warn") for r in read_jsonl(path))
