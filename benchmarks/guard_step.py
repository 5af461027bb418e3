"""The guard's own host cost per optimizer step, outside any trainer: warm, and with the CPU caches disturbed
between its calls the way a trainer's step disturbs them.

``benchmarks/trl_overhead.py`` measures the guard inside a real ``GRPOTrainer``, where every step carries the
trainer's own variation. This script times the same calls on the same tiny model with micro-batches of
the same shapes and fields, with nothing else running: a figure stable enough to compare two commits. Each step:
gradients are set (not timed), then ``observe_sequences`` + ``observe_samples`` (generation steps only),
``observe``, ``check``, a real ``AdamW`` step (not timed), ``step_done``.

It runs the steps twice: ``warm`` (the calls back to back) and ``cold``, where before every guard call a fixed
disturbance evicts what the guard's code and data left in the CPU caches: a pass over a 64 MB tensor, the model's
forward pass and some Python work, as the trainer's own step does between the guard's calls. Inside a trainer
the guard runs cold; ``cold_over_warm`` says how much of its in-trainer cost is that, rather than its work.

``machine`` says what the machine makes of that: the time of one small torch operation (a 64-element add), one
numpy operation and one 64-iteration Python loop, warm and right after the disturbance. A cache miss costs each
machine its own price (a virtual machine's nested page tables add to it), so ``machine`` is what to compare before
comparing two machines' ``cold`` figures: the guard's ~100 small operations per step pay it on every call.

``host_ms_over_outside`` (warm and cold): what the guard itself logs as ``rl_guard/guard/host_ms`` over the same
calls timed from outside, median per step cycle: at most 1 (the outside timer adds a little around each call), and
0.9 or more unless the guard's clock misses part of the time spent in its calls (a note says so).

Setups, as in ``trl_overhead.py``: ``demo`` (the demo's guard; old and reference log-probs; a generation batch every
4 steps), ``trl-short`` (the shipped preset unmodified; TRL's loss defaults: no reference model, the ratio is exactly
1, a generation batch every step) and ``trl-defaults`` (the same with TRL's longer completions and groups of 8).

Usage: ``python benchmarks/guard_step.py [--steps N] [--setup demo|trl-short|trl-defaults] [--json [FILE]]``.
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
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from json_output import add_json_argument, emit_json  # noqa: E402
from trl_overhead import guard_config  # noqa: E402  (the same guard per setup as the TRL benchmark)

CALLS = ("generation", "observe", "check", "step_done")
B = 8  # completions per micro-batch, as in trl_overhead.py
# setup -> (tokens per completion, completions per prompt, optimizer steps per generation batch), as trl_overhead.py's
# setups give them: the demo's and trl-short's 8-token completions; under TRL's defaults (up to 512 tokens) the tiny
# model ends each completion with EOS at random: a batch's longest is mostly 20-40 tokens (up to ~75)
SETUPS = {"demo": (8, 4, 4), "trl-short": (8, 4, 1), "trl-defaults": (40, 8, 1)}
# the guard's own host_ms over its calls timed from outside: below this, its clock misses part of its calls' time
HOST_MS_FLOOR = 0.9


class _Disturbance:
    """What a trainer's step does to the caches between two guard calls, always the same."""

    def __init__(self, model, inputs: torch.Tensor | None = None):
        self.model, self.big = model, torch.ones(16 << 20)  # 64 MB: larger than the last-level cache
        self.inputs = torch.arange(B * 16).reshape(B, 16) % 10 if inputs is None else inputs  # token ids by default

    def __call__(self) -> None:
        self.big.add_(1.0)
        with torch.no_grad():
            self.model(self.inputs)
        for _ in range(20):
            json.dumps({str(i): i * 0.5 for i in range(300)})


def _inputs(setup: str, gen: torch.Generator):
    """One micro-batch as the TRL adapter hands it over, the generation batch's rewards and its samples: a healthy
    run (every completion ends with EOS), so that no rule fires and the steady state is what is timed."""
    from rl_guard.diagnostics import SampleBatch
    from rl_guard.stats.batch import TokenBatch

    T, group, _ = SETUPS[setup]
    lp = -torch.rand(B, T, generator=gen) * 3
    mask = torch.arange(T) < torch.randint(T // 4, T + 1, (B, 1), generator=gen)  # completions of varied length
    demo = setup == "demo"
    old = lp + torch.randn(B, T, generator=gen) * 0.01 if demo else lp  # TRL's defaults: on-policy, the ratio is 1
    ref = lp + torch.randn(B, T, generator=gen) * 0.05 if demo else None  # beta=0: no reference model
    batch = TokenBatch(
        logprobs=lp,
        mask=mask,
        old_logprobs=old,
        ref_logprobs=ref,
        entropy=torch.rand(B, T, generator=gen),
        advantages=torch.randn(B, generator=gen),
        lengths=mask.sum(1),
        truncated=torch.zeros(B, dtype=torch.bool),
        eps_low=0.2,
        eps_high=0.2,
        clipped_loss=True,
    )  # TRL's dapo loss clips
    rewards = torch.rand(B, generator=gen)
    lengths = batch.lengths.tolist()
    samples = SampleBatch(
        rewards=rewards.numpy(),
        group_ids=np.arange(B) // group,
        reward_components={"repeat_last_digit_reward": rewards.numpy(), "length_penalty_reward": np.zeros(B)},
        lengths=lengths,
        truncated=batch.truncated.tolist(),
        texts=[" ".join("7" * n) for n in lengths],
        prompts=["1 2 3 4 5"] * B,
        rollout_tokens=sum(lengths),
        episodes=B,
        funnel={"sampled": B, "reward_available": B},
    )
    return batch, rewards, samples


def machine(repeats: int = 60) -> dict:
    """Microseconds (median) of one small torch op, one numpy op and one short Python loop, warm and right after
    the disturbance (a fresh 64 MB pass and a forward pass of a small model: no guard code involved)."""
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    disturb = _Disturbance(net, torch.randn(B, 32))
    t = torch.randn(64)
    a, values = t.numpy(), t.tolist()

    def loop():
        total = 0.0
        for v in values:
            total += v * v
        return total

    out = {}
    for name, fn in (("torch_op", lambda: t + 1), ("numpy_op", lambda: a + 1), ("python_loop", loop)):
        for state, before in (("warm", lambda: None), ("cold", disturb)):
            times = []
            for _ in range(repeats):
                before()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[f"{name}_us_{state}"] = round(1e6 * statistics.median(times[repeats // 4 :]), 2)
    return out


def run(setup: str = "demo", steps: int = 200, cold: bool = False, work: Path | None = None) -> dict:
    """Median ms per step of each guard call over the steps after the first quarter."""
    from transformers import AutoModelForCausalLM

    from rl_guard.demo.tiny import build_tiny_model
    from rl_guard.guard import Guard

    torch.manual_seed(0)
    work = Path(work or tempfile.mkdtemp())
    model_dir = work / "model"
    if not model_dir.exists():
        build_tiny_model(model_dir, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = Guard.from_yaml(guard_config(setup), run_dir=work / f"guard_{setup}_{'cold' if cold else 'warm'}")
    guard.attach(model, optimizer)
    disturb = _Disturbance(model) if cold else None
    gen = torch.Generator().manual_seed(0)
    every = SETUPS[setup][2]  # optimizer steps per generation batch: steps_per_generation x num_iterations
    times = {c: [] for c in CALLS}
    outside = 0.0  # the timed calls since the last check began: the cycle the guard's next host_ms covers
    host_over_outside = []  # per cycle: the guard's own rl_guard/guard/host_ms over those calls timed from outside

    def timed(call, fn, *args, **kwargs):
        nonlocal outside
        if disturb is not None:
            disturb()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        took = time.perf_counter() - start
        times[call].append(took)
        outside += took
        return out

    def generation(rewards, samples):
        guard.observe_sequences(rewards=rewards)
        guard.observe_samples(samples, optimizer_updates=every)

    for step in range(steps):
        batch, rewards, samples = _inputs(setup, gen)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        if step % every == 0:
            timed("generation", generation, rewards, samples)
        timed("observe", guard.observe, batch, loss=torch.tensor(0.5))
        cycle = outside
        decision = timed("check", guard.check, params=optimizer, pre_clip_norm=torch.tensor(1.0))
        host_ms = guard.last_metrics.get("rl_guard/guard/host_ms")
        if host_ms is not None and cycle > 0:
            host_over_outside.append(host_ms / (1e3 * cycle))
        outside -= cycle  # the next cycle begins with this check
        if decision.apply_step:
            optimizer.step()
        optimizer.zero_grad()
        timed("step_done", guard.step_done)
    guard.close()
    per_call = {}
    for call, values in times.items():
        kept = values[len(values) // 4 :]
        per_call[call] = 1e3 * statistics.median(kept) * len(values) / steps if kept else 0.0
    kept = host_over_outside[len(host_over_outside) // 4 :]
    return {
        "per_call": per_call,
        "total": sum(per_call.values()),
        "steps": steps,
        "run_dir": str(guard.run_dir),
        "host_ms_over_outside": statistics.median(kept) if kept else None,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps per pass (default 400)")
    ap.add_argument("--setup", default="demo", choices=list(SETUPS))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        work = Path(tempfile.mkdtemp())
        warm = run(args.setup, args.steps, cold=False, work=work)
        cold = run(args.setup, args.steps, cold=True, work=work)
        probe = machine()
    finally:
        torch.set_num_threads(threads)
    result = {
        "setup": args.setup,
        "steps": args.steps,
        "threads": args.threads,
        "guard_ms_per_step_warm": round(warm["total"], 3),
        "guard_ms_per_step_cold": round(cold["total"], 3),
        "cold_over_warm": round(cold["total"] / warm["total"], 2),
        "per_call_ms_warm": {k: round(v, 3) for k, v in warm["per_call"].items()},
        "per_call_ms_cold": {k: round(v, 3) for k, v in cold["per_call"].items()},
        "host_ms_over_outside": {
            name: _round(r["host_ms_over_outside"], 3) for name, r in (("warm", warm), ("cold", cold))
        },
        "machine": probe,
    }
    print(f"guard ms per step ({args.setup}, {args.steps} steps, median per call):")
    print(f"  {'call':<12} {'warm':>7} {'cold':>7}")
    for call in CALLS:
        print(f"  {call:<12} {warm['per_call'][call]:7.3f} {cold['per_call'][call]:7.3f}")
    print(f"  {'total':<12} {warm['total']:7.3f} {cold['total']:7.3f}   cold / warm = {result['cold_over_warm']}")
    print(
        "this machine, one operation in us (warm / cold): "
        + ", ".join(
            f"{name} {probe[name + '_us_warm']:.1f} / {probe[name + '_us_cold']:.1f}"
            for name in ("torch_op", "numpy_op", "python_loop")
        )
    )
    ratios = result["host_ms_over_outside"]
    if None not in ratios.values():
        print(
            f"the guard's own rl_guard/guard/host_ms over its calls timed from outside (median per cycle): "
            f"warm {ratios['warm']:.3f}, cold {ratios['cold']:.3f} (at most 1: the outside timer adds a little "
            "around each call)"
        )
        if min(ratios.values()) < HOST_MS_FLOOR:
            print(
                f"note: below {HOST_MS_FLOOR}: the guard's clock misses part of the time spent in its calls, or "
                "the machine was loaded"
            )
    slower = [name for name in ("torch_op", "numpy_op") if probe[f"{name}_us_cold"] < probe[f"{name}_us_warm"]]
    if slower:
        print(
            f"note: {', '.join(slower)} ran faster cold than warm: the disturbance did not evict what it needs "
            "here, or the machine was loaded"
        )
    emit_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
