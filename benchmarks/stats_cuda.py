"""The statistics benchmark on a GPU: ``python benchmarks/stats.py --device cuda [--json FILE]``.

* Time per step of the same paths as on CPU (``full`` with the eager engine, ``compiled``, ``floor``, ``naive``) on
  8M tokens by default (``--sizes``), measured with CUDA events around each call, after one warm-up, over
  interleaved repeats (best and median reported). ``full`` ends with the step's one device->host transfer, so its
  events cover all its work. The floor reads each whole tensor once (on a GPU, CPU-sized blocks would time kernel
  launches, not memory).
* For the largest size, both engines' time by tokens per chunk (``chunk_sweep``); for the smallest and the largest,
  one step under torch's profiler (``profile``: kernels per step, the ops taking the most GPU and host time).
* Synchronisations of a whole guard cycle: a real ``Guard`` with the async preset (every statistic family, lag
  buckets, rules) observes four micro-batches of the 8M-token batch with their losses, then ``check()`` probes
  the gradients, transfers once and evaluates the rules; ``step_done()`` is counted apart (a snapshot, when one
  is due, copies the state to host memory on purpose), once per stats engine (``syncs_observe_check`` eager,
  ``syncs_observe_check_compiled``). Counted with ``torch.cuda.set_sync_debug_mode("warn")``:
  every synchronising CUDA call warns once per call. The expected count for ``observe -> check`` is 1.

Without CUDA it prints why and exits cleanly (returns ``{"skipped": reason}``).
"""

from __future__ import annotations

import json
import os
import statistics
import traceback
import warnings
from pathlib import Path

import torch
from stats_common import CURRENT_VERSION, SIZES, floor_pass, full_step, make_inputs, naive_step, time_interleaved

SIZES_GPU = {"64K": 1 << 16, **SIZES, "8M": 1 << 23}
SWEEP_CHUNKS = (1 << 20, 1 << 21, 1 << 22, 1 << 23)
ASYNC_PRESET = "async"


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_paths(d: dict, repeats: int) -> dict:
    # the floor reads each whole tensor once: on a GPU, CPU-sized blocks would make it a count of kernel launches
    fns = {
        "full": lambda: full_step(d),
        "compiled": lambda: full_step(d, "compiled"),
        "floor": lambda: floor_pass(d, chunk=d["mask"].numel()),
        "naive": lambda: naive_step(d),
    }
    timed = time_interleaved(fns, repeats, measure=lambda fn: (_event_ms(fn),), clocks=("ms",))
    times, errors = {name: t["ms"] for name, t in timed["times"].items()}, timed["errors"]
    out = {f"{name}_ms": min(v) if v else None for name, v in times.items()}
    out.update({f"{name}_ms_median": statistics.median(v) if v else None for name, v in times.items()})
    for name, suffix in (("full", ""), ("compiled", "_compiled")):  # the eager engine, and stats_engine: compiled
        if out["naive_ms"]:
            out[f"speedup_vs_naive{suffix}"] = out["naive_ms"] / out[f"{name}_ms"]
        out[f"floor_ratio{suffix}"] = out[f"{name}_ms"] / out["floor_ms"]
    out["errors"] = errors
    return out


def chunk_sweep(d: dict, repeats: int) -> dict:
    """ms per step (best of ``repeats``) of both engines with each of ``SWEEP_CHUNKS`` tokens per chunk, up to the
    batch's size: what the GPU chunk size (``rl_guard.stats.chunks.chunk_size``) trades against memory."""
    n = d["mask"].numel()
    fns = {
        f"{engine}_{c >> 20}M": (lambda e=engine, c=c: full_step(d, e, chunk=c))
        for engine in ("eager", "compiled")
        for c in SWEEP_CHUNKS
        if c <= n
    }
    timed = time_interleaved(fns, repeats, measure=lambda fn: (_event_ms(fn),), clocks=("ms",))
    return {name: min(t["ms"]) for name, t in timed["times"].items() if t["ms"]}


def profile_step(d: dict, engine: str, rows: int = 12) -> dict:
    """One warm step under torch's profiler: kernels launched, and the ops that take the most GPU and host time."""
    from torch.profiler import ProfilerActivity, profile

    full_step(d, engine)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        full_step(d, engine)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "kernels": kernels,
        "by_gpu_time": events.table(sort_by="self_device_time_total", row_limit=rows),
        "by_host_time": events.table(sort_by="self_cpu_time_total", row_limit=rows),
    }


class _SyncCounter:
    """Counts the warnings of ``set_sync_debug_mode("warn")`` raised inside the block, each as the innermost
    rl_guard line that made it (``syncs``; on CUDA only: elsewhere it only runs the block, which lets the cycle be
    exercised without a GPU)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.syncs: list[str] = []

    def _show(self, message, *args, **kwargs):
        if str(message).startswith("called a synchronizing"):  # not the mode's own "prototype feature" notice
            self.syncs.append(_innermost_rl_guard_line())

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show  # called where the warning is raised: the stack still holds the caller
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


def _innermost_rl_guard_line() -> str:
    frames = [f for f in traceback.extract_stack() if f"{os.sep}rl_guard{os.sep}" in f.filename]
    if not frames:
        return "outside rl_guard"
    f = frames[-1]
    return f"{f.filename[f.filename.rindex(os.sep + 'rl_guard' + os.sep) + 1 :]}:{f.lineno} {f.line}"


def guard_cycle_syncs(
    tokens: int, micro_batches: int = 4, steps: int = 3, device: str = "cuda", stats_engine: str = "eager"
) -> dict:
    """Synchronisations per step of ``observe`` (all micro-batches) + ``check``, and of ``step_done``, with the
    guard's ``stats_engine`` set as given (a first step that compiles is counted like the others)."""
    import tempfile

    from rl_guard import Guard
    from rl_guard.stats.batch import TokenBatch
    from rl_guard.stats.engines import Engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = Guard.from_yaml(ASYNC_PRESET, run_dir=tempfile.mkdtemp(prefix="rl_guard_cuda_")).attach(model, opt)
    guard.engine = Engine(stats_engine)
    d = make_inputs(tokens, device=device)
    rows = d["mask"].shape[0] // micro_batches
    batches = [
        TokenBatch(**{k: v[i * rows : (i + 1) * rows] for k, v in d.items()}, current_version=CURRENT_VERSION)
        for i in range(micro_batches)
    ]
    x = torch.randn(32, 64, device=device)
    per_step = []
    for _ in range(steps):
        losses = [model(x).pow(2).mean() for _ in batches]
        with _SyncCounter(device) as cycle:
            for batch, loss in zip(batches, losses):
                guard.observe(batch, loss=loss.detach())
                loss.backward()
            decision = guard.check()
        if decision.apply_step:
            opt.step()
        opt.zero_grad()
        with _SyncCounter(device) as done:
            guard.step_done()
        per_step.append(
            {"observe_check": len(cycle.syncs), "step_done": len(done.syncs), "observe_check_calls": cycle.syncs}
        )
    guard.close()
    return {
        "per_step": per_step,
        "internal_failures": guard.internal_failures,
        "engine_failure": getattr(guard.engine, "failure", None) or getattr(guard.engine, "whole_failure", None),
    }


def main(args) -> dict:
    if not torch.cuda.is_available():
        reason = "CUDA is not available on this machine: the GPU benchmark was not run"
        print(reason)
        return {"skipped": reason}
    names = args.sizes.split(",") if args.sizes else ["8M"]
    repeats = args.repeats or 5
    result = {"device": torch.cuda.get_device_name(), "repeats": repeats, "rows": []}
    for label in names:
        tokens = SIZES_GPU[label]
        d = make_inputs(tokens, device="cuda")
        row = {"size": label, "tokens": tokens, **time_paths(d, repeats)}
        result["rows"].append(row)
        for key in ("full_ms", "floor_ms", "naive_ms", "speedup_vs_naive", "floor_ratio"):
            result[f"{key}_{label}"] = row.get(key)
        del d
        torch.cuda.empty_cache()
        naive = "fails" if row["naive_ms"] is None else f"{row['naive_ms']:.2f}"
        print(
            f"{label}: full {row['full_ms']:.2f} ms/step (compiled {row['compiled_ms']:.2f}), floor "
            f"{row['floor_ms']:.3f}, naive {naive} (CUDA events, best of {repeats})"
        )
    largest = SIZES_GPU[names[-1]]
    d = make_inputs(largest, device="cuda")
    result["chunk_sweep"] = {"size": names[-1], **chunk_sweep(d, repeats)}
    print(f"{names[-1]}, ms per step by tokens per chunk: {result['chunk_sweep']}")
    for label in dict.fromkeys((names[0], names[-1])):
        small = make_inputs(SIZES_GPU[label], device="cuda")
        for engine in ("eager", "compiled"):
            prof = result.setdefault("profile", {})[f"{label}_{engine}"] = profile_step(small, engine)
            print(
                f"{label} {engine}: {prof['kernels']} kernels per step\n{prof['by_gpu_time']}\n{prof['by_host_time']}"
            )
    del d, small
    torch.cuda.empty_cache()
    for engine, suffix in (("eager", ""), ("compiled", "_compiled")):
        sync = guard_cycle_syncs(SIZES_GPU[names[0]], stats_engine=engine)
        result[f"syncs{suffix}"] = sync
        result[f"syncs_observe_check{suffix}"] = max(s["observe_check"] for s in sync["per_step"])
        print(
            f"stats_engine {engine}: synchronisations per observe -> check cycle ({names[0]} tokens, 4 "
            f"micro-batches): {[s['observe_check'] for s in sync['per_step']]}; in step_done: "
            f"{[s['step_done'] for s in sync['per_step']]}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
