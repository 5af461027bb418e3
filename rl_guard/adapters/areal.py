"""AReaL adapter: guard AReaL's decoupled-PPO actor on its train engine (e.g. ``FSDPPPOActor``).

Supported: areal >= 1.0, < 1.1 (matched against 1.0.4). In either launch mode, with no edit of AReaL::

    from rl_guard.adapters.areal_trainer import PPOTrainer   # instead of: from areal import PPOTrainer

(the actor becomes ``rl_guard.adapters.areal_engine.GuardedFSDPPPOActor``, which calls ``install`` on itself in
the process that owns it; snapshots go through the engine's own save / load). By hand, on an engine in this
process (SPMD mode)::

    guard = Guard.from_yaml(async_yaml(config.rollout.max_head_offpolicyness), run_dir=...)
    install(actor, guard)          # actor: the engine whose train_batch / optimizer_step PPOActor calls

AReaL internals relied on:

- ``PPOActor._ppo_update`` calls ``engine.train_batch(mb, loss_fn=functools.partial(grpo_loss_fn, eps_clip=,
  eps_clip_higher=, importance_sampling_level=, current_version=engine.get_version(), ...), loss_weight_fn=)``
  once per mini-batch (``ppo_n_minibatches`` optimizer steps per global step). ``train_batch`` calls
  ``loss_fn(logprobs, entropy, input_data)`` per micro-batch (packed 1-D tensors, ``cu_seqlens``), then
  ``self.optimizer_step()`` once; that dict becomes ``stats_tracker.scalar(**train_stat)``, so the merged
  ``rl_guard/*`` keys are exported as ``ppo_actor/update/rl_guard/...`` (mean over the step's mini-batches).
- ``input_data``: ``logprobs`` = behaviour (inference engine), ``prox_logp`` = proximal (recomputed with
  ``prox_logp_method="recompute"``; equal to ``logprobs`` when not decoupled), ``advantages``, ``loss_mask``,
  ``versions`` (-1 on the prompt), ``ref_logp``. ``compute_advantages`` rolls ``loss_mask`` and ``logprobs`` by
  -1 (position t scores token t+1) but not ``versions``, so versions are rolled the same way here.
- importance_weight = pi_theta / pi_prox and behave_imp_weight = pi_prox / pi_behave, as in
  ``ppo_actor_loss_fn``'s stats (before rejection sampling). With an approximated proximal (``loglinear`` etc.)
  AReaL builds it inside the loss, so both families are absent.
- lag = ``current_version - version`` = AReaL's ``sample_staleness_theta``. ``max_head_offpolicyness`` bounds
  it at admission (``StalenessManager``), so ``lag/max`` above it means the bound did not hold: ``lag_rule``, or
  ``async_yaml(n)``, which sets the async preset's ``staleness_bound`` threshold to ``n``.
- Skip: ``optimizer_zero_grad()`` and ``update_successful=0``, AReaL's own non-finite-norm path. Rollback restores
  the guard's snapshots of ``model`` / ``optimizer`` / ``lr_scheduler``; ``GuardedFSDPPPOActor`` takes them
  through the engine's own ``save`` / ``load`` (DCP) instead (``areal_engine.EngineState``); the next
  ``update_weights`` ships them to inference. Halt raises ``GuardHalted`` (all ranks alike).
  ``FSDPPPOActor``'s FSDP2 gradients are ``DTensor`` shards: detected and merged by sum
  (``rl_guard/stats/grads.py``), the skip drops them before AReaL's own step. ``tests/adapters/areal/`` runs the real
  ``FSDPPPOActor`` on CPU (gloo) with one and two processes.
- Checked at attach (``check_seams``, before anything is wrapped): areal in the tested range (1.0.x; not installed:
  an error unless ``RL_GUARD_ALLOW_UNTESTED=1``, then said on the console), the engine's ``train_batch`` (with
  ``loss_fn``), ``optimizer_step``, ``optimizer_zero_grad``, ``get_version``, ``model``, ``optimizer``,
  ``lr_scheduler``, and, where AReaL's PPO actor is loaded, that ``grpo_loss_fn`` still takes the settings read
  (``eps_clip``, ``eps_clip_higher``, ``importance_sampling_level``, ``current_version``). The settings are read
  from each ``loss_fn`` call bound to its own signature, so a loss function's own defaults count; a setting the
  loss function does not have falls back (the AReaL default) and is said once on the console.
- A skip is verified: the optimizer must not step in a ``train_batch`` whose update the guard dropped (a step
  pre-hook counts its steps), else the guard escalates to checkpoint-and-halt (``Guard.skip_not_taken``); a
  ``train_batch`` that returns without calling ``optimizer_step`` raises ``SeamError``.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from pathlib import Path

import torch

from .. import TokenBatch
from ..stats.constants import DEFAULT_CLIP_EPS
from ..versions import ALLOW_UNTESTED, check_range, installed, require_attr, require_seam
from .seams import DroppedStepCheck, announce, arguments, halted, where

TESTED = {"areal": ("1.0", "1.1")}  # constraints/areal.txt: areal 1.0.4
# the engine's methods wrapped or called, with the parameters read by name, and the attributes read
ENGINE_METHODS = {
    "train_batch": ("input_", "loss_fn"),
    "optimizer_step": (),
    "optimizer_zero_grad": (),
    "get_version": (),
}
ENGINE_ATTRS = ("model", "optimizer", "lr_scheduler")
LOSS_MODULE = "areal.trainer.ppo.actor"  # PPOActor binds grpo_loss_fn's settings with functools.partial
LOSS_ARGS = ("logprobs", "entropy", "input_data")
# grpo_loss_fn's settings read for the token statistics, and what they mean when a loss function has none
LOSS_SETTINGS = {
    "eps_clip": DEFAULT_CLIP_EPS,
    "eps_clip_higher": None,
    "importance_sampling_level": "token",
    "current_version": None,
}
PRESET = Path(__file__).resolve().parents[1] / "presets" / "async.yaml"


def check_versions() -> None:
    """areal in the tested range. Not installed: an error, unless ``RL_GUARD_ALLOW_UNTESTED=1`` (an engine with
    AReaL's API without the package), which is said on the console."""
    if installed("areal") is None and os.environ.get(ALLOW_UNTESTED) == "1":
        announce(
            f"areal is not installed ({ALLOW_UNTESTED}=1): attaching to an engine with AReaL's API; its methods "
            f"were checked, its version cannot be ({describe_tested()})"
        )
        return
    check_range("AReaL", "areal", *TESTED["areal"])


def describe_tested() -> str:
    return where("AReaL", "areal", *TESTED["areal"])


def align_versions(versions: torch.Tensor) -> torch.Tensor:
    """Roll versions by -1 along the token axis, as ``compute_advantages`` rolls ``loss_mask``. Entries that wrap
    across a sequence end sit where the rolled mask is 0, so they never count."""
    return torch.roll(versions, shifts=-1, dims=-1)


def token_batch(
    logprobs,
    input_data: dict,
    entropy=None,
    current_version: int | None = None,
    eps_clip: float = DEFAULT_CLIP_EPS,
    eps_clip_higher: float | None = None,
    importance_sampling_level: str = "token",
    shift_versions: bool = True,
) -> TokenBatch:
    """One micro-batch's ``TokenBatch`` from ``loss_fn``'s arguments (packed ``[N]`` or padded ``[B, T]``)."""
    versions = input_data.get("versions")
    if versions is not None and current_version is not None:
        versions = align_versions(versions) if shift_versions else versions
    else:
        versions = None
    cu = input_data.get("cu_seqlens") if logprobs.dim() == 1 else None
    prox = input_data.get("prox_logp")
    return TokenBatch(
        logprobs=logprobs.detach(),
        mask=input_data["loss_mask"].bool(),
        old_logprobs=input_data["logprobs"].detach(),
        prox_logprobs=None if prox is None else prox.detach(),
        ref_logprobs=input_data.get("ref_logp"),
        entropy=None if entropy is None else entropy.detach().float(),
        advantages=input_data["advantages"],
        versions=versions,
        current_version=current_version if versions is not None else None,
        cu_seqlens=cu,
        eps_low=float(eps_clip),
        eps_high=float(eps_clip if eps_clip_higher is None else eps_clip_higher),
        importance_sampling_level="sequence" if importance_sampling_level == "sequence" else "token",
    )


def lag_rule(max_head_offpolicyness: int, action: str = "warn", name: str = "staleness_bound") -> dict:
    """A rule spec (the dict a YAML ``rules:`` entry parses to) firing when a token is staler than AReaL's bound."""
    return {
        "name": name,
        "metric": "rl_guard/lag/max",
        "op": ">",
        "threshold": int(max_head_offpolicyness),
        "action": action,
        "description": f"policy lag above max_head_offpolicyness={int(max_head_offpolicyness)}",
    }


def async_yaml(max_head_offpolicyness: int, source: str | Path | None = None) -> str:
    """The async preset (or ``source``, a YAML path) as YAML text with ``staleness_bound`` set to the bound."""
    import yaml

    data = yaml.safe_load(Path(source or PRESET).read_text(encoding="utf-8"))
    rule = lag_rule(max_head_offpolicyness)
    rules = data.setdefault("rules", [])
    found = [r for r in rules if r.get("name") == rule["name"]]
    if found:
        found[0]["threshold"] = rule["threshold"]
    else:
        rules.insert(0, rule)
    return yaml.safe_dump(data, sort_keys=False)


def _last_lr(engine) -> float:
    sched = engine.lr_scheduler  # checked at attach; None where the engine has no schedule
    return float(sched.get_last_lr()[0]) if sched is not None else math.nan


def check_seams(engine) -> None:
    """Everything ``install`` relies on (module docstring), before anything is wrapped; raises
    ``UnsupportedVersion`` or ``SeamError`` naming the version, the tested range and the seam."""
    check_versions()
    if not hasattr(engine, "optimizer_step") and hasattr(engine, "train_engine"):  # a TrainController
        raise TypeError(
            f"rl_guard: {type(engine).__name__} is AReaL's single-controller proxy; its engines live in worker "
            "processes. Build the trainer with `from rl_guard.adapters.areal_trainer import PPOTrainer` (instead of "
            "`from areal import PPOTrainer`): the workers then import rl_guard.adapters.areal_engine."
            "GuardedFSDPPPOActor, which installs the guard itself."
        )
    at = describe_tested()
    for name, params in ENGINE_METHODS.items():
        require_seam(engine, name, params=params, where=at)
    require_attr(engine, ENGINE_ATTRS, where=at)
    module = sys.modules.get(LOSS_MODULE)
    if module is not None:
        require_seam(module, "grpo_loss_fn", params=LOSS_ARGS + tuple(LOSS_SETTINGS), where=at)


def loss_settings(named: dict, engine, said: set) -> dict:
    """The loss settings of one ``loss_fn`` call (``named``: its arguments by name, defaults filled in); a setting
    the loss function does not take falls back to ``LOSS_SETTINGS`` (``current_version``: the engine's version) and
    is said once (``said``)."""
    out, missing = {}, []
    for key, default in LOSS_SETTINGS.items():
        if key in named:
            out[key] = named[key]
        else:
            out[key] = default
            missing.append(key)
    if out["current_version"] is None:
        out["current_version"] = engine.get_version()
        missing.append("current_version")
    new = [k for k in missing if k not in said]
    if new:
        said.update(new)
        fallback = {**LOSS_SETTINGS, "current_version": "the engine's get_version()"}
        announce(
            "AReaL's loss_fn does not give "
            + ", ".join(new)
            + "; the guard uses "
            + ", ".join(f"{k}={fallback[k]}" for k in new)
            + " for the clip and lag statistics"
        )
    return out


def install(engine, guard, shift_versions: bool = True):
    """Wrap ``engine.train_batch`` (observe every ``loss_fn`` call) and ``engine.optimizer_step`` (the gate), on
    this instance only; the originals run unchanged with the same arguments. Checks every seam first."""
    check_seams(engine)
    guard.attach(engine.model, engine.optimizer, engine.lr_scheduler)
    original_train_batch, original_step = engine.train_batch, engine.optimizer_step
    check = DroppedStepCheck(engine, guard, "AReaL", describe_tested)  # a dropped update stays dropped
    said: set[str] = set()

    def observing(loss_fn):
        def guarded(*args, **kwargs):
            loss = loss_fn(*args, **kwargs)
            with guard.protect("observe (AReaL loss_fn inputs)"):  # a renamed AReaL key must not kill training
                named = arguments(loss_fn, args, kwargs)
                cfg = loss_settings(named, engine, said)
                guard.observe(
                    token_batch(
                        named["logprobs"],
                        named["input_data"],
                        named["entropy"],
                        cfg["current_version"],
                        cfg["eps_clip"],
                        cfg["eps_clip_higher"],
                        cfg["importance_sampling_level"],
                        shift_versions,
                    ),
                    loss=loss.detach(),
                )
            return loss

        return guarded

    @functools.wraps(original_train_batch)
    def train_batch(*args, **kwargs):
        call = inspect.signature(original_train_batch).bind(*args, **kwargs)
        call.arguments["loss_fn"] = observing(call.arguments["loss_fn"])
        check.begin()
        out = original_train_batch(*call.args, **call.kwargs)
        check.verify()
        return out

    @functools.wraps(original_step)
    def optimizer_step(*args, **kwargs):
        check.gated()
        decision = guard.check()
        if decision.apply_step:
            stats = original_step(*args, **kwargs)
        else:
            check.dropped(decision)
            engine.optimizer_zero_grad()
            stats = {
                "update_successful": 0.0,
                "grad_norm": guard.last_metrics.get("rl_guard/grad/norm", math.nan),
                "lr": _last_lr(engine),
            }
        guard.step_done()
        stats.update(guard.last_logged)
        if decision.stop:
            raise halted(guard, decision)
        return stats

    engine.train_batch, engine.optimizer_step = train_batch, optimizer_step
    return guard
