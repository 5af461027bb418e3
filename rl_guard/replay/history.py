"""A recorded metric history in any format ``rl-guard replay`` reads, as step-ordered rl_guard metric records.

``load_history(path)`` accepts: the guard's own ``metrics.jsonl`` (or a run directory holding one); a
transformers/TRL ``trainer_state.json`` (or a checkpoint directory holding one); a TensorBoard event directory (or
one event file); an offline wandb run directory (or its ``run-*.wandb`` file). Anything else is a
``HistoryFormatError`` saying what was found and what is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Fewest healthy values a condition is calibrated from by ``rl-guard suggest`` (its --min-steps). The preset's spike
# rules judge each step against the last 50 (update_jump, entropy_spike, logprob_jump, reward_collapse,
# length_collapse: window 50), so a shorter history has not shown the step-to-step spread those rules will see; and
# the default quantile 0.99 of fewer than 50 values is the sample's maximum or within one value of it. Calibrated
# from less, thresholds come out far tighter than the preset's and fire on the next healthy run: a healthy 20-step
# demo run (rl-guard demo --fault none --steps 20) proposed robust-z limits of 0.1 (update_jump) and 1.91
# (entropy_spike) where the preset has 20, and lr_growth > 1.5 (lr_jump) where it has 10.
MIN_STEPS = 50

ACCEPTED = (
    "the guard's metrics.jsonl (or its run directory)",
    "a transformers/TRL trainer_state.json",
    "a TensorBoard event directory (events.out.tfevents.*)",
    "an offline wandb run directory (run-*.wandb)",
)


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
