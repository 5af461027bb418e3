"""Which healthy snapshots a run would hold, computed from decisions alone: no state is captured or restored.

Shadow mode (``mode: shadow``) and ``rl-guard replay`` both need the answer the live guard gets from its snapshot
ring, ``can_rollback``, to say truthfully whether a rollback would have happened or escalated to
``checkpoint_and_halt``. ``SnapshotPlan`` follows the same schedule as ``Actions`` (``snapshot_due``), the same
``rollback.confirm_steps`` horizon and ``max_rollbacks`` budget, with step labels instead of tensors, so shadow mode
reads no weights and draws nothing the run could see.
"""

from __future__ import annotations

APPLIED = (None, "warn")  # decisions whose update reaches the weights: the step counts as healthy


def snapshot_due(streak: int, snapshots: dict) -> bool:
    """After ``healthy_steps`` consecutive healthy steps, then every ``every`` further healthy steps."""
    first = snapshots["healthy_steps"]
    return streak == first or (streak > first and (streak - first) % snapshots["every"] == 0)


class SnapshotPlan:
    def __init__(self, config, rules) -> None:
        self.snapshots, self.rollback_cfg = config.snapshots, config.rollback
        self.enabled = any(r.action == "rollback" for r in rules)  # as Actions: no rollback rule, no snapshots
        self.steps: list[int] = []
        self.streak = 0
        self.rollbacks = 0
        self.started = False
        self.last_restored: int | None = None

    def horizon(self, step: int) -> int:
        return step - self.rollback_cfg["confirm_steps"] + 1

    def can_rollback(self, step: int) -> bool:
        """A trusted snapshot exists and the rollback budget is not spent (else the controller escalates)."""
        return self.rollbacks < self.rollback_cfg["max_rollbacks"] and any(s < self.horizon(step) for s in self.steps)

    def rollback(self, step: int) -> int | None:
        """The snapshot a rollback at ``step`` would restore; newer ones belong to the abandoned trajectory."""
        trusted = [s for s in self.steps if s < self.horizon(step)]
        if not trusted:
            return None
        target = trusted[-1]
        if self.last_restored is not None and target <= self.last_restored and len(trusted) > 1:
            target = trusted[-2]  # the fault returned before a new healthy snapshot: one further back, as Actions
        self.steps = [s for s in self.steps if s <= target]
        self.streak, self.rollbacks, self.last_restored = 0, self.rollbacks + 1, target
        return target

    def after_step(self, action: str | None, step: int) -> None:
        """``action``: the decision's action (the would-be action in shadow mode)."""
        if not self.started:  # as Actions: the starting state, when the first check passes
            self.started = True
            if self.enabled and action in APPLIED and not self.steps:
                self.steps = [step]
        self.streak = self.streak + 1 if action in APPLIED else 0
        if self.enabled and snapshot_due(self.streak, self.snapshots):
            self.steps = (self.steps + [step + 1])[-self.snapshots["keep"] :]  # labelled as Actions: state after step
