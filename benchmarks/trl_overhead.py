"""Wall-time overhead of ``RLGuardCallback`` on a real (tiny) GRPO run: guarded vs unguarded, same seed.

Each pair runs an unguarded and a guarded ``GRPOTrainer`` on the tiny local Llama (GRPO preset, reference KL,
two passes over each rollout batch), alternating which goes first so drift in the machine's load hits both
alike. Only ``trainer.train()`` is timed (model loading and trainer construction are not). Reported:

* ``overhead_ratio``: median over pairs of guarded / unguarded wall time (target <= 1.05);
* ``overhead_ratio_cpu``: the same with process CPU time (less sensitive to neighbours on a shared machine);
* ``guard_time_frac``: time spent inside the guard's own calls (statistics, gradient probe, transfer, rules,
  logging, snapshots) over the guarded run's wall time, measured directly with ``perf_counter``.

A tiny model is the worst case for a relative figure: the guard's per-step work is fixed while a step costs
~0.1 s. One intra-op thread by default (``--threads``): on a shared machine, spinning worker threads make
multi-threaded wall time measure the neighbours.

Usage: ``python benchmarks/trl_overhead.py [--quick] [--runs N] [--steps N] [--json FILE] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TARGET = 1.05
GUARD_CALLS = ("observe", "observe_sequences", "observe_samples", "check", "step_done")


class _Timer:
    """Accumulates the wall time of wrapped calls (nested calls are counted once)."""

    def __init__(self):
        self.total, self._depth = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.total += time.perf_counter() - start

        return timed


def _one_run(model_path: Path, dataset, steps: int, guarded: bool, work: Path, seed: int = 0) -> dict:
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.adapters import trl as adapter
    from rl_guard.demo.run import demo_config
    from rl_guard.demo.tiny import length_penalty_reward, repeat_last_digit_reward

    work.mkdir(parents=True, exist_ok=True)
    args = GRPOConfig(output_dir=str(work / "trainer"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=steps, logging_steps=1, use_cpu=True, bf16=False,
                      report_to=[], learning_rate=3e-3, save_strategy="no", seed=seed, beta=0.04, num_iterations=2,
                      steps_per_generation=2, disable_tqdm=True, max_grad_norm=1.0)
    callbacks, timer = [], _Timer()
    if guarded:
        callback = adapter.RLGuardCallback(demo_config("rollback", console_every=None), run_dir=str(work / "guard"))
        for name in GUARD_CALLS:
            setattr(callback.guard, name, timer.wrap(getattr(callback.guard, name)))
        callback._token_batch = timer.wrap(callback._token_batch)
        callbacks.append(callback)
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=[repeat_last_digit_reward, length_penalty_reward],
                          args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.pop_callback(PrinterCallback)
    original_samples = adapter.samples_from_rewards
    adapter.samples_from_rewards = timer.wrap(original_samples)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        adapter.samples_from_rewards = original_samples
    acted = 0
    if guarded:
        incidents = work / "guard" / "incidents.jsonl"
        lines = incidents.read_text().splitlines() if incidents.exists() else []
        acted = sum('"action": "warn"' not in line for line in lines)
    return {"wall": wall, "cpu": cpu, "guard": timer.total, "steps": trainer.state.global_step, "acted": acted}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 pairs of 8 steps (well under 2 minutes)")
    ap.add_argument("--runs", type=int, help="pairs of runs (default 5, quick 3)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 24, quick 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    runs = args.runs or (3 if args.quick else 5)
    steps = args.steps or (8 if args.quick else 24)

    import torch

    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="rl_guard_overhead_"))
    model_path = build_tiny_model(work / "model", seed=0)
    dataset = prompt_dataset(256, seed=0)
    for guarded in (False, True):  # warm-up: first-call costs (kernels, lazy imports) land in neither figure
        _one_run(model_path, dataset, 2, guarded, work / f"warmup_{int(guarded)}")
    pairs = []
    for i in range(runs):
        order = (False, True) if i % 2 == 0 else (True, False)
        result = {g: _one_run(model_path, dataset, steps, g, work / f"run{i}_{int(g)}") for g in order}
        pairs.append((result[False], result[True]))
        print(f"pair {i}: unguarded {result[False]['wall']:.2f}s, guarded {result[True]['wall']:.2f}s "
              f"(guard calls {result[True]['guard']:.3f}s), ratio {result[True]['wall'] / result[False]['wall']:.3f}")
    out = {
        "overhead_ratio": statistics.median(g["wall"] / p["wall"] for p, g in pairs),
        "overhead_ratio_cpu": statistics.median(g["cpu"] / p["cpu"] for p, g in pairs),
        "guard_time_frac": statistics.median(g["guard"] / g["wall"] for _, g in pairs),
        "target": TARGET, "runs": runs, "steps": steps, "threads": args.threads,
        "guard_acted": sum(g["acted"] for _, g in pairs),
        "wall_s": {"unguarded": [p["wall"] for p, _ in pairs], "guarded": [g["wall"] for _, g in pairs]},
    }
    print(f"median wall-time ratio guarded/unguarded: {out['overhead_ratio']:.3f} (target <= {TARGET}); "
          f"CPU-time ratio {out['overhead_ratio_cpu']:.3f}; time inside the guard {100 * out['guard_time_frac']:.1f}% "
          f"of the guarded run ({runs} pairs x {steps} steps)")
    if out["guard_acted"]:
        print(f"note: the guard acted {out['guard_acted']} time(s); those runs did different work")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
