"""Calibrating before arming: replay recorded runs through the rules (``rl-guard replay``) and propose thresholds
from healthy runs (``rl-guard suggest``). History readers: ``jsonl``, ``trainer_state``, ``tensorboard``,
``wandb_offline`` (one module per format, chosen by ``history.load_history``)."""

from .history import History, HistoryFormatError
from .load import load_history
from .loop import Replay, replay

__all__ = ["History", "HistoryFormatError", "load_history", "Replay", "replay"]
