"""DeepSpeed: the guard decides inside ``engine.step``, before the optimizer, on the engine's own seams.

Read against deepspeed 0.19.6, accelerate 1.15.0 and transformers 5.24.0 (imported lazily; core never imports
deepspeed):

- accelerate's ``DeepSpeedEngineWrapper.backward`` runs ``engine.backward(loss)`` and, at a sync step,
  ``engine.step()``; ``DeepSpeedOptimizerWrapper.step`` is a no-op. transformers' ``Trainer._inner_training_loop``
  calls ``training_step`` (the backward) before ``on_pre_optimizer_step``, so under DeepSpeed the update is
  already applied when callbacks run. The seam that comes before it is ``engine.step`` itself: ``EngineGate``
  wraps it on the one engine instance, and only at the accumulation boundary
  (``engine.is_gradient_accumulation_boundary()``) checks the guard before calling the original.
- ``DeepSpeedEngine.step`` -> ``_take_model_step`` -> ``optimizer.step()``; afterwards it reads
  ``optimizer.overflow``: when set it counts ``skipped_steps`` and holds the LR schedule. ZeRO 1/2
  (``DeepSpeedZeroOptimizer.step``) and ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3.step`` via
  ``_overflow_check_and_loss_scale_update``) test ``self.overflow`` after their own check (fp16 only, or
  ``check_grad_overflow``) and, when it is set, free the gradient partitions and return before the optimizer and
  before the parameter all-gather. ``suppressed_step`` sets that flag and shadows ``check_overflow`` for one
  call, so a skipped step takes exactly DeepSpeed's overflow path on every rank (the guard's decision is the same
  on every rank). Side effect under fp16 dynamic loss scaling: the loss scale is lowered as on a real overflow.
- Gradients under ZeRO are not in ``p.grad``: before ``optimizer.step`` each rank holds its partition in
  ``optimizer.averaged_gradients[group]`` (lists of tensors; ZeRO 1/2 and 3 without offload) or in the fp32
  partition's ``.grad`` with CPU offload (``single_partition_of_fp32_groups`` for 1/2,
  ``fp32_partitioned_groups_flat`` for 3). Under fp16 they carry the loss scale. ``ZeroGradients`` hands them
  to the probe as disjoint partitions (merged by sum) scaled by ``1 / loss_scale``.
- Without ZeRO (stage 0) the gradients are in ``p.grad``; a skip drops them before the engine's step, so a torch
  optimizer leaves weights and moments alone (the engine still advances its LR schedule).
- The update probe (``update/*``) reads, under ZeRO, this rank's fp32 master partitions (``MasterPartitions``:
  ranks merge by sum), before the update inside the gate and after it at ``step_done``.
- Snapshots, save-and-halt and rollback go through ``engine.save_checkpoint`` / ``load_checkpoint``
  (``EngineCheckpointState``): ZeRO-3 parameters are partitioned, so ``state_dict()`` copies would be empty.
- Checked at attach (``check_engine``): deepspeed in the tested range (0.19.6), the engine's methods and attributes
  used here, and a way to skip: ZeRO's ``overflow`` / ``check_overflow`` (with its gradient partitions), or a torch
  optimizer on ``p.grad`` at stage 0. Any other optimizer (``BF16_Optimizer``, ``FP16_Optimizer``) is an attach
  error: the guard could not drop an update there. A skip is verified: after the overflow path,
  ``engine.skipped_steps`` must have advanced by one; if DeepSpeed applied the update anyway, the guard says so,
  records a ``skip_not_taken`` incident, checkpoints and halts (``Guard.skip_not_taken``).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

from ..versions import SeamError, check_range, require_attr, require_seam
from .seams import where

# constraints/*.txt: deepspeed 0.19.6. 0.19.8 resets the ZeRO optimizer's overflow flag inside step(), so the skip
# path below no longer skips there (found by `nox -s latest`; the guard's check after the step halts such a run).
TESTED = {"deepspeed": ("0.19.6", "0.19.7")}
ENGINE_METHODS = ("step", "is_gradient_accumulation_boundary", "zero_optimization_stage", "fp16_enabled")
ENGINE_ATTRS = ("optimizer", "module", "skipped_steps")
# this rank's gradient and fp32 master partitions, and whether they live on the CPU (ZeroGradients, master_partitions)
ZERO_ATTRS = {
    3: ("fp32_partitioned_groups_flat", "sub_group_to_group_id", "offload_optimizer", "averaged_gradients"),
    1: ("single_partition_of_fp32_groups", "cpu_offload", "averaged_gradients"),
}
OVERFLOW, DROP_GRADS = "overflow", "drop_grads"  # how a dropped step is skipped


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


def is_engine(obj) -> bool:
    """A DeepSpeed engine (duck-typed, so that checking never imports deepspeed)."""
    return hasattr(obj, "is_gradient_accumulation_boundary") and hasattr(obj, "zero_optimization_stage")


class ZeroGradients:
    """This rank's ZeRO gradient partitions, as a ``rl_guard.stats.grads.GradientSource``."""

    sharded = True  # every element of the flat gradient lives in exactly one rank's partition

    def __init__(self, engine):
        self.engine, self.optimizer = engine, engine.optimizer

    @property
    def scale(self) -> float:
        return 1.0 / self.optimizer.loss_scale if self.engine.fp16_enabled() else 1.0

    def grad_groups(self) -> list[list[torch.Tensor]]:
        opt = self.optimizer  # the attributes were checked at attach (check_engine)
        if zero_stage(self.engine) == 3:
            flat, offload = opt.fp32_partitioned_groups_flat, bool(opt.offload_optimizer)
        else:
            flat, offload = opt.single_partition_of_fp32_groups, bool(opt.cpu_offload)
        out = []
        for i in range(len(flat)):
            if offload:
                out.append([flat[i].grad] if flat[i].grad is not None else [])
            else:
                out.append([g for g in (opt.averaged_gradients.get(i) or []) if g is not None])
        return out

    def drop_grads(self) -> None:
        """Nothing here: ``EngineGate`` runs the step through ZeRO's overflow path, which frees the partitions."""


def partitioned_optimizer(optimizer) -> bool:
    """A ZeRO optimizer: it keeps this rank's fp32 master partition (ZeRO 1/2: ``single_partition_of_fp32_groups``,
    3: ``fp32_partitioned_groups_flat``), disjoint across ranks."""
    return hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "fp32_partitioned_groups_flat")


def master_partitions(optimizer) -> list[list[torch.Tensor]] | None:
    """This rank's fp32 master partitions per parameter group, what a ZeRO optimizer updates (None for any other
    optimizer). ZeRO 3 splits a group into sub-groups and hands each to the torch optimizer only during ``step``
    (its ``param_groups`` are empty in between), so the partitions are read from the ZeRO optimizer itself."""
    if not partitioned_optimizer(optimizer):
        return None
    flat = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if flat is None:  # ZeRO 1/2: one partition per group
        return [[t] for t in optimizer.single_partition_of_fp32_groups]
    groups: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for sub, t in enumerate(flat):
        groups[optimizer.sub_group_to_group_id[sub]].append(t)
    return groups


class MasterPartitions:
    """Part of the guard's state protocol for ZeRO: the update probe reads this rank's fp32 master partitions
    (``update_groups``), which ranks merge by sum (``params_sharded``)."""

    optimizer = None

    @property
    def params_sharded(self) -> bool:
        return partitioned_optimizer(self.optimizer)

    def update_groups(self) -> list[list[torch.Tensor]] | None:
        return master_partitions(self.optimizer)


def gradient_source(engine):
    """What the guard probes at the engine's boundary: the ZeRO partitions, or the optimizer's ``p.grad``."""
    return ZeroGradients(engine) if zero_stage(engine) > 0 else engine.optimizer


def check_engine(engine) -> str:
    """At attach: deepspeed in the tested range and every seam of ``engine`` the gate uses; returns how a dropped
    step is skipped, ``OVERFLOW`` (DeepSpeed's overflow path) or ``DROP_GRADS`` (a torch optimizer at stage 0, its
    gradients dropped). Raises ``UnsupportedVersion`` or ``SeamError`` naming the version, the tested range and the
    seam."""
    check_range("DeepSpeed", "deepspeed", *TESTED["deepspeed"])
    at = where("DeepSpeed", "deepspeed", *TESTED["deepspeed"])
    for name in ENGINE_METHODS:
        require_seam(engine, name, where=at)
    require_attr(engine, ENGINE_ATTRS, where=at)
    opt, stage = engine.optimizer, zero_stage(engine)
    if stage == 0 and isinstance(opt, torch.optim.Optimizer):
        return DROP_GRADS
    if not (callable(getattr(opt, "check_overflow", None)) and hasattr(opt, "overflow")):
        raise SeamError(
            f"rl_guard: {type(opt).__name__} (ZeRO stage {stage}) has no overflow / check_overflow ({at}); "
            "the guard skips a step through DeepSpeed's overflow path and could not drop an update on "
            "this engine"
        )
    if stage > 0:
        require_attr(opt, ZERO_ATTRS[3 if stage == 3 else 1], where=at)
        if engine.fp16_enabled():
            require_attr(opt, ("loss_scale",), where=at)
    return OVERFLOW


def skip_path(engine) -> str:
    """``check_engine``'s answer for a DeepSpeed engine; ``DROP_GRADS`` for anything else (an engine-shaped object
    over a torch optimizer, whose gradients the guard drops)."""
    return check_engine(engine) if is_engine(engine) else DROP_GRADS


def suppressed_step(engine, step, path: str = OVERFLOW, guard=None, decision=None):
    """Run the engine's ``step`` without the update (see the module docstring); on the overflow path, verify that
    DeepSpeed skipped (``skipped_steps`` advanced) and escalate through ``guard.skip_not_taken`` when it did not."""
    if path == DROP_GRADS:
        for group in getattr(getattr(engine, "optimizer", None), "param_groups", ()):  # dropped by the guard: none left
            for p in group["params"]:
                p.grad = None
        return step()  # a torch optimizer skips every parameter without a gradient
    opt, before = engine.optimizer, engine.skipped_steps

    def overflowed(*args, **kwargs):
        opt.overflow = True

    opt.check_overflow, opt.overflow = overflowed, True  # instance attribute shadows the method for one step
    try:
        out = step()
    finally:
        del opt.check_overflow
        opt.overflow = False
    after = engine.skipped_steps
    if after != before + 1 and guard is not None and decision is not None:
        guard.skip_not_taken(
            decision,
            "DeepSpeed",
            f"its overflow path did not skip (engine.skipped_steps {before} -> {after}, expected {before + 1})",
        )
    return out


def gated_step(guard, engine, call, path: str | None = None):
    """``guard.check`` on the engine's gradients (ZeRO partitions, or ``p.grad`` without ZeRO), then ``call`` as
    is or through DeepSpeed's overflow path (``path``: ``check_engine``'s, found at attach). Returns
    ``(decision, call's result)``; after a skip DeepSpeed did not take, the decision is ``checkpoint_and_halt``."""
    decision = guard.check(params=gradient_source(engine) if is_engine(engine) else None, defer_restore=True)
    if decision.apply_step:
        return decision, call()
    return decision, suppressed_step(engine, call, path or skip_path(engine), guard, decision)


class EngineGate:
    """Wraps ``engine.step`` (this instance only): at the accumulation boundary, ``gated_step``. The caller
    collects the decision with ``take()`` (TRL's ``on_pre_optimizer_step``)."""

    def __init__(self, engine, guard):
        self.engine, self.guard = engine, guard
        self.path = check_engine(engine)  # before anything is wrapped: a changed seam fails here
        self.decision = None
        self._original = engine.step

        @functools.wraps(self._original.__func__)
        def step(*args, **kwargs):
            return self._step(*args, **kwargs)

        engine.step = step

    def _step(self, *args, **kwargs):
        if not self.engine.is_gradient_accumulation_boundary():
            return self._original(*args, **kwargs)
        self.decision, out = gated_step(
            self.guard, self.engine, functools.partial(self._original, *args, **kwargs), self.path
        )
        return out

    def take(self):
        """The decision taken inside the last boundary ``engine.step`` (once), or None."""
        decision, self.decision = self.decision, None
        return decision

    def remove(self) -> None:
        self.engine.__dict__.pop("step", None)


def gate_accelerator(accelerator, guard) -> EngineGate | None:
    """The gate for a trainer running under accelerate + DeepSpeed (``accelerator.deepspeed_engine_wrapped``), and
    the guard's state moved to DeepSpeed checkpoints; None elsewhere."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        return None
    engine = wrapped.engine
    guard.attach_state(EngineCheckpointState(engine, guard))
    return EngineGate(engine, guard)


class EngineCheckpointState(MasterPartitions):
    """The guard's state protocol over ``engine.save_checkpoint`` / ``load_checkpoint`` (collective: every rank
    calls them at the same step, as every rank takes the same decision). A snapshot is a checkpoint tag."""

    def __init__(self, engine, guard, ckpt_dir=None):
        at = where("DeepSpeed", "deepspeed", *TESTED["deepspeed"])
        require_seam(engine, "save_checkpoint", params=("save_dir", "tag", "client_state", "save_latest"), where=at)
        require_seam(
            engine,
            "load_checkpoint",
            params=("load_dir", "tag", "load_optimizer_states", "load_lr_scheduler_states"),
            where=at,
        )
        require_attr(engine, ("module", "optimizer", "lr_scheduler"), where=at)
        self.engine, self.guard = engine, guard
        self.ckpt_dir = str(ckpt_dir or guard.run_dir / "deepspeed_snapshots")
        self.model, self.optimizer = engine.module, engine.optimizer

    def capture(self, step: int) -> dict:
        tag = f"rl_guard_step{step}"
        self.engine.save_checkpoint(
            self.ckpt_dir, tag=tag, client_state={"rl_guard": self.guard.state_dict()}, save_latest=False
        )
        return {"step": step, "tag": tag, "ckpt_dir": self.ckpt_dir}

    def discard(self, snap: dict) -> None:
        """A snapshot the guard will no longer restore: its tag is removed (rank 0, for every rank's files; every
        rank finished writing it, as ``save_checkpoint`` ends in a barrier)."""
        if self.guard.rank == 0:
            shutil.rmtree(Path(snap["ckpt_dir"]) / snap["tag"], ignore_errors=True)

    def restore(self, snap: dict, lr_scale: float = 1.0) -> None:
        path, _ = self.engine.load_checkpoint(
            snap["ckpt_dir"], tag=snap["tag"], load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"rl_guard rollback: no DeepSpeed checkpoint {snap['tag']!r} under {snap['ckpt_dir']}")
        if lr_scale != 1.0:
            from ..control.state import scale_lr

            scale_lr(self.engine.optimizer, self.engine.lr_scheduler, lr_scale)
