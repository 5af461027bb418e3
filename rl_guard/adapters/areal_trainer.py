"""AReaL's ``PPOTrainer`` with a guarded actor, in either launch mode; a drop-in for ``from areal import PPOTrainer``.

    from rl_guard.adapters.areal_trainer import PPOTrainer     # was: from areal import PPOTrainer

    with PPOTrainer(config, train_dataset=..., valid_dataset=...) as trainer:   # unchanged
        trainer.train(workflow=..., eval_workflow=...)

Guard settings (optional; environment of the launching shell): ``RL_GUARD_CONFIG`` (a guard YAML; default: the
async preset with ``staleness_bound`` at ``rollout.max_head_offpolicyness``) and ``RL_GUARD_RUN_DIR`` (default
``<cluster.fileroot>/rl_guard/<experiment_name>/<trial_name>``).

Read against areal 1.0.4 (``areal/trainer/rl_trainer.py``): ``PPOTrainer.__init__`` builds the actor with
``self._create_train_engine(config.actor, self.actor_alloc)``, which picks ``FSDPPPOActor`` for the ``fsdp``
backend and calls ``FSDPPPOActor.as_controller(config, scheduler)`` in single-controller mode or
``FSDPPPOActor(config=...)`` in SPMD mode. This subclass does the same with ``GuardedFSDPPPOActor`` for the actor
only (the reference model and the critic are left alone), and passes the guard's settings to the actor's workers
through ``actor.scheduling_spec[*].env_vars``, the field AReaL itself uses for worker environment variables.
Before it builds the actor it checks what it relies on (``check_seams``): the parent's ``_create_train_engine``
(``actor_config``, ``alloc``), ``as_controller`` / ``create_process_group``, and the config values it reads; a
missing or changed one raises ``SeamError`` naming the version and the seam.
"""

from __future__ import annotations

import os

from areal.trainer.rl_trainer import PPOTrainer as _PPOTrainer
from areal.utils.environ import is_single_controller

from ..versions import SeamError, require_attr, require_seam
from .areal import check_versions, describe_tested
from .areal_engine import BOUND, CONFIG, RUN_DIR, GuardedFSDPPPOActor, settings


def check_seams(trainer, actor_config, alloc) -> None:
    """What ``PPOTrainer._create_train_engine`` relies on, before it builds the guarded actor."""
    at = describe_tested()
    require_seam(GuardedFSDPPPOActor, "as_controller", params=("config", "scheduler"), where=at)
    require_seam(GuardedFSDPPPOActor, "create_process_group", params=("parallel_strategy",), where=at)
    config = trainer.config
    require_attr(config, ("cluster", "experiment_name", "trial_name", "rollout", "actor"), where=at)
    require_attr(config.cluster, ("fileroot",), where=at)
    require_attr(config.rollout, ("max_head_offpolicyness",), where=at)
    require_attr(actor_config, ("scheduling_spec",), where=at)
    require_attr(alloc, ("backend", "parallel"), where=at)


def guard_settings(config) -> dict:
    default_dir = os.path.join(config.cluster.fileroot, "rl_guard", config.experiment_name, config.trial_name)
    return settings(
        os.environ.get(CONFIG), os.environ.get(RUN_DIR) or default_dir, int(config.rollout.max_head_offpolicyness)
    )


class PPOTrainer(_PPOTrainer):
    def __init__(self, *args, **kwargs):
        """AReaL's ``__init__``; it must build the actor through ``_create_train_engine`` (checked before and after:
        a release that builds it elsewhere would train unguarded)."""
        check_versions()
        require_seam(_PPOTrainer, "_create_train_engine", params=("actor_config", "alloc"), where=describe_tested())
        self._rl_guard_actor = False
        super().__init__(*args, **kwargs)
        if not self._rl_guard_actor:
            raise SeamError(
                f"rl_guard: AReaL's PPOTrainer built its actor without _create_train_engine "
                f"({describe_tested()}); the actor would run unguarded"
            )

    def _create_train_engine(self, actor_config, alloc):
        if actor_config is not self.config.actor:  # the reference model, the critic
            return super()._create_train_engine(actor_config, alloc)
        check_seams(self, actor_config, alloc)
        self._rl_guard_actor = True
        if alloc.backend != "fsdp":  # loud, not an unguarded run
            raise SeamError(f"rl_guard guards AReaL's fsdp backend; this actor's backend is {alloc.backend!r}")
        env = guard_settings(self.config)
        if is_single_controller():
            for spec in actor_config.scheduling_spec:
                spec.env_vars.update(env)
            actor = GuardedFSDPPPOActor.as_controller(actor_config, self.scheduler)
        else:
            os.environ.update(env)
            actor = GuardedFSDPPPOActor(config=actor_config)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor


__all__ = ["PPOTrainer", "GuardedFSDPPPOActor", "CONFIG", "RUN_DIR", "BOUND"]
