"""``Guard``: the framework-agnostic guard a training loop (or an adapter) calls.

A plain PyTorch loop::

    guard = Guard.from_yaml("configs/ppo.yaml", run_dir="runs/ppo").attach(model, optimizer, scheduler)
    for batch in loader:
        for mb in micro_batches(batch):
            loss = loss_fn(mb)
            guard.observe(TokenBatch(...), loss=loss)   # device-side, no sync
            loss.backward()
        decision = guard.check()                        # grads probe, ONE host transfer, rules, actions
        if decision.apply_step:
            optimizer.step(); scheduler.step()
        optimizer.zero_grad()
        guard.step_done()                               # healthy snapshots, step counter
        if decision.stop:
            break
    guard.close()

Failure policy, one code path (``protect``) for every entry point and for adapters' own translation code:

- caller errors (``InputError``: ``ConfigError``, ``BatchError``/``EmptyMaskError``, ``SampleError``; and
  ``RankMismatch``, ranks feeding different layouts) always raise: they are bugs upstream, not guard failures;
- any other exception inside the guard or an adapter (observe, check, logging, snapshots, restore, translation)
  is an internal failure, handled by ``fail_mode``:
  ``open`` (default): warn with the traceback and let the step through; a non-finite gradient still drops the
  update (checked independently of the failed part). ``closed``: a step whose check failed is never applied (the
  update is dropped).
- after ``max_internal_failures`` consecutive steps with an internal failure the run is unguarded: the guard says
  so loudly (stderr, a ``guard_unguarded`` incident, ``rl_guard/guard/unguarded`` = 1 in the metrics) and, in
  ``closed`` mode, checkpoints and halts. It says so again when a step passes cleanly.
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .control.actions import Actions
from .control.announce import Announcer, console_logger
from .control.config import GuardConfig, load_config
from .control.controller import Controller, Decision
from .control.quarantine import Quarantine
from .control.state import TrainState
from .diagnostics import RunDiagnostics, SampleBatch
from .errors import InputError
from .stats import keys, ranks
from .stats.accumulate import StepAccumulator
from .stats.batch import EmptyMaskError, TokenBatch
from .stats.engines import HOST_MAX_TOKENS, Engine
from .stats.grads import any_nonfinite_grad, param_groups_of, probe_grads
from .stats.sequences import rank_count
from .stats.summarize import summarize
from .stats.update import UpdateProbe, learning_rates

if TYPE_CHECKING:
    from .sinks import SinkSet


class _Clock:
    """The guard's own host time: ``with guard._clock:`` around each public call's body (a context manager rather
    than a wrapper, so the call adds no stack frame and warnings still point at the caller). Only the outermost
    call counts (``check`` calls ``observe_partial``)."""

    __slots__ = ("seconds", "depth", "start", "lap_start")

    def __init__(self) -> None:
        self.seconds, self.depth, self.start = 0.0, 0, 0.0
        self.lap_start: float | None = None

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:  # None: exceptions propagate
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.start

    def lap(self) -> dict[str, float]:
        """Called at the start of ``check``: the host time inside the guard's calls since the previous lap (that
        check, the step_done after it, this step's observe calls) and its share of the lap's wall time; none before
        the first lap. Logged only, never seen by rules: timings differ between ranks, and every rank must decide
        alike."""
        now, start = time.perf_counter(), self.lap_start
        host, self.seconds, self.lap_start = self.seconds, 0.0, now
        if start is None or now <= start:
            return {}
        return {"rl_guard/guard/host_ms": 1e3 * host, "rl_guard/guard/host_frac": host / (now - start)}


class Guard:
    def __init__(self, config: GuardConfig, run_dir: str | Path | None = None, sinks=None, open_run_dir: bool = True):
        self.config = config
        self.rank, self.world_size = ranks.rank_and_world()
        self.run_dir = Path(run_dir or config.run_dir or "runs/rl_guard")
        self.controller = Controller(config, rank=self.rank)
        self._acc = StepAccumulator()
        self.state: TrainState | None = None
        self.actions = Actions(self)
        self.announcer = Announcer()  # one console line per action, and the end-of-run summary
        self.quarantine = Quarantine(config.quarantine["max_share"])
        # family -> sequences (control/culprits.py), or the function that makes them when a rule acts
        self.culprit_candidates: dict[str, list[dict] | Callable[[], list[dict]]] = {}
        self.last_bundle: dict | None = None  # the last incident bundle: path, bytes, seconds to write
        # this step's micro-batches (detached) with the adapter's context, for culprits if a rule acts
        self.step_batches: list[tuple[TokenBatch, object]] = []
        self.describe_sequence = None  # adapter: (context, row) -> {"prompt": ..., "completion": ..., ids}
        self.last_metrics: dict[str, float] = {}
        self.last_histograms: dict = {}
        self.last_decision: Decision | None = None
        self.last_logged: dict[str, float] = {}  # metrics of the last completed step (adapters merge these into logs)
        self.internal_failures = 0  # cumulative
        self.failing_steps = 0  # consecutive steps with an internal failure
        self._failed_this_step = False
        self._incomplete_step = False  # an observe failed: this rank's statistics for the step are partial
        self._saw_loss = False
        self._stepped = False  # a step_done in this process (start_at numbers only what comes before it)
        self.diagnostics = RunDiagnostics(run_dir=self.run_dir if self.rank == 0 else None)
        # How far each optimizer step moves the weights (every configuration has an update; stats/update.py).
        self.update_probe = UpdateProbe(sharded=config.sharded_grads)
        self.engine = Engine(config.stats_engine)  # the token statistics' engine: this guard's own
        self._engine_said = False
        self._probed_lrs: list[float] | None = None  # the step's learning rates, when the probe ran before it
        self._host_metrics: dict[str, float] = {}  # run-level diagnostics, merged into the next step's metrics
        self._sinks: SinkSet | None = None
        self._sink_spec = sinks if sinks is not None else config.sinks
        self._clock = _Clock()  # the guard's own cost, logged every step
        if open_run_dir:
            self.open_run_dir()

    @classmethod
    def from_yaml(cls, source, run_dir=None, sinks=None, open_run_dir: bool = True) -> Guard:
        """Build from a YAML path or YAML text (validated at once; raises ``ConfigError``). ``open_run_dir=False``:
        nothing is written until ``use_run_dir`` / ``open_run_dir`` (an adapter that learns the directory later)."""
        return cls(load_config(source), run_dir=run_dir, sinks=sinks, open_run_dir=open_run_dir)

    def open_run_dir(self) -> None:
        """Create the run directory and write the config the run uses (rank 0)."""
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(self.config.source_text or "# defaults\n", encoding="utf-8")

    def use_run_dir(self, run_dir: str | Path) -> Guard:
        """Point the guard at another run directory before anything was recorded (sinks not started)."""
        if self._sinks is not None:
            raise RuntimeError(f"the run directory is already in use ({self.run_dir}); set it before the first step")
        self.run_dir = Path(run_dir)
        self._new_rank_parts()
        return self

    def _new_rank_parts(self) -> None:
        """The parts built from the run directory and the rank (before anything was recorded)."""
        self.actions = Actions(self)
        self.diagnostics = RunDiagnostics(run_dir=self.run_dir if self.rank == 0 else None)

    # -- wiring ----------------------------------------------------------------------------------------------------
    def attach(self, model, optimizer=None, scheduler=None, **extra) -> Guard:
        """Give the guard the state its actions work on (``extra``: objects with state_dict/load_state_dict)."""
        self.state = TrainState(model, optimizer, scheduler, extra)
        if ranks.rank_and_world() != (self.rank, self.world_size):
            # The process group may start after the guard was built (TRL's GRPOConfig starts it).
            self.rank, self.world_size = ranks.rank_and_world()
            self.controller.rank = self.rank
            self._new_rank_parts()
        param = next(iter(model.parameters()), None) if model is not None else None
        if param is not None and self._acc.device is None:
            # A rank that saw no data this step still enters the collectives with tensors on the right device.
            self._acc.device = param.device
        if not self._engine_said and self.rank == 0:
            self._engine_said = True
            device = param.device if param is not None else torch.device("cpu")
            console_logger().info(f"rl_guard: stats_engine {self.engine.describe(device)}")
        return self

    def use_host_reads(self, on: bool) -> Guard:
        """Whether small CPU micro-batches' token statistics and losses are computed by numpy on their memory (the
        default) or take the path a GPU's tensors take (``False``)."""
        self.engine = Engine(self.config.stats_engine, HOST_MAX_TOKENS if on else 0)
        return self

    def attach_state(self, state) -> Guard:
        """Use a custom state object (``capture(step) -> dict`` and ``restore(snapshot, lr_scale)``), e.g. one that
        checkpoints through a framework's own save/load path. Optional: ``state.discard(snapshot)``, called for every
        snapshot the guard will no longer restore (pushed out of the ring, or abandoned by a rollback), to free
        what ``capture`` wrote outside memory; ``state.update_groups()``, the weights the
        optimizer updates when they are not its ``param_groups`` (None: they are), and ``state.params_sharded``
        True when those are this rank's partition (DeepSpeed ZeRO), so the update probe merges ranks by sum."""
        self.state = state
        if getattr(state, "params_sharded", False):
            self.mark_sharded()
        return self

    def mark_sharded(self) -> Guard:
        """This rank holds shards of the gradients and of the weights the optimizer updates, as plain tensors that
        detection cannot tell from replicas (ZeRO partitions, FSDP1 flat parameters): ranks merge both by sum.
        An explicit ``sharded_grads`` in the config wins."""
        if self.config.sharded_grads is None:
            self.config.sharded_grads = True
            self.update_probe.sharded = True
        return self

    @property
    def sinks(self):
        if self._sinks is None:
            from .sinks import build_sinks

            self._sinks = build_sinks(self._sink_spec, self.run_dir, is_main_process=self.rank == 0)
            self._sinks.start(self.run_dir, resume_step=self.controller.step - 1 if self.controller.step else None)
        return self._sinks

    @property
    def step(self) -> int:
        return self.controller.step

    @property
    def skipped_steps(self) -> int:
        return self.controller.skipped_steps

    @property
    def rollbacks(self) -> int:
        return self.controller.rollbacks

    def start_at(self, step: int) -> None:
        """Number the next step ``step`` (a trainer starting or resuming at its own count, which wins over a loaded
        state's; the adapter says so when they differ); only before this process's first step."""
        if not self._stepped:
            self.controller.step = step

    def mark_reported_absent(self, metrics) -> None:
        """Metrics already reported as absent (e.g. by an adapter's coverage report): no later missing warning."""
        self.controller.missing_warned.update(metrics)

    def take_restored(self) -> int | None:
        """Carry out a deferred rollback (``check(defer_restore=True)``); the restored snapshot's step, or None."""
        return self.actions.restore_pending()

    @property
    def stopped(self) -> dict | None:
        """The incident record of the rule that stopped or halted the run (None while it runs on)."""
        return self.announcer.stop_record

    # -- per micro-batch ---------------------------------------------------------------------------------------------
    def observe(self, batch: TokenBatch | None = None, loss: torch.Tensor | None = None, context=None) -> None:
        """Accumulate one micro-batch's statistics on the device (no host sync). ``context``: what the adapter knows
        of the batch's rows (e.g. token ids), handed to ``describe_sequence`` if a rule acts on one of them."""
        with self._clock, self.protect("observe"):
            if batch is not None:
                self._acc.add(self.engine.probe(batch, self.config.lag_buckets))
                self.step_batches.append((batch, context))  # reduced only if a rule on a token family acts
            if loss is not None:
                self._saw_loss = True
                self._acc.add(self.engine.loss(loss))

    def observe_sequences(self, rewards=None, lengths=None, truncated=None) -> None:
        """Accumulate per-sequence figures seen outside the loss (e.g. at generation time); no host sync."""
        with self._clock, self.protect("observe_sequences"):
            self._acc.add(self.engine.sequences(lengths=lengths, truncated=truncated, rewards=rewards))

    def observe_samples(self, samples: SampleBatch, optimizer_updates: int | None = None) -> None:
        """Run-level diagnostics from per-sample host data (once per generation batch); see rl_guard.diagnostics."""
        with self._clock, self.protect("observe_samples"):
            self._host_metrics.update(self.diagnostics.update(samples, self.step, optimizer_updates=optimizer_updates))

    def observe_culprits(self, family: str, candidates: list[dict] | Callable[[], list[dict]]) -> None:
        """The candidate culprit sequences of one family (``"rewards"``) for the steps that train on this generation
        batch: dicts with ``prompt``, ``prompt_key``, ``completion``, ``reward``, ``rewards``, ``nonfinite`` (see
        ``rl_guard/control/culprits.py``). Host data. ``candidates``: their list, or a function that makes it, called
        only when a rule acts (choosing and describing them would cost every healthy step ~0.1-0.2 ms) or, where an
        enabled quarantine does not know how many prompts the data holds, at once (its share counts those seen)."""
        with self._clock:
            self.culprit_candidates[family] = candidates
            if self.config.quarantine["enabled"] and self.quarantine.population is None:
                self.quarantine.seen.update(c["prompt_key"] for c in self.culprits_of(family) if "prompt_key" in c)

    def culprits_of(self, family: str | None) -> list[dict]:
        """The candidates ``observe_culprits`` last received for ``family`` (made now if they were deferred)."""
        key = family or ""
        found = self.culprit_candidates.get(key, [])
        if callable(found):
            self.culprit_candidates[key] = found = found()
        return found

    def observe_partial(self, partial=None, host_metrics: dict | None = None) -> None:
        """Add statistics measured outside ``observe`` to this step, e.g. the update probe's device ``Partial``
        (``rl_guard/stats/update.py``) and host floats such as learning rates; no host sync."""
        with self._clock:
            if partial is not None:
                self._acc.add(partial)
            if host_metrics:
                self._host_metrics.update(host_metrics)

    # -- per optimizer step --------------------------------------------------------------------------------------------
    def check(self, params=None, pre_clip_norm=None, defer_restore: bool = False) -> Decision:
        """Probe gradients, transfer once, evaluate rules and act. Call after backward, before optimizer.step()."""
        with self._clock:
            if params is None:
                params = (self.state.optimizer or self.state.model) if self.state else None
            cost = self._clock.lap()
            self._probe_update_before()
            self._host_metrics.update(self.diagnostics.no_signal_steps())
            reduce = ranks.reducer()
            try:
                if self._incomplete_step:
                    raise RuntimeError("this rank's statistics for the step are incomplete (an observe call failed)")
                if params is not None:
                    sharded = self.config.sharded_grads
                    self._acc.add(probe_grads(param_groups_of(params), pre_clip_norm, sharded=sharded))
                if self._saw_loss:
                    self._acc.add(rank_count(keys.LOSS.ranks, self._acc.device))
                raw = self._acc.finish(reduce)
                if raw.get(keys.TOKENS.empty_microbatches, [0])[0] > 0:
                    raise EmptyMaskError(
                        f"{int(raw['tokens.empty_microbatches'][0])} micro-batch(es) at step {self.step} had an "
                        "all-zero mask: no token reaches the loss. An empty action mask is a bug upstream, not 'no "
                        "data'."
                    )
                metrics, hists = summarize(raw, self.config.lag_buckets)
                metrics.update(self._host_metrics)
                decision = self.controller.decide(metrics, can_rollback=self.actions.can_rollback())
            except (InputError, ranks.RankMismatch):
                raise
            except Exception as exc:  # noqa: BLE001
                if reduce is not None and not reduce.entered:
                    ranks.abstain()  # the other ranks must not wait for statistics that will never come
                return self._fail(exc, params)
            finally:
                self._incomplete_step = self._saw_loss = False
                self._host_metrics = {}
                kept, self.step_batches = self.step_batches, []
            metrics.update(self.controller.counters(decision))
            metrics["rl_guard/guard/fired"] = float(len(decision.firings))
            metrics.update(cost)
            self.last_metrics, self.last_histograms, self.last_decision = metrics, hists, decision
            self.actions.apply(decision, params, defer_restore=defer_restore, kept=kept)
            return decision

    def step_done(self) -> None:
        """Report that the step happened (applied or skipped): log, snapshot if healthy, advance the counter."""
        with self._clock:
            decision = self.last_decision or Decision(step=self.step)
            self._probe_update_after(decision)
            self._count_failing_step()
            if self.step % self.config.log_every == 0 or decision.firings or self.failing_steps:
                with self.protect("log"):
                    self.sinks.log(self.last_metrics, self.step, self.last_histograms)
            with self.protect("snapshot"):
                self.actions.after_step(decision)
            self.controller.step_done(decision)
            self._stepped = True
            self.last_logged = dict(self.last_metrics)
            self.last_decision = None

    def _optimizer(self):
        optimizer = getattr(self.state, "optimizer", None)
        return optimizer if hasattr(optimizer, "param_groups") else None

    def _update_groups(self, optimizer) -> list:
        update_groups = getattr(self.state, "update_groups", None)  # e.g. ZeRO's fp32 master partitions
        return (update_groups and update_groups()) or param_groups_of(optimizer)

    def _probe_update_before(self) -> None:
        """Learning rates and the sampled weights right before the update (the last update joins this step)."""
        optimizer, self._probed_lrs = self._optimizer(), None
        if optimizer is None:
            return
        with self.protect("update probe"):
            lrs = learning_rates(optimizer)
            self.observe_partial(
                self.update_probe.pre_step(self._update_groups(optimizer), lrs), self.update_probe.lr_metrics(lrs)
            )
            self._probed_lrs = lrs

    def _probe_update_after(self, decision: Decision) -> None:
        """Called after ``optimizer.step()`` (applied or not): sample the weights it left, or, after a rollback,
        the restored ones (a restore is not a change from outside the optimizer)."""
        optimizer, lrs, self._probed_lrs = self._optimizer(), self._probed_lrs, None
        if optimizer is None or lrs is None:
            return
        with self.protect("update probe"):
            groups = self._update_groups(optimizer)
            if decision.rollback:
                self.update_probe.resync(groups)
                return
            self.update_probe.post_step(groups)
            if decision.apply_step:
                self.update_probe.accept(lrs)

    def close(self) -> None:
        if self._sinks is not None:
            with self.protect("close"):
                self._sinks.finish()
        with self.protect("close"):
            self.diagnostics.close()

    # -- failure policy ------------------------------------------------------------------------------------------------
    def protect(self, where: str) -> _Protected:
        """Run guard or adapter code under the failure policy (module docstring): caller errors raise, anything
        else is recorded as an internal failure and swallowed."""
        return _Protected(self, where)

    def _fail(self, exc: Exception, params) -> Decision:
        self._internal_failure("check", exc)
        decision = Decision(step=self.step)
        if self.config.fail_mode == "closed":
            unguarded = self.failing_steps + 1 >= self.config.max_internal_failures
            decision.action = "checkpoint_and_halt" if unguarded else "skip_step"
        elif params is not None and ranks.any_rank(any_nonfinite_grad(param_groups_of(params))):
            # Agreed across ranks: under sharded gradients (ZeRO, FSDP) each rank sees only its own shard, and ranks
            # deciding differently would hang in the engine's next collective.
            decision.action = "skip_step"
        self.last_metrics, self.last_histograms, self.last_decision = self.controller.counters(), {}, decision
        with self.protect("fail-safe action"):
            self.actions.apply(decision, params, defer_restore=False)
        return decision

    def _internal_failure(self, where: str, exc: Exception) -> None:
        self.internal_failures += 1
        self._failed_this_step = True
        if where == "check" or where.startswith("observe"):
            # what the step recorded is spent or incomplete; other failures (the update probe, logging, snapshots)
            # leave the step's statistics to be checked
            device, self._acc = self._acc.device, StepAccumulator()
            self._acc.device = device
        if where.startswith("observe"):
            self._incomplete_step = True
        self._last_failure = f"{where}: {exc!r}"
        warnings.warn(
            f"rl_guard internal failure in {where} at step {self.step} (fail_mode={self.config.fail_mode}): "
            f"{exc!r}\n{''.join(traceback.format_exception(exc))}",
            RuntimeWarning,
            stacklevel=4,
        )

    def _count_failing_step(self) -> None:
        """Consecutive failing steps; crossing ``max_internal_failures`` (or recovering) is announced once."""
        failed, self._failed_this_step = self._failed_this_step, False
        limit = self.config.max_internal_failures
        was_unguarded = self.failing_steps >= limit
        self.failing_steps = self.failing_steps + 1 if failed else 0
        unguarded = self.failing_steps >= limit
        self.last_metrics["rl_guard/guard/internal_failures"] = float(self.internal_failures)
        self.last_metrics["rl_guard/guard/unguarded"] = float(unguarded)
        if unguarded == was_unguarded:
            return
        if unguarded:
            if self.config.fail_mode == "open":
                then = "training continues WITHOUT the guard's checks (set fail_mode: closed to halt instead)"
            else:
                shadow = self.config.mode == "shadow"
                then = "would checkpoint and halt (shadow mode)" if shadow else "checkpointed and halted"
            message = (
                f"[rl_guard] UNGUARDED at step {self.step}: internal failure on {self.failing_steps} "
                f"consecutive steps (last: {self._last_failure}); {then}"
            )
        else:
            message = f"[rl_guard] guarded again at step {self.step}: the step passed without internal failure"
        print(message, file=sys.stderr, flush=True)
        with self.protect("incident"):
            self.actions.guard_incident(
                "guard_unguarded" if unguarded else "guard_recovered",
                message,
                action=self.last_decision.action if self.last_decision else None,
            )

    # -- persistence ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "controller": self.controller.state_dict(),
            "actions": self.actions.state_dict(),
            "diagnostics": self.diagnostics.state_dict(),
            "update": self.update_probe.state_dict(),
            "announcer": self.announcer.state_dict(),
            "quarantine": self.quarantine.state_dict(),
            "run_dir": str(self.run_dir),
            "time": time.time(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        self.actions.load_state_dict(state["actions"])
        if "diagnostics" in state:
            self.diagnostics.load_state_dict(state["diagnostics"])
        if "update" in state:
            self.update_probe.load_state_dict(state["update"])
        if "announcer" in state:
            self.announcer.load_state_dict(state["announcer"])
        if "quarantine" in state:
            self.quarantine.load_state_dict(state["quarantine"])

    # -- a skip the framework did not take -----------------------------------------------------------------------------
    def skip_not_taken(self, decision: Decision, framework: str, seen: str) -> str:
        """The guard dropped this step's update through the framework and the framework applied it anyway (``seen``:
        how the adapter saw it). The guard can no longer keep bad updates out of the run, so it escalates to
        ``checkpoint_and_halt``: one console line, a ``skip_not_taken`` incident, a checkpoint (it holds the state
        after that update; healthy snapshots, if any, are older). ``decision`` becomes ``checkpoint_and_halt`` (its
        ``stop`` is set); returns the message, for the adapter's ``GuardHalted``. Every rank must call it at the
        same step (the checkpoint is collective): adapters call it on a figure every rank shares."""
        message = (
            f"[rl_guard] {framework} applied the update of step {decision.step} that the guard dropped "
            f"({decision.action}): {seen}. Skips do not work on this run; checkpoint and halt"
        )
        if self.rank == 0:
            console_logger().error(message)
        decision.escalated_from, decision.action = decision.action, "checkpoint_and_halt"
        checkpoint = None
        try:
            checkpoint = self.actions.save_checkpoint(reason="skip_not_taken")
        finally:
            record = {
                "step": decision.step,
                "rule": "skip_not_taken",
                "metric": "rl_guard/guard/skip_not_taken",
                "value": 1.0,
                "op": ">",
                "threshold": 0.0,
                "action": "checkpoint_and_halt",
                "decision": "checkpoint_and_halt",
                "escalated_from": decision.escalated_from,
                "severity": "critical",
                "message": message,
                "rank": self.rank,
                "checkpoint": checkpoint,
                "time": time.time(),
            }
            self.last_metrics["rl_guard/guard/skip_not_taken"] = 1.0
            if self.announcer.stop_record is None:
                self.announcer.stop_record = record
            if self.rank == 0:
                with self.protect("incident"):
                    self.sinks.incident(record)
        return message


class _Protected:
    """``Guard.protect``'s context manager, a plain class: several run every step, and a generator-based one costs
    several times more."""

    __slots__ = ("guard", "where")

    def __init__(self, guard: Guard, where: str) -> None:
        self.guard, self.where = guard, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if not isinstance(exc, Exception) or isinstance(exc, (InputError, ranks.RankMismatch)):
            return False  # no exception, a caller error, or not an error at all (KeyboardInterrupt): it propagates
        self.guard._internal_failure(self.where, exc)  # the guard must not take the run down
        return True
