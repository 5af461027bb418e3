"""AReaL's FSDP actor with the guard built in, for the launch modes where AReaL builds the engine itself.

Read against areal 1.0.4 (``areal/engine/fsdp_engine.py``, ``areal/infra/controller/train_controller.py``,
``areal/infra/rpc/guard/engine_blueprint.py``):

- Single-controller mode (``scheduler.type=local|ray|slurm``, AReaL's default): ``trainer.actor`` is a
  ``PPOActorController``; it sends ``f"{cls.__module__}.{cls.__name__}"`` of its engine class to every worker,
  whose RPC server imports that dotted path (``import_from_string``, any ``TrainEngine`` subclass) and builds the
  engine there. ``GuardedFSDPPPOActor`` is such a subclass: it installs the guard at the end of its own
  ``initialize`` (model, optimizer and LR schedule exist from then on), in the worker process.
- SPMD mode (``AREAL_SPMD_MODE=1``, torchrun): the same class is built in the trainer's process.
- The guard's settings reach the workers as environment variables (``RL_GUARD_*``, see ``settings``), which the
  controller passes through AReaL's own ``actor.scheduling_spec[*].env_vars`` (``areal_trainer.PPOTrainer`` sets
  them); without ``RL_GUARD_CONFIG`` the async preset is used with ``staleness_bound`` at
  ``RL_GUARD_MAX_HEAD_OFFPOLICYNESS``.
- Snapshots, save-and-halt and rollback go through the engine's own ``save`` / ``load`` (``SaveLoadMeta``,
  ``weight_format="dcp"``, ``with_optim=True``: torch.distributed.checkpoint of the FSDP2 model and optimizer,
  collective over the engine's ranks); the LR schedule, which DCP leaves out, is kept as its ``state_dict``.
  ``where: memory`` writes them under ``/dev/shm`` (RAM-backed), ``where: disk`` under the run directory.
- Resume: ``GuardedFSDPPPOActor.save`` / ``load`` add the guard's state (``rl_guard_rank<r>.pt``) to every DCP save
  and load outside the guard's snapshots, which is how AReaL's ``RecoverHandler`` writes and reads its recover
  checkpoints (``areal/utils/recover.py``), so a recovered run continues the guard's step and counters. The
  file holds plain data (dicts, lists, numbers, strings, tensors) and is read with ``torch.load(weights_only=True)``.
- Checked at attach: ``areal.check_seams`` on the engine, then ``save`` / ``load`` (``meta``) and ``SaveLoadMeta``'s
  ``path`` / ``weight_format`` / ``with_optim`` (``check_engine_state``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from areal.api.io_struct import SaveLoadMeta
from areal.engine.fsdp_engine import FSDPPPOActor

from ..control.ram_dir import ram_dir
from ..versions import require_seam
from . import CONFIG_ENV as CONFIG
from . import RUN_DIR_ENV as RUN_DIR
from . import areal as adapter
from .seams import announce, load_state, save_state

if TYPE_CHECKING:
    from ..guard import Guard

BOUND = "RL_GUARD_MAX_HEAD_OFFPOLICYNESS"


def settings(config_path: str | None, run_dir: str | None, max_head_offpolicyness: int | None) -> dict:
    """The environment variables a guarded engine reads (absolute paths: workers may start elsewhere)."""
    env = {}
    if config_path:
        env[CONFIG] = os.path.abspath(config_path)
    if run_dir:
        env[RUN_DIR] = os.path.abspath(run_dir)
    if max_head_offpolicyness is not None:
        env[BOUND] = str(int(max_head_offpolicyness))
    return env


def guard_from_env():
    from ..guard import Guard

    source = os.environ.get(CONFIG)
    if not source:
        bound = os.environ.get(BOUND)
        if bound is None:
            announce(
                f"neither {CONFIG} nor {BOUND} is set in this worker: the async preset with staleness_bound at 0 "
                "(synchronous); areal_trainer.PPOTrainer sets it from rollout.max_head_offpolicyness"
            )
            bound = "0"
        source = adapter.async_yaml(int(bound))
    return Guard.from_yaml(source, run_dir=os.environ.get(RUN_DIR) or "runs/rl_guard")


def check_engine_state(engine) -> None:
    """``save`` / ``load`` and the ``SaveLoadMeta`` fields ``EngineState`` uses (``SeamError`` names the one)."""
    at = adapter.describe_tested()
    for name in ("save", "load"):
        require_seam(engine, name, params=("meta",), where=at)
    require_seam(SaveLoadMeta, "__init__", params=("path", "weight_format", "with_optim"), where=at)


class EngineState:
    """The guard's state protocol over the engine's own ``save`` / ``load`` (DCP, model + optimizer)."""

    def __init__(self, engine, guard):
        check_engine_state(engine)
        self.engine, self.guard, self.model, self.optimizer = engine, guard, engine.model, engine.optimizer
        where = guard.config.snapshots.get("where", "memory")
        # where: memory -> RAM (/dev/shm), freed when this node's last rank of the run exits
        self.snapshot_dir = ram_dir(guard.run_dir, guard.rank, where=where) or Path(guard.run_dir) / "areal_snapshots"
        self.checkpoint_dir = Path(guard.run_dir) / "areal_checkpoints"
        if guard.rank == 0:  # snapshots of an earlier process are not this run's (its ranks save after this point)
            shutil.rmtree(self.snapshot_dir, ignore_errors=True)

    def capture(self, step: int) -> dict:
        # the guard asks for a snapshot with the step it is about to start, for a checkpoint with the current one
        snapshot = step > self.guard.step
        path = (self.snapshot_dir if snapshot else self.checkpoint_dir) / f"step{step}"
        self.engine.save(SaveLoadMeta(path=str(path), weight_format="dcp", with_optim=True))
        sched = self.engine.lr_scheduler  # checked at attach (areal.check_seams); None: no schedule
        return {
            "step": step,
            "path": str(path),
            "lr_scheduler": None if sched is None else sched.state_dict(),
            "version": self.engine.get_version(),
        }

    def discard(self, snap: dict) -> None:
        """A snapshot the guard will no longer restore: removed (rank 0; the ranks of a node share the directory)."""
        if self.guard.rank == 0:
            shutil.rmtree(snap["path"], ignore_errors=True)

    def restore(self, snap: dict, lr_scale: float = 1.0) -> None:
        self.engine.load(SaveLoadMeta(path=snap["path"], weight_format="dcp", with_optim=True))
        sched = self.engine.lr_scheduler
        if sched is not None and snap["lr_scheduler"] is not None:
            sched.load_state_dict(snap["lr_scheduler"])
        if lr_scale != 1.0:
            from ..control.state import scale_lr

            scale_lr(self.engine.optimizer, sched, lr_scale)


def install_with_engine_state(engine, guard):
    """``areal.install`` plus snapshots / rollback through the engine's own save / load."""
    adapter.install(engine, guard)
    guard.attach_state(EngineState(engine, guard))
    return guard


class GuardedFSDPPPOActor(FSDPPPOActor):
    """``FSDPPPOActor`` that guards itself once initialised (dotted path:
    ``rl_guard.adapters.areal_engine.GuardedFSDPPPOActor``)."""

    rl_guard: Guard | None = None

    def initialize(self, *args, **kwargs):
        out = super().initialize(*args, **kwargs)
        self.rl_guard = install_with_engine_state(self, guard_from_env())
        return out

    def save(self, meta: SaveLoadMeta):
        """AReaL's own save (``RecoverHandler`` recover checkpoints are DCP saves with the optimizer), plus the
        guard's state beside it, so that a recovered run resumes the guard's step, counters and windows."""
        super().save(meta)
        guard = self.rl_guard
        if guard is not None and meta.weight_format == "dcp" and not self._guard_snapshot(guard, meta.path):
            with guard.protect("save guard state"):
                save_state(guard.state_dict(), self._guard_state_path(guard, meta.path))

    def load(self, meta: SaveLoadMeta):
        """AReaL's own load, plus the guard's state saved beside it (not on the guard's own rollback, which keeps
        its counters)."""
        super().load(meta)
        guard = self.rl_guard
        if guard is None or self._guard_snapshot(guard, meta.path):
            return
        path = self._guard_state_path(guard, meta.path)
        if path.exists():
            guard.load_state_dict(load_state(path))

    @staticmethod
    def _guard_state_path(guard: Guard, path: str) -> Path:
        return Path(path) / f"rl_guard_rank{guard.rank}.pt"

    @staticmethod
    def _guard_snapshot(guard: Guard, path: str) -> bool:
        snapshots = getattr(guard.state, "snapshot_dir", None)
        return snapshots is not None and Path(path).resolve().is_relative_to(Path(snapshots).resolve())

    def rl_guard_summary(self) -> dict:
        """For the controller (``_custom_function_call``): the guard's last logged metrics on this rank."""
        g = self.rl_guard
        return (
            {} if g is None else {"step": g.step, "skipped": g.skipped_steps, "rollbacks": g.rollbacks, **g.last_logged}
        )
