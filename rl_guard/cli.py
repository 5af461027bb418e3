"""``rl-guard`` command line: one argparse subcommand per entry of ``COMMANDS``.

A subcommand is a pair of functions: ``add_arguments(parser)`` declares its options and ``run(args) -> int``
does the work and returns the exit status. To add one, write the two functions and register them in
``COMMANDS``; ``main`` needs no change. Every option's help ends with its default (``DefaultsFormatter``).

Only the chosen subcommand's ``add_arguments`` runs, and none of them imports torch or transformers, so
``rl-guard --help`` and ``rl-guard <command> --help`` answer at once; the work itself imports what it needs.

    rl-guard validate configs/grpo.yaml       # exit 0: "OK: configs/grpo.yaml (10 rules)"; 1: every error listed
    rl-guard replay runs/demo                 # when each rule of runs/demo/config.yaml would have fired on the run
    rl-guard suggest runs/healthy --rules grpo                 # thresholds from healthy runs, evidence as comments
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import __version__
from .errors import ConfigError


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help already names its default, there is none
    (None), or the option is an on/off flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default in (None, argparse.SUPPRESS)
            or action.nargs == 0
            or "default" in text.lower()
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return action.help
        return f"{text} (default: %(default)s)".strip()


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
    from .report.cli import add_arguments

    add_arguments(parser)


def _report(args: argparse.Namespace) -> int:
    from .report.cli import main as report_main

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
    "replay": (
        "replay a recorded run through the rules: when each would have fired, and what it would have done",
        _replay_arguments,
        _replay,
    ),
    "suggest": (
        "propose rule thresholds from healthy recorded runs, with the evidence as YAML comments",
        _suggest_arguments,
        _suggest,
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``rl-guard`` parser; with `command`, only that subcommand gets its options (the others only their name
    and help line), so parsing one command line never imports another command's modules."""
    parser = argparse.ArgumentParser(
        prog="rl-guard", description="rl_guard: guardrails inside RL training.", formatter_class=DefaultsFormatter
    )
    parser.add_argument("--version", action="version", version=f"rl-guard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsFormatter)
        if command is None or name == command:
            add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first word that is not an option is the subcommand (rl-guard's own options take no value).
    command = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(command).parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    raise SystemExit(main())
