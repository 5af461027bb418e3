"""A transformers ``trainer_state.json``: ``log_history`` entries, TRL keys mapped onto rl_guard names.

Entries without a training metric (evaluation ``eval_*`` lines, the final ``train_runtime`` summary) are skipped.
Steps are the trainer's ``global_step`` (the number of optimizer steps done when the entry was logged).
"""

from __future__ import annotations

import json
from pathlib import Path

from .history import History, HistoryFormatError, ordered
from .names import carry_generation, map_record


def read(path: Path) -> History:
    path = path / "trainer_state.json" if path.is_dir() else path
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("log_history"), list):
        raise HistoryFormatError(path, "no 'log_history' list")
    rows: dict[int, dict] = {}
    origin: dict[str, str] = {}
    for entry in data["log_history"]:
        if not isinstance(entry, dict) or "train_runtime" in entry or not isinstance(entry.get("step"), int):
            continue
        metrics, where = map_record({k: v for k, v in entry.items() if not k.startswith("eval_")})
        if metrics:
            rows.setdefault(entry["step"], {}).update(metrics)
            origin.update(where)
    carry_generation(rows, origin)
    return History(path, "trainer_state", ordered(rows), origin)
