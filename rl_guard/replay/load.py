"""Which history format a path holds, and reading it with that format's reader (one module per format)."""

from __future__ import annotations

import json
from pathlib import Path

from .history import History, HistoryFormatError


def detect(path: Path) -> str:
    """The format of ``path``; raises ``HistoryFormatError``."""
    if not path.exists():
        raise HistoryFormatError(path, "no such file or directory")
    if path.is_dir():
        if (path / "metrics.jsonl").is_file():
            return "jsonl"
        if (path / "trainer_state.json").is_file():
            return "trainer_state"
        if next(path.rglob("events.out.tfevents.*"), None) is not None:
            return "tensorboard"
        if next(path.rglob("run-*.wandb"), None) is not None:
            return "wandb"
        raise HistoryFormatError(
            path, "the directory holds no metrics.jsonl, trainer_state.json, TensorBoard event file or run-*.wandb file"
        )
    name = path.name
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.startswith("events.out.tfevents."):
        return "tensorboard"
    if name.endswith(".wandb"):
        return "wandb"
    if name.endswith(".json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HistoryFormatError(path, f"not valid JSON ({exc})") from exc
        if isinstance(data, dict) and isinstance(data.get("log_history"), list):
            return "trainer_state"
        raise HistoryFormatError(path, "a JSON file without a 'log_history' list (not a trainer_state.json)")
    raise HistoryFormatError(path, "unknown file type")


def load_history(path) -> History:
    path = Path(path)
    kind = detect(path)
    if kind == "jsonl":
        from .jsonl import read
    elif kind == "trainer_state":
        from .trainer_state import read
    elif kind == "tensorboard":
        from .tensorboard import read
    else:
        from .wandb_offline import read
    history = read(path)
    if not history.records:
        raise HistoryFormatError(path, f"read as {history.kind}, but it holds no step with a metric")
    return history
