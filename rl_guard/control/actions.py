"""Carrying out decisions on the attached ``TrainState``: drop the update, checkpoint, halt, roll back, snapshot.

- skip (every action but warn): gradients are set to ``None``, so ``optimizer.step()`` changes no parameter and no
  optimizer moment (torch optimizers skip parameters without a gradient).
- checkpoint: the full state (model, optimizer, scheduler, RNG, step, extra such as a data cursor, and the
  guard's own state) saved atomically per rank under ``run_dir/checkpoints/step_<N>/rank<r>.pt``.
- rollback: restores the newest healthy snapshot older than the suspect update bit for bit and scales the LR by
  ``lr_scale ** n`` on the n-th rollback.
- snapshots: taken after ``healthy_steps`` consecutive healthy steps, then every ``every`` healthy steps. A step
  is healthy when its update was applied (no rule fired, or only ``warn`` rules): a warn-level rule is by
  definition tolerated, and counting it as unhealthy would let one noisy warning disable rollback entirely.
- checkpoints: the newest ``checkpoint.keep`` step directories are kept; older ones are removed.
"""

from __future__ import annotations

import time

from ..stats import ranks
from .action_names import Action
from .checkpoint import SnapshotRing, atomic_save, prune_checkpoints
from .controller import Decision
from .shadow import SnapshotPlan, snapshot_due


class Actions:
    def __init__(self, guard):
        self.guard = guard
        cfg = guard.config
        self.snapshots = SnapshotRing(cfg.snapshots["keep"], cfg.snapshots["where"],
                                      guard.run_dir / "snapshots" / f"rank{guard.rank}", on_drop=self._discard)
        self.healthy_streak = 0
        self.pending_restore: dict | None = None
        self.last_checkpoint: str | None = None
        # mode shadow: no snapshot is ever taken; a plan of step labels says what a rollback would have restored.
        self.plan = SnapshotPlan(cfg, guard.controller.rules) if cfg.mode == "shadow" else None

    def rollback_horizon(self, step: int) -> int:
        """Snapshots labelled below this are trusted at ``step``. With ``rollback.confirm_steps`` = k, a snapshot
        counts as healthy only once k further updates went by: a bad update (a learning-rate blow-up) shows in the
        numbers one step later, or later still when the next steps only generate fresh rollouts (TRL with
        ``steps_per_generation`` / ``num_iterations`` > 1: set k to their product)."""
        return step - self.guard.config.rollback["confirm_steps"] + 1

    def can_rollback(self) -> bool:
        if self.plan is not None:
            return self.plan.can_rollback(self.guard.step)
        if self.guard.state is None:
            return False
        horizon = self.rollback_horizon(self.guard.step)
        return min(self.snapshots.steps(), default=horizon) < horizon

    def apply(self, decision: Decision, params, defer_restore: bool) -> None:
        if decision.firings:  # the samples that led here are worth reading, even after a crash
            with self.guard.protect("audit"):
                self.guard.diagnostics.flush()
        if self.plan is not None:
            return self._shadow(decision)
        if decision.skip_step and params is not None:
            drop_grads(params)
        ckpt = None
        if decision.save:
            assert decision.action is not None  # a save comes with a stopping action
            try:
                ckpt = self.save_checkpoint(reason=decision.action)
            except RuntimeError:
                for firing in decision.firings:  # the incident must not be lost with the checkpoint
                    self._incident(decision, firing, None)
                raise
        restored_to = None
        if decision.rollback:
            self.pending_restore = self.snapshots.latest(before_step=self.rollback_horizon(decision.step))
            restored_to = self.pending_restore["step"] if self.pending_restore else None
            if not defer_restore:
                self.restore_pending()
        for firing in decision.firings:
            self._incident(decision, firing, ckpt, restored_to)

    def _shadow(self, decision: Decision) -> None:
        """Record what would happen; leave gradients, weights, optimizer, scheduler and RNG alone."""
        assert self.plan is not None  # shadow mode
        if decision.action is not None:  # a decision from the failure policy, not the controller
            decision.would, decision.action = decision.action, None
        restored_to = self.plan.rollback(decision.step) if decision.would == "rollback" else None
        for firing in decision.firings:
            self._incident(decision, firing, None, restored_to)

    def restore_pending(self) -> int | None:
        """Restore the snapshot chosen by a rollback decision; returns its step."""
        snap, self.pending_restore = self.pending_restore, None
        if snap is None:
            return None
        cfg = self.guard.config.rollback
        # Compounds: the n-th rollback of the run resumes at lr_scale ** n of the snapshot's learning rate.
        self.guard.state.restore(snap, lr_scale=cfg["lr_scale"] ** (self.guard.controller.rollbacks + 1))
        self.snapshots.drop_after(snap["step"])
        self.healthy_streak = 0
        return snap["step"]

    def after_step(self, decision: Decision) -> None:
        self.healthy_streak = self.healthy_streak + 1 if decision.apply_step else 0
        cfg = self.guard.config.snapshots
        n = self.healthy_streak
        if self.plan is not None:
            return self.plan.after_step(decision.would, self.guard.step)
        due = snapshot_due(n, cfg)
        if self.guard.state is not None and due and self._uses_snapshots():
            self.snapshots.push(self.guard.state.capture(self.guard.step + 1))

    def _discard(self, snapshot: dict) -> None:
        """A snapshot the ring forgot: a state that keeps snapshots outside memory (an engine's checkpoint tags)
        frees it (``discard``)."""
        discard = getattr(self.guard.state, "discard", None)
        if discard is not None:
            discard(snapshot)

    def _uses_snapshots(self) -> bool:
        return any(r.action == "rollback" for r in self.guard.controller.rules)

    def save_checkpoint(self, reason: str) -> str | None:
        """Every rank saves its own state; a failure on any rank fails the action on all ranks."""
        g = self.guard
        if g.state is None:
            return None
        root = g.run_dir / g.config.checkpoint["dir"]
        path = root / f"step_{g.step:08d}" / f"rank{g.rank}.pt"
        error = None
        try:
            payload = g.state.capture(g.step)
            payload["guard"] = g.state_dict()
            payload["reason"] = reason
            atomic_save(payload, path)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = exc
        ranks.raise_if_any_rank_failed(error, f"checkpoint save to {path}")
        prune_checkpoints(root, path.name, g.config.checkpoint["keep"])
        self.last_checkpoint = str(path)
        return str(path)

    def _incident(self, decision: Decision, firing, ckpt: str | None, restored_to: int | None = None) -> None:
        g = self.guard
        if g.rank != 0:
            return
        v = firing.verdict
        record = {"step": decision.step, "rule": firing.rule.name, "metric": v.metric, "value": v.value, "op": v.op,
                  "threshold": v.threshold, "action": firing.action, "severity": firing.rule.severity,
                  "message": firing.message, "detail": v.detail, "rank": g.rank, "window": firing.window,
                  "checkpoint": ckpt, "time": time.time(), "escalated_from": decision.escalated_from,
                  "decision": decision.action,  # the step's action after precedence (``action`` is this rule's)
                  "restored_to_step": restored_to}  # rollback: the state from before this guard step was restored
        if self.plan is not None:  # shadow: the run only got this record; ``would`` is what the guard would have done
            record.update(action="warn", would=firing.action, mode="shadow", restored_to_step=None,
                          would_restore_to_step=restored_to)
        with g.protect("incident"):
            g.sinks.incident(record)
        lr_scale = g.config.rollback["lr_scale"] ** (g.controller.rollbacks + 1) if decision.rollback else None
        with g.protect("announce"):
            g.announcer.incident(record, lr_scale)

    def guard_incident(self, rule: str, message: str, action: Action | None) -> None:
        """An incident about the guard itself (e.g. it is failing internally and the run is unguarded)."""
        g = self.guard
        if g.rank == 0:
            g.sinks.incident({"step": g.step, "rule": rule, "metric": "rl_guard/guard/unguarded", "action": action,
                              "decision": action, "severity": "critical", "message": message, "rank": g.rank,
                              "time": time.time()})

    def state_dict(self) -> dict:
        return {"healthy_streak": self.healthy_streak, "snapshots": self.snapshots.state_dict(), "last_checkpoint": self.last_checkpoint}

    def load_state_dict(self, state: dict) -> None:
        self.healthy_streak = state["healthy_streak"]
        self.last_checkpoint = state["last_checkpoint"]
        self.snapshots.load_state_dict(state["snapshots"])


def drop_grads(params) -> None:
    """Discard every gradient so the optimizer step is a no-op for weights and moments."""
    from ..stats.grads import drop_grads as drop

    drop(params)
