"""``rl-guard`` command line: one argparse subcommand per entry of ``COMMANDS``.

A subcommand is a pair of functions: ``add_arguments(parser)`` declares its options and ``run(args) -> int``
does the work and returns the exit status. To add one, write the two functions and register them in
``COMMANDS``; ``main`` needs no change.

    rl-guard validate configs/grpo.yaml       # exit 0: "OK: configs/grpo.yaml (10 rules)"; 1: every error listed
    rl-guard replay runs/demo --config runs/demo/config.yaml   # when each rule would have fired on a recorded run
    rl-guard suggest runs/healthy --rules grpo                 # thresholds from healthy runs, evidence as comments
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .errors import ConfigError


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="guard YAML config(s) to check")


def _validate(args: argparse.Namespace) -> int:
    """Load each file with the same validation ``Guard.from_yaml`` uses; report, never raise."""
    from .control.config import load_config

    status = 0
    for path in args.files:
        try:
            config = load_config(path)
        except ConfigError as exc:
            print(f"ERROR: {path}\n{exc}", file=sys.stderr)
            status = 1
        else:
            print(f"OK: {path} ({len(config.rules)} rules)")
    return status


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo.run import add_arguments

    add_arguments(parser)


def _demo(args: argparse.Namespace) -> int:
    from .demo.run import main as demo_main

    return demo_main(args)


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    from .report import add_arguments

    add_arguments(parser)


def _report(args: argparse.Namespace) -> int:
    from .report import main as report_main

    return report_main(args)


def _replay_arguments(parser: argparse.ArgumentParser) -> None:
    from .replay.cli import add_replay_arguments

    add_replay_arguments(parser)


def _replay(args: argparse.Namespace) -> int:
    from .replay.cli import replay_main

    return replay_main(args)


def _suggest_arguments(parser: argparse.ArgumentParser) -> None:
    from .replay.cli import add_suggest_arguments

    add_suggest_arguments(parser)


def _suggest(args: argparse.Namespace) -> int:
    from .replay.cli import suggest_main

    return suggest_main(args)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "validate": ("check guard YAML files: key paths, line numbers, allowed values", _validate_arguments, _validate),
    "demo": ("train a tiny GRPO model on CPU, inject a fault, watch the guard act before NaN", _demo_arguments, _demo),
    "report": ("render a run directory as PNG plots and a Markdown incident summary", _report_arguments, _report),
    "replay": ("replay a recorded run through the rules: when each would have fired, and what it would have done",
               _replay_arguments, _replay),
    "suggest": ("propose rule thresholds from healthy recorded runs, with the evidence as YAML comments",
                _suggest_arguments, _suggest),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl-guard", description="rl_guard: guardrails inside RL training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    raise SystemExit(main())
