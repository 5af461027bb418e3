"""Calibrating before arming: replay recorded runs through the rules (``rl-guard replay``) and propose thresholds
from healthy runs (``rl-guard suggest``). History readers: ``jsonl``, ``trainer_state``, ``tensorboard``,
``wandb_offline`` (one module per format, chosen by ``history.load_history``).

The names below are imported on first use, so ``rl-guard replay --help`` does not load the controller (and torch).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "History": ".history",
    "HistoryFormatError": ".history",
    "load_history": ".load",
    "Replay": ".loop",
    "replay": ".loop",
}
__all__ = ["History", "HistoryFormatError", "load_history", "Replay", "replay"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
