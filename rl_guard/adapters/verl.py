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
  ``model_output["log_probs"]`` / ``["entropy"]`` are unpadded: they are gathered on the device at the positions
  ``no_padding_2_padding`` (``verl/workers/utils/padding.py``) reads for ``ppo_loss``; ``data`` holds
  ``response_mask``, ``old_log_probs``, ``advantages``, ``ref_log_prob`` (reference, when computed),
  ``rollout_log_probs`` (the inference engine's, kept with rollout correction) and ``token_level_scores`` /
  ``token_level_rewards`` ``[B, R]`` (summed to each sequence's reward).
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
- Checked at attach (``check_seams``, before anything is wrapped): verl in the tested range (0.9.x), the engine's
  ``optimizer_step`` / ``train_batch`` / ``save_checkpoint`` / ``load_checkpoint`` (``local_path``), ``module`` /
  ``optimizer`` / ``lr_scheduler``, the loss function's ``model_output`` / ``data``, and the ``ActorConfig`` values
  read (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``policy_loss.loss_mode``; verl's own rule: a low
  or high bound of None means ``clip_ratio``). A loss function without a config (not verl's ``ppo_loss``) falls back
  to clip 0.2 and token-level ratios, said once at attach. ``register`` checks ``TrainingWorker.set_loss_fn``.
- A skip is verified: the optimizer must not step in a ``train_batch`` whose update the guard dropped (a step
  pre-hook counts its steps), else the guard escalates to checkpoint-and-halt (``Guard.skip_not_taken``); a
  ``train_batch`` that returns without calling ``optimizer_step`` raises ``SeamError``. The guard's state file is
  plain data, read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
from pathlib import Path

import torch

from .. import TokenBatch
from ..stats.constants import DEFAULT_CLIP_EPS
from ..versions import SeamError, check_range, require_attr, require_seam
from . import CONFIG_ENV, RUN_DIR_ENV
from .seams import DroppedStepCheck, announce, arguments, halted, load_state, save_state, where

TESTED = {"verl": ("0.9", "0.10")}  # constraints/verl.txt: verl 0.9.1
ENGINE_METHODS = {
    "optimizer_step": (),
    "train_batch": (),
    "save_checkpoint": ("local_path",),
    "load_checkpoint": ("local_path",),
}
ENGINE_ATTRS = ("module", "optimizer", "lr_scheduler")
LOSS_PARAMS = ("model_output", "data")  # what engine.forward_step passes the loss function, read by name
CONFIG_ATTRS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "policy_loss")  # ActorConfig values read
ACTOR_LOSSES = ("ppo_loss", "distillation_ppo_loss")  # the actor's loss functions in verl.workers.utils.losses
ROLLOUT_FIELDS = ("ref_log_prob", "rollout_log_probs", "token_level_scores", "token_level_rewards")


def response_positions(data, width=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where verl's ``no_padding_2_padding`` reads each response in the packed model output: indices ``[B, R]`` and
    their validity. Its token ``j`` of sequence ``b`` sits at ``end[b] - response_len[b] - 1 + j`` (outputs are
    shifted left by one), with the same lengths, ends and width verl uses; computed on the device, where verl's
    function syncs the host once per sequence (its checks on these lengths ran in ``ppo_loss`` just before).
    ``width``: the padded fields' width, used only in the nested layout when ``max_response_len`` is not set
    (verl's loss subtracts those fields from the log-probs, so the widths agree)."""
    from verl.utils import tensordict_utils as tu

    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:  # packed end to end
        prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
        max_len = tu.get_non_tensor_data(data=data, key="max_response_len", default=-1)
        if max_len < 0:  # verl takes the longest response (a host sync); the caller's width is that figure
            max_len = int(response_lens.max()) if width is None else width
        width = max_len
    else:  # left-padded prompts, right-padded responses (verl's trainer): lengths from the attention mask
        attention = data["attention_mask"]
        prompt_lens = attention[:, : prompts.shape[1]].sum(dim=1)
        response_lens = attention[:, prompts.shape[1] :].sum(dim=1)
        width = responses.shape[1]
    ends = (prompt_lens + response_lens).cumsum(dim=0)
    steps = torch.arange(width, device=ends.device)
    return (ends - response_lens - 1).unsqueeze(1) + steps, steps < response_lens.unsqueeze(1)


def gather_response(output: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``no_padding_2_padding``'s tensor ``[B, R, *]`` from a packed model output (nested or ``[total, *]``):
    the same values, zeros past each response."""
    values = (output.values() if output.is_nested else output).detach()
    index, valid = index.to(values.device), valid.to(values.device)
    picked = values[index.clamp(0, values.shape[0] - 1)]  # clamped positions are zeroed below
    return picked.masked_fill(~valid.view(*valid.shape, *[1] * (values.dim() - 1)), 0)


def token_batch(model_output, data, config=None) -> TokenBatch:
    """One micro-batch's ``TokenBatch`` from the arguments verl passes the actor's loss function."""
    # keys(): a TensorDict refuses `key in td`
    fields = ["response_mask", "old_log_probs", "advantages"] + [k for k in ROLLOUT_FIELDS if k in data.keys()]  # noqa: SIM118
    # as ppo_loss pads them (torch's jagged padding reads the cached max length: no sync); plain tensors as they are
    td = {k: torch.nested.to_padded_tensor(data[k], 0.0) if data[k].is_nested else data[k] for k in fields}
    index, valid = response_positions(data, width=td["response_mask"].shape[-1])
    logp = gather_response(model_output["log_probs"], index, valid)
    entropy = model_output.get("entropy", None)
    entropy = None if entropy is None else gather_response(entropy, index, valid).float()
    mask = td["response_mask"].bool()
    old, rollout = td["old_log_probs"], td.get("rollout_log_probs")
    behaviour, prox = (old, None) if rollout is None else (rollout, old)
    scores = td.get("token_level_scores", td.get("token_level_rewards"))
    low, high, level = clip_settings(config)
    return TokenBatch(
        logprobs=logp,
        mask=mask,
        old_logprobs=behaviour.detach(),
        prox_logprobs=None if prox is None else prox.detach(),
        ref_logprobs=td.get("ref_log_prob"),
        entropy=entropy,
        advantages=td["advantages"],
        rewards=None if scores is None else torch.where(mask, scores, 0.0).sum(-1),
        lengths=mask.sum(-1),
        eps_low=low,
        eps_high=high,
        importance_sampling_level=level,
    )


def clip_settings(config) -> tuple[float, float, str]:
    """``(eps_low, eps_high, importance_sampling_level)`` from verl's ``ActorConfig`` (checked at attach) as its
    ``compute_policy_loss`` reads them: a low or high bound of None means ``clip_ratio``; ``gspo`` clips a sequence
    ratio. ``config`` None (a loss function without one; said at attach): 0.2 and token-level."""
    if config is None:
        return DEFAULT_CLIP_EPS, DEFAULT_CLIP_EPS, "token"
    clip = config.clip_ratio
    low = clip if config.clip_ratio_low is None else config.clip_ratio_low
    high = clip if config.clip_ratio_high is None else config.clip_ratio_high
    return float(low), float(high), "sequence" if config.policy_loss.loss_mode == "gspo" else "token"


def _where() -> str:
    return where("verl", "verl", *TESTED["verl"])


def loss_config(loss_fn, at: str):
    """The ``ActorConfig`` bound to the actor's loss function (``partial(ppo_loss, config=...)``), its values checked;
    None, said once, when the loss function has none."""
    config = (getattr(loss_fn, "keywords", None) or {}).get("config")  # a partial's keywords, or none at all
    if config is None:
        announce(
            f"verl's actor loss function {getattr(loss_fn, '__name__', loss_fn)!r} carries no ActorConfig: the "
            f"guard uses clip {DEFAULT_CLIP_EPS} and token-level ratios for the clip statistics"
        )
        return None
    require_attr(config, CONFIG_ATTRS, where=at)
    require_attr(config.policy_loss, ("loss_mode",), where=at)
    return config


def observing(loss_fn, guard):
    """The actor's loss function, observing each training micro-batch (its result is returned unchanged). Checks
    its parameters and config first (``SeamError``)."""
    at = _where()
    _require_params(loss_fn, at)
    config = loss_config(loss_fn, at)

    @functools.wraps(loss_fn)
    def guarded(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        if torch.is_grad_enabled():  # log-prob recomputation runs the same function under no_grad
            with guard.protect("observe (verl loss inputs)"):  # a renamed verl key must not kill training
                named = arguments(loss_fn, args, kwargs)
                guard.observe(token_batch(named["model_output"], named["data"], config), loss=out[0].detach())
        return out

    return guarded


def _require_params(loss_fn, at: str) -> None:
    import inspect

    params = inspect.signature(loss_fn).parameters
    missing = [p for p in LOSS_PARAMS if p not in params]
    if missing:
        name = getattr(getattr(loss_fn, "func", loss_fn), "__name__", repr(loss_fn))
        raise SeamError(
            f"rl_guard: verl's actor loss function {name}{inspect.signature(loss_fn)} no longer takes "
            f"{', '.join(missing)} ({at}); the adapter reads them by name"
        )


def check_seams(worker) -> None:
    """Everything ``install`` relies on (module docstring), before anything is wrapped; raises
    ``UnsupportedVersion`` or ``SeamError`` naming the version, the tested range and the seam."""
    check_range("verl", "verl", *TESTED["verl"])
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    at = _where()
    require_attr(worker, ("engine", "loss_fn"), where=at)
    engine = worker.engine
    if not isinstance(engine, FSDPEngine):  # loud, not an unguarded run
        raise RuntimeError(
            f"rl_guard.adapters.verl guards verl's FSDP engines (actor strategy fsdp / fsdp2), "
            f"not {type(engine).__name__}"
        )
    for name, params in ENGINE_METHODS.items():
        require_seam(engine, name, params=params, where=at)
    require_attr(engine, ENGINE_ATTRS, where=at)
    _require_params(worker.loss_fn, at)


def install(worker, guard):
    """Guard one actor ``TrainingWorker`` (its engine built, its loss set): observe the loss, gate the optimizer
    step, merge metrics into the engine's outputs. Instance attributes only; every seam is checked first."""
    check_seams(worker)
    engine = worker.engine
    worker.loss_fn = observing(worker.loss_fn, guard)  # checks the loss function's config
    guard.attach(engine.module, engine.optimizer, engine.lr_scheduler)
    if type(engine.module).__name__ == "FullyShardedDataParallel":
        guard.mark_sharded()  # FSDP1 flat parameters: plain tensors, disjoint shards (sum over ranks)
    original_step, original_train = engine.optimizer_step, engine.train_batch
    check = DroppedStepCheck(engine, guard, "verl", _where)  # a dropped update stays dropped

    @functools.wraps(original_step)
    def optimizer_step(*args, **kwargs):
        check.gated()
        decision = guard.check()  # before verl clips: the guard sees the pre-clip gradients
        if decision.apply_step:
            grad_norm = original_step(*args, **kwargs)
        else:  # gradients already dropped by the guard; the optimizer does not run
            check.dropped(decision)
            engine.optimizer.zero_grad(set_to_none=True)
            grad_norm = guard.last_metrics.get("rl_guard/grad/norm", math.nan)
        guard.step_done()
        if decision.stop:
            raise halted(guard, decision)
        return grad_norm

    @functools.wraps(original_train)
    def train_batch(*args, **kwargs):
        check.begin()
        outputs = original_train(*args, **kwargs)
        check.verify()
        if isinstance(outputs, dict) and isinstance(outputs.get("metrics"), dict):
            # one entry per step, as verl's per-micro-batch metric lists (it gathers them over ranks, then averages)
            outputs["metrics"].update({k: [v] for k, v in guard.last_logged.items()})
        return outputs

    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(*args, **kwargs):  # verl's periodic saves carry the guard's state too
        out = original_save(*args, **kwargs)
        with guard.protect("save guard state"):
            path = guard_state_path(arguments(original_save, args, kwargs)["local_path"], guard.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_state(guard.state_dict(), path)
        return out

    @functools.wraps(original_load)
    def load_checkpoint(*args, **kwargs):  # resume: counters, rule history, snapshots
        out = original_load(*args, **kwargs)
        path = guard_state_path(arguments(original_load, args, kwargs)["local_path"], guard.rank)
        if path.exists():
            guard.load_state_dict(load_state(path))  # written by save_checkpoint above
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

    return Guard.from_yaml(os.environ.get(CONFIG_ENV, "grpo"), run_dir=os.environ.get(RUN_DIR_ENV))


def register(make_guard=guard_from_env) -> None:
    """Wrap ``TrainingWorker.set_loss_fn`` so the actor's worker is guarded when verl gives it the PPO loss.
    Idempotent; runs when verl imports this module as ``external_lib``."""
    from verl.workers.engine_workers import TrainingWorker

    check_range("verl", "verl", *TESTED["verl"])
    original = require_seam(TrainingWorker, "set_loss_fn", params=("loss_fn",), where=_where())
    if getattr(original, "rl_guard", False):
        return

    @functools.wraps(original)  # keeps verl's dispatch attributes
    def set_loss_fn(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        loss_fn = arguments(original, (self, *args), kwargs)["loss_fn"]
        name = getattr(getattr(loss_fn, "func", loss_fn), "__name__", "")
        if name in ACTOR_LOSSES:
            guard = getattr(self, "rl_guard", None)
            if guard is None:
                install(self, make_guard())
            else:  # a later loss for a guarded worker is observed too
                self.loss_fn = observing(self.loss_fn, guard)
        return out

    set_loss_fn.rl_guard = True  # type: ignore[attr-defined]  # a marker on the function object
    TrainingWorker.set_loss_fn = set_loss_fn


def _verl_installed() -> bool:
    try:
        importlib.metadata.distribution("verl")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if _verl_installed():  # imported by verl as external_lib: hook in at once
    register()
