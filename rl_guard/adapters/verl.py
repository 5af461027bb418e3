"""verl adapter: guard verl's PPO/GRPO actor from inside its workers, attached through verl's own config.

Supported: verl >= 0.9, < 0.10 (matched against 0.9.1 and its engine workers). Add to a ``main_ppo`` command::

    actor_rollout_ref.model.external_lib=rl_guard.adapters.verl

verl imports ``external_lib`` in every worker process (``HFModelConfig.__post_init__``, ``verl/workers/config/
model.py``; ``import_external_libs`` in ``verl/utils/import_utils.py``). ``RL_GUARD_CONFIG`` (preset name or YAML
path, default ``grpo``) and ``RL_GUARD_RUN_DIR`` (default ``runs/rl_guard``) choose the guard; the workers inherit
the driver's environment on a local Ray cluster (elsewhere: ``ray_kwargs.ray_init.runtime_env.env_vars``).
verl 0.9.1 internals relied on (``verl/workers/engine_workers.py``, ``verl/workers/engine/base.py``,
``verl/workers/engine/fsdp/transformer_impl.py``, ``verl/workers/utils/losses.py``):

- ``ActorRolloutRefWorker.init_model`` builds the actor's ``TrainingWorker`` and hands it
  ``partial(ppo_loss, config=ActorConfig)`` through ``TrainingWorker.set_loss_fn``. That method is the one verl name
  this module wraps (behaviour unchanged); when it receives the PPO loss, the guard is installed on that instance.
- ``engine.forward_step`` calls ``loss_function(model_output=, data=, dp_group=)`` per micro-batch, in training
  and (under ``no_grad``) for log-prob recomputation: only calls with gradients enabled are observed.
  ``model_output["log_probs"]`` / ``["entropy"]`` are unpadded (``no_padding_2_padding`` pads them as ``ppo_loss``
  does); ``data`` holds ``response_mask``, ``old_log_probs``, ``advantages``, ``ref_log_prob`` (reference, when
  computed), ``rollout_log_probs`` (the inference engine's, kept with rollout correction) and
  ``token_level_scores`` / ``token_level_rewards`` ``[B, R]`` (summed to each sequence's reward).
  With rollout log-probs: behaviour = rollout, proximal = old, as ``rollout_corr_helper`` defines them.
- ``BaseEngine.train_batch``: ``optimizer_zero_grad``, ``forward_backward_batch``, then ``optimizer_step`` once per
  mini-batch on every rank. The guard decides there, before the engine clips and steps (FSDP2 ``DTensor`` gradients
  are merged over ranks). Skip / halt / rollback drop the gradients and the optimizer never runs, on every rank
  alike (verl's own ``optimizer_step`` only refuses a non-finite grad norm). As on verl's own refusal, the LR
  scheduler still advances (``TrainingWorker.train_batch`` steps it). A halt raises ``GuardHalted``, which Ray
  returns to the driver. Rollback restores the guard's in-memory snapshots of the FSDP module, optimizer and LR
  scheduler; the next ``update_weights`` ships them to the rollout engine.
- Engines: FSDP2 (``DTensor`` shards, detected) is exercised on CPU; FSDP1 (``strategy=fsdp``, verl's default)
  keeps flat shards as plain tensors, so ``sharded_grads`` is set for it (hybrid sharding would count the
  replicas' norms twice: set ``sharded_grads`` yourself there); FSDP1 needs a GPU to run. Other engines
  (Megatron, ...) are refused at install, loudly.
- Checkpoints: ``engine.save_checkpoint`` / ``load_checkpoint`` (the trainer's ``save_freq`` saves and its
  resume) also write / read the guard's state, ``<checkpoint>/rl_guard/rank<r>.pt``.
- Metrics: ``train_batch``'s ``outputs["metrics"]`` gets the step's ``rl_guard/*``; verl reduces them with its own
  actor metrics and prefixes them ``actor/`` (``RayPPOTrainer._update_actor``), so every configured
  ``trainer.logger`` backend (console, wandb, tensorboard, ...) receives ``actor/rl_guard/...``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
from pathlib import Path

import torch

from .. import TokenBatch
from ..errors import GuardHalted
from ..stats.constants import DEFAULT_CLIP_EPS
from ..versions import require

SUPPORTED = {"verl": ((0, 9), (0, 10))}
ACTOR_LOSSES = ("ppo_loss", "distillation_ppo_loss")  # the actor's loss functions in verl.workers.utils.losses
ROLLOUT_FIELDS = ("ref_log_prob", "rollout_log_probs", "token_level_scores", "token_level_rewards")


def token_batch(model_output, data, config=None) -> TokenBatch:
    """One micro-batch's ``TokenBatch`` from the arguments verl passes the actor's loss function."""
    from verl.workers.utils.padding import no_padding_2_padding

    logp = no_padding_2_padding(model_output["log_probs"], data).detach()
    entropy = model_output.get("entropy", None)
    entropy = None if entropy is None else no_padding_2_padding(entropy, data).detach().float()
    fields = ["response_mask", "old_log_probs", "advantages"] + [k for k in ROLLOUT_FIELDS if k in data.keys()]
    td = data.select(*fields).to_padded_tensor()
    mask = td["response_mask"].bool()
    old, rollout = td["old_log_probs"], td.get("rollout_log_probs", None)
    behaviour, prox = (old, None) if rollout is None else (rollout, old)
    scores = td.get("token_level_scores", td.get("token_level_rewards", None))
    policy_loss = getattr(config, "policy_loss", None) or {}
    clip = getattr(config, "clip_ratio", DEFAULT_CLIP_EPS)
    return TokenBatch(
        logprobs=logp, mask=mask, old_logprobs=behaviour.detach(),
        prox_logprobs=None if prox is None else prox.detach(),
        ref_logprobs=td.get("ref_log_prob", None), entropy=entropy, advantages=td["advantages"],
        rewards=None if scores is None else torch.where(mask, scores, 0.0).sum(-1), lengths=mask.sum(-1),
        eps_low=float(getattr(config, "clip_ratio_low", None) or clip),
        eps_high=float(getattr(config, "clip_ratio_high", None) or clip),
        importance_sampling_level="sequence" if policy_loss.get("loss_mode", "vanilla") == "gspo" else "token")


def observing(loss_fn, guard):
    """The actor's loss function, observing each training micro-batch (its result is returned unchanged)."""
    config = (getattr(loss_fn, "keywords", None) or {}).get("config")

    @functools.wraps(loss_fn)
    def guarded(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        if torch.is_grad_enabled():  # log-prob recomputation runs the same function under no_grad
            with guard.protect("observe (verl loss inputs)"):  # a renamed verl key must not kill training
                guard.observe(token_batch(kwargs["model_output"], kwargs["data"], config), loss=out[0].detach())
        return out
    return guarded


def install(worker, guard):
    """Guard one actor ``TrainingWorker`` (its engine built, its loss set): observe the loss, gate the optimizer
    step, merge metrics into the engine's outputs. Instance attributes only."""
    require("verl", "verl", *SUPPORTED["verl"])
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    engine = worker.engine
    if not isinstance(engine, FSDPEngine):  # loud, not an unguarded run
        raise RuntimeError(f"rl_guard.adapters.verl guards verl's FSDP engines (actor strategy fsdp / fsdp2), "
                           f"not {type(engine).__name__}")
    guard.attach(engine.module, engine.optimizer, engine.lr_scheduler)
    if type(engine.module).__name__ == "FullyShardedDataParallel":
        guard.mark_sharded()  # FSDP1 flat parameters: plain tensors, disjoint shards (sum over ranks)
    worker.loss_fn = observing(worker.loss_fn, guard)
    original_step, original_train = engine.optimizer_step, engine.train_batch

    @functools.wraps(original_step)
    def optimizer_step(*args, **kwargs):
        decision = guard.check()  # before verl clips: the guard sees the pre-clip gradients
        if decision.apply_step:
            grad_norm = original_step(*args, **kwargs)
        else:  # gradients already dropped by the guard; the optimizer does not run
            engine.optimizer.zero_grad(set_to_none=True)
            grad_norm = guard.last_metrics.get("rl_guard/grad/norm", math.nan)
        guard.step_done()
        if decision.stop:
            raise GuardHalted("; ".join(decision.messages) or f"rl_guard halted at step {decision.step}")
        return grad_norm

    @functools.wraps(original_train)
    def train_batch(*args, **kwargs):
        outputs = original_train(*args, **kwargs)
        if isinstance(outputs, dict) and isinstance(outputs.get("metrics"), dict):
            # one entry per step, as verl's per-micro-batch metric lists (it gathers them over ranks, then averages)
            outputs["metrics"].update({k: [v] for k, v in guard.last_logged.items()})
        return outputs

    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(local_path, *args, **kwargs):  # verl's periodic saves carry the guard's state too
        out = original_save(local_path, *args, **kwargs)
        with guard.protect("save guard state"):
            path = guard_state_path(local_path, guard.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(guard.state_dict(), path)
        return out

    @functools.wraps(original_load)
    def load_checkpoint(local_path, *args, **kwargs):  # resume: counters, rule history, snapshots
        out = original_load(local_path, *args, **kwargs)
        path = guard_state_path(local_path, guard.rank)
        if path.exists():
            guard.load_state_dict(torch.load(path, weights_only=False))  # written by save_checkpoint above
        return out

    engine.optimizer_step, engine.train_batch = optimizer_step, train_batch
    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    worker.rl_guard = guard
    return guard


def guard_state_path(local_path, rank: int) -> Path:
    """Where a verl checkpoint (``<default_local_dir>/global_step_N/actor``) keeps this rank's guard state."""
    return Path(local_path) / "rl_guard" / f"rank{rank}.pt"


def guard_from_env():
    """The guard the workers build: ``RL_GUARD_CONFIG`` (preset or YAML path), ``RL_GUARD_RUN_DIR``."""
    from .. import Guard

    return Guard.from_yaml(os.environ.get("RL_GUARD_CONFIG", "grpo"), run_dir=os.environ.get("RL_GUARD_RUN_DIR"))


def register(make_guard=guard_from_env) -> None:
    """Wrap ``TrainingWorker.set_loss_fn`` so the actor's worker is guarded when verl gives it the PPO loss.
    Idempotent; runs when verl imports this module as ``external_lib``."""
    from verl.workers.engine_workers import TrainingWorker

    original = TrainingWorker.set_loss_fn
    if getattr(original, "rl_guard", False):
        return

    @functools.wraps(original)  # keeps verl's dispatch attributes
    def set_loss_fn(self, loss_fn, *args, **kwargs):
        out = original(self, loss_fn, *args, **kwargs)
        name = getattr(getattr(loss_fn, "func", loss_fn), "__name__", "")
        if name in ACTOR_LOSSES:
            guard = getattr(self, "rl_guard", None)
            if guard is None:
                install(self, make_guard())
            else:  # a later loss for a guarded worker is observed too
                self.loss_fn = observing(self.loss_fn, guard)
        return out

    set_loss_fn.rl_guard = True
    TrainingWorker.set_loss_fn = set_loss_fn


def _verl_installed() -> bool:
    try:
        importlib.metadata.distribution("verl")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if _verl_installed():  # imported by verl as external_lib: hook in at once
    register()
