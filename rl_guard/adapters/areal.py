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
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from .. import TokenBatch
from ..errors import GuardHalted
from ..stats.constants import DEFAULT_CLIP_EPS
from ..versions import require

SUPPORTED = {"areal": ((1, 0), (1, 1))}
PRESET = Path(__file__).resolve().parents[1] / "presets" / "async.yaml"


def check_versions() -> None:
    """An engine with AReaL's API but without the package installed is let through."""
    require("AReaL", "areal", *SUPPORTED["areal"], optional=True)


def align_versions(versions: torch.Tensor) -> torch.Tensor:
    """Roll versions by -1 along the token axis, as ``compute_advantages`` rolls ``loss_mask``. Entries that wrap
    across a sequence end sit where the rolled mask is 0, so they never count."""
    return torch.roll(versions, shifts=-1, dims=-1)


def token_batch(logprobs, input_data: dict, entropy=None, current_version: int | None = None,
                eps_clip: float = DEFAULT_CLIP_EPS, eps_clip_higher: float | None = None,
                importance_sampling_level: str = "token", shift_versions: bool = True) -> TokenBatch:
    """One micro-batch's ``TokenBatch`` from ``loss_fn``'s arguments (packed ``[N]`` or padded ``[B, T]``)."""
    versions = input_data.get("versions")
    if versions is not None and current_version is not None:
        versions = align_versions(versions) if shift_versions else versions
    else:
        versions = None
    cu = input_data.get("cu_seqlens") if logprobs.dim() == 1 else None
    prox = input_data.get("prox_logp")
    return TokenBatch(
        logprobs=logprobs.detach(), mask=input_data["loss_mask"].bool(), old_logprobs=input_data["logprobs"].detach(),
        prox_logprobs=None if prox is None else prox.detach(), ref_logprobs=input_data.get("ref_logp"),
        entropy=None if entropy is None else entropy.detach().float(), advantages=input_data["advantages"],
        versions=versions, current_version=current_version if versions is not None else None, cu_seqlens=cu,
        eps_low=float(eps_clip), eps_high=float(eps_clip if eps_clip_higher is None else eps_clip_higher),
        importance_sampling_level="sequence" if importance_sampling_level == "sequence" else "token")


def lag_rule(max_head_offpolicyness: int, action: str = "warn", name: str = "staleness_bound") -> dict:
    """A rule spec (the dict a YAML ``rules:`` entry parses to) firing when a token is staler than AReaL's bound."""
    return {"name": name, "metric": "rl_guard/lag/max", "op": ">", "threshold": int(max_head_offpolicyness),
            "action": action, "description": f"policy lag above max_head_offpolicyness={int(max_head_offpolicyness)}"}


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
    sched = getattr(engine, "lr_scheduler", None)
    return float(sched.get_last_lr()[0]) if sched is not None else math.nan


def install(engine, guard, shift_versions: bool = True):
    """Wrap ``engine.train_batch`` (observe every ``loss_fn`` call) and ``engine.optimizer_step`` (the gate), on
    this instance only; the originals run unchanged with the same arguments."""
    check_versions()
    if not hasattr(engine, "optimizer_step") and hasattr(engine, "train_engine"):  # a TrainController
        raise TypeError(
            f"rl_guard: {type(engine).__name__} is AReaL's single-controller proxy; its engines live in worker "
            "processes. Build the trainer with `from rl_guard.adapters.areal_trainer import PPOTrainer` (instead of "
            "`from areal import PPOTrainer`): the workers then import rl_guard.adapters.areal_engine."
            "GuardedFSDPPPOActor, which installs the guard itself.")
    guard.attach(engine.model, getattr(engine, "optimizer", None), getattr(engine, "lr_scheduler", None))
    original_train_batch, original_step = engine.train_batch, engine.optimizer_step

    def observing(loss_fn):
        kw = getattr(loss_fn, "keywords", None) or {}  # grpo_loss_fn's settings, bound by functools.partial

        def guarded(logprobs, entropy, input_data, *args, **kwargs):
            loss = loss_fn(logprobs, entropy, input_data, *args, **kwargs)
            version = kw.get("current_version")
            version = engine.get_version() if version is None else version
            with guard.protect("observe (AReaL loss_fn inputs)"):  # a renamed AReaL key must not kill training
                guard.observe(token_batch(logprobs, input_data, entropy, version, kw.get("eps_clip", DEFAULT_CLIP_EPS),
                                          kw.get("eps_clip_higher"), kw.get("importance_sampling_level", "token"),
                                          shift_versions), loss=loss.detach())
            return loss
        return guarded

    @functools.wraps(original_train_batch)
    def train_batch(input_, loss_fn, loss_weight_fn, *args, **kwargs):
        return original_train_batch(input_, observing(loss_fn), loss_weight_fn, *args, **kwargs)

    @functools.wraps(original_step)
    def optimizer_step(*args, **kwargs):
        decision = guard.check()
        if decision.apply_step:
            stats = original_step(*args, **kwargs)
        else:
            engine.optimizer_zero_grad()
            stats = {"update_successful": 0.0, "grad_norm": guard.last_metrics.get("rl_guard/grad/norm", math.nan),
                     "lr": _last_lr(engine)}
        guard.step_done()
        stats.update(guard.last_logged)
        if decision.stop:
            raise GuardHalted.of(decision)
        return stats

    engine.train_batch, engine.optimizer_step = train_batch, optimizer_step
    return guard
