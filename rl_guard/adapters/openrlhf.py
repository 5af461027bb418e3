"""OpenRLHF adapter: guard the PPO actor of OpenRLHF's Ray trainer (``ActorPPOTrainer``).

Supported: openrlhf >= 0.11, < 0.12 (matched against 0.11.2 and the DeepSpeed 0.19.6 / Ray 2.55.0 it pins).
Without editing OpenRLHF: ``python -m rl_guard.adapters.openrlhf_launch --rl_guard.config configs/ppo.yaml
<train_ppo_ray arguments>`` (a Ray worker hook calls ``install`` on every ``ActorPPOTrainer`` and restores the
guard's state on resume). By hand, in the actor process once the trainer exists:
``install(self.trainer, Guard.from_yaml("configs/ppo.yaml"))``; in a hand-written step: ``guard_policy_loss`` at the
PolicyLoss call, ``gate_optimizer_step`` on the strategy and ``attach_checkpoints`` for save / rollback. OpenRLHF
internals relied on:

- ``Experience``: ``action_log_probs`` = the trainer's recompute of the rollout policy (PPO's old),
  ``rollout_log_probs`` = vLLM's (only with ``is_correction_level != "off"``), ``base_action_log_probs`` = the
  reference, all ``(B, A)`` over ``action_mask``. With rollout log-probs: behaviour = vLLM, proximal = old, so
  ``importance_weight`` is the ratio PolicyLoss clips and ``behave_imp_weight`` its train/rollout IS ratio.
- ``training_step``: current log-probs and ``output.entropy`` (only with ``--actor.entropy_coef``; 0 = log only)
  from ``self.actor(..., return_output=True)``; ``self.actor_loss_fn(...)`` returns a 5-tuple;
  ``strategy.optimizer_step`` runs every micro-batch and DeepSpeed updates only at its accumulation boundary,
  so the guard decides there, before ``engine.step``. Under ZeRO the ``grad/*`` family comes from the optimizer's
  gradient partitions (``rl_guard/adapters/deepspeed.py``).
- Skip on ZeRO 1-3: the optimizer's own overflow path (gradient partitions freed, ``skipped_steps`` counted, LR
  schedule held; with fp16 the loss scale halves as on a real overflow). Elsewhere: gradients dropped.
- Save / rollback: ``strategy.save_ckpt`` / ``load_ckpt`` with the guard's state in ``client_state["rl_guard"]``
  (``load_guard_state`` on resume); with ``snapshots: {where: memory}`` the snapshot tags go to ``/dev/shm``
  (``memory_dir``), checkpoints for save-and-halt to ``ckpt_dir`` on disk; vLLM gets restored weights at the next
  ``broadcast_to_vllm``. ``ppo_train``'s status (logged as ``train/<key>``) gets the last step's ``rl_guard/*``. A
  halt raises ``GuardHalted``.
- Checked at attach (``check_seams``, before anything is wrapped): openrlhf in the tested range (0.11.x), every
  method wrapped or called here with the parameters it reads by name, ``PolicyLoss``'s ``policy_loss_type`` /
  ``clip_eps_low`` / ``clip_eps_high``, ``args.ckpt.path``, the ``Experience`` fields read, and the DeepSpeed
  engine (``deepspeed.check_engine``). A missing or changed one raises ``SeamError`` naming the version, the tested
  range and the seam. A skip DeepSpeed did not take escalates to checkpoint-and-halt (``deepspeed.suppressed_step``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import shutil
import sys

from .. import TokenBatch
from ..control.ram_dir import ram_dir
from ..control.state import scale_lr
from ..versions import SeamError, check_range, require_attr, require_seam
from .deepspeed import MasterPartitions, gated_step, is_engine, skip_path
from .seams import arguments, halted, where

TESTED = {"openrlhf": ("0.11", "0.12")}  # constraints/openrlhf.txt: openrlhf 0.11.2
# What install wraps or calls, with the parameters it reads by name, and the settings token_batch reads.
TRAINER_METHODS = {"training_step": ("experience",), "ppo_train": ()}
TRAINER_ATTRS = ("strategy", "actor", "actor_optim", "actor_scheduler", "args", "actor_loss_fn")
LOSS_PARAMS = ("log_probs", "old_log_probs", "advantages", "action_mask", "rollout_log_probs")
LOSS_ATTRS = ("policy_loss_type", "clip_eps_low", "clip_eps_high")
STRATEGY_METHODS = {
    "save_ckpt": ("model", "save_dir", "tag", "max_num", "max_mem", "client_state"),
    "load_ckpt": ("model", "load_dir", "tag"),
    "optimizer_step": ("model",),
}
EXPERIENCE_MODULE = "openrlhf.trainer.ppo_utils.experience"
# Experience fields as of openrlhf 0.11.2 (tests compare with the real dataclass) and the ones read here.
EXPERIENCE_FIELDS = (
    "sequences",
    "attention_mask",
    "action_mask",
    "action_log_probs",
    "base_action_log_probs",
    "rollout_log_probs",
    "values",
    "returns",
    "advantages",
    "kl",
    "rewards",
    "scores",
    "response_length",
    "truncated",
    "total_length",
    "index",
    "prompts",
    "labels",
    "images",
    "mm_train_inputs",
    "info",
)
FIELDS_READ = (
    "action_mask",
    "action_log_probs",
    "base_action_log_probs",
    "rollout_log_probs",
    "advantages",
    "rewards",
    "response_length",
    "truncated",
    "info",
)


def token_batch(experience, log_probs, entropy=None, policy_loss=None) -> TokenBatch:
    """One micro-batch's ``TokenBatch``: the Experience plus the current log-probs / entropy ``(B, A)``."""

    def per_seq(t):
        return t.reshape(-1).to(log_probs.device) if hasattr(t, "numel") and t.numel() == log_probs.shape[0] else None

    loss_type = policy_loss.policy_loss_type  # PolicyLoss's settings (LOSS_ATTRS, checked at attach)
    old, rollout = experience.action_log_probs, experience.rollout_log_probs
    behaviour, prox = old, None
    if rollout is not None:  # GSPO's ratio is pi/pi_rollout itself; PPO's is pi/pi_old with pi_old/pi_rollout as IS
        behaviour, prox = (rollout, None) if loss_type == "gspo" else (rollout, old)
    rewards = experience.rewards if experience.rewards is not None else experience.info.get("reward")
    entropy = None if entropy is None else entropy[:, -log_probs.shape[1] :].detach()  # (B, T-1) -> (B, A)
    return TokenBatch(
        logprobs=log_probs.detach(),
        mask=experience.action_mask.bool(),
        old_logprobs=behaviour.detach(),
        prox_logprobs=None if prox is None else prox.detach(),
        ref_logprobs=experience.base_action_log_probs,
        entropy=entropy,
        advantages=experience.advantages,
        rewards=per_seq(rewards),
        lengths=per_seq(experience.response_length),
        truncated=per_seq(experience.truncated),
        eps_low=float(policy_loss.clip_eps_low),
        eps_high=float(policy_loss.clip_eps_high),
        importance_sampling_level="sequence" if loss_type == "gspo" else "token",
    )


def guard_policy_loss(guard, policy_loss, experience, log_probs, entropy=None, **loss_batch_info):
    """Call ``PolicyLoss`` as ``training_step`` does, observe the micro-batch, return its 5-tuple unchanged."""
    out = policy_loss(
        log_probs,
        experience.action_log_probs,
        experience.advantages,
        action_mask=experience.action_mask,
        rollout_log_probs=experience.rollout_log_probs,
        **loss_batch_info,
    )
    with guard.protect("observe (OpenRLHF Experience)"):  # a renamed field must not kill training
        guard.observe(token_batch(experience, log_probs, entropy, policy_loss), loss=out[0].detach())
    return out


class CheckpointState(MasterPartitions):
    """The guard's state protocol over OpenRLHF checkpoints: a snapshot is a ``strategy.save_ckpt`` tag.

    ``snapshot_dir``: where rollback snapshots go (``where: memory``: a RAM-backed tmpfs directory, see
    ``memory_dir``); checkpoints for save-and-halt always go to ``ckpt_dir`` on disk. The guard asks for a
    snapshot with the step it is about to start (``guard.step + 1``) and for a checkpoint with the current one."""

    def __init__(
        self,
        guard,
        strategy,
        actor,
        optimizer,
        scheduler,
        ckpt_dir: str,
        max_num: int = 3,
        max_mem=1000,
        snapshot_dir: str | None = None,
    ):
        self.guard, self.strategy, self.model, self.optimizer = guard, strategy, actor, optimizer
        self.scheduler, self.ckpt_dir, self.max_num, self.max_mem = scheduler, ckpt_dir, max_num, max_mem
        self.snapshot_dir = snapshot_dir or ckpt_dir

    def capture(self, step: int) -> dict:
        tag = f"rl_guard_step{step}"
        where = self.snapshot_dir if step > self.guard.step else self.ckpt_dir
        self.strategy.save_ckpt(
            _engine(self.model),
            where,
            tag,
            self.max_num,
            self.max_mem,
            client_state={"rl_guard": self.guard.state_dict()},
        )
        return {"step": step, "tag": tag, "ckpt_dir": where}

    def discard(self, snap: dict) -> None:
        """A snapshot the guard will no longer restore: its tag is removed (rank 0, as ``save_ckpt`` rotates), so
        ``save_ckpt``'s own rotation (oldest first, ``max_num``) never reaches a tag the guard still offers."""
        if self.guard.rank == 0:
            shutil.rmtree(os.path.join(snap["ckpt_dir"], snap["tag"]), ignore_errors=True)

    def restore(self, snap: dict, lr_scale: float = 1.0) -> None:
        path, _ = self.strategy.load_ckpt(_engine(self.model), snap["ckpt_dir"], tag=snap["tag"])
        if path is None:
            raise RuntimeError(f"rl_guard rollback: no checkpoint {snap['tag']!r} under {snap['ckpt_dir']}")
        if lr_scale != 1.0:
            scale_lr(self.optimizer, self.scheduler, lr_scale)


def load_guard_state(guard, client_states: dict) -> bool:
    """On resume: restore the guard from ``strategy.load_ckpt``'s client states (``self.checkpoint_states``)."""
    if not client_states or "rl_guard" not in client_states:
        return False
    guard.load_state_dict(client_states["rl_guard"])
    return True


def _engine(model):
    """The DeepSpeed engine of OpenRLHF's ``Actor`` (``.model``), or ``model`` when it is the engine already (a
    DeepSpeedEngine forwards unknown attributes to its module, so its ``.model`` would be the HF inner model)."""
    return model if is_engine(model) else getattr(model, "model", model)


def gate_optimizer_step(strategy, actor, guard) -> None:
    """Wrap ``strategy.optimizer_step`` (this instance): at the actor's accumulation boundaries only, check the
    guard, then apply, skip, roll back or halt."""
    original = require_seam(strategy, "optimizer_step", params=STRATEGY_METHODS["optimizer_step"], where=_where())
    path = skip_path(_engine(actor))  # a DeepSpeed engine: deepspeed.check_engine

    @functools.wraps(original)
    def optimizer_step(*args, **kwargs):
        engine = _engine(arguments(original, args, kwargs)["model"])
        boundary = getattr(engine, "is_gradient_accumulation_boundary", lambda: True)()  # plain optimizers: always
        if engine is not _engine(actor) or not boundary:  # another model (a critic), or DeepSpeed accumulates
            return original(*args, **kwargs)
        decision, out = gated_step(guard, engine, functools.partial(original, *args, **kwargs), path)
        guard.take_restored()
        guard.step_done()
        if decision.stop:
            raise halted(guard, decision)
        return out

    strategy.optimizer_step = optimizer_step


def memory_dir(guard, name: str = "actor") -> str | None:
    """For ``snapshots: {where: memory}``: a directory on the RAM-backed ``/dev/shm`` (one per run directory,
    freed when this node's last rank exits). Snapshots stay DeepSpeed checkpoints: under ZeRO the parameters
    (stage 3), the fp32 master weights and the optimizer moments (stages 1-3) are partitions inside DeepSpeed's
    optimizer that only ``save_checkpoint`` / ``load_checkpoint`` write and restore consistently, so they are
    written to memory, not copied in Python."""
    path = ram_dir(guard.run_dir, guard.rank, name, guard.config.snapshots.get("where", "memory"))
    return None if path is None else str(path)


def attach_checkpoints(guard, strategy, actor, optimizer, scheduler, ckpt_dir: str, snapshot_dir: str | None = None):
    """Give the guard OpenRLHF's checkpoint path as its state (snapshots, save-and-halt, rollback)."""
    for name in ("save_ckpt", "load_ckpt"):
        require_seam(strategy, name, params=STRATEGY_METHODS[name], where=_where())
    guard.attach(actor, optimizer, scheduler)
    return guard.attach_state(
        CheckpointState(
            guard,
            strategy,
            actor,
            optimizer,
            scheduler,
            ckpt_dir,
            max_num=guard.config.snapshots["keep"] + 1,
            snapshot_dir=snapshot_dir,
        )
    )


def _where() -> str:
    return where("OpenRLHF", "openrlhf", *TESTED["openrlhf"])


def check_experience(experience_type, at: str) -> None:
    """The ``Experience`` fields ``token_batch`` reads (a dataclass or an instance)."""
    names = {f.name for f in dataclasses.fields(experience_type)}
    missing = [f for f in FIELDS_READ if f not in names]
    if missing:
        raise SeamError(f"rl_guard: OpenRLHF's Experience has no {', '.join(missing)} ({at}); the adapter reads them")


def check_seams(trainer) -> None:
    """Everything ``install`` relies on, before anything is wrapped: the tested openrlhf range, the trainer's,
    actor's, loss's and strategy's methods with the parameters read by name, the settings read, the ``Experience``
    fields (when OpenRLHF's module is loaded, as it is in the process that built the trainer; otherwise on the
    first experience) and the DeepSpeed engine. Raises ``UnsupportedVersion`` / ``SeamError``."""
    check_range("OpenRLHF", "openrlhf", *TESTED["openrlhf"])
    at = _where()
    require_attr(trainer, TRAINER_ATTRS, where=at)
    for name, params in TRAINER_METHODS.items():
        require_seam(trainer, name, params=params, where=at)
    require_seam(trainer.actor, "forward", params=("return_output",), where=at)
    loss = trainer.actor_loss_fn
    require_seam(loss, "forward", params=LOSS_PARAMS, where=at)
    require_attr(loss, LOSS_ATTRS, where=at)
    for name, params in STRATEGY_METHODS.items():
        require_seam(trainer.strategy, name, params=params, where=at)
    require_attr(trainer.args, ("ckpt",), where=at)
    require_attr(trainer.args.ckpt, ("path",), where=at)
    module = sys.modules.get(EXPERIENCE_MODULE)
    if module is not None:
        check_experience(module.Experience, at)
    skip_path(_engine(trainer.actor))


def install(trainer, guard, ckpt_dir: str | None = None):
    """Guard an ``ActorPPOTrainer``: observe every micro-batch, gate the step, save / roll back through OpenRLHF
    checkpoints (``ckpt_dir`` defaults to ``<args.ckpt.path>/_actor_rl_guard``; snapshots under ``where: memory``
    go to ``memory_dir``), merge metrics into the logs. Without editing OpenRLHF: ``openrlhf_launch``. Checks
    every seam first (``check_seams``)."""
    check_seams(trainer)
    at = _where()
    strategy, actor = trainer.strategy, trainer.actor
    ckpt_dir = ckpt_dir or os.path.join(trainer.args.ckpt.path, "_actor_rl_guard")
    snapshot_dir = memory_dir(guard)
    attach_checkpoints(
        guard, strategy, actor, trainer.actor_optim, trainer.actor_scheduler, ckpt_dir, snapshot_dir=snapshot_dir
    )
    live = {"experience": None, "entropy": None, "checked": sys.modules.get(EXPERIENCE_MODULE) is not None}

    def forward(original, *args, **kwargs):
        out = original(*args, **kwargs)
        if live["experience"] is not None:
            with guard.protect("observe (OpenRLHF Actor.forward)"):
                if arguments(original, args, kwargs)["return_output"] and isinstance(out, tuple):
                    # output.entropy exists only when the actor computes it (--actor.entropy_coef): data, not a setting
                    live["entropy"] = getattr(out[1], "entropy", None)
        return out

    def loss_fn(original, *args, **kwargs):
        out = original(*args, **kwargs)
        if live["experience"] is not None:
            with guard.protect("observe (OpenRLHF Experience)"):
                log_probs = arguments(original.forward, args, kwargs)["log_probs"]
                guard.observe(
                    token_batch(live["experience"], log_probs, live["entropy"], original), loss=out[0].detach()
                )
        return out

    def training_step(original, *args, **kwargs):
        experience = arguments(original, args, kwargs)["experience"]
        if not live["checked"]:  # no Experience class at attach (a stand-in trainer): its fields, once
            check_experience(experience, at)
            live["checked"] = True
        live["experience"], live["entropy"] = experience, None
        try:
            return original(*args, **kwargs)
        finally:
            live["experience"] = live["entropy"] = None

    def ppo_train(original, *args, **kwargs):  # the driver logs this dict: train/rl_guard/... in wandb / tensorboard
        return {**original(*args, **kwargs), **guard.last_logged}

    def save_ckpt(original, *args, **kwargs):
        with guard.protect("save guard state"):  # OpenRLHF's own periodic saves carry the guard's state too
            call = inspect.signature(original).bind(*args, **kwargs)  # client_state may come positionally
            if _engine(call.arguments["model"]) is _engine(actor):
                given = call.arguments.get("client_state") or {}  # save_ckpt's own default is None
                call.arguments["client_state"] = {**given, "rl_guard": guard.state_dict()}
                args, kwargs = call.args, call.kwargs
        return original(*args, **kwargs)

    for obj, name, wrapper in (
        (actor, "forward", forward),
        (trainer, "actor_loss_fn", loss_fn),
        (trainer, "training_step", training_step),
        (trainer, "ppo_train", ppo_train),
        (strategy, "save_ckpt", save_ckpt),
    ):
        setattr(obj, name, functools.partial(wrapper, getattr(obj, name)))  # instance attributes only
    gate_optimizer_step(strategy, actor, guard)
    return guard
