"""TRL / transformers adapter: ``GRPOTrainer(..., callbacks=[RLGuardCallback("configs/grpo.yaml")])``.

Tested: trl >= 1.16, < 1.17 and transformers >= 5.25, < 5.26 (``trl_seams.TESTED``); every seam below is verified at
attach (``trl_seams.check_seams``), so a release that changed one fails there with an error naming it.

A ``TrainerCallback`` gets no trainer object, so ``on_train_begin`` finds the trainer calling it (the frame whose
``callback_handler`` holds this callback) and wraps methods of that instance only. Each wrapper calls the
original with the same arguments and returns its result unchanged; it only reads detached tensors and draws no
random numbers, so losses, gradients and the RNG stream are untouched. The wrappers go at ``on_train_end``.

TRL internals relied on (GRPOTrainer): ``_get_per_token_logps_and_entropies`` (log-probs and entropies of the
loss), ``compute_loss(model, inputs)`` with ``inputs`` keys ``completion_ids``, ``completion_mask``, ``tool_mask``,
``advantages``, ``old_per_token_logps`` (absent when fully on-policy: TRL then uses the detached current log-probs,
so the ratio is reported as exactly 1), ``ref_per_token_logps`` (``beta != 0``), ``sampling_per_token_logps``
(vLLM); attributes ``epsilon_low``, ``epsilon_high``, ``importance_sampling_level``, ``eos_token_ids``,
``mask_truncated_completions``, ``reward_weights``, ``_buffered_inputs`` (cleared after a rollback so TRL
regenerates rather than train on rollouts of the diverged policy); ``_calculate_rewards`` (per-function rewards,
before TRL's nansum hides a NaN); ``log(logs)``. transformers ``Trainer``: ``_clip_grad_norm`` (pre-clip norm),
events ``on_pre_optimizer_step`` / ``on_step_end``; ``state.global_step``. A plain
``Trainer`` gets the gradient, update, loss and non-finite rules only.

``rl_guard/grad/norm`` is the pre-clip norm the trainer computed (what TRL logs as ``grad_norm``); the gradients
the guard reads are already clipped, and their norm is ``grad/norm_postclip``. The guard's update probe
(``rl_guard/stats/update.py``) measures every optimizer step between ``on_pre_optimizer_step`` (``check``) and
``on_step_end`` (``step_done``). Step numbers the guard writes (incidents, ``metrics.jsonl``, checkpoints, console)
are the trainer's ``global_step`` after the step, the x-axis of every ``report_to`` backend. At attach the adapter
reports which rules can fire in the trainer's configuration (``trl_coverage.py``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from .. import Guard, TokenBatch
from ..control.announce import console_logger
from ..control.culprits import IDS_LIMIT, cut
from ..run_dirs import fresh_run_dir
from ..sinks.printed import for_printing, printed_keys
from ..stats.on_device import host_to_device
from .trl_checkpoints import checkpoints_before, load_guard_state, resume_checkpoint, save_guard_state
from .trl_coverage import PPO_CLIP_LOSSES, rule_coverage, trainer_configuration, write_coverage
from .trl_quarantine import PromptGate, reward_culprits
from .trl_rewards import NoneTracker, applicable_total
from .trl_samples import samples_from_rewards
from .trl_seams import QUARANTINE_SEAM, check_seams, check_versions, settings

if TYPE_CHECKING:
    from .deepspeed import EngineGate

logger = logging.getLogger("rl_guard")


class RLGuardCallback(TrainerCallback):
    """Guard a transformers / TRL trainer.

    ``guard``: a preset name (``"grpo"``), a YAML path, YAML text, or a ``Guard``. ``run_dir``: where the guard's
    records go; default the YAML's ``run_dir``, else ``<output_dir>/rl_guard``. A fresh run never writes into another
    run's records (it takes ``<run_dir>-2`` and says so); a run resumed with ``resume_from_checkpoint`` continues
    them. ``printed_metrics``: the guard keys in the line the trainer prints, ``"core"`` (default, ~14 keys),
    ``"all"``, ``"none"`` or a list; every report_to backend receives all of them.

    After training, ``stopped`` is the incident that stopped or halted the run (None if it ran to its end), and
    ``summary`` the lines printed at the end."""

    def __init__(self, guard="grpo", run_dir: str | None = None, printed_metrics="core"):
        check_versions()
        self._printed = printed_keys(printed_metrics)
        self._run_dir_given = run_dir is not None
        if isinstance(guard, Guard):
            self.guard, self._run_dir_given = guard, True
        else:
            self.guard = Guard.from_yaml(guard, run_dir=run_dir, open_run_dir=False)
            self._run_dir_given = self._run_dir_given or self.guard.config.run_dir is not None
        self.summary: list[str] = []
        self.resumed_from: str | None = None
        self._told: set = set()
        self.trainer: Any = None  # the Trainer whose callback this is, found at train begin
        self._originals: dict = {}
        self._in_loss, self._captured, self._preclip, self._on_policy_noted = False, None, None, False
        # DeepSpeed: the decision is taken inside engine.step (adapters/deepspeed.py)
        self._engine_gate: EngineGate | None = None
        self.coverage: list[dict] = []
        self._eos_cache: tuple | None = None
        self._printers: list = []
        self._seams: dict = {}
        self._gate: PromptGate | None = None
        self._settings: dict = {}
        self._first_step: int | None = None

    # -- finding the trainer and wrapping its methods -----------------------------------------------------------
    def _find_trainer(self):
        frame = inspect.currentframe()
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and self in getattr(handler, "callbacks", ()):
                return candidate
            frame = frame.f_back
        raise RuntimeError("RLGuardCallback could not find the Trainer calling it; pass it in `callbacks=[...]`")

    def _wrap(self, name: str, make) -> None:
        original = self._seams.get(name)
        if original is not None:  # the RL seams are absent on a plain transformers Trainer (check_seams decides)
            self._originals[name] = original
            setattr(self.trainer, name, functools.wraps(original)(make(original)))

    @property
    def stopped(self) -> dict | None:
        return self.guard.stopped

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.trainer = self._find_trainer()
        # before anything is wrapped or written: a changed TRL fails here
        self._seams = check_seams(self.trainer, quarantine=self.guard.config.quarantine["enabled"])
        self._settings = settings(self.trainer) if "_calculate_rewards" in self._seams else {}
        self._start_records(args, state)
        self.guard.attach(model, optimizer, lr_scheduler)
        self._align_steps(state)
        self._report_coverage()
        self._quiet_printers()
        self._wrap("_get_per_token_logps_and_entropies", self._wrap_logps)
        self._wrap("compute_loss", self._wrap_loss)
        self._wrap("_calculate_rewards", self._wrap_rewards)
        self._wrap("_clip_grad_norm", self._wrap_clip)
        self._wrap("log", self._wrap_log)
        self.guard.describe_sequence = self._describe
        if QUARANTINE_SEAM in self._seams:
            self._gate = PromptGate(self.trainer, self.guard.quarantine)
            self._wrap(QUARANTINE_SEAM, self._wrap_generate)
        self._nones = NoneTracker(self.trainer) if hasattr(self.trainer, "reward_funcs") else None
        # -- DeepSpeed (rl_guard/adapters/deepspeed.py): the update runs inside backward, so gate engine.step --
        from .deepspeed import gate_accelerator

        self._engine_gate = gate_accelerator(self.trainer.accelerator, self.guard)
        if "wandb" in (args.report_to or []) and "wandb" not in self.guard.sinks.names:
            from ..sinks.wandb import WandbSink

            # The trainer logs the metrics to its wandb run; the guard adds alerts and the incident table.
            self.guard.sinks.add(WandbSink(metrics=False))

    def _start_records(self, args, state) -> None:
        """Resume the guard from the trainer's checkpoint, or start a fresh run in a directory of its own."""
        checkpoint = resume_checkpoint(args, state)
        default = Path(args.output_dir) / "rl_guard"
        saved = None
        if checkpoint is not None:
            self.resumed_from = checkpoint
            saved = load_guard_state(self.guard, checkpoint)
        if checkpoint is not None and saved is not None:
            if not self._run_dir_given and Path(saved.get("run_dir") or default) != self.guard.run_dir:
                self.guard.use_run_dir(saved.get("run_dir") or default)
            self._announce_resume(checkpoint, saved, args)
        else:
            wanted = self.guard.run_dir if self._run_dir_given else default
            fresh = fresh_run_dir(wanted) if self.guard.rank == 0 else Path(wanted)
            if fresh != Path(wanted):
                console_logger().warning(
                    f"rl_guard: {wanted} holds another run's records; this run writes to {fresh} "
                    "(resume_from_checkpoint continues a run's own records)"
                )
            if fresh != self.guard.run_dir:
                self.guard.use_run_dir(fresh)
            if checkpoint is not None:
                console_logger().warning(
                    f"rl_guard: {checkpoint} carries no guard state: the guard starts unarmed at step "
                    f"{state.global_step + 1} (empty rule histories and counters; spike rules arm after their "
                    "min_history)"
                )
        self.guard.open_run_dir()

    def _announce_resume(self, checkpoint: str, saved: dict, args) -> None:
        line = (
            f"rl_guard: resumed from {checkpoint}: step {self.guard.step}, {self.guard.skipped_steps} skipped, "
            f"{self.guard.rollbacks} rollbacks, rule histories restored; records continue in {self.guard.run_dir}"
        )
        stop = saved.get("stopped")
        if stop is not None:
            earlier = checkpoints_before(args.output_dir, stop["step"])
            healthy = (
                f"the newest checkpoint from before it is {earlier[-1]}"
                if earlier
                else "no checkpoint from before it is in output_dir"
            )
            line += (
                f"\n  WARNING: this checkpoint was saved when rule {stop['rule']} stopped the run at step "
                f"{stop['step']} ({stop['message']}): it holds "
                f"the state the fault left; {healthy}. A fault still present is acted on at the first resumed "
                "step."
            )
        console_logger().warning(line)

    def _align_steps(self, state) -> None:
        """Number guard steps as the trainer does: the step that ends with global_step = n is guard step n."""
        if self.guard.step == 0:
            _ = self.guard.sinks  # started first, so a fresh run is not mistaken for a resumed one
        elif self.guard.step != state.global_step + 1:
            console_logger().warning(
                f"rl_guard: the saved guard state is at step {self.guard.step}, the trainer at "
                f"global_step {state.global_step}: the guard follows the trainer"
            )
        self.guard.start_at(state.global_step + 1)
        _ = self.guard.sinks  # a resumed run: records after the resume step are dropped, none duplicated

    def _quiet_printers(self) -> None:
        """The trainer's printed log line carries the core guard keys only; backends still receive every key."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, (PrinterCallback, ProgressCallback)) and "on_log" not in cb.__dict__:
                original = cb.on_log

                def on_log(args, state, control, logs=None, _original=original, **kw):
                    return _original(args, state, control, logs=for_printing(logs or {}, self._printed), **kw)

                cb.on_log = on_log
                self._printers.append(cb)

    def _report_coverage(self) -> None:
        with self.guard.protect("coverage report"):
            self._write_coverage()

    def _write_coverage(self) -> None:
        cfg = trainer_configuration(self.trainer)
        self.coverage = rule_coverage(self.guard.controller.rules, cfg)
        for row in self.coverage:  # reported now: no 'metric not reported' warning 20 steps later
            self.guard.mark_reported_absent(row["absent_metrics"])
        if self.guard.rank == 0:
            print(write_coverage(self.guard.run_dir, cfg, self.coverage), flush=True)

    def on_save(self, args, state, control, **kw):
        """Every checkpoint the trainer writes carries the guard's state (restored by resume_from_checkpoint)."""
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if checkpoint.is_dir():
            with self.guard.protect("save guard state"):
                save_guard_state(self.guard, checkpoint, self._told)
        return control

    def on_train_end(self, args, state, control, **kw):
        if self._engine_gate is not None:
            self._engine_gate.remove()
        for name in self._originals:
            self.trainer.__dict__.pop(name, None)
        self._originals.clear()
        for cb in self._printers:
            cb.__dict__.pop("on_log", None)
        self._printers.clear()
        if self._nones is not None:
            self._nones.remove()
        self.guard.close()
        if self.guard.rank == 0:
            with self.guard.protect("summary"):
                self._print_summary(args, state)

    def _print_summary(self, args, state) -> None:
        first = self._first_step if self._first_step is not None else state.global_step
        lines = self.guard.announcer.summary(first, state.global_step, self.guard.run_dir)
        records = lines.pop()  # last, after what this trainer adds
        stop = self.guard.stopped
        if stop is not None:
            saved = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            earlier = checkpoints_before(args.output_dir, stop["step"])
            if saved.is_dir():
                lines.append(
                    f"  trainer checkpoint: {saved} (holds the state the fault left; the guard's state is in "
                    "it, so a fault still present is acted on at the first resumed step)"
                )
            lines.append(
                f"  newest healthy checkpoint (before step {stop['step']}, not written at a stop): "
                + (str(earlier[-1]) if earlier else "none in output_dir")
            )
            target = saved if saved.is_dir() else (earlier[-1] if earlier else None)
            if target is not None:
                lines.append(f'  to resume: trainer.train(resume_from_checkpoint="{target}")')
        self.summary = [*lines, records]
        console_logger().warning("\n".join(self.summary))

    def _wrap_logps(self, original):
        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            self._captured = out if self._in_loss else self._captured
            return out

        return wrapper

    def _wrap_loss(self, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            self._in_loss, self._captured = True, None
            try:
                out = original(*args, **kwargs)
            finally:
                self._in_loss = False
            with self.guard.protect("observe (TRL inputs)"):  # a renamed TRL key must not kill training
                named = signature.bind(*args, **kwargs).arguments
                if named["model"].training:
                    loss = out[0] if isinstance(out, tuple) else out
                    self.guard.observe(self._token_batch(named["inputs"]), loss=loss.detach(), context=named["inputs"])
            return out

        return wrapper

    def _wrap_rewards(self, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            per_func = original(*args, **kwargs)
            if self.trainer.model.training:
                with self.guard.protect("observe (TRL rewards)"):
                    named = signature.bind(*args, **kwargs).arguments
                    self._observe_rewards(
                        per_func, named["prompts"], named["completions"], named["completion_ids_list"]
                    )
            return per_func

        return wrapper

    def _observe_rewards(self, per_func, prompts, completions, completion_ids_list) -> None:
        weights = self.trainer.reward_weights.to(per_func.device)
        # per_func is gathered over processes: the merged statistics take this rank's slice only (where a
        # function's None is known), the (host-side) diagnostics the whole batch, identically on every rank.
        start, n = self.trainer.accelerator.process_index * len(prompts), len(prompts)
        local = per_func[start : start + n]
        none = (
            self._nones.not_applicable(n, local.device) if self._nones is not None else torch.zeros_like(local).bool()
        )
        # As TRL, a None adds nothing; unlike TRL's nansum, a NaN a function really returned stays visible.
        self.guard.observe_sequences(rewards=applicable_total(local, weights, none))
        # On one process the whole batch is local and its Nones are known; across processes only this rank's are.
        total = applicable_total(per_func, weights, none) if n == len(per_func) else (per_func * weights).sum(1)
        samples = samples_from_rewards(self.trainer, per_func, total, prompts, completions, completion_ids_list)
        self.guard.observe_samples(samples)
        k = self.guard.config.quarantine["culprits"]
        self.guard.observe_culprits(
            "rewards", lambda: reward_culprits(samples, start, prompts, completions, completion_ids_list, k)
        )

    def _describe(self, inputs, row: int) -> dict:
        """A culprit sequence of a loss micro-batch, as text and ids (read on the host only when a rule acted)."""
        tokenizer = self.trainer.processing_class
        decode = tokenizer.decode if hasattr(tokenizer, "decode") else tokenizer.tokenizer.decode
        prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist()
        completion = inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].tolist()
        return {
            "prompt": cut(decode(prompt)),
            "completion": cut(decode(completion)),
            "prompt_ids": prompt[:IDS_LIMIT],
            "completion_ids": completion[:IDS_LIMIT],
        }

    def _wrap_generate(self, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            gate = self._gate
            with self.guard.protect("quarantine"):  # fail open: a failing gate leaves the batch as it is
                if gate is not None:
                    bound.arguments["inputs"] = gate.filter(bound.arguments["inputs"])
            return original(*bound.args, **bound.kwargs)

        return wrapper

    def _wrap_clip(self, original):
        def wrapper(*args, **kwargs):
            self._preclip = original(*args, **kwargs)
            return self._preclip

        return wrapper

    def _wrap_log(self, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            with self.guard.protect("log"):
                logs = signature.bind(*args, **kwargs).arguments["logs"]
                if "loss" in logs:  # training logs only; every report_to backend then receives rl_guard/* too
                    logs.update(self.guard.last_logged)
            return original(*args, **kwargs)

        return wrapper

    # -- translating TRL tensors --------------------------------------------------------------------------------
    def _token_batch(self, inputs) -> TokenBatch | None:
        if self._captured is None or "completion_mask" not in inputs:
            return None
        logps, entropies = self._captured[0], self._captured[1]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        if old is None and "old_logps" in inputs:
            # RLOOTrainer keeps one old log-prob per sequence (old_logps): there is no per-token ratio to report,
            # and reporting the detached current log-probs would fake a ratio of exactly 1 (see trl_coverage.py).
            return self._batch(inputs, logps, entropies, mask, None, None)
        if old is None:
            old = logps.detach()
            if not self._on_policy_noted:
                self._on_policy_noted = True
                logger.info("rl_guard: TRL is fully on-policy here (no old_per_token_logps): the ratio is exactly 1")
        behaviour, prox = old.detach(), None
        if inputs.get("sampling_per_token_logps") is not None:
            behaviour, prox = inputs["sampling_per_token_logps"].detach(), old  # vLLM sampler vs trainer's old policy
        return self._batch(inputs, logps, entropies, mask, behaviour, prox)

    def _batch(self, inputs, logps, entropies, mask, old, prox) -> TokenBatch:
        t = self.trainer
        completion_ids = inputs["completion_ids"]
        eos = self._eos_ids(t.eos_token_ids, completion_ids.device)
        truncated = ~(torch.isin(completion_ids, eos) & inputs["completion_mask"].bool()).any(1)
        return TokenBatch(
            logprobs=logps.detach(),
            mask=mask.bool(),
            old_logprobs=old,
            prox_logprobs=prox,
            ref_logprobs=inputs.get("ref_per_token_logps"),
            entropy=None if entropies is None else entropies.detach(),
            advantages=inputs["advantages"],
            lengths=inputs["completion_mask"].sum(1),
            truncated=truncated,
            eps_low=float(t.epsilon_low),
            eps_high=float(t.epsilon_high),
            clipped_loss=self._settings["loss_type"] in PPO_CLIP_LOSSES,
            importance_sampling_level=self._settings["importance_sampling_level"],
            allow_empty_mask=bool(t.mask_truncated_completions),
        )

    def _eos_ids(self, ids, device) -> torch.Tensor:
        """The trainer's EOS ids as a device tensor, built once per (ids, device) rather than per micro-batch."""
        key = (tuple(ids), device)
        if self._eos_cache is None or self._eos_cache[0] != key:
            self._eos_cache = (key, host_to_device(torch.tensor(ids), device))
        return self._eos_cache[1]

    # -- acting before and after the optimizer step -------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kw):
        preclip, self._preclip = self._preclip, None
        if self._engine_gate is not None:  # DeepSpeed: decided inside engine.step, before the update
            decision = self._engine_gate.take()
            if decision is not None and decision.stop:
                control.should_training_stop = control.should_save = True
            return control
        decision = self.guard.check(
            params=optimizer if optimizer is not None else model, pre_clip_norm=preclip, defer_restore=True
        )
        if decision.stop:  # should_save: the trainer also writes its own checkpoint of the halted state
            control.should_training_stop = control.should_save = True
        return control

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        if self._first_step is None:
            self._first_step = state.global_step
        restored = self.guard.take_restored()  # the console line was printed when the rule fired
        if restored is not None and hasattr(self.trainer, "_buffered_inputs"):
            # Rollouts buffered from the diverged policy must not be trained on: TRL regenerates when this is None.
            self.trainer._buffered_inputs = None
        self.guard.step_done()
        return control
