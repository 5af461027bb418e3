"""Carrying out decisions on the attached ``TrainState``: drop the update, checkpoint, halt, roll back, snapshot.

- skip (every action but warn): gradients are set to ``None``, so ``optimizer.step()`` changes no parameter and no
  optimizer moment (torch optimizers skip parameters without a gradient).
- checkpoint: the full state (model, optimizer, scheduler, RNG, step, extra such as a data cursor, and the
  guard's own state) saved atomically per rank under ``run_dir/checkpoints/step_<N>/rank<r>.pt``.
- rollback: restores the newest healthy snapshot older than the suspect update bit for bit (weights, optimizer
  moments, scheduler, RNG, step, extra state) and changes two things, so the run does not replay what failed:
  the learning rate is ``lr_scale ** n`` of the schedule's after the n-th rollback of the run (each snapshot
  records the factor in force when it was taken, so the factor is the same whichever snapshot is restored, and a
  schedule that keeps rising after the restore, a warm-up, stays scaled: the scheduler's base rates are scaled);
  and when the fault returns before the run took a new healthy snapshot, the rollback goes one snapshot further
  back than the last one did (where the ring holds one). After ``max_rollbacks`` the next one escalates to
  ``checkpoint_and_halt``, and its message says why.
- snapshots: the state the process starts from (or resumes from), at its first check that passes (no update of
  this process can have harmed it, so a fault in the first steps has something to roll back to); then after
  ``healthy_steps`` consecutive healthy steps, then every ``every`` healthy steps. A step
  is healthy when its update was applied (no rule fired, or only ``warn`` rules): a warn-level rule is by
  definition tolerated, and counting it as unhealthy would let one noisy warning disable rollback entirely.
- checkpoints: the newest ``checkpoint.keep`` step directories are kept; older ones are removed.
"""

from __future__ import annotations

import time

from ..stats import ranks
from ..stats.culprits import family_of as token_family
from ..stats.culprits import host_candidates
from .action_names import Action
from .checkpoint import SnapshotRing, atomic_save, prune_checkpoints
from .controller import Decision
from .culprits import culprits_for, family_of, write_bundle
from .incident import incident_record
from .shadow import SnapshotPlan, snapshot_due


class Actions:
    def __init__(self, guard):
        self.guard = guard
        cfg = guard.config
        self.snapshots = SnapshotRing(
            cfg.snapshots["keep"],
            cfg.snapshots["where"],
            guard.run_dir / "snapshots" / f"rank{guard.rank}",
            on_drop=self._discard,
        )
        self.healthy_streak = 0
        self.pending_restore: dict | None = None
        self.last_checkpoint: str | None = None
        self.lr_factor = 1.0  # lr_scale ** (rollbacks so far): the factor on the schedule's learning rate
        self.last_restored: int | None = None  # the step label of the snapshot the last rollback restored
        self.further_back = False  # the pending rollback goes further back than the last one
        self._first_check = True  # the first check of this process (its starting state may become a snapshot)
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

    def apply(self, decision: Decision, params, defer_restore: bool, kept: list | None = None) -> None:
        if decision.firings:  # the samples that led here are worth reading, even after a crash
            with self.guard.protect("audit"):
                self.guard.diagnostics.flush()
        if self.plan is not None:
            return self._shadow(decision)
        culprits = self._culprits(decision, kept or [])
        quarantined = self._quarantine(decision, culprits)
        self._starting_snapshot(decision)
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
            self.pending_restore = self._rollback_target(decision.step)
            restored_to = self.pending_restore["step"] if self.pending_restore else None
            if not defer_restore:
                self.restore_pending()
        bundle = self._bundle(decision, culprits, ckpt, restored_to)
        for firing in decision.firings:
            self._incident(decision, firing, ckpt, restored_to, culprits.get(firing.rule.name), bundle, quarantined)

    def _culprits(self, decision: Decision, kept: list) -> dict[str, list[dict]]:
        """Per acting rule, the sequences behind it (at most ``quarantine.culprits``): from the adapter's reward
        candidates, or the step's most extreme sequences of the rule's token family (read on the host now)."""
        g, k = self.guard, self.guard.config.quarantine["culprits"]
        out = {}
        for f in decision.firings:
            if f.action == "warn":
                continue
            family = token_family(f.verdict.metric)
            with g.protect("culprits"):
                out[f.rule.name] = (
                    host_candidates(kept, family, k, g.describe_sequence)
                    if family
                    else culprits_for(f.verdict.metric, g.culprits_of(family_of(f.verdict.metric)))[:k]
                )
        return out

    def _quarantine(self, decision: Decision, culprits: dict[str, list[dict]]) -> list[dict]:
        """Quarantine the prompts behind a skip or rollback; past ``max_share`` of the data, halt instead."""
        g, cfg = self.guard, self.guard.config.quarantine
        if not cfg["enabled"] or decision.action not in ("skip_step", "rollback"):
            return []
        new = []
        for rule, found in culprits.items():
            new += g.quarantine.add(found, decision.step, rule, g.run_dir if g.rank == 0 else None)
        if ranks.any_rank(g.quarantine.over_limit()):  # every rank took this decision, so every rank is here
            decision.escalated_from, decision.action = decision.action, "checkpoint_and_halt"
            decision.escalation_reason = (
                f"{len(g.quarantine)} quarantined prompts, {g.quarantine.share():.1%} of "
                f"the data, over quarantine.max_share={cfg['max_share']:g}: a reward or "
                "data source that fails this often is broken"
            )
        return new

    def _bundle(self, decision: Decision, culprits: dict, ckpt: str | None, restored_to: int | None) -> str | None:
        """``run_dir/incidents/<step>/`` for a step a rule acted on (rank 0); its folder, or None."""
        g = self.guard
        acting = [f for f in decision.firings if f.action != "warn"]
        if g.rank != 0 or not acting:
            return None
        from .state import rng_state

        lrs = [float(group["lr"]) for group in getattr(getattr(g.state, "optimizer", None), "param_groups", [])]
        record = {
            "step": decision.step,
            "decision": decision.action,
            "escalated_from": decision.escalated_from,
            "rules": [
                {
                    "rule": f.rule.name,
                    "metric": f.verdict.metric,
                    "value": f.verdict.value,
                    "op": f.verdict.op,
                    "threshold": f.verdict.threshold,
                    "action": f.action,
                    "message": f.message,
                    "window": f.window,
                    "culprits": culprits.get(f.rule.name, []),
                }
                for f in decision.firings
            ],
            "learning_rates": lrs,
            "checkpoint": ckpt,
            "restored_to_step": restored_to,
            "counters": g.controller.counters(decision),
            "quarantined_prompts": len(g.quarantine),
        }
        with g.protect("incident bundle"):
            folder, size, seconds = write_bundle(g.run_dir, decision.step, record, rng_state())
            g.last_bundle = {"path": str(folder), "bytes": size, "seconds": seconds}
            return str(folder)
        return None

    def _shadow(self, decision: Decision) -> None:
        """Record what would happen; leave gradients, weights, optimizer, scheduler and RNG alone."""
        assert self.plan is not None  # shadow mode
        if decision.action is not None:  # a decision from the failure policy, not the controller
            decision.would, decision.action = decision.action, None
        restored_to = self.plan.rollback(decision.step) if decision.would == "rollback" else None
        for firing in decision.firings:
            self._incident(decision, firing, None, restored_to)

    def _rollback_target(self, step: int) -> dict | None:
        """The newest trusted snapshot; one further back when that is the one the last rollback restored (the fault
        returned before the run took a new healthy snapshot) and an older one is kept."""
        snap = self.snapshots.latest(before_step=self.rollback_horizon(step))
        self.further_back = False
        if snap is not None and self.last_restored is not None and snap["step"] <= self.last_restored:
            older = self.snapshots.latest(before_step=snap["step"])
            if older is not None:
                snap, self.further_back = older, True
        return snap

    def _starting_snapshot(self, decision: Decision) -> None:
        """At the process's first check, when it passes and no snapshot is kept (a resumed run may bring its own):
        the state the process starts from, labelled with this step (the state before its update)."""
        if not self._first_check:
            return
        self._first_check = False
        if (
            decision.action in (None, "warn")
            and not len(self.snapshots)
            and self.guard.state is not None
            and self._uses_snapshots()
        ):
            with self.guard.protect("snapshot"):
                self._push(self.guard.state.capture(self.guard.step))

    def _push(self, snap: dict) -> None:
        snap["lr_factor"] = self.lr_factor  # the factor in force on the rate this snapshot holds
        self.snapshots.push(snap)

    def restore_pending(self) -> int | None:
        """Restore the snapshot chosen by a rollback decision; returns its step."""
        snap, self.pending_restore = self.pending_restore, None
        if snap is None:
            return None
        cfg = self.guard.config.rollback
        # Cumulative: after the n-th rollback of the run the rate is lr_scale ** n of the schedule's, whatever
        # factor was in force when the restored snapshot was taken.
        target = cfg["lr_scale"] ** (self.guard.controller.rollbacks + 1)
        self.guard.state.restore(snap, lr_scale=target / float(snap.get("lr_factor", 1.0)))
        self.lr_factor, self.last_restored = target, snap["step"]
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
            self._push(self.guard.state.capture(self.guard.step + 1))

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

    def _incident(
        self,
        decision: Decision,
        firing,
        ckpt: str | None,
        restored_to: int | None = None,
        culprits: list[dict] | None = None,
        bundle: str | None = None,
        quarantined: list[dict] | None = None,
    ) -> None:
        g = self.guard
        if g.rank != 0:
            return
        record = incident_record(
            decision,
            firing,
            rank=g.rank,
            checkpoint=ckpt,
            time=time.time(),
            restored_to=restored_to,
            culprits=culprits,
            bundle=bundle,
            quarantined=quarantined,
        )
        if restored_to is not None and self.further_back:
            record["further_back"] = True  # the fault returned before a new healthy snapshot: one further back
        if self.plan is not None:  # shadow: the run only got this record; ``would`` is what the guard would have done
            record.update(
                action="warn",
                would=firing.action,
                mode="shadow",
                restored_to_step=None,
                would_restore_to_step=restored_to,
            )
        with g.protect("incident"):
            g.sinks.incident(record)
        lr_scale = g.config.rollback["lr_scale"] ** (g.controller.rollbacks + 1) if decision.rollback else None
        with g.protect("announce"):
            g.announcer.incident(record, lr_scale)

    def guard_incident(self, rule: str, message: str, action: Action | None) -> None:
        """An incident about the guard itself (e.g. it is failing internally and the run is unguarded)."""
        g = self.guard
        if g.rank == 0:
            g.sinks.incident(
                {
                    "step": g.step,
                    "rule": rule,
                    "metric": "rl_guard/guard/unguarded",
                    "action": action,
                    "decision": action,
                    "severity": "critical",
                    "message": message,
                    "rank": g.rank,
                    "time": time.time(),
                }
            )

    def state_dict(self) -> dict:
        return {
            "healthy_streak": self.healthy_streak,
            "snapshots": self.snapshots.state_dict(),
            "last_checkpoint": self.last_checkpoint,
            "lr_factor": self.lr_factor,
            "last_restored": self.last_restored,
        }

    def load_state_dict(self, state: dict) -> None:
        self.healthy_streak = state["healthy_streak"]
        self.last_checkpoint = state["last_checkpoint"]
        self.lr_factor = state.get("lr_factor", 1.0)
        self.last_restored = state.get("last_restored")
        self.snapshots.load_state_dict(state["snapshots"])


def drop_grads(params) -> None:
    """Discard every gradient so the optimizer step is a no-op for weights and moments."""
    from ..stats.grads import drop_grads as drop

    drop(params)
