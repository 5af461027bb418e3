"""A recorded metric history in any format ``rl-guard replay`` reads, as step-ordered rl_guard metric records.

``load_history(path)`` accepts: the guard's own ``metrics.jsonl`` (or a run directory holding one); a
transformers/TRL ``trainer_state.json`` (or a checkpoint directory holding one); a TensorBoard event directory (or
one event file); an offline wandb run directory (or its ``run-*.wandb`` file). Anything else is a
``HistoryFormatError`` saying what was found and what is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ACCEPTED = ("the guard's metrics.jsonl (or its run directory)", "a transformers/TRL trainer_state.json",
            "a TensorBoard event directory (events.out.tfevents.*)", "an offline wandb run directory (run-*.wandb)")


class HistoryFormatError(ValueError):
    """The path is not a history this version reads; the message lists what is accepted."""

    def __init__(self, path, why: str):
        super().__init__(f"{path}: {why}. rl-guard replay reads: " + "; ".join(ACCEPTED))


@dataclass
class History:
    """``records``: ``{"step": int, metric: float, ...}`` sorted by step (a repeated step: the last one wins)."""

    path: Path
    kind: str  # "rl_guard jsonl", "trainer_state", "tensorboard", "wandb offline"
    records: list[dict]
    origin: dict[str, str] = field(default_factory=dict)  # metric -> where its values came from

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]

    def count(self, metric: str) -> int:
        return sum(metric in r for r in self.records)


def ordered(rows: dict[int, dict]) -> list[dict]:
    return [{"step": step, **rows[step]} for step in sorted(rows)]


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
        raise HistoryFormatError(path, "the directory holds no metrics.jsonl, trainer_state.json, TensorBoard event "
                                       "file or run-*.wandb file")
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
