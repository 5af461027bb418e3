"""``--json [FILE]`` for the benchmarks: the results as JSON in FILE, or on stdout when no file is given."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_json_argument(ap: argparse.ArgumentParser, what: str = "the results") -> None:
    ap.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help=f"write {what} as JSON to FILE (stdout without FILE)"
    )


def emit_json(dest: str | None, data, indent: int = 2) -> None:
    if not dest:
        return
    text = json.dumps(data, indent=indent, default=str)
    if dest == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(dest).write_text(text + "\n", encoding="utf-8")
