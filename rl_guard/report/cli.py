"""`rl-guard report RUN_DIR`: argument wiring for the command-line entry point."""

from __future__ import annotations

import argparse
import sys


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `report` subcommand's arguments to `ap`."""
    ap.add_argument("run_dir", help="run directory written by the guard (holds metrics.jsonl / incidents.jsonl)")
    ap.add_argument(
        "-o",
        "--out",
        "--out-dir",
        dest="out_dir",
        default=None,
        help="where to write the PNGs and report.md (default: RUN_DIR/report/)",
    )
    ap.add_argument("--dpi", type=int, default=110, help="resolution of the PNG files (default: 110)")
    ap.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    return ap


def main(args: argparse.Namespace) -> int:
    """Render the report; 0 on success, 1 if matplotlib is missing, 2 if RUN_DIR is not a run directory."""
    from .render import ReportDependencyError, render_report

    try:
        res = render_report(args.run_dir, getattr(args, "out_dir", None), dpi=getattr(args, "dpi", 110))
    except ReportDependencyError as e:
        print(f"rl-guard report: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"rl-guard report: {e}", file=sys.stderr)
        return 2
    if not getattr(args, "quiet", False):
        print(f"report: {res['markdown']}")
        for name, path in res["plots"].items():
            print(f"  {name:<9} {path}")
        if res["skipped"]:
            print(f"  (no data for: {', '.join(res['skipped'])})")
    return 0
