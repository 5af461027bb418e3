"""OpenRLHF adapter: guard the PPO actor of OpenRLHF's Ray trainer (``ActorPPOTrainer``).

Supported: openrlhf >= 0.11, < 0.12 (matched against 0.11.2 and the DeepSpeed 0.19.6 it pins).

One call, in the actor process after the trainer exists (e.g. at the end of
``PolicyModelActor.init_model_from_pretrained``)::

    install(self.trainer, Guard.from_yaml("configs/ppo.yaml"))

or, in a hand-written step, ``guard_policy_loss(...)`` around the ``PolicyLoss`` call plus
``gate_optimizer_step(strategy, actor, guard)``. OpenRLHF internals relied on:

- ``Experience`` (``trainer/ppo_utils/experience.py``): ``action_log_probs`` is the trainer's recompute of the
  rollout policy before training (PPO's "old"), ``rollout_log_probs`` the vLLM sampler's (filled only when
  ``is_correction_level != "off"``), ``base_action_log_probs`` the reference; all ``(B, A)`` over
  ``action_mask``. With rollout log-probs the batch is decoupled: behaviour = vLLM, proximal = old, so
  ``importance_weight`` is the ratio PolicyLoss clips and ``behave_imp_weight`` its train/rollout IS ratio.
- ``training_step``: current log-probs and ``output.entropy`` (only with ``--actor.entropy_coef``, 0 = log
  only) come from ``self.actor(..., return_output=True)``; ``self.actor_loss_fn(log_probs, old, advantages,
  action_mask=, rollout_log_probs=, **loss_batch_info)`` returns a 5-tuple; ``strategy.optimizer_step`` is
  called every micro-batch and DeepSpeed's ``engine.step()`` updates only at its accumulation boundary, so the
  guard decides there and nowhere else.
- Skip on DeepSpeed runs the engine's own overflow-skip path (ZeRO frees the gradient partitions, counts
  ``skipped_steps``, leaves the LR schedule); with fp16 the dynamic loss scale also halves, as on a real
  overflow. Elsewhere the guard drops the gradients and the step leaves weights and moments untouched.
- Save / rollback go through ``strategy.save_ckpt`` / ``strategy.load_ckpt`` (DeepSpeed checkpoints) with the
  guard's state in ``client_state["rl_guard"]``; ``load_guard_state`` reads it back on resume. vLLM receives
  the restored weights at the next ``broadcast_to_vllm``.
- ``ppo_train`` returns the status dict the driver logs as ``train/<key>``; the last step's ``rl_guard/*``
  metrics are merged into it. A halt raises ``GuardHalted`` in the actor (all ranks decide alike).
"""

from __future__ import annotations

import functools
import os

from .. import TokenBatch
from ..errors import GuardHalted

SUPPORTED = {"openrlhf": ((0, 11), (0, 12))}
# Experience fields as of openrlhf 0.11.2 (tests compare with the real dataclass) and the ones read here.
EXPERIENCE_FIELDS = ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs",
                     "rollout_log_probs", "values", "returns", "advantages", "kl", "rewards", "scores",
                     "response_length", "truncated", "total_length", "index", "prompts", "labels", "images",
                     "mm_train_inputs", "info")
FIELDS_READ = ("action_mask", "action_log_probs", "base_action_log_probs", "rollout_log_probs", "advantages",
               "rewards", "response_length", "truncated", "info")


def check_versions() -> None:
    import importlib.metadata as md

    for pkg, (lo, hi) in SUPPORTED.items():
        version = md.version(pkg)
        parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
        if not lo <= parts < hi:
            raise RuntimeError(f"rl_guard's OpenRLHF adapter supports {pkg} >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; "
                               f"found {version}")


def token_batch(experience, log_probs, entropy=None, policy_loss=None) -> TokenBatch:
    """One micro-batch's ``TokenBatch``: the Experience plus the current log-probs / entropy ``(B, A)``."""
    loss_type = getattr(policy_loss, "policy_loss_type", "ppo")
    old, rollout = experience.action_log_probs, experience.rollout_log_probs
    behaviour, prox = old, None
    if rollout is not None:  # GSPO's ratio is pi/pi_rollout itself; PPO's is pi/pi_old with pi_old/pi_rollout as IS
        behaviour, prox = (rollout, None) if loss_type == "gspo" else (rollout, old)
    rewards = experience.rewards if experience.rewards is not None else experience.info.get("reward")
    if entropy is not None:
        entropy = entropy[:, -log_probs.shape[1]:].detach()
    return TokenBatch(
        logprobs=log_probs.detach(), mask=experience.action_mask.bool(), old_logprobs=behaviour.detach(),
        prox_logprobs=None if prox is None else prox.detach(), ref_logprobs=experience.base_action_log_probs,
        entropy=entropy, advantages=experience.advantages, rewards=_per_seq(rewards, log_probs),
        lengths=_per_seq(experience.response_length, log_probs), truncated=_per_seq(experience.truncated, log_probs),
        eps_low=float(getattr(policy_loss, "clip_eps_low", 0.2)), eps_high=float(getattr(policy_loss, "clip_eps_high", 0.2)),
        importance_sampling_level="sequence" if loss_type == "gspo" else "token")


def _per_seq(t, log_probs):
    return t.reshape(-1).to(log_probs.device) if hasattr(t, "reshape") and t.numel() == log_probs.shape[0] else None


def guard_policy_loss(guard, policy_loss, experience, log_probs, entropy=None, **loss_batch_info):
    """Call OpenRLHF's ``PolicyLoss`` exactly as ``training_step`` does and observe the micro-batch.

    Returns PolicyLoss's own 5-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` unchanged."""
    out = policy_loss(log_probs, experience.action_log_probs, experience.advantages,
                      action_mask=experience.action_mask, rollout_log_probs=experience.rollout_log_probs,
                      **loss_batch_info)
    guard.observe(token_batch(experience, log_probs, entropy, policy_loss), loss=out[0].detach())
    return out


class CheckpointState:
    """The guard's state protocol over OpenRLHF checkpoints: a snapshot is a ``strategy.save_ckpt`` tag."""

    def __init__(self, guard, strategy, actor, optimizer, scheduler, ckpt_dir: str, max_num: int = 3, max_mem: int = 1000):
        self.guard, self.strategy, self.model, self.optimizer, self.scheduler = guard, strategy, actor, optimizer, scheduler
        self.ckpt_dir, self.max_num, self.max_mem = ckpt_dir, max_num, max_mem

    def capture(self, step: int) -> dict:
        tag = f"rl_guard_step{step}"
        self.strategy.save_ckpt(_engine(self.model), self.ckpt_dir, tag, self.max_num, self.max_mem,
                                client_state={"rl_guard": self.guard.state_dict()})
        return {"step": step, "tag": tag, "ckpt_dir": self.ckpt_dir}

    def restore(self, snap: dict, lr_scale: float = 1.0) -> None:
        from ..state import scale_lr

        path, _ = self.strategy.load_ckpt(_engine(self.model), snap["ckpt_dir"], tag=snap["tag"])
        if path is None:
            raise RuntimeError(f"rl_guard rollback: no checkpoint {snap['tag']!r} under {snap['ckpt_dir']}")
        if lr_scale != 1.0:
            scale_lr(self.optimizer, self.scheduler, lr_scale)


def load_guard_state(guard, client_states: dict) -> bool:
    """On resume: restore the guard from ``strategy.load_ckpt``'s client states (``self.checkpoint_states``)."""
    if client_states and "rl_guard" in client_states:
        guard.load_state_dict(client_states["rl_guard"])
        return True
    return False


def _engine(model):
    return getattr(model, "model", model)  # OpenRLHF's Actor wraps the DeepSpeed engine as .model


def _at_boundary(engine) -> bool:
    probe = getattr(engine, "is_gradient_accumulation_boundary", None)
    return bool(probe()) if probe is not None else True  # a plain optimizer steps on every call


def _run_suppressed(engine, step):
    """Run the engine's step with the update suppressed (the gradients were already dropped by the guard)."""
    opt = getattr(engine, "optimizer", None)
    if not (hasattr(opt, "overflow") and hasattr(opt, "check_grad_overflow")):
        return step()
    saved = opt.check_grad_overflow  # DeepSpeed ZeRO: take the optimizer's own overflow path
    opt.check_grad_overflow, opt.overflow = False, True
    try:
        return step()
    finally:
        opt.check_grad_overflow, opt.overflow = saved, False


def gate_optimizer_step(strategy, actor, guard) -> None:
    """Wrap ``strategy.optimizer_step`` (instance only): at each accumulation boundary of ``actor`` check the
    guard, then apply, skip, roll back or halt. Other models (a critic) pass through untouched."""
    original = strategy.optimizer_step

    @functools.wraps(original)
    def optimizer_step(optimizer, model, scheduler, *args, **kwargs):
        engine = _engine(model)
        if engine is not _engine(actor) or not _at_boundary(engine):  # another model, or DeepSpeed accumulates
            return original(optimizer, model, scheduler, *args, **kwargs)
        decision = guard.check(defer_restore=True)
        call = functools.partial(original, optimizer, model, scheduler, *args, **kwargs)
        out = call() if decision.apply_step else _run_suppressed(engine, call)
        guard.actions.restore_pending()
        guard.step_done()
        if decision.stop:
            raise GuardHalted("; ".join(decision.messages) or f"rl_guard halted at step {decision.step}")
        return out

    strategy.optimizer_step = optimizer_step


def attach_checkpoints(guard, strategy, actor, optimizer, scheduler, ckpt_dir: str):
    """Give the guard OpenRLHF's checkpoint path as its state (snapshots, save-and-halt, rollback)."""
    guard.attach(actor, optimizer, scheduler)
    guard.state = CheckpointState(guard, strategy, actor, optimizer, scheduler, ckpt_dir,
                                  max_num=guard.config.snapshots["keep"] + 1)
    return guard


def install(trainer, guard, ckpt_dir: str | None = None):
    """Guard an ``ActorPPOTrainer``: observe every micro-batch, gate the step, save / roll back through OpenRLHF
    checkpoints (``ckpt_dir`` defaults to ``<args.ckpt.path>/_actor_rl_guard``), merge metrics into the logs."""
    check_versions()
    strategy, actor = trainer.strategy, trainer.actor
    ckpt = getattr(getattr(trainer.args, "ckpt", None), "path", None)
    ckpt_dir = ckpt_dir or os.path.join(ckpt or str(guard.run_dir), "_actor_rl_guard")
    attach_checkpoints(guard, strategy, actor, trainer.actor_optim, trainer.actor_scheduler, ckpt_dir)
    live = {"experience": None, "entropy": None}

    def forward(original, *args, **kwargs):
        out = original(*args, **kwargs)
        if live["experience"] is not None and kwargs.get("return_output") and isinstance(out, tuple):
            live["entropy"] = getattr(out[1], "entropy", None)
        return out

    def loss_fn(original, log_probs, old_log_probs, advantages, *args, **kwargs):
        out = original(log_probs, old_log_probs, advantages, *args, **kwargs)
        if live["experience"] is not None:
            guard.observe(token_batch(live["experience"], log_probs, live["entropy"], original), loss=out[0].detach())
        return out

    def training_step(original, experience, *args, **kwargs):
        live["experience"], live["entropy"] = experience, None
        try:
            return original(experience, *args, **kwargs)
        finally:
            live["experience"] = live["entropy"] = None

    def ppo_train(original, *args, **kwargs):
        status = original(*args, **kwargs)
        status.update(guard.last_logged)  # reaches wandb / tensorboard as train/rl_guard/...
        return status

    def save_ckpt(original, model, *args, **kwargs):
        if _engine(model) is _engine(actor):  # OpenRLHF's own periodic saves carry the guard's state too
            args = list(args)  # save_ckpt(model, save_dir, tag, max_num, max_mem, client_state, ...)
            given = args[4] if len(args) > 4 else kwargs.get("client_state")
            state = {**(given or {}), "rl_guard": guard.state_dict()}
            if len(args) > 4:
                args[4] = state
            else:
                kwargs["client_state"] = state
        return original(model, *args, **kwargs)

    for obj, name, wrapper in ((actor, "forward", forward), (trainer, "actor_loss_fn", loss_fn),
                               (trainer, "training_step", training_step), (trainer, "ppo_train", ppo_train),
                               (strategy, "save_ckpt", save_ckpt)):
        setattr(obj, name, functools.partial(wrapper, getattr(obj, name)))  # instance attributes only
    gate_optimizer_step(strategy, actor, guard)
    return guard
