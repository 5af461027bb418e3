"""Wall-time overhead of ``RLGuardCallback`` on a real (tiny) GRPO run: guarded vs unguarded, same seed.

Each pair runs an unguarded and a guarded ``GRPOTrainer`` on the tiny local Llama, alternating which goes first so
drift in the machine's load hits both alike. Only ``trainer.train()`` is timed (model loading and trainer
construction are not). Setups (``--setup``):

* ``demo`` (default): the demo's trainer and guard (reference KL, two passes over each rollout batch, frequent
  snapshots) with its short rollouts: 8-token completions, 4 per prompt, a log every step;
* ``trl-defaults``: ``GRPOConfig``'s defaults as a user gets them (completions of up to 512 tokens, 8 per prompt,
  a log every 10 steps, lr 1e-6, ``beta=0``, one pass per rollout batch) and the shipped ``grpo.yaml`` unmodified;
* ``trl-short``: TRL's loss defaults (``beta=0``, ``num_iterations=1``, a generation every step) and the shipped
  preset, with the demo's short rollouts: the largest share the guard's fixed per-step cost can have.

Every setup runs in float32 on the CPU (``bf16=False``). Reported:

* ``overhead_ratio``: median over pairs of guarded / unguarded wall time (target <= 1.05);
* ``overhead_ratio_cpu``: the same with process CPU time (less sensitive to neighbours on a shared machine);
* ``overhead_ratio_best``: the fastest guarded run over the fastest unguarded one (the least disturbed runs of each
  arm; on a loaded machine the per-pair median carries the neighbours' noise);
* ``overhead_ratio_range``: the smallest and largest per-pair ratio, how far one pair can be from the median;
* ``overhead_ratio_steady``: median over pairs of the steady-state step time, guarded / unguarded: from the end of
  the first optimizer step to the end of the last. ``train()`` starts with fixed work (accelerate's
  ``clear_device_cache`` runs a full ``gc.collect()``, ~0.2 s here), which a 24-step run spreads as ~10 ms over
  every step of both arms: the whole-run ratio understates the per-step cost of a long run, this one does not;
* ``guard_time_frac``: time spent inside the guard's own calls (statistics, gradient probe, transfer, rules,
  logging, snapshots) over the guarded run's wall time, measured directly with ``perf_counter``;
* ``guard_ms_per_step``: that time per optimizer step, split by part: ``statistics`` (observe calls and the
  adapter's TokenBatch translation), ``grad_probe``, ``update_probe`` (the weight samples around the optimizer
  step), ``transfer`` (the one device->host copy and its packing), ``summarize`` (host formulas), ``rules``,
  ``sinks``, ``diagnostics`` (generation batches only), ``snapshots``, ``adapter`` (the callback's own work around
  those calls: its events and the reward translation) and ``other`` (the rest of check/step_done). A nested timed
  call counts in its own part only;
* ``unaccounted_ms_per_step``: median over pairs of (guarded - unguarded wall time) / steps minus the time inside
  the guard's calls: what the guarded run costs beyond the guard's own work (the trainer's code running slower
  beside it, and the machine's noise: it can be negative);
* ``step_ms``: median wall time per optimizer step, unguarded and guarded (the whole ``train()`` call over its
  steps); ``steady_step_ms``: the same in the steady state.

A tiny model is the worst case for a relative figure: the guard's per-step work is fixed while a step costs 25-85 ms
here. One intra-op thread by default (``--threads``): on a shared machine, spinning worker threads make
multi-threaded wall time measure the neighbours.

``--hidden`` / ``--layers`` / ``--completion`` make the model and the rollouts larger (or shorter), to see the fixed
cost spread over a step that does more work.

Usage: ``python benchmarks/trl_overhead.py [--quick] [--runs N] [--steps N] [--json [FILE]] [--threads N]
[--hidden N] [--layers N] [--completion N]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from json_output import add_json_argument, emit_json  # noqa: E402
from rl_guard.stats.constants import STATS_ENGINES  # noqa: E402

TARGET = 1.05


PARTS = ("statistics", "grad_probe", "update_probe", "transfer", "summarize", "rules", "sinks", "diagnostics",
         "snapshots", "adapter", "other")


class _Breakdown:
    """Wall time of the guard's calls, split by part. Each wrapped call adds its own (exclusive) time to its part:
    time spent in a nested wrapped call goes to the nested call's part, so the parts add up to the total."""

    def __init__(self):
        self.parts = dict.fromkeys(PARTS, 0.0)
        self._stack: list[list[float]] = []  # per open call: [time spent in nested wrapped calls]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def wrap(self, fn, part: str):
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                nested = self._stack.pop()[0]
                self.parts[part] += elapsed - nested
                if self._stack:
                    self._stack[-1][0] += elapsed

        return timed


def _guard_patches(bd: _Breakdown) -> list[tuple[object, str, str]]:
    """(owner, attribute, part) of every function the breakdown times; the owners are the modules and classes the
    guard calls through, patched for the guarded run only."""
    from rl_guard import guard as guard_module
    from rl_guard.adapters import trl as adapter
    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.control.controller import Controller
    from rl_guard.control.state import TrainState
    from rl_guard.diagnostics import RunDiagnostics
    from rl_guard.sinks.base import SinkSet
    from rl_guard.stats.accumulate import StepAccumulator
    from rl_guard.stats.update import UpdateProbe

    return [
        (guard_module.Guard, "observe", "statistics"), (guard_module.Guard, "observe_sequences", "statistics"),
        (RLGuardCallback, "_token_batch", "statistics"),
        (guard_module.Guard, "check", "other"), (guard_module.Guard, "step_done", "other"),
        (guard_module.Guard, "observe_samples", "diagnostics"), (adapter, "samples_from_rewards", "diagnostics"),
        (RunDiagnostics, "update", "diagnostics"),
        (guard_module, "probe_grads", "grad_probe"), (StepAccumulator, "finish", "transfer"),
        (guard_module, "summarize", "summarize"), (Controller, "decide", "rules"),
        (SinkSet, "log", "sinks"), (SinkSet, "incident", "sinks"), (SinkSet, "finish", "sinks"),
        (TrainState, "capture", "snapshots"),
        (UpdateProbe, "pre_step", "update_probe"), (UpdateProbe, "post_step", "update_probe"),
        (UpdateProbe, "resync", "update_probe"),
        (RLGuardCallback, "on_pre_optimizer_step", "adapter"), (RLGuardCallback, "on_step_end", "adapter"),
        (RLGuardCallback, "_observe_rewards", "adapter"),
    ]


# What each setup sets in GRPOConfig beyond the run's own settings (steps, seed, output, CPU). trl-defaults sets
# nothing else: TRL's defaults as a user gets them (completions of up to 512 tokens, 8 generations per prompt, a log
# every 10 steps, lr 1e-6). demo and trl-short take the demo's short rollouts (8 tokens, 4 generations, a log every
# step): the largest share a fixed per-step cost can have.
SHORT = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
             learning_rate=3e-3)
TRAINER_SETUPS = {
    "demo": dict(SHORT, beta=0.04, num_iterations=2, steps_per_generation=2),  # the demo's trainer
    "trl-short": dict(SHORT, beta=0.0, num_iterations=1),                     # TRL's loss defaults, short rollouts
    "trl-defaults": {},
}
SETUPS = tuple(TRAINER_SETUPS)


def guard_config(setup: str, stats_engine: str = "eager") -> str:
    """The guard's YAML: the demo's for ``demo``, else the shipped GRPO preset as is."""
    from rl_guard.demo.run import PRESET, demo_config

    if setup == "demo":
        return demo_config("rollback", console_every=None, stats_engine=stats_engine)
    return PRESET.read_text(encoding="utf-8") + f"stats_engine: {stats_engine}\n"


def _step_clock():
    """A callback that records when each optimizer step ends (both arms): the steady-state step time leaves out
    ``train()``'s own start (accelerate's ``clear_device_cache`` runs a full ``gc.collect()`` there, ~0.2 s here)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    return StepClock()


def _one_run(model_path: Path, dataset, steps: int, guarded: bool, work: Path, seed: int = 0,
             completion: int | None = None, lr: float | None = None, stats_engine: str = "eager",
             setup: str = "demo") -> dict:
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.adapters import trl as adapter
    from rl_guard.demo.tiny import length_penalty_reward, repeat_last_digit_reward

    work.mkdir(parents=True, exist_ok=True)
    trainer_setup = dict(TRAINER_SETUPS[setup])
    if completion is not None:
        trainer_setup["max_completion_length"] = completion
    if lr is not None:
        trainer_setup["learning_rate"] = lr
    # bf16=False: TRL's default bf16 is for accelerators; on CPU every setup runs float32
    args = GRPOConfig(output_dir=str(work / "trainer"), max_steps=steps, use_cpu=True, bf16=False, report_to=[],
                      save_strategy="no", seed=seed, disable_tqdm=True, **trainer_setup)
    clock = _step_clock()
    callbacks, bd, patched = [clock], _Breakdown(), []
    if guarded:
        for owner, name, part in _guard_patches(bd):
            original = getattr(owner, name)
            patched.append((owner, name, original))
            setattr(owner, name, bd.wrap(original, part))
        callbacks.append(adapter.RLGuardCallback(guard_config(setup, stats_engine), run_dir=str(work / "guard")))
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=[repeat_last_digit_reward, length_penalty_reward],
                          args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.pop_callback(PrinterCallback)
    try:
        # Both arms start from the same collector state: on the larger model one full (generation-2) collection,
        # ~0.4 s, lands in some runs and not in others and would swing a pair by ~25 ms per step.
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    acted = 0
    if guarded:
        incidents = work / "guard" / "incidents.jsonl"
        lines = incidents.read_text().splitlines() if incidents.exists() else []
        acted = sum('"action": "warn"' not in line for line in lines)
    # steady state: from the end of the first step to the end of the last (the guard's work of the first step, and
    # the trainer's start, are left out)
    steady = (clock.ends[-1] - clock.ends[0]) / (len(clock.ends) - 1) if len(clock.ends) > 1 else float("nan")
    return {"wall": wall, "cpu": cpu, "guard": bd.total, "parts": dict(bd.parts), "steps": trainer.state.global_step,
            "acted": acted, "steady": steady}


def _trl_default(field: str):
    """A ``GRPOConfig`` field's default, as the installed TRL declares it."""
    from trl import GRPOConfig

    return GRPOConfig.__dataclass_fields__[field].default


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 pairs of 8 steps (well under 2 minutes)")
    ap.add_argument("--runs", type=int, help="pairs of runs (default 5, quick 3)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 24, quick 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--hidden", type=int, default=32, help="the model's hidden size (default 32: the tiny model)")
    ap.add_argument("--layers", type=int, default=2, help="the model's layers (default 2)")
    ap.add_argument("--completion", type=int, help="max completion tokens (default: the setup's, 8 or TRL's 512)")
    ap.add_argument("--lr", type=float, help="learning rate (default: the setup's, 3e-3 or TRL's 1e-6; lower it for "
                    "larger models so that the guard does not act: a run it acts on does different work)")
    ap.add_argument("--setup", default="demo", choices=SETUPS,
                    help="demo (default): the demo's trainer and guard configuration; trl-defaults: TRL's GRPOConfig "
                    "defaults as a user gets them, with the shipped grpo preset; trl-short: TRL's loss defaults "
                    "(beta=0, num_iterations=1, a generation every step) with the demo's short rollouts")
    ap.add_argument("--stats-engine", default="eager", choices=STATS_ENGINES,
                    help="the guard's stats_engine (default eager; compiled compiles during the warm-up runs)")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    runs = args.runs or (3 if args.quick else 5)
    steps = args.steps or (8 if args.quick else 24)

    import torch

    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="rl_guard_overhead_"))
    completion = args.completion or TRAINER_SETUPS[args.setup].get("max_completion_length") or _trl_default(
        "max_completion_length")
    model_path = build_tiny_model(work / "model", seed=0, hidden=args.hidden, layers=args.layers,
                                  max_positions=max(64, completion + 16))  # the prompts are 3 words
    dataset = prompt_dataset(256, seed=0)
    run_options = dict(completion=args.completion, lr=args.lr, stats_engine=args.stats_engine, setup=args.setup)
    for guarded in (False, True):  # warm-up: first-call costs (kernels, lazy imports) land in neither figure
        _one_run(model_path, dataset, 2, guarded, work / f"warmup_{int(guarded)}", **run_options)
    pairs = []
    for i in range(runs):
        order = (False, True) if i % 2 == 0 else (True, False)
        result = {g: _one_run(model_path, dataset, steps, g, work / f"run{i}_{int(g)}", **run_options)
                  for g in order}
        pairs.append((result[False], result[True]))
        print(f"pair {i}: unguarded {result[False]['wall']:.2f}s, guarded {result[True]['wall']:.2f}s "
              f"(guard calls {result[True]['guard']:.3f}s), ratio {result[True]['wall'] / result[False]['wall']:.3f}")
    ratios = [g["wall"] / p["wall"] for p, g in pairs]
    out = {
        "overhead_ratio": statistics.median(ratios),
        "overhead_ratio_cpu": statistics.median(g["cpu"] / p["cpu"] for p, g in pairs),
        "overhead_ratio_best": min(g["wall"] for _, g in pairs) / min(p["wall"] for p, _ in pairs),
        "overhead_ratio_range": [min(ratios), max(ratios)],
        "overhead_ratio_steady": statistics.median(g["steady"] / p["steady"] for p, g in pairs),
        "guard_time_frac": statistics.median(g["guard"] / g["wall"] for _, g in pairs),
        "target": TARGET, "runs": runs, "steps": steps, "threads": args.threads, "stats_engine": args.stats_engine,
        "setup": args.setup,
        "model": {"hidden": args.hidden, "layers": args.layers, "completion": completion,
                  "lr": args.lr or TRAINER_SETUPS[args.setup].get("learning_rate") or _trl_default("learning_rate")},
        "guard_ms_per_step": {part: statistics.median(1e3 * g["parts"][part] / g["steps"] for _, g in pairs)
                              for part in PARTS},
        "unaccounted_ms_per_step": statistics.median(1e3 * (g["wall"] - p["wall"] - g["guard"]) / g["steps"]
                                                     for p, g in pairs),
        "step_ms": {"unguarded": statistics.median(1e3 * p["wall"] / p["steps"] for p, _ in pairs),
                    "guarded": statistics.median(1e3 * g["wall"] / g["steps"] for _, g in pairs)},
        "steady_step_ms": {"unguarded": statistics.median(1e3 * p["steady"] for p, _ in pairs),
                           "guarded": statistics.median(1e3 * g["steady"] for _, g in pairs)},
        "guard_acted": sum(g["acted"] for _, g in pairs),
        "wall_s": {"unguarded": [p["wall"] for p, _ in pairs], "guarded": [g["wall"] for _, g in pairs]},
    }
    print(f"median wall-time ratio guarded/unguarded: {out['overhead_ratio']:.3f} (target <= {TARGET}); "
          f"pairs {out['overhead_ratio_range'][0]:.3f}-{out['overhead_ratio_range'][1]:.3f}; "
          f"CPU-time ratio {out['overhead_ratio_cpu']:.3f}; fastest runs {out['overhead_ratio_best']:.3f}; "
          f"steady-state step {out['overhead_ratio_steady']:.3f}; "
          f"time inside the guard {100 * out['guard_time_frac']:.1f}% of the guarded run "
          f"({runs} pairs x {steps} steps)")
    out["guard_ms_per_step"]["total"] = sum(out["guard_ms_per_step"][part] for part in PARTS)
    print(f"guard ms per step (median over pairs; a step takes {out['step_ms']['unguarded']:.1f} ms unguarded):")
    for part, ms in out["guard_ms_per_step"].items():
        print(f"  {part:<12} {ms:7.3f}")
    print(f"  {'unaccounted':<12} {out['unaccounted_ms_per_step']:7.3f} "
          "(guarded - unguarded step, beyond the guard's calls)")
    if out["guard_acted"]:
        print(f"note: the guard acted {out['guard_acted']} time(s); those runs did different work")
    emit_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
