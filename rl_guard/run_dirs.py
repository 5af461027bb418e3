"""Run directories never mix two runs: a fresh run pointed at a directory that holds another run's records writes to
a numbered sibling instead (``rl_guard`` -> ``rl_guard-2``), and says so; only a resumed run continues records."""

from __future__ import annotations

from pathlib import Path

RECORD_FILES = ("metrics.jsonl", "incidents.jsonl")


def holds_records(run_dir: str | Path) -> bool:
    return any((Path(run_dir) / name).is_file() and (Path(run_dir) / name).stat().st_size > 0 for name in RECORD_FILES)


def fresh_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` itself when it holds no run's records, else the first ``<run_dir>-<n>`` (n >= 2) that holds none."""
    path = Path(run_dir)
    n = 2
    candidate = path
    while holds_records(candidate):
        candidate = path.with_name(f"{path.name}-{n}")
        n += 1
    return candidate
