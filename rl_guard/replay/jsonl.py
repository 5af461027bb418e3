"""The guard's own ``metrics.jsonl``: one record per guard step, already in rl_guard names."""

from __future__ import annotations

from pathlib import Path

from ..sinks.jsonl import METRICS_FILE, read_jsonl
from .history import History, HistoryFormatError, ordered


def read(path: Path) -> History:
    path = path / METRICS_FILE if path.is_dir() else path
    rows: dict[int, dict] = {}
    for i, rec in enumerate(read_jsonl(path)):
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise HistoryFormatError(path, f"line {i + 1} has no integer 'step' (not a metrics.jsonl of rl_guard)")
        rows[step] = {
            k: float(v)
            for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    names = {k for r in rows.values() for k in r}
    return History(path, "rl_guard metrics.jsonl", ordered(rows), {k: "rl_guard" for k in names})
