"""A run directory as numpy columns for plotting and summaries.

A metric missing from a step record means "no data that step" (nothing is drawn there); a non-finite value is
data (it is kept, because it is usually the point, and drawn as a marker). If a step was logged twice (a resumed
run appended without de-duplication) the last record wins.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import numpy as np

from ..sinks.jsonl import INCIDENTS_FILE, METRICS_FILE, read_jsonl

PREFIX = "rl_guard/"


def full_name(name: str) -> str:
    """Accept `ratio/p50` as shorthand for `rl_guard/ratio/p50`."""
    return name if name.startswith(PREFIX) else PREFIX + name


def _as_float(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None  # strings other than nan/inf, lists, ...: not a plottable scalar


@dataclass
class Series:
    """The steps where a metric was reported, and its values there (float64, non-finite kept)."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def finite(self) -> np.ndarray:
        return np.isfinite(self.values)


class RunData:
    """Metrics as columns aligned on ``steps`` (NaN where a metric is absent) plus incidents sorted by step."""

    def __init__(self, run_dir: pathlib.Path, records: list[dict], incidents: list[dict]):
        self.run_dir = run_dir
        by_step: dict[int, dict] = {}
        for rec in records:
            step = _as_float(rec.get("step"))
            if step is None or not math.isfinite(step):
                continue
            by_step[int(step)] = rec  # last record of a step wins
        self.steps = np.array(sorted(by_step), dtype=np.int64)
        n = len(self.steps)
        self._cols: dict[str, np.ndarray] = {}
        self._present: dict[str, np.ndarray] = {}
        for i, step in enumerate(self.steps):
            for name, raw in by_step[int(step)].items():
                v = _as_float(raw)
                if name == "step" or v is None:
                    continue
                if name not in self._cols:
                    self._cols[name] = np.full(n, np.nan, dtype=np.float64)
                    self._present[name] = np.zeros(n, dtype=bool)
                self._cols[name][i] = v
                self._present[name][i] = True
        self.incidents = sorted((r for r in incidents if isinstance(r, dict)), key=_incident_key)

    @property
    def names(self) -> list[str]:
        return sorted(self._cols)

    def has(self, name: str) -> bool:
        return full_name(name) in self._cols

    def has_any(self, *names: str) -> bool:
        return any(self.has(n) for n in names)

    def column(self, name: str) -> np.ndarray:
        """Values on all ``steps``; NaN where absent (so lines break there). All-NaN if never reported."""
        col = self._cols.get(full_name(name))
        return col.copy() if col is not None else np.full(len(self.steps), np.nan)

    def present(self, name: str) -> np.ndarray:
        """Boolean mask over ``steps``: where the metric was reported (finite or not)."""
        mask = self._present.get(full_name(name))
        return mask.copy() if mask is not None else np.zeros(len(self.steps), dtype=bool)

    def get(self, name: str) -> Series:
        """Only the steps where the metric was reported (non-finite values included)."""
        name = full_name(name)
        if name not in self._cols:
            return Series(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))
        mask = self._present[name]
        return Series(self.steps[mask], self._cols[name][mask])

    def with_prefix(self, prefix: str) -> list[str]:
        prefix = full_name(prefix)
        return [n for n in self.names if n.startswith(prefix)]

    def value_at(self, name: str, step: int) -> float | None:
        s = self.get(name)
        hit = np.nonzero(s.steps == step)[0]
        return float(s.values[hit[-1]]) if len(hit) else None

    def nonfinite(self) -> dict[str, list[int]]:
        """metric -> steps where it was reported non-finite."""
        out = {}
        for name, col in self._cols.items():
            bad = self._present[name] & ~np.isfinite(col)
            if bad.any():
                out[name] = [int(s) for s in self.steps[bad]]
        return dict(sorted(out.items()))

    def incident_steps(self) -> list[int]:
        return [int(r["step"]) for r in self.incidents if _step_of(r) is not None]


def _step_of(rec: dict) -> int | None:
    s = _as_float(rec.get("step"))
    return int(s) if s is not None and math.isfinite(s) else None


def _incident_key(rec: dict) -> tuple:
    s = _step_of(rec)
    return (s is None, s if s is not None else 0)


def load_run(run_dir) -> RunData:
    """Read ``metrics.jsonl`` and ``incidents.jsonl``; either may be missing, but not both."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    mpath, ipath = run_dir / METRICS_FILE, run_dir / INCIDENTS_FILE
    if not mpath.exists() and not ipath.exists():
        raise FileNotFoundError(
            f"{run_dir} has neither {METRICS_FILE} nor {INCIDENTS_FILE}; is it a run directory written by rl_guard?"
        )
    records = read_jsonl(mpath) if mpath.exists() else []
    incidents = read_jsonl(ipath) if ipath.exists() else []
    return RunData(run_dir, records, incidents)
