"""Per-step overhead of ``RLGuardCallback`` on a real (tiny) GRPO run: guarded vs unguarded, same seed.

Each pair trains an unguarded and a guarded ``GRPOTrainer`` on the tiny local Llama in lockstep
(``lockstep.py``): both in one process, taking turns one optimizer step at a time, each with the random stream it
would have alone (so both sample the same rollouts). Step i of one arm runs right after step i of the other, so the
machine's drifting load, which swings two whole runs made one after the other by 10-40 % here, hits both arms
alike. Which arm steps first alternates from pair to pair. Model loading, trainer construction and ``train()``'s
setup are not timed; every optimizer step is, from its ``on_step_begin`` to the next one (or the end of
``train()``, which includes the guard's closing flush). Setups (``--setup``, one or more; by default
``trl-defaults`` then ``demo``: the first gives the top-level figures, the others follow under ``other_setups``):

* ``trl-defaults``: ``GRPOConfig``'s defaults as a user gets them (completions of up to 512 tokens, 8 per prompt,
  a log every 10 steps, lr 1e-6, ``beta=0``, one pass per rollout batch) and the shipped ``grpo.yaml`` unmodified:
  what a TRL user runs, and what the target is stated on;
* ``demo``: the demo's trainer and guard (reference KL, two passes over each rollout batch, frequent snapshots)
  with its short rollouts: 8-token completions, 4 per prompt, a log every step. A 15-25 ms step: the largest share
  the guard's fixed per-step cost takes, reported beside the first so that neither figure is read alone;
* ``trl-short``: TRL's loss defaults (``beta=0``, ``num_iterations=1``, a generation every step) and the shipped
  preset, with the demo's short rollouts.

Every setup runs in float32 on the CPU (``bf16=False``). Reported:

* ``overhead_ratio``: median over every step of every pair of guarded / unguarded step time (step i against step
  i; target <= 1.05): the typical step, which a few steps disturbed by neighbours do not move. For a fixed cost per
  step it is at least the ratio of total times (a short step's ratio is the larger);
* ``overhead_ratio_ci95``: its 95 % bootstrap interval over the pairs (pairs resampled with replacement): how far
  the figure could move on another run here. An interval that contains the target means this run does not decide
  whether the target is met;
* ``overhead_ratio_cpu``: the same with each arm's thread CPU time (what neighbours stealing the CPU change less);
* ``overhead_ratio_total``: median over pairs of the guarded arm's total step time over the unguarded arm's, and
  ``overhead_ratio_range`` the smallest and largest per-pair ratio (how far one pair can be from the others);
* ``guard_time_frac``: time spent inside the guard's own calls (statistics, gradient probe, transfer, rules,
  logging, snapshots) over the guarded arm's step time, measured directly with ``perf_counter``;
* ``guard_ms_per_step``: that time per optimizer step, split by part: ``statistics`` (observe calls and the
  adapter's TokenBatch translation), ``grad_probe``, ``update_probe`` (the weight samples around the optimizer
  step), ``transfer`` (the one device->host copy and its packing), ``summarize`` (host formulas), ``rules``,
  ``sinks``, ``diagnostics`` (generation batches only), ``snapshots``, ``adapter`` (the callback's own work around
  those calls: its events and the reward translation) and ``other`` (the rest of check/step_done). A nested timed
  call counts in its own part only;
* ``unaccounted_ms_per_step``: median over pairs of (guarded - unguarded step time) minus the time inside the
  guard's calls, per step: what the guarded arm costs beyond the guard's own work (the trainer's code running slower
  beside it, and what noise is left: it can be negative);
* ``guard_reported_ms``: what the guarded run itself logged as ``rl_guard/guard/host_ms`` (the time inside the
  guard's calls per step cycle), median over its steps, then over pairs: ``guard_ms_per_step`` less the adapter's
  own work (its ``host_frac`` is not reported here: in lockstep a cycle also holds the other arm's step);
* ``step_ms``: median over pairs of each arm's mean step time; ``same_rollouts``: whether both arms logged the same
  rewards and completion lengths at every step (the guard changed nothing in the run; false when it acted);
* ``control`` (``--control``): the same ratios from an A/A pair run right after each pair, both arms unguarded: what
  the method reads when the arms do the same work (ideally 1; its distance from 1 is the resolution of the figures
  above on this machine);
* ``floor`` (``--floor``): the same ratios from a pair whose second arm runs, instead of the guard, the least any guard
  that acts before ``optimizer.step()`` must do (``FloorGuard``: the gradients' norm and non-finite count, one host
  read per step): what no guard of this kind can read below on this setup and machine.

A tiny model is the worst case for a relative figure: the guard's per-step work is fixed while a step costs 20-150 ms
here. One intra-op thread by default (``--threads``): on a shared machine, spinning worker threads make
multi-threaded wall time measure the neighbours. With one thread both lockstep arms run on the same CPU
(``pinned_cpu``; ``lockstep.py`` says why): A/A pairs then read 0.95-1.01 instead of 0.96-1.14.

``--sequential`` runs each pair as two whole runs, one after the other in the calling thread (which arm runs first
alternates), as a user runs one trainer: lockstep gives each arm a thread of its own, and with it its own OpenMP
workers, which hides what depends on the thread that drives the trainer. With ``--threads 0`` (torch's default
thread count) that is how a guard whose numpy dot products went to BLAS's own threads, stalling ~4 ms each behind
torch's still-spinning workers, showed: 1.98 per step (demo) and 1.87 (trl-defaults), the trainer's own work 25
and 124 ms a step slower beside it, where lockstep read 1.2 and 1.02-1.05.

``--hidden`` / ``--layers`` / ``--completion`` make the model and the rollouts larger (or shorter), to see the fixed
cost spread over a step that does more work.

Usage: ``python benchmarks/trl_overhead.py [--quick] [--runs N] [--steps N] [--json [FILE]] [--threads N]
[--hidden N] [--layers N] [--completion N] [--setup S [S ...]] [--control] [--floor] [--sequential]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
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

from rl_guard.demo.run import guard_cost  # noqa: E402
from rl_guard.stats.constants import STATS_ENGINES  # noqa: E402

TARGET = 1.05


def floor_guard():
    """A ``TrainerCallback`` doing the least a guard that acts before ``optimizer.step()`` must do: per step, one
    multi-tensor norm over the gradients, their squared total and non-finite count in one host read (a non-finite
    gradient stops the run). ``reads`` counts the steps it checked."""
    import torch
    from transformers import TrainerCallback

    class FloorGuard(TrainerCallback):
        def __init__(self):
            self.reads = 0

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms = torch.stack(torch._foreach_norm(grads))
            _, bad = torch.stack([norms.square().sum(), (~norms.isfinite()).sum().to(norms.dtype)]).tolist()
            self.reads += 1
            if bad:
                control.should_training_stop = True

    return FloorGuard()


PARTS = (
    "statistics",
    "grad_probe",
    "update_probe",
    "transfer",
    "summarize",
    "rules",
    "sinks",
    "diagnostics",
    "snapshots",
    "adapter",
    "other",
)


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
        (guard_module.Guard, "observe", "statistics"),
        (guard_module.Guard, "observe_sequences", "statistics"),
        (RLGuardCallback, "_token_batch", "statistics"),
        (guard_module.Guard, "check", "other"),
        (guard_module.Guard, "step_done", "other"),
        (guard_module.Guard, "observe_samples", "diagnostics"),
        (adapter, "samples_from_rewards", "diagnostics"),
        (RunDiagnostics, "update", "diagnostics"),
        (guard_module, "probe_grads", "grad_probe"),
        (StepAccumulator, "finish", "transfer"),
        (guard_module, "summarize", "summarize"),
        (Controller, "decide", "rules"),
        (SinkSet, "log", "sinks"),
        (SinkSet, "incident", "sinks"),
        (SinkSet, "finish", "sinks"),
        (TrainState, "capture", "snapshots"),
        (UpdateProbe, "pre_step", "update_probe"),
        (UpdateProbe, "post_step", "update_probe"),
        (UpdateProbe, "resync", "update_probe"),
        (RLGuardCallback, "on_pre_optimizer_step", "adapter"),
        (RLGuardCallback, "on_step_end", "adapter"),
        (RLGuardCallback, "_observe_rewards", "adapter"),
    ]


# What each setup sets in GRPOConfig beyond the run's own settings (steps, seed, output, CPU). trl-defaults sets
# nothing else: TRL's defaults as a user gets them (completions of up to 512 tokens, 8 generations per prompt, a log
# every 10 steps, lr 1e-6). demo and trl-short take the demo's short rollouts (8 tokens, 4 generations, a log every
# step): the largest share a fixed per-step cost can have.
SHORT = dict(
    per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1, learning_rate=3e-3
)
TRAINER_SETUPS = {
    "demo": dict(SHORT, beta=0.04, num_iterations=2, steps_per_generation=2),  # the demo's trainer
    "trl-short": dict(SHORT, beta=0.0, num_iterations=1),  # TRL's loss defaults, short rollouts
    "trl-defaults": {},
}
SETUPS = tuple(TRAINER_SETUPS)
# What a user runs first (the top-level figures, and the target's), then the largest share the fixed cost can take.
DEFAULT_SETUPS = ("trl-defaults", "demo")


def guard_config(setup: str, stats_engine: str = "eager") -> str:
    """The guard's YAML: the demo's for ``demo``, else the shipped GRPO preset as is."""
    from rl_guard.demo.run import PRESET, demo_config

    if setup == "demo":
        return demo_config("rollback", console_every=None, stats_engine=stats_engine)
    return PRESET.read_text(encoding="utf-8") + f"stats_engine: {stats_engine}\n"


def _trainer(
    model_path: Path,
    dataset,
    steps: int,
    guarded: bool | str,
    work: Path,
    turns,
    seed: int = 0,
    completion: int | None = None,
    lr: float | None = None,
    stats_engine: str = "eager",
    setup: str = "demo",
):
    """One arm's ``GRPOTrainer`` (``turns``: its lockstep callback, last, so that a step's slice takes in every
    callback's work of the step). ``guarded``: the guard, nothing, or ``"floor"`` (``floor_guard``)."""
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
    args = GRPOConfig(
        output_dir=str(work / "trainer"),
        max_steps=steps,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=seed,
        disable_tqdm=True,
        **trainer_setup,
    )
    if guarded == "floor":
        callbacks = [floor_guard()]
    elif guarded:
        callbacks = [adapter.RLGuardCallback(guard_config(setup, stats_engine), run_dir=str(work / "guard"))]
    else:
        callbacks = []
    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=[repeat_last_digit_reward, length_penalty_reward],
        args=args,
        train_dataset=dataset,
        callbacks=[*callbacks, turns],
    )
    trainer.pop_callback(PrinterCallback)
    return trainer


ROLLOUT_LOGS = ("reward", "completions/mean_length")  # what both arms must have logged alike (same rollouts)


def _one_pair(
    model_path: Path,
    dataset,
    steps: int,
    work: Path,
    first: int,
    seed: int = 0,
    control: bool = False,
    floor: bool = False,
    method: str = "lockstep",
    **options,
) -> dict:
    """An unguarded (arm 0) and a guarded (arm 1) trainer in lockstep (``method``: or ``sequential``, one whole run
    after the other); ``first``: the arm that steps first. ``control``: arm 1 is unguarded too (an A/A pair: what the
    method reads when there is no difference); ``floor``: arm 1 runs ``floor_guard`` instead of the guard."""
    import torch
    from lockstep import Lockstep, Sequential, shared_cpu

    # one CPU for both single-threaded lockstep arms: neither spends the pair on a CPU whose neighbours are busier
    cpu = shared_cpu() if method == "lockstep" and torch.get_num_threads() == 1 else None
    lockstep, bd, patched = Sequential() if method == "sequential" else Lockstep(cpu=cpu), _Breakdown(), []
    second = "floor" if floor else not control
    trainers = [
        _trainer(model_path, dataset, steps, guarded, work / f"arm{arm}", lockstep.callbacks[arm], seed=seed, **options)
        for arm, guarded in enumerate((False, second))
    ]
    for owner, name, part in _guard_patches(bd):  # only the guarded arm calls these
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, bd.wrap(original, part))
    try:
        gc.collect()  # both arms start from the same collector state
        lockstep.run(trainers, seed=seed, first=first)
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    incidents = work / "arm1" / "guard" / "incidents.jsonl"
    lines = incidents.read_text().splitlines() if incidents.exists() else []
    reported = guard_cost(work / "arm1" / "guard")
    logs = [[{k: e[k] for k in ROLLOUT_LOGS if k in e} for e in t.state.log_history if "reward" in e] for t in trainers]
    arms = [
        {"wall": turns.wall, "cpu": turns.cpu, "steps": t.state.global_step}
        for t, turns in zip(trainers, lockstep.callbacks)
    ]
    floor_reads = sum(getattr(c, "reads", 0) for c in trainers[1].callback_handler.callbacks)
    return {
        "arms": arms,
        "ratio": sum(arms[1]["wall"]) / sum(arms[0]["wall"]),
        "guard": bd.total,
        "cpu": cpu,
        "floor_reads": floor_reads,
        "parts": dict(bd.parts),
        "same_rollouts": logs[0] == logs[1],
        "acted": sum('"action": "warn"' not in line for line in lines),
        "reported_ms": reported[0] if reported else None,
    }


def _median_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _per_step(pairs: list[dict], field: str) -> float:
    """Median over every step of every pair of arm 1's step time over arm 0's (step i against step i)."""
    return statistics.median(b / a for p in pairs for a, b in zip(p["arms"][0][field], p["arms"][1][field]))


def _per_step_interval(
    pairs: list[dict], field: str, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> list[float]:
    """Percentile bootstrap interval of ``_per_step``: the pairs resampled with replacement (a pair, not a step, is
    the unit that repeats: its steps share one stretch of the machine's load). With few pairs it is coarse, and it
    can only be as wide as the pairs differ; one pair gives a point."""
    rng = random.Random(seed)
    values = sorted(_per_step(rng.choices(pairs, k=len(pairs)), field) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return [values[round(tail * (resamples - 1))], values[round((1.0 - tail) * (resamples - 1))]]


def _ratios(pairs: list[dict]) -> dict:
    """The ratios of a set of pairs (guarded, control or floor): per step (wall, with its interval, and CPU time) and
    of total times (median and range over the pairs)."""
    totals = [p["ratio"] for p in pairs]
    return {
        "ratio": _per_step(pairs, "wall"),
        "ratio_ci95": _per_step_interval(pairs, "wall"),
        "ratio_cpu": _per_step(pairs, "cpu"),
        "ratio_total": statistics.median(totals),
        "ratio_range": [min(totals), max(totals)],
    }


def _trl_default(field: str):
    """A ``GRPOConfig`` field's default, as the installed TRL declares it."""
    from trl import GRPOConfig

    return GRPOConfig.__dataclass_fields__[field].default


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 pairs of 8 steps (well under 2 minutes)")
    ap.add_argument("--runs", type=int, help="pairs of runs (default 5, quick 3)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 24, quick 8)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1; 0: torch's own default, as a user gets it)",
    )
    ap.add_argument("--hidden", type=int, default=32, help="the model's hidden size (default 32: the tiny model)")
    ap.add_argument("--layers", type=int, default=2, help="the model's layers (default 2)")
    ap.add_argument("--completion", type=int, help="max completion tokens (default: the setup's, 8 or TRL's 512)")
    ap.add_argument(
        "--lr",
        type=float,
        help="learning rate (default: the setup's, 3e-3 or TRL's 1e-6; lower it for "
        "larger models so that the guard does not act: a run it acts on does different work)",
    )
    ap.add_argument(
        "--setup",
        nargs="+",
        default=list(DEFAULT_SETUPS),
        choices=SETUPS,
        metavar="SETUP",
        help="one or more of: trl-defaults (TRL's GRPOConfig defaults as a user gets them, with the "
        "shipped grpo preset), demo (the demo's trainer and guard configuration: 8-token rollouts, the "
        "largest share the guard's fixed cost takes), trl-short (TRL's loss defaults with the demo's "
        "short rollouts). Default: trl-defaults demo. The first gives the top-level figures, the others "
        "follow under other_setups",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="after each pair, an A/A pair (both arms unguarded): what the method reads when there is no "
        "difference, i.e. how finely it resolves a ratio on this machine",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="after each pair, a pair whose second arm runs the least a guard acting before "
        "optimizer.step() must do (gradient norm and non-finite count, one host read) instead of the "
        "guard: what no such guard reads below here",
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="each pair as two whole runs one after the other in this thread (order alternated), as a "
        "user runs one trainer, instead of lockstep: shows what depends on the thread that drives the "
        "trainer (torch's and BLAS's thread pools), at the price of the load's drift between the runs",
    )
    ap.add_argument(
        "--stats-engine",
        default="eager",
        choices=STATS_ENGINES,
        help="the guard's stats_engine (default eager; compiled compiles during the warm-up runs)",
    )
    add_json_argument(ap)
    args = ap.parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        results = [measure(setup, args) for setup in dict.fromkeys(args.setup)]
    finally:
        torch.set_num_threads(threads)
    out = results[0]
    if len(results) > 1:
        out["other_setups"] = {r["setup"]: r for r in results[1:]}
        _compare_steps(results)
    emit_json(args.json, out)
    return out


def _compare_steps(results: list[dict]) -> None:
    """The setups' unguarded step times side by side; a note where shorter completions did not give the shorter
    step (the guard's fixed cost is then not read against the step it was meant for)."""
    print(
        "unguarded step: "
        + ", ".join(
            f"{r['setup']} {r['step_ms']['unguarded']:.1f} ms ({r['model']['completion']}-token completions)"
            for r in results
        )
    )
    for short in results:
        for long in results:
            if (
                short["model"]["completion"] < long["model"]["completion"]
                and short["step_ms"]["unguarded"] >= long["step_ms"]["unguarded"]
            ):
                print(
                    f"note: {short['setup']}'s shorter completions did not give the shorter step "
                    f"(against {long['setup']}): its completions ended early, or the load moved between the setups"
                )


def measure(setup: str, args) -> dict:
    """Every figure of one setup (pairs, controls and floors as ``args`` asks), printed and returned."""
    runs = args.runs or (3 if args.quick else 5)
    steps = args.steps or (8 if args.quick else 24)

    import torch

    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    print(f"setup {setup}:")
    work = Path(tempfile.mkdtemp(prefix="rl_guard_overhead_"))
    completion = (
        args.completion or TRAINER_SETUPS[setup].get("max_completion_length") or _trl_default("max_completion_length")
    )
    model_path = build_tiny_model(
        work / "model", seed=0, hidden=args.hidden, layers=args.layers, max_positions=max(64, completion + 16)
    )  # the prompts are 3 words
    dataset = prompt_dataset(256, seed=0)
    run_options = dict(
        completion=args.completion,
        lr=args.lr,
        stats_engine=args.stats_engine,
        setup=setup,
        method="sequential" if args.sequential else "lockstep",
    )
    # warm-up: first-call costs (kernels, lazy imports) land in neither figure
    _one_pair(model_path, dataset, 2, work / "warmup", first=0, **run_options)
    pairs, controls, floors = [], [], []
    for i in range(runs):
        pair = _one_pair(model_path, dataset, steps, work / f"run{i}", first=i % 2, **run_options)
        plain, guarded = pair["arms"]
        pairs.append(pair)
        print(
            f"pair {i}: unguarded {sum(plain['wall']):.2f}s, guarded {sum(guarded['wall']):.2f}s over "
            f"{guarded['steps']} steps (guard calls {pair['guard']:.3f}s), ratio {pair['ratio']:.3f}"
        )
        if args.control:  # right after the pair it controls: the same stretch of the machine's load
            controls.append(
                _one_pair(model_path, dataset, steps, work / f"control{i}", first=i % 2, control=True, **run_options)
            )
        if args.floor:
            floors.append(
                _one_pair(model_path, dataset, steps, work / f"floor{i}", first=i % 2, floor=True, **run_options)
            )

    out = {
        **{f"overhead_{name}": value for name, value in _ratios(pairs).items()},
        "guard_time_frac": statistics.median(p["guard"] / sum(p["arms"][1]["wall"]) for p in pairs),
        "target": TARGET,
        "runs": runs,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "stats_engine": args.stats_engine,
        "setup": setup,
        "method": run_options["method"],
        "pinned_cpu": pairs[0]["cpu"],  # the one CPU both lockstep arms ran on (None: left to the scheduler)
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "completion": completion,
            "lr": args.lr or TRAINER_SETUPS[setup].get("learning_rate") or _trl_default("learning_rate"),
        },
        "guard_ms_per_step": {
            part: statistics.median(1e3 * p["parts"][part] / p["arms"][1]["steps"] for p in pairs) for part in PARTS
        },
        "unaccounted_ms_per_step": statistics.median(
            1e3 * (sum(p["arms"][1]["wall"]) - sum(p["arms"][0]["wall"]) - p["guard"]) / p["arms"][1]["steps"]
            for p in pairs
        ),
        "step_ms": {
            arm: statistics.median(1e3 * statistics.fmean(p["arms"][i]["wall"]) for p in pairs)
            for i, arm in enumerate(("unguarded", "guarded"))
        },
        "guard_reported_ms": _median_known(p["reported_ms"] for p in pairs),
        "same_rollouts": all(p["same_rollouts"] for p in pairs),
        "guard_acted": sum(p["acted"] for p in pairs),
        "step_s": {arm: [sum(p["arms"][i]["wall"]) for p in pairs] for i, arm in enumerate(("unguarded", "guarded"))},
    }
    for name, extra in (("control", controls), ("floor", floors)):
        if extra:
            out[name] = {**_ratios(extra), "same_rollouts": all(c["same_rollouts"] for c in extra)}
    low, high = out["overhead_ratio_ci95"]
    print(
        f"median per-step ratio guarded/unguarded: {out['overhead_ratio']:.3f} (95% interval over pairs "
        f"{low:.3f}-{high:.3f}; target <= {TARGET}); "
        f"CPU time {out['overhead_ratio_cpu']:.3f}; total time {out['overhead_ratio_total']:.3f} "
        f"(pairs {out['overhead_ratio_range'][0]:.3f}-{out['overhead_ratio_range'][1]:.3f}); "
        f"time inside the guard {100 * out['guard_time_frac']:.1f}% of the guarded steps "
        f"({runs} {run_options['method']} pairs x {steps} steps, {torch.get_num_threads()} torch thread(s))"
    )
    out["guard_ms_per_step"]["total"] = sum(out["guard_ms_per_step"][part] for part in PARTS)
    print(f"guard ms per step (median over pairs; a step takes {out['step_ms']['unguarded']:.1f} ms unguarded):")
    for part, ms in out["guard_ms_per_step"].items():
        print(f"  {part:<12} {ms:7.3f}")
    print(
        f"  {'unaccounted':<12} {out['unaccounted_ms_per_step']:7.3f} "
        "(guarded - unguarded step, beyond the guard's calls)"
    )
    if out["guard_reported_ms"] is not None:
        print(f"  {'as logged':<12} {out['guard_reported_ms']:7.3f} (rl_guard/guard/host_ms: the guard's calls only)")
    for name, label in (
        ("control", "control, both arms unguarded"),
        ("floor", "floor, the least a guard acting before the step does"),
    ):
        if name in out:
            c = out[name]
            print(
                f"{label}: per-step {c['ratio']:.3f} ({c['ratio_ci95'][0]:.3f}-{c['ratio_ci95'][1]:.3f}), "
                f"CPU time {c['ratio_cpu']:.3f}, total time "
                f"{c['ratio_total']:.3f} (pairs {c['ratio_range'][0]:.3f}-{c['ratio_range'][1]:.3f})"
            )
    if out["guard_acted"] or not out["same_rollouts"]:
        print(
            f"note: the guard acted {out['guard_acted']} time(s) (same rollouts in both arms: "
            f"{out['same_rollouts']}); those runs did different work"
        )
    return out


if __name__ == "__main__":
    main()
